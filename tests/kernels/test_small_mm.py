"""fp8fx.small_mm's kernel (``fp8fx.kernels.small_mm``, an MoE router's logits) against the float64 linear: under the
Triton interpreter on CPU, on the GPU; and the op around it."""
import textwrap

import pytest
import torch

from tests.conftest import run_under_triton_interpreter

CHECKS = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from fp8fx.kernels import small_mm as kernel

    g = torch.Generator().manual_seed(0)
    # (rows, K, N, bias, x, w and out dtypes): routers' shapes and ragged ones; a float32 router on 16-bit x (Nemotron-H),
    # and on 16-bit x and w; rows past MAX_ROWS, which the op leaves to torch, computed right all the same
    bf, f32 = torch.bfloat16, torch.float32
    cases = [(1, 2048, 128, False, bf, bf, bf), (4, 2880, 32, True, bf, bf, bf), (4, 2688, 128, False, bf, f32, f32),
             (2, 2688, 128, False, bf, bf, f32), (3, 100, 7, True, torch.float16, torch.float16, torch.float16),
             (1, 16, 1, False, f32, f32, f32), (3, 333, 65, True, f32, f32, f32), (2, 3, 40, False, bf, f32, f32),
             (16, 2048, 128, False, bf, bf, bf), (9, 333, 65, True, f32, f32, f32)]
    for rows, k, n, bias, xd, wd, od in cases:
        x = torch.randn(rows, k, generator=g).to(xd).to(DEVICE)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(wd).to(DEVICE)
        b = torch.randn(n, generator=g).to(od).to(DEVICE) if bias else None
        assert (kernel.reason(x, w, b, od) == "") == (rows <= kernel.MAX_ROWS), kernel.reason(x, w, b, od)
        y = kernel.small_mm(x, w, b, od)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        # float32: the sum's rounding; 16-bit: one rounding of the output (2**-8 of bf16) - a lost bias, row or K
        # step is off by far more
        bound = 1e-5 if od == torch.float32 else 8e-3
        assert y.dtype == od and y.shape == (rows, n) and err < bound, (rows, k, n, bias, xd, wd, od, err)
    # a strided bias (the kernel reads it contiguous); a broadcast bias the kernel does not take
    x = torch.randn(2, 64, generator=g).to(DEVICE)
    w = torch.randn(8, 64, generator=g).to(DEVICE)
    b = torch.randn(16, generator=g).to(DEVICE)[::2]
    assert kernel.reason(x, w, b, f32) == ""
    assert torch.allclose(kernel.small_mm(x, w, b, f32), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert "a bias of shape ()" in kernel.reason(x, w, torch.tensor(0.5, device=DEVICE), f32)
    # leading dims and a strided x
    x = torch.randn(2, 2, 256, generator=g).to(DEVICE)[:, :, ::2]
    w = torch.randn(5, 128, generator=g).to(DEVICE)
    assert torch.allclose(kernel.small_mm(x, w, None, f32), F.linear(x, w), rtol=1e-5, atol=1e-5)
    print("small_mm ok")
    """
)


def test_small_mm_kernel_under_triton_interpreter():
    """Within float32's (or one 16-bit rounding's) error of float64 at 1-16 rows, with and without bias, K and N
    ragged against the tiles, float32 out of a float32 weight on 16-bit x and of 16-bit x and w."""
    assert "small_mm ok" in run_under_triton_interpreter(["-c", "DEVICE = 'cpu'\n" + CHECKS])


@pytest.mark.cuda
def test_small_mm_kernel_cuda():
    exec(compile("DEVICE = 'cuda'\n" + CHECKS, "small_mm_checks", "exec"), {})


def test_small_mm_op_and_its_refusals():
    """Off CUDA the op is torch's linear on x and w cast to out_dtype; dtypes whose cast is not exact, and shapes that
    do not multiply, are refused with their values."""
    x, w, b = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(4, 16), torch.randn(4)
    f32 = torch.float32
    assert torch.equal(torch.ops.fp8fx.small_mm(x, w, b, f32), torch.nn.functional.linear(x.float(), w, b))
    with pytest.raises(ValueError, match=r"x torch.float32, w torch.bfloat16, bias None, out_dtype torch.bfloat16"):
        torch.ops.fp8fx.small_mm(x.float(), w.bfloat16(), None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"bias torch.bfloat16"):
        torch.ops.fp8fx.small_mm(x, w, b.bfloat16(), f32)
    with pytest.raises(RuntimeError, match=r"x \(3, 16\) and w \(4, 8\)"):
        torch.ops.fp8fx.small_mm(x, w[:, :8], None, f32)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (its fake impl's dtype, whatever autocast would do)
        assert torch.ops.fp8fx.small_mm(x.float(), w, None, f32).dtype == f32
    from fp8fx.kernels.small_mm import reason

    assert "x of 5 rows of 16" in reason(torch.empty(5, 16), torch.empty(4, 16), None, f32)
    assert "x of 3 rows of 7168" in reason(torch.empty(3, 7168), torch.empty(4, 7168), None, f32)
    assert "w (1025, 16)" in reason(torch.empty(1, 16), torch.empty(1025, 16), None, f32)
    assert "dtypes x torch.float16, w torch.bfloat16" in reason(torch.empty(1, 16).half(), torch.empty(4, 16).bfloat16(),
                                                                None, torch.bfloat16)
