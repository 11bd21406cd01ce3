"""What ``fp8fx.kernels.topk``'s kernels take (sizes, dtypes), and why a top-k is not theirs: plain Python, no
Triton, so the top-k passes can ask it at trace time on a machine without Triton (the CPU build of torch ships none,
and ``import fp8fx`` failed there when the pass imported the kernels' module)."""
from __future__ import annotations

import torch

from fp8fx.quant import HIGH_PRECISION

MAX_ROW = 4096  # elements of a row one program holds (the index takes the low 12 bits of the sort key)
MAX_K = 32  # k steps, unrolled
MAX_GROUPS = 64


def grouped_reason(x: torch.Tensor, k: int, groups: int, topk_group: int) -> str:
    """Why ``grouped_topk`` of these is not the kernel's, or ""."""
    e = x.shape[-1] if x.dim() else 0

    def power_of_2(v):
        return type(v) is int and v > 0 and v & (v - 1) == 0

    if x.dtype != torch.float32:
        return f"logits of {x.dtype} (the kernel takes float32: the graph's sigmoid rounds 16-bit ones)"
    if not 1 <= e <= MAX_ROW:
        return f"{e} experts (the kernel takes up to {MAX_ROW})"
    if topk_group < groups and not (power_of_2(e) and power_of_2(groups) and groups <= MAX_GROUPS
                                    and e // groups >= 2):
        return (f"{e} experts in {groups} groups, {topk_group} kept (where it drops groups the kernel takes powers "
                f"of 2: up to {MAX_GROUPS} groups of 2 or more)")
    if not 1 <= topk_group <= groups or not 1 <= k <= min(MAX_K, e):
        return f"k={k} of {e} experts in {topk_group} of {groups} groups (the kernel takes k 1-{MAX_K})"
    return ""


def reason(x: torch.Tensor, k: int) -> str:
    """Why ``topk(x, k)`` over x's last dim is not this kernel's, or "" where it is."""
    n = x.shape[-1] if x.dim() else 1
    if x.dtype not in HIGH_PRECISION:
        return f"dtype {x.dtype} (the kernel takes {', '.join(str(d).removeprefix('torch.') for d in HIGH_PRECISION)})"
    if not 1 <= k <= MAX_K:
        return f"k={k} (the kernel takes 1-{MAX_K})"
    if not k <= n <= MAX_ROW:
        return f"a row of {n} elements (the kernel takes k-{MAX_ROW})"
    return ""
