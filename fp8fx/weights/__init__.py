"""Load-time weight hooks: fp8 parameters under checkpoint names, loaders, post-load processing."""
from fp8fx.weights.counter import CopyNumelCounter
from fp8fx.weights.dequantize import dequantize_
from fp8fx.weights.kv_method import Fp8KVCacheMethod
from fp8fx.weights.linear import Fp8LinearMethod, fp8_class, is_quantized
from fp8fx.weights.moe import Fp8MoEMethod, Fp8OnlineMoEMethod, fp8_experts_class, is_quantized_experts
from fp8fx.weights.quantize import calibrate, quantize_

__all__ = [
    "CopyNumelCounter", "Fp8KVCacheMethod", "Fp8LinearMethod", "Fp8MoEMethod", "Fp8OnlineMoEMethod", "calibrate",
    "dequantize_", "fp8_class", "fp8_experts_class", "is_quantized", "is_quantized_experts", "quantize_",
]
