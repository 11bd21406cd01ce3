"""Test fixture: Triton's interpreter with the GPU's float conversions.

The interpreter converts floats bit by bit in numpy (``triton.runtime.interpreter._convert_float``): it
truncates float32 -> bf16 and gets about 3% of float32 -> fp8 e4m3 conversions wrong (triton 3.6 and
3.9, FACTS.md). ``round_to_nearest()`` replaces that function, for this process, by torch's casts:
round to nearest even, fp8 saturated to +-448 as the GPU's ``cvt.rn.satfinite`` does, NaN kept. Kernels
that convert inside (quantization, bf16 outputs rounded mid-kernel) can then be held to the bits of
their reference. Call it before the first kernel runs, in a process with TRITON_INTERPRET=1.
"""
from __future__ import annotations

import numpy as np
import torch


def round_to_nearest() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    floats = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
              tl.float8e4nv: torch.float8_e4m3fn}
    ints = {32: (np.int32, torch.int32), 16: (np.int16, torch.int16), 8: (np.int8, torch.int8)}
    numpy_way = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src not in floats or dst not in floats:
            return numpy_way(data, src, dst, rounding_mode)
        np_int, torch_int = ints[src.primitive_bitwidth]
        value = torch.from_numpy(np.ascontiguousarray(data).view(np_int).copy()).view(floats[src])
        if dst == tl.float8e4nv:
            value = value.float().clamp(-448.0, 448.0)  # NaN stays NaN
        out = value.to(floats[dst])
        torch_out = ints[dst.primitive_bitwidth][1]
        return out.view(torch_out).numpy().view(getattr(np, f"uint{dst.primitive_bitwidth}")).reshape(data.shape)

    interpreter._convert_float = convert
