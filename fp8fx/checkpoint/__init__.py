"""FP8 checkpoints: ``load_checkpoint`` (fp8 per-tensor / block, compressed-tensors, or bf16 quantized
while it streams in), ``save_checkpoint``, ``convert`` (bf16 -> fp8, file by file), ``meta_model``."""
from fp8fx.checkpoint.files import CheckpointError
from fp8fx.checkpoint.load import FUSED, LoadReport, load_checkpoint
from fp8fx.checkpoint.save import convert, meta_model, save_checkpoint

__all__ = ["FUSED", "CheckpointError", "LoadReport", "convert", "load_checkpoint", "meta_model", "save_checkpoint"]
