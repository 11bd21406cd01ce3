"""fp8fx: FP8 inference for unmodified PyTorch models through ``torch.compile``.

    fp8fx.quantize_(model, fp8fx.Fp8Config())
    model = torch.compile(model, backend=fp8fx.fp8_backend)
"""
from fp8fx import ops  # noqa: F401  (registers torch.ops.fp8fx.*)
from fp8fx import testing  # noqa: F401  (fp8fx.testing.assert_rewritten ...: light, torch and fp8fx only)
from fp8fx.backend import Fp8Backend, fp8_backend
from fp8fx.checkpoint import CheckpointError, LoadReport, load_checkpoint, save_checkpoint
from fp8fx.config import Fp8Config, PerBlock, PerGroup, PerRow, PerTensor
from fp8fx.report import Report, Site
from fp8fx.weights import CopyNumelCounter, Fp8KVCacheMethod, Fp8LinearMethod, Fp8MoEMethod, Fp8OnlineMoEMethod
from fp8fx.weights import calibrate, dequantize_, quantize_

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CopyNumelCounter",
    "Fp8Backend",
    "Fp8Config",
    "Fp8KVCacheMethod",
    "Fp8LinearMethod",
    "Fp8MoEMethod",
    "Fp8OnlineMoEMethod",
    "LoadReport",
    "PerBlock",
    "PerGroup",
    "PerRow",
    "PerTensor",
    "Report",
    "Site",
    "calibrate",
    "dequantize_",
    "fp8_backend",
    "load_checkpoint",
    "quantize_",
    "save_checkpoint",
]
