"""The fp8fx custom ops: opcheck, semantics against the float64 reference, compiled == eager."""
import textwrap

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fp8fx
from fp8fx import ops, quant
from fp8fx.ops import fp8_linear
from tests.conftest import rel_err, run_under_triton_interpreter

BLOCKS = {"per-tensor": [-1, -1], "per-row": [1, -1], "per-group": [1, 32], "per-block": [32, 32]}


# torch's SchemaCheckMode (opcheck's "test_schema") compares inputs before/after with a mul that has
# no float8 kernel on CPU (torch 2.13: "mul_cpu_reduced_float not implemented for Float8_e4m3fn"), so
# ops with fp8 inputs run the other opcheck utils and `_check_no_mutation` stands in for test_schema.
FP8_INPUT_UTILS = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")


def _opcheck_fp8(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs, test_utils=FP8_INPUT_UTILS)
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    op(*args, **(kwargs or {}))
    after = [a for a in args if isinstance(a, torch.Tensor)]
    for b, a in zip(before, after):
        assert torch.equal(b.view(torch.uint8) if b.element_size() == 1 else b, a.view(torch.uint8) if a.element_size() == 1 else a)


def _weights(n=64, k=96, block=(1, -1), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    return w, *quant.quantize(w, block)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block", [[-1, -1], [1, -1], [1, 32]])
def test_opcheck_quantize(dtype, block):
    x = torch.randn(3, 5, 64, dtype=dtype)
    torch.library.opcheck(torch.ops.fp8fx.quantize.default, (x, block))


@pytest.mark.parametrize("shape", [(3, 5, 256), (7, 256), (0, 256), (1, 256)])
@pytest.mark.parametrize("block", [[1, 128], [1, -1], [-1, -1]])
def test_quantize_scale_is_m_major(shape, block):
    """quantize's scale [M, K/128] comes M-major, as cuBLAS's 1x128 x 128x128 GEMM takes it: its operands are then
    the scale itself (no per-call copy kernel, ``cublas_block_operands``). The fake promises the same strides, which
    Inductor's generated code asserts."""
    x = torch.randn(shape)
    q, s = torch.ops.fp8fx.quantize(x, block)
    with FakeTensorMode() as mode:
        fq, fs = torch.ops.fp8fx.quantize(mode.from_tensor(x), block)
    assert (fq.shape, fq.stride(), fs.shape, fs.stride()) == (q.shape, q.stride(), s.shape, s.stride())
    m = q.numel() // 256
    if block == [1, 128]:
        assert s.shape == (m, 2) and (m <= 1 or s.stride() == (1, m))  # (a dim of 0 or 1 elements: any stride)
        if m > 1:
            wq, ws = quant.quantize(torch.randn(384, 256), [128, 128])
            _, _, scale_a, _ = ops.cublas_block_operands(quant.as_rows(q), s, wq, ws)
            assert scale_a.data_ptr() == s.data_ptr() and scale_a.stride() == (1, m)
            # a row-major scale (quant.quantize's) is laid out so by a copy, the values the same
            rows = quant.quantize(quant.as_rows(x), block)[1]
            copied = ops.cublas_block_operands(quant.as_rows(q), rows, wq, ws)[2]
            assert copied.data_ptr() != rows.data_ptr() and copied.stride() == (1, m) and torch.equal(copied, s)
    assert torch.equal(s, quant.quantize_rows(x, block)[1])


def test_opcheck_quantize_static_and_dequantize():
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fp8fx.quantize_static.default, (x, torch.tensor([0.01])))
    w, q, s = _weights(block=(32, 32))
    _opcheck_fp8(torch.ops.fp8fx.dequantize.default, (q, s, [32, 32], torch.bfloat16))
    _opcheck_fp8(
        torch.ops.fp8fx.dequantize.default, (q, s, [32, 32], torch.bfloat16), {"input_scale": None, "act_block": [1, 32]}
    )


@pytest.mark.parametrize("w_block,x_block", [([-1, -1], [-1, -1]), ([1, -1], [1, -1]), ([32, 32], [1, 32])])
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_scaled_mm(w_block, x_block, bias):
    w, wq, ws = _weights(block=w_block)
    xq, xs = quant.quantize_rows(torch.randn(2, 3, 96), x_block)
    b = torch.randn(64, dtype=torch.bfloat16) if bias else None
    _opcheck_fp8(torch.ops.fp8fx.scaled_mm.default, (xq, xs, wq, ws, b, x_block, w_block, torch.bfloat16))


def test_quantize_op_scale_shapes():
    x = torch.randn(2, 3, 100)
    assert torch.ops.fp8fx.quantize(x, [-1, -1])[1].shape == (1, 1)
    assert torch.ops.fp8fx.quantize(x, [1, -1])[1].shape == (6, 1)
    assert torch.ops.fp8fx.quantize(x, [1, 32])[1].shape == (6, 4)  # ragged last group
    q, _ = torch.ops.fp8fx.quantize(x, [1, 32])
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn


def test_quantize_static_saturates_instead_of_nan():
    x = torch.tensor([[1.0, -1e4, 3e38, 0.0]])
    q = torch.ops.fp8fx.quantize_static(x, torch.tensor([1.0]))
    assert q.float().tolist() == [[1.0, -448.0, 448.0, 0.0]]


def test_bad_block_is_a_clear_error():
    with pytest.raises(ValueError, match=r"block=\[0, 128\] is not a block"):
        torch.ops.fp8fx.quantize(torch.randn(4, 8), [0, 128])


def test_opcheck_strided_inputs():
    """Transposed activations and weights: the real impls return the contiguous layout the fake impls promise
    (a mismatch fails torch.compile at run time)."""
    x = torch.randn(64, 7, dtype=torch.bfloat16).t()
    torch.library.opcheck(torch.ops.fp8fx.quantize.default, (x, [1, -1]))
    torch.library.opcheck(torch.ops.fp8fx.quantize_static.default, (x, torch.tensor([0.01])))
    w, q, s = _weights(block=(-1, -1))
    _opcheck_fp8(torch.ops.fp8fx.dequantize.default, (q.t().contiguous().t(), s, [-1, -1], torch.bfloat16))


def test_bad_bias_and_static_scale_are_clear_errors():
    w, wq, ws = _weights(block=(1, -1))
    xq, xs = quant.quantize_rows(torch.randn(3, 96), [1, -1])
    for bias in (torch.randn(1), torch.randn(64, 1)):
        with pytest.raises(ValueError, match=r"bias has shape \[.*\]; it must be \[64\]"):
            torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, bias, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"bias has shape \[1\]; it must be \[64\]"):
        torch.ops.fp8fx.weight_only_mm(torch.randn(3, 96), wq, ws, torch.randn(1), [1, -1])
    with pytest.raises(ValueError, match=r"w_block=\[0, 8\] is not a block"):
        torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, None, [1, -1], [0, 8], torch.bfloat16)
    with pytest.raises(ValueError, match=r"static input scale must have one element, got shape \[4\]"):
        torch.ops.fp8fx.quantize_static(torch.randn(3, 96), torch.ones(4))


def test_bad_operands_are_clear_errors():
    """The real ops refuse what the reference would compute wrongly or fail on with a bare reshape error: a
    16-bit activation where fp8 codes are due, a K mismatch, scales of the wrong size; each message names the
    tensor and what it needs."""
    w, wq, ws = _weights(block=(1, -1))
    xq, xs = quant.quantize_rows(torch.randn(3, 96), [1, -1])
    mm = torch.ops.fp8fx.scaled_mm
    with pytest.raises(ValueError, match=r"scaled_mm: xq is torch.bfloat16; it takes the fp8 codes"):
        mm(torch.randn(3, 96, dtype=torch.bfloat16), xs, wq, ws, None, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"scaled_mm: the activation's K is 80 \(\[3, 80\]\) but the weight is \[64, 96\]"):
        mm(xq[:, :80].contiguous(), xs, wq, ws, None, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"scaled_mm: x_scale has 2 elements .* block \[1, -1\] of a \[3, 96\] activation needs 3"):
        mm(xq, xs[:2], wq, ws, None, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"scaled_mm: w_scale has 63 elements .* block \[1, -1\] of a \[64, 96\] weight needs 64"):
        mm(xq, xs, wq, ws[:63], None, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"scaled_mm: the weight is torch.bfloat16 \[64, 96\]; it must be a torch.float8_e4m3fn"):
        mm(xq, xs, w.bfloat16(), ws, None, [1, -1], [1, -1], torch.bfloat16)
    wo = torch.ops.fp8fx.weight_only_mm
    with pytest.raises(ValueError, match=r"weight_only_mm: w_scale has 64 elements .* block \[32, 32\] of a \[64, 96\] weight needs 6"):
        wo(torch.randn(3, 96), wq, ws, None, [32, 32])
    with pytest.raises(ValueError, match=r"w_block=\[0, 5\] is not a block"):
        wo(torch.randn(3, 96), wq, ws, None, [0, 5])
    # the CUDA decompositions of the quantize ops (what runs under compile on a GPU) check as the ops do
    from fp8fx.lowerings import aten

    with pytest.raises(ValueError, match=r"block=\[0, 4\] is not a block"):
        aten._quantize(torch.randn(3, 8), [0, 4])
    with pytest.raises(ValueError, match=r"static input scale must have one element, got shape \[2\]"):
        aten._quantize_static(torch.randn(3, 8), torch.ones(2))


def test_more_bad_operands_are_clear_errors():
    """fp8 codes given to the weight-only GEMM were multiplied without their scale (saturated at 448); a zero static
    scale made every value saturate and zeros NaN; a dequantize scale of the wrong size failed in a reshape."""
    w, wq, ws = _weights(block=(1, -1))
    xq, _ = quant.quantize_rows(torch.randn(3, 96), [1, -1])
    with pytest.raises(ValueError, match=r"weight_only_mm: x is torch.float8_e4m3fn; it takes bf16/fp16/fp32 "
                                         r"activations \(for fp8 activation codes and their scale, use fp8fx.scaled_mm"):
        torch.ops.fp8fx.weight_only_mm(xq, wq, ws, None, [1, -1])
    with pytest.raises(ValueError, match=r"weight_only_mm: x is torch.float64; it takes bf16/fp16/fp32"):
        torch.ops.fp8fx.weight_only_mm(torch.randn(3, 96, dtype=torch.float64), wq, ws, None, [1, -1])
    with pytest.raises(ValueError, match=r"grouped_topk: k=2, 2 of 4 groups of 4 experts; groups must divide the "
                                         r"experts \(2 or more each\)"):  # (one expert a group)
        torch.ops.fp8fx.grouped_topk(torch.randn(3, 4), torch.zeros(4), 2, 4, 2, True, 1e-20, 1.0, -1)
    for bad in (0.0, float("inf"), float("nan"), -1.0, 1e-40):  # (1e-40: subnormal, saturated every value)
        with pytest.raises(ValueError, match=r"static input scale is .*; a static scale must be a positive finite"):
            torch.ops.fp8fx.quantize_static(torch.randn(3, 96), torch.tensor([bad]))
    from fp8fx.lowerings import aten

    with pytest.raises(ValueError, match=r"a static scale must be a positive finite float"):
        aten._quantize_static(torch.randn(3, 8), torch.zeros(1))
    with pytest.raises(ValueError, match=r"dequantize: scale has 5 elements .* block \[1, -1\] of a \[64, 96\] weight "
                                         r"needs 64"):
        torch.ops.fp8fx.dequantize(wq, ws[:5], [1, -1], torch.bfloat16)


def test_scales_read_in_the_wrong_layout_are_refused():
    """A 128x128 block scale grid stored transposed ([K/128, N/128], as a converter may write it) has the right count
    and was read scrambled (5.8% off with random scales); dequantize multiplied a 16-bit weight by a scale as if it held
    fp8 codes, and cast to an integer dtype. Each is refused, by the real op and by its fake (torch.compile's trace)."""
    torch.manual_seed(0)
    wq, ws = quant.quantize(torch.randn(256, 384), [128, 128])  # ws: [2, 3]
    xq, xs = quant.quantize(torch.randn(5, 384), [1, 128])
    grid = r"w_scale has shape \[3, 2\]; block \[128, 128\] of a \[256, 384\] weight needs a grid of scales \[2, 3\]"
    with pytest.raises(ValueError, match=grid):
        torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws.t().contiguous(), None, [1, 128], [128, 128], torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale has shape \[6\]; .* needs a grid of scales \[2, 3\]"):
        torch.ops.fp8fx.dequantize(wq, ws.reshape(-1), [128, 128], torch.bfloat16)
    y = torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, None, [1, 128], [128, 128], torch.float32)  # the right layout runs
    x3q, x3s = quant.quantize(torch.randn(2, 3, 384), [1, 128])  # activation groups of a 3-D input: [2, 3, 3]
    assert torch.ops.fp8fx.scaled_mm(x3q, x3s, wq, ws, None, [1, 128], [128, 128], torch.float32).shape == (2, 3, 256)
    assert y.shape == (5, 256)
    with pytest.raises(ValueError, match=r"fp8fx.dequantize: q is torch.bfloat16; it dequantizes torch.float8_e4m3fn"):
        torch.ops.fp8fx.dequantize(wq.bfloat16(), ws, [128, 128], torch.bfloat16)
    with pytest.raises(ValueError, match=r"fp8fx.dequantize: dtype=torch.int32; the result is bf16, fp16, fp32 or fp64"):
        torch.ops.fp8fx.dequantize(wq, ws, [128, 128], torch.int32)
    ws_t = ws.t().contiguous()
    with FakeTensorMode() as mode:  # the fake checks the same
        fakes = [mode.from_tensor(t) for t in (xq, xs, wq, ws_t)]
        with pytest.raises(ValueError, match=grid):
            torch.ops.fp8fx.scaled_mm(*fakes[:3], fakes[3], None, [1, 128], [128, 128], torch.bfloat16)


def test_experts_per_channel_scales_in_the_wrong_layout_are_refused():
    """Experts' per-channel scales have the grid [E, R, 1]; a [R, E] scale has its count, and fused_moe read it
    scrambled (45% off) and dequantize too, where the grid check skipped grids whose last dim is 1. [E, R] and
    [E, R, 1] run the same."""
    torch.manual_seed(0)
    e, i, h = 4, 16, 32
    q13, s13 = quant.quantize(torch.randn(e, 2 * i, h), [1, -1])
    q2, s2 = quant.quantize(torch.randn(e, h, i), [1, -1])
    x, w, ids = torch.randn(3, h), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 2]])
    moe = lambda s: torch.ops.fp8fx.fused_moe(x, w, ids, q13, s, q2, s2, [1, -1], [1, -1], torch.float32)  # noqa: E731
    flat = s13.reshape(e, 2 * i)
    assert torch.equal(moe(s13), moe(flat))
    grid = r"w13_scale has shape \[32, 4\]; block \[1, -1\] of w13 \[4, 32, 32\] needs a grid of scales \[4, 32, 1\]"
    with pytest.raises(ValueError, match=grid):
        moe(flat.t().contiguous())
    with pytest.raises(ValueError, match=r"dequantize: scale has shape \[32, 4\]; .* grid of scales \[4, 32, 1\]"):
        torch.ops.fp8fx.dequantize(q13, flat.t().contiguous(), [1, -1], torch.float32)
    with pytest.raises(ValueError, match=r"scale has shape \[128\]; .* needs a grid of scales \[4, 32, 1\]"):
        torch.ops.fp8fx.dequantize(q13, flat.reshape(-1), [1, -1], torch.float32)
    ws = quant.quantize(torch.randn(64, 96), [1, -1])[1]  # a 2-D weight's per-channel scale: [N, 1], [N] or [1, N]
    for s in (ws, ws.reshape(-1), ws.reshape(1, -1)):
        torch.ops.fp8fx.dequantize(quant.quantize(torch.randn(64, 96), [1, -1])[0], s, [1, -1], torch.float32)


def test_no_k_at_all():
    """K = 0: reshape(-1, 0) cannot tell M, so the real ops failed where their fake ones promised [M, 0] and
    [M, 1] (compiled code traced, then failed when it ran)."""
    x = torch.randn(2, 3, 0)
    q, s = torch.ops.fp8fx.quantize(x, [1, -1])
    assert q.shape == (2, 3, 0) and s.shape == (6, 1)
    assert torch.ops.fp8fx.quantize_static(x, torch.tensor([0.5])).shape == (2, 3, 0)
    wq = torch.zeros(4, 0, dtype=torch.float8_e4m3fn)
    y = torch.ops.fp8fx.weight_only_mm(x, wq, torch.ones(4, 1), torch.ones(4), [1, -1])
    assert y.shape == (2, 3, 4) and torch.equal(y, torch.ones(2, 3, 4))
    y = torch.ops.fp8fx.scaled_mm(q, s, wq, torch.ones(4, 1), None, [1, -1], [1, -1], torch.bfloat16)
    assert y.shape == (2, 3, 4) and not y.any()


def test_fused_shards_with_one_scale_row_each_run_apart():
    """[-1, G] weight blocks: each shard has one row of K-group scales, which do not stack into the fused weight's
    one row: the op runs the shards apart (it raised a scale-size error)."""
    x = torch.randn(4, 256)
    xq, xs = quant.quantize_rows(x, [1, -1])
    shards = [quant.quantize(torch.randn(n, 256), [-1, 128]) for n in (64, 32)]
    wq = torch.cat([q for q, _ in shards])  # back to back, as the horizontal pass arranges them
    wqs = [wq[:64], wq[64:]]
    y = torch.ops.fp8fx.scaled_mm_fused(xq, xs, wqs, [s for _, s in shards], [None, None], [1, -1], [-1, 128],
                                        torch.float32)
    want = torch.cat([torch.ops.fp8fx.scaled_mm(xq, xs, q, s, None, [1, -1], [-1, 128], torch.float32)
                      for q, s in zip(wqs, [s for _, s in shards])], -1)
    assert torch.equal(y, want)


def test_cuda_dispatch_rules():
    """Which blocks fp8fx's Triton GEMM takes; the rest is the reference's (all checked without a GPU)."""
    assert ops._tensor_or_row([1, -1], [1, -1]) and ops._tensor_or_row([-1, -1], [1, -1])
    assert not ops._tensor_or_row([1, -1], [128, -1])  # row blocks of weights: not cuBLAS's row-wise scales
    assert ops._k_groups_agree([1, 128], [128, 128]) and ops._k_groups_agree([1, -1], [128, -1])
    assert not ops._k_groups_agree([4, 32], [16, 32])  # activation scales for blocks of rows
    assert not ops._k_groups_agree([1, 48], [16, 48])  # a K group that is no tl.dot tile
    assert not ops._k_groups_agree([1, 64], [128, 128])  # K groups that differ
    # weight-only (activations unscaled): the Triton GEMM takes weight K groups of 32-256, else the reference
    assert ops._k_groups_agree([-1, -1], [128, 128]) and ops._k_groups_agree([-1, -1], [1, -1])
    assert not ops._k_groups_agree([-1, -1], [128, 96]) and not ops._k_groups_agree([-1, -1], [-1, 32])


@pytest.mark.parametrize("scheme", ["per-tensor", "per-row", "per-block"])
def test_fp8_linear_close_to_float64(scheme):
    """W8A8 of random data stays within the fp8 error bound of the float64 product (measured ~0.03-0.04),
    and a wrong scale (e.g. scale applied twice or transposed) would be off by far more."""
    w_block = BLOCKS[scheme]
    act_block = [1, 32] if scheme == "per-block" else w_block
    w, wq, ws = _weights(block=w_block)
    x = torch.randn(4, 9, 96, dtype=torch.bfloat16)
    bias = torch.randn(64, dtype=torch.bfloat16)
    y = fp8_linear(x, wq, ws, bias, w_block, act_block)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 9, 64)
    ref = x.double() @ w.double().t() + bias.double()
    assert rel_err(y, ref) < 0.06


def test_static_input_scale_used():
    w, wq, ws = _weights(block=[1, -1])
    x = torch.randn(16, 96)
    scale = torch.tensor([x.abs().max().item() / 448])
    y = fp8_linear(x, wq, ws, None, [1, -1], [1, -1], input_scale=scale)
    assert rel_err(y, x.double() @ w.double().t()) < 0.06
    # a static scale 100x too small saturates everything: the result must be visibly wrong
    y_bad = fp8_linear(x, wq, ws, None, [1, -1], [1, -1], input_scale=scale / 100)
    assert rel_err(y_bad, x.double() @ w.double().t()) > 0.3


@pytest.mark.parametrize("block", [[1, -1], [-1, -1], [1, 32]])
def test_compiled_equals_eager_bitwise(block):
    """On CPU the fp8fx ops stay opaque under Inductor (lowerings/aten.py), so the compiled graph runs the same CPU
    impls: what can differ is the code around them (fp8_linear's reshapes, the bias, the casts) and the layouts the
    fakes promise, which Inductor's generated code asserts (assert_size_stride). On CUDA, where the activation
    quantization is decomposed into ATen, the compiled models are held to their bf16 output (tests/e2e/test_llama.py,
    cuda-marked)."""
    w_block = [32, 32] if block == [1, 32] else block
    _, wq, ws = _weights(block=w_block)
    bias = torch.randn(64)
    fn = lambda x: fp8_linear(x, wq, ws, bias, w_block, block)  # noqa: E731
    x = torch.randn(5, 96)
    assert torch.equal(torch.compile(fn, backend="inductor")(x), fn(x))


def test_fused_lists_and_shards_are_checked():
    """scaled_mm_fused's lists must pair up (zip cut the longer ones short: 2 weights with one bias gave 16 columns
    where the fake promised 24) and each shard's scale is checked as scaled_mm checks it (adjacent shards were
    checked only as a whole: per-channel scales split 12 / 12 over shards of 16 and 8 rows computed)."""
    xq, xs = quant.quantize_rows(torch.randn(5, 32), [1, -1])
    shards = [quant.quantize(torch.randn(n, 32), [1, -1]) for n in (16, 8)]
    wq = torch.cat([q for q, _ in shards])
    wqs, scales = [wq[:16], wq[16:]], [s for _, s in shards]
    fused = torch.ops.fp8fx.scaled_mm_fused
    with pytest.raises(ValueError, match=r"2 weights, 2 scales and 1 biases"):
        fused(xq, xs, wqs, scales, [None], [1, -1], [1, -1], torch.float32)
    with pytest.raises(ValueError, match=r"0 weights, 0 scales and 0 biases"):
        fused(xq, xs, [], [], [], [1, -1], [1, -1], torch.float32)
    both = torch.cat(scales)
    with pytest.raises(ValueError, match=r"scaled_mm_fused \(weight 0\): w_scale has 12 elements"):
        fused(xq, xs, wqs, [both[:12], both[12:]], [None, None], [1, -1], [1, -1], torch.float32)
    with pytest.raises(ValueError, match=r"scaled_mm_fused \(weight 1\): bias has shape \[4\]"):
        fused(xq, xs, wqs, scales, [torch.ones(16), torch.ones(4)], [1, -1], [1, -1], torch.float32)


def test_result_dtypes_are_floats():
    """An int or fp8 out_dtype / h_dtype computed garbage (the CUDA kernels cast into it)."""
    xq, xs = quant.quantize_rows(torch.randn(5, 32), [1, -1])
    wq, ws = quant.quantize(torch.randn(16, 32), [1, -1])
    for dtype in (torch.int32, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=rf"fp8fx.scaled_mm: out_dtype={dtype}; the result is bf16, fp16 or"):
            torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, None, [1, -1], [1, -1], dtype)


@pytest.mark.cuda
def test_cuda_edge_operands_match_the_cpu():
    """What the CUDA paths refused or failed on while the CPU gave an answer: a weight stored transposed on the
    cuBLAS paths (M > 64; cuBLASLt takes a row-major weight only), K = 0 with K-group blocks (the Triton GEMM's
    scale layout reshaped an empty tensor), an MoE with H = 0 or I = 0 (a zero tile size)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 512, generator=g)
    w = torch.randn(512, 128, generator=g).t()  # [128, 512] with strides (1, 128)
    for x_block, w_block in (([1, -1], [1, -1]), ([1, 128], [128, 128])):
        xq, xs = quant.quantize(x, x_block)
        wq, ws = quant.quantize(w, w_block)
        wq = wq.t().contiguous().t()  # the fp8 weight transposed in memory too
        assert wq.stride() == (1, 128) and ops.cublas_block_fits(128, 128, 512, [1, 128], [128, 128], torch.bfloat16)
        want = torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, None, x_block, w_block, torch.bfloat16)
        got = torch.ops.fp8fx.scaled_mm(xq.cuda(), xs.cuda(), wq.cuda(), ws.cuda(), None, x_block, w_block,
                                        torch.bfloat16)
        assert rel_err(got.cpu(), want) < 1e-2, (x_block, w_block)
    xq, xs = quant.quantize(torch.randn(4, 0), [1, 32])
    wq, ws = torch.zeros(8, 0, dtype=torch.float8_e4m3fn), torch.ones(8, 0)
    bias = torch.arange(8.0)
    y = torch.ops.fp8fx.scaled_mm(xq.cuda(), xs.cuda(), wq.cuda(), ws.cuda(), bias.cuda(), [1, 32], [1, 32],
                                  torch.float32)
    assert torch.equal(y.cpu(), bias.expand(4, 8))
    y = torch.ops.fp8fx.weight_only_mm(torch.randn(4, 0).bfloat16().cuda(), wq.cuda(), ws.cuda(), None, [1, 32])
    assert y.shape == (4, 8) and not y.any()
    for e, i, h in ((4, 8, 0), (4, 0, 16)):
        w13 = torch.zeros(e, 2 * i, h, dtype=torch.float8_e4m3fn, device="cuda")
        w2 = torch.zeros(e, h, i, dtype=torch.float8_e4m3fn, device="cuda")
        x = torch.randn(3, h, device="cuda").bfloat16()
        ids = torch.tensor([[0, 1]] * 3, device="cuda")
        y = torch.ops.fp8fx.fused_moe(x, torch.ones(3, 2, device="cuda"), ids, w13, torch.ones(e, device="cuda"), w2,
                                      torch.ones(e, device="cuda"), [-1, -1], [1, -1], torch.bfloat16)
        assert y.shape == (3, h) and not y.any()


def test_fakes_refuse_what_the_real_impls_refuse():
    """Each op's fake impl runs its real impls' argument checks: torch.compile fails while it traces the call, with the
    real impl's message, where it compiled the frame and failed only when the graph ran (a wrong w_scale size, a
    16-bit xq, an integer out_dtype, a 3-D weight, ...)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, wq, ws = _weights()
    xq, xs = quant.quantize(torch.randn(5, 96), [1, -1])
    h = torch.randn(1, 96, dtype=torch.bfloat16)
    w2q, w2s = quant.quantize(torch.randn(96, 32), [1, -1])
    f = torch.ops.fp8fx
    cases = [
        (f.scaled_mm.default, (xq, xs, wq, ws[:3], None, [1, -1], [1, -1], torch.bfloat16), r"w_scale has 3 elements"),
        (f.scaled_mm.default, (h, xs, wq, ws, None, [1, -1], [1, -1], torch.bfloat16), r"xq is torch.bfloat16"),
        (f.scaled_mm.default, (xq, xs, wq, ws, None, [1, -1], [1, -1], torch.int32), r"out_dtype=torch.int32"),
        (f.scaled_mm.default, (xq, xs, wq.reshape(64, 96, 1), ws, None, [1, -1], [1, -1], torch.bfloat16),
         r"must be a torch.float8_e4m3fn \[N, K\] matrix"),
        (f.quantize_static.default, (h, torch.ones(4)), r"must have one element"),
        (f.quantize.default, (h, [-2, 4]), r"block=\[-2, 4\] is not a block"),
        (f.dequantize.default, (wq, ws[:3], [1, -1], torch.bfloat16), r"scale has 3 elements"),
        (f.dequantize.default, (wq[0], ws, [1, -1], torch.bfloat16), r"q has shape \[96\]"),
        (f.weight_only_mm.default, (h, wq, ws[:3], None, [1, -1]), r"w_scale has 3 elements"),
        (f.fused_moe.default, (torch.randn(2, 96), torch.ones(2, 1), torch.zeros(2, 1), wq.reshape(1, 64, 96),
                               ws.reshape(1, 64, 1), w2q.reshape(1, 96, 32), w2s.reshape(1, 96, 1),
                               [1, -1], [1, -1], torch.float32), r"topk_ids is torch.float32"),
        # scaled_mm_fused's fake checked its shards only: a wrong x_scale or out_dtype failed when the graph ran
        (f.scaled_mm_fused.default, (xq, xs[:3], [wq[:32], wq[32:]], [ws[:32], ws[32:]], [None, None], [1, -1],
                                     [1, -1], torch.bfloat16), r"scaled_mm_fused: x_scale has 3 elements"),
        (f.scaled_mm_fused.default, (xq, xs, [wq[:32], wq[32:]], [ws[:32], ws[32:]], [None, None], [1, -1],
                                     [1, -1], torch.int32), r"scaled_mm_fused: out_dtype=torch.int32"),
        (f.scaled_mm_fused.default, (h, xs[:1], [wq[:32], wq[32:]], [ws[:32], ws[32:]], [None, None], [1, -1],
                                     [1, -1], torch.bfloat16), r"scaled_mm_fused: xq is torch.bfloat16"),
    ]
    for op, args, match in cases:
        with pytest.raises(ValueError, match=match):
            op(*args)  # the real impl
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            to_fake = lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
            fake = [[to_fake(t) for t in a] if isinstance(a, list) else to_fake(a) for a in args]
            with pytest.raises(ValueError, match=match):
                op(*fake)


@pytest.mark.parametrize("shape,given", [
    ((5, 1), (5, 1)), ((5, 1), (5,)), ((5, 1), (1,)), ((5, 1), ()), ((1, 7), (7, 1)), ((1, 7), (7,)),
    ((1, 7), (1, 1)), ((1, 7), (1, 7)), ((1, 1), (1,)), ((1, 1), (1, 1))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_as_gives_scaled_mms_layout_and_reuses_one_already_in_it(shape, given, dtype):
    """torch._scaled_mm's row-wise scales: float32 [M, 1] for A and [1, N] for B, from a per-tensor scale or one
    per row / column in any of the shapes fp8fx holds them; a scale already in that layout is passed as it is, a
    contiguous float32 one of the same values in order as a view of it."""
    s = torch.rand(given, dtype=dtype) + 0.5
    got = ops._scale_as(s, shape)
    assert got.shape == shape and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, s.float().reshape(-1).expand(max(shape)).reshape(shape) if s.numel() == 1
                       else s.float().reshape(shape))
    assert (got is s) == (dtype == torch.float32 and tuple(given) == shape)
    assert (got.data_ptr() == s.data_ptr()) == (dtype == torch.float32 and s.numel() == shape[0] * shape[1])
    # the host's cost: no tensor op for one in layout, one (a view) for a float32 one in order, more otherwise
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Count() as count:
        ops._scale_as(s, shape)
    if dtype == torch.float32 and s.numel() == shape[0] * shape[1]:
        assert count.ops == ([] if tuple(given) == shape else [torch.ops.aten.view.default]), count.ops
    else:
        assert len(count.ops) > 1, count.ops


def test_fused_gemm_does_not_take_column_halves_of_one_row_for_back_to_back_rows():
    """Two one-row weights cut as the column halves of one [2, 128] tensor: ``is_contiguous()`` ignores a size-1 dim's
    stride, so they passed for back-to-back rows and the one GEMM read the tensor's second row as the second weight."""
    torch.manual_seed(0)
    parent = torch.randn(2, 128).to(quant.FP8_DTYPE)
    wqs = [parent[0:1, :64], parent[0:1, 64:]]
    xq = torch.randn(3, 64).to(quant.FP8_DTYPE)
    one, scales = torch.tensor([1.0]), [torch.tensor([1.0])] * 2
    fused = ops.scaled_mm_fused(xq, one, wqs, scales, [None, None], [-1, -1], [-1, -1], torch.float32)
    apart = [ops.scaled_mm(xq, one, w, s, None, [-1, -1], [-1, -1], torch.float32) for w, s in zip(wqs, scales)]
    assert torch.equal(fused, torch.cat(apart, -1))


def test_fused_gemm_takes_the_0d_block_scales_scaled_mm_takes():
    """A weight of one 128x128 block may carry its scale as a 0-d tensor: scaled_mm took it, scaled_mm_fused raised an
    IndexError where its fake returned a result."""
    torch.manual_seed(0)
    xq, x_scale = torch.randn(3, 96).to(quant.FP8_DTYPE), torch.tensor([0.5])
    wqs = [torch.randn(64, 96).to(quant.FP8_DTYPE), torch.randn(32, 96).to(quant.FP8_DTYPE)]
    scales = [torch.tensor(0.01), torch.tensor(0.02)]
    fused = ops.scaled_mm_fused(xq, x_scale, wqs, scales, [None, None], [-1, -1], [128, 128], torch.float32)
    apart = [ops.scaled_mm(xq, x_scale, w, s, None, [-1, -1], [128, 128], torch.float32) for w, s in zip(wqs, scales)]
    assert torch.equal(fused, torch.cat(apart, -1))


def test_quantize_decompositions_return_the_layout_of_the_ops():
    """The ATen decompositions (CUDA graphs) gave a transposed x's codes its strides, where the op and its fake
    promise row-major ones: a ``.view`` traced against the fake failed once the decomposition replaced the op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8fx.lowerings import aten

    def f(x):
        q, s = torch.ops.fp8fx.quantize(x.t(), [1, -1])
        return q.view(-1), s, torch.ops.fp8fx.quantize_static(x.t(), torch.tensor([0.01])).view(-1)

    x = torch.randn(64, 32)
    gm = make_fx(f, decomposition_table=aten.decompositions(), tracing_mode="fake")(x)
    assert torch.ops.fp8fx.quantize.default not in {n.target for n in gm.graph.nodes}  # decomposed
    for got, want in zip(gm(x), f(x)):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want)


def test_shapes_the_ops_cannot_take_are_refused_by_name():
    """A 0-d activation (a bare IndexError; quantize_static's fake returned a tensor its real impl could not), and one
    expert's [2I, H] slice as fused_moe's w13 (a bare unpacking error)."""
    scalar = torch.tensor(1.0)
    for call, what in ((lambda: torch.ops.fp8fx.quantize(scalar, [1, -1]), "quantize: x"),
                       (lambda: torch.ops.fp8fx.quantize_static(scalar, torch.tensor([0.5])), "quantize_static: x"),
                       (lambda: torch.ops.fp8fx.scaled_mm(scalar.to(quant.FP8_DTYPE), torch.tensor([1.0]),
                                                          torch.zeros(4, 1, dtype=quant.FP8_DTYPE), torch.tensor([1.0]),
                                                          None, [-1, -1], [-1, -1], torch.float32), "scaled_mm: xq")):
        with pytest.raises(ValueError, match=rf"^fp8fx\.{what} is a 0-d tensor; it takes activations of shape"):
            call()
    fp8 = scalar.to(quant.FP8_DTYPE)
    w, s = torch.zeros(4, 1, dtype=quant.FP8_DTYPE), torch.tensor([1.0])
    for call, what in ((lambda: torch.ops.fp8fx.scaled_mm_fused(fp8, s, [w], [s], [None], [-1, -1], [-1, -1],
                                                                torch.float32), "scaled_mm_fused: xq"),
                       (lambda: torch.ops.fp8fx.gated_mlp(fp8, s, w, s, w, s, w.t(), s, None, [-1, -1], [-1, -1],
                                                          [1, -1], [-1, -1], None, "silu", torch.float32,
                                                          torch.float32), "gated_mlp: xq"),
                       (lambda: torch.ops.fp8fx.weight_only_mm(scalar, w, s, None, [-1, -1]), "weight_only_mm: x")):
        with pytest.raises(ValueError, match=rf"^fp8fx\.{what} is a 0-d tensor"):  # (they raised IndexError)
            call()
    with FakeTensorMode(), pytest.raises(ValueError, match=r"^fp8fx\.quantize_static: x is a 0-d tensor"):
        torch.ops.fp8fx.quantize_static(torch.tensor(1.0), torch.tensor([0.5]))
    e, h, i = 4, 64, 32
    w13, w2 = torch.zeros(e, 2 * i, h, dtype=quant.FP8_DTYPE), torch.zeros(e, h, i, dtype=quant.FP8_DTYPE)
    x, weights, ids = torch.randn(3, h, dtype=torch.bfloat16), torch.rand(3, 2, dtype=torch.bfloat16), torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"^fp8fx\.fused_moe: w13 has shape \[64, 64\]; it must be \[E, 2I, H\]"):
        torch.ops.fp8fx.fused_moe(x, weights, ids.long(), w13[0], torch.tensor([1.0]), w2, torch.ones(e), [-1, -1],
                                  [1, -1], torch.bfloat16)


def test_dtypes_the_ops_cannot_take_are_refused_by_name():
    """An int32 scale (of values it truncated to 0: the output was all zeros), a complex bias (its imaginary part
    dropped with a UserWarning) and int / bool / fp8 activations given to the quantizers (quantized as numbers) ran
    without an error."""
    xq, x_scale = quant.quantize(torch.randn(3, 8), [1, -1])
    wq, w_scale = quant.quantize(torch.randn(4, 8), [1, -1])
    mm = lambda **kw: torch.ops.fp8fx.scaled_mm(**{**dict(  # noqa: E731
        xq=xq, x_scale=x_scale, wq=wq, w_scale=w_scale, bias=None, x_block=[1, -1], w_block=[1, -1],
        out_dtype=torch.float32), **kw})
    assert mm().shape == (3, 4)
    with pytest.raises(ValueError, match=r"^fp8fx\.scaled_mm: w_scale is torch\.int32; scales are float32"):
        mm(w_scale=w_scale.int())
    with pytest.raises(ValueError, match=r"^fp8fx\.scaled_mm: x_scale is torch\.float8_e4m3fn; scales are float32"):
        mm(x_scale=x_scale.to(quant.FP8_DTYPE))
    with pytest.raises(ValueError, match=r"^fp8fx\.scaled_mm: bias is torch\.complex64; it must be bf16, fp16"):
        mm(bias=torch.zeros(4, dtype=torch.complex64))
    for x in (torch.ones(2, 8, dtype=torch.int64), torch.ones(2, 8, dtype=torch.bool), xq):
        with pytest.raises(ValueError, match=rf"^fp8fx\.quantize: x is {x.dtype}; it quantizes bf16/fp16/fp32/fp64"):
            torch.ops.fp8fx.quantize(x, [1, -1])
        with pytest.raises(ValueError, match=rf"^fp8fx\.quantize_static: x is {x.dtype}; it quantizes"):
            torch.ops.fp8fx.quantize_static(x, torch.tensor([0.5]))


def test_cuda_impls_of_empty_operands_match_the_cpu_under_the_interpreter():
    """N = 0, I = 0, K = 0 (prefill route) and E = 0: the CPU ops give an answer, and the CUDA impls failed on a TMA
    descriptor of an empty shape, a scale reshape, a division by E or a misleading a_scale error. Each CUDA impl
    (``ops._CUDA_FNS``: what the op runs on a GPU after its checks) runs here on CPU tensors under Triton's
    interpreter and gives the CPU op's result."""
    script = textwrap.dedent("""
        import torch
        from fp8fx import ops, quant
        g = torch.Generator().manual_seed(0)
        q = lambda shape, blk: quant.quantize(torch.randn(*shape, generator=g), blk)
        R, bf16 = [1, -1], torch.bfloat16
        def same(name, *args):
            want, got = getattr(ops, name)(*args), ops._CUDA_FNS[name](*args)
            assert got.shape == want.shape and torch.equal(got, want), (name, got.shape, want.shape)
        xq, xs = q((24, 256), R); wq, ws = q((0, 256), R)
        same("scaled_mm", xq, xs, wq, ws, None, R, R, bf16)
        same("weight_only_mm", torch.randn(3, 256, generator=g).bfloat16(), wq, ws, None, R)
        for m, k, i, hb in ((3, 64, 0, [1, 32]), (ops.GATED_PREFILL_MIN_M, 0, 32, [1, -1])):
            xq, xs = q((m, k), R); w1, s1 = q((i, k), R); w2, s2 = q((16, i), R)
            same("gated_mlp", xq, xs, w1, s1, w1.clone(), s1, w2, s2, torch.ones(16), R, R, hb, R, None, "silu", bf16,
                 bf16, False)
        w13, s13 = q((0, 32, 64), R); w2, s2 = q((0, 64, 16), R)
        x, w, ids = torch.randn(2, 64, generator=g).bfloat16(), torch.rand(2, 2), torch.full((2, 2), -1)
        same("fused_moe", x, w, ids, w13, s13, w2, s2, R, R, bf16)
        print("empty operands: ok")
    """)
    assert "empty operands: ok" in run_under_triton_interpreter(["-c", script])


@pytest.mark.parametrize("activation", ["swiglu_oai", "silu_clamped"])
def test_clamped_moe_activations_clamp_the_gate_from_above_only(activation):
    """GPT-OSS's (and DeepSeek-V4's) gate is clamped at +limit only, its up at +-limit: a gate far below -limit keeps
    its value (the only check of that was one MoE test's error bound, which a clamp at both ends passed by 0.0003)."""
    limit, alpha = 7.0, 1.702
    gate = torch.tensor([-30.0, -9.0, -7.5, -1.0, 0.5, 6.0, 9.0, 40.0], dtype=torch.float64)
    up = torch.tensor([-20.0, -8.0, 3.0, 0.25, -0.5, 7.5, 1.0, -9.0], dtype=torch.float64)
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    if activation == "swiglu_oai":
        want = g * torch.sigmoid(alpha * g) * (u + 1)
    else:
        want = torch.nn.functional.silu(g) * u
    for interleaved in (False, True):
        g1 = torch.stack([gate, up], -1).reshape(-1) if interleaved else torch.cat([gate, up])
        got = ops.moe_activation(g1, interleaved, activation, alpha, limit)
        assert torch.equal(got, want), (interleaved, got, want)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_layer_whose_scale_alone_requires_grad_keeps_the_reference_path(compiler, caplog, monkeypatch):
    """model.requires_grad_() on a model whose first layer has no bias and reads data that takes no gradient: only
    its scale requires grad. The linear pass looked at the activation and the bias, rewrote the layer, and the
    backward failed ("no autograd formula" for fp8fx.scaled_mm). It keeps torch's linear on the dequantized weight,
    reported, and the scale's gradient is the eager one. A gradient into the scales warns once: an optimizer step
    on them moved per-channel scales below 0 within a few dozen AdamW steps, found only at save."""
    monkeypatch.setattr(ops, "_SCALE_GRAD_WARNED", [False])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 32)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    model.requires_grad_()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="fp8fx"):
        model(x).float().square().sum().backward()
    assert "fp8 weight scales took a gradient" in caplog.text
    want = model[0].weight_scale.grad.clone()
    model.zero_grad()
    backend = fp8fx.Fp8Backend(compiler=compiler)
    torch.compile(model, backend=backend)(x).float().square().sum().backward()
    first = next(s for s in backend.report.sites if s.fqn == "0")
    assert not first.rewritten and "weight scale or bias requires grad" in first.reason, first.reason
    assert rel_err(model[0].weight_scale.grad.double(), want.double()) < 0.02


@pytest.mark.parametrize("block, shape", [([-1, -1], (40, 33)), ([1, -1], (40, 33)), ([16, 16], (40, 33)),
                                          ([16, 16], (2, 40, 33))])
def test_dequantize_is_differentiable_in_its_scale(block, shape):
    """A model set requires_grad (model.requires_grad_()) stopped its backward at fp8fx.dequantize ("no autograd
    formula was registered"), also where only the input's gradient was asked for."""
    torch.manual_seed(0)
    w = torch.randn(shape)
    scale = quant.compute_scale(w, block)
    q = (w / quant.expand_scale(scale, w.shape, block)).to(quant.FP8_DTYPE)
    s = scale.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda s: torch.ops.fp8fx.dequantize(q, s, block, torch.float64), (s,))
    grad = torch.randn(shape, dtype=torch.float64)
    (got,) = torch.autograd.grad(torch.ops.fp8fx.dequantize(q, s, block, torch.float64), s, grad)
    (want,) = torch.autograd.grad(q.double() * quant.expand_scale(s, q.shape, block), s, grad)
    assert rel_err(got, want) < 1e-12  # (float64 throughout: a float32 sum was 1e-7 off, within gradcheck's bounds)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_quantized_model_set_requires_grad_backpropagates_to_its_input(compiled):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    model.requires_grad_()
    reference = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).double()
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items() if "scale" not in k} | {
        f"{i}.weight": model[i].weight.double() for i in (0, 2)})
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    fn = torch.compile(model, backend=fp8fx.Fp8Backend(compiler="eager")) if compiled else model
    fn(x).float().square().sum().backward()
    reference(x64).square().sum().backward()
    assert rel_err(x.grad.double(), x64.grad) < 0.05
    scale_grad = model[0].weight_scale.grad  # d/dscale = sum over each row of dL/dW * codes
    want = (reference[0].weight.grad * model[0].weight.double()).sum(-1, keepdim=True) / model[0].weight_scale.double()
    assert scale_grad.shape == model[0].weight_scale.shape and rel_err(scale_grad.double(), want) < 0.05
    assert model[0]._parameters["weight"].grad is None  # (no gradient reaches fp8 codes)


def test_forward_mode_ad_carries_the_inputs_tangents_and_gives_the_scales_none():
    """README: forward mode (torch.func.jvp / jacfwd) carries the inputs' tangents through fp8 layers (the Jacobian
    is reverse mode's), and gives a scale none: torch drops a tangent at a custom op with no forward formula, a zero
    derivative, where reverse mode gives the scale its gradient."""
    from torch.func import functional_call, jacfwd, jacrev, jvp

    torch.manual_seed(0)
    model = fp8fx.quantize_(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    x = torch.randn(8)
    forward, reverse = jacfwd(model)(x), jacrev(model)(x)
    assert forward.abs().max() > 0.1 and torch.allclose(forward, reverse, rtol=1e-5, atol=1e-6)
    scale = model[0].weight_scale.detach().clone()
    of_scale = lambda s: functional_call(model, {"0.weight_scale": s}, (x,))  # noqa: E731
    _, tangent = jvp(of_scale, (scale,), (torch.ones_like(scale),))
    assert torch.equal(tangent, torch.zeros(4))
    leaf = scale.clone().requires_grad_()  # (what forward mode gives up: the scale's derivative, reverse mode's)
    assert torch.autograd.grad(of_scale(leaf).sum(), leaf)[0].abs().max() > 0.1


def test_reference_ops_compute_in_float32_under_autocast():
    """The caller's torch.autocast reached into the ops' CPU implementations: scaled_mm and weight_only_mm computed
    their products in bf16 (3e-3 off float32 math, which the ops promise), and fused_moe failed writing a bf16
    product into its float32 buffer ("Index put requires the source and destination dtypes match"), so an fp8 MoE
    model compiled with compiler="eager" failed under autocast."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 128, generator=g), torch.randn(64, 128, generator=g)
    xq, xs = quant.quantize(x, [1, -1])
    wq, ws = quant.quantize(w, [1, -1])
    wd = quant.dequantize(wq, ws, [1, -1], torch.float64)
    want = quant.dequantize(xq, xs, [1, -1], torch.float64) @ wd.t()
    q13, s13 = quant.quantize(torch.randn(4, 64, 64, generator=g) / 8, [1, -1])
    q2, s2 = quant.quantize(torch.randn(4, 64, 32, generator=g) / 6, [1, -1])
    xm, weights = torch.randn(3, 64, generator=g), torch.rand(3, 2, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    moe = (xm, weights, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.float32)
    plain = torch.ops.fp8fx.fused_moe(*moe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, None, [1, -1], [1, -1], torch.float32)
        y_weight_only = torch.ops.fp8fx.weight_only_mm(x, wq, ws, None, [1, -1])
        moe_out = torch.ops.fp8fx.fused_moe(*moe)
    assert (y.double() - want).abs().max() / want.abs().max() < 1e-6
    assert (y_weight_only.double() - x.double() @ wd.t()).abs().max() / want.abs().max() < 1e-6
    assert torch.equal(moe_out, plain)


@pytest.mark.parametrize("per_token", [True, False])
def test_an_inf_activation_makes_the_rows_of_its_scale_nan(per_token):
    """README: activations are not checked at run time; an Inf one makes its dynamic scale Inf, so the rows that
    scale covers come out NaN (its token's row per token, every row per tensor), and the other rows are as before."""
    torch.manual_seed(0)
    config = fp8fx.Fp8Config() if per_token else fp8fx.Fp8Config(
        weight_granularity=fp8fx.PerTensor(), activation_granularity=fp8fx.PerTensor())
    model = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16), config)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    bad = x.clone()
    bad[1, 5] = float("inf")
    compiled = torch.compile(model, backend=fp8fx.Fp8Backend(compiler="eager"))
    with torch.no_grad():
        y, y_bad = compiled(x), compiled(bad)
    assert y_bad.isnan().all(dim=1).tolist() == ([False, True, False] if per_token else [True] * 3)
    if per_token:
        assert torch.equal(y_bad[[0, 2]], y[[0, 2]])


def test_static_scales_of_another_dtype_and_dequantize_s_riders_are_refused_naming_them():
    """A complex static scale lost its imaginary part and a bool one read as 1.0 (quantize_static); an int64 h_static
    failed as "fp8fx.scaled_mm: x_scale", an argument the caller never passed; dequantize took input_scale=-1, two
    input scales or act_block=[0, 5], which a compiled graph then failed on, naming other ops' arguments after the
    report called the layer rewritten; fused_moe refused a13_scale with a per-group act_block but took a2_scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    for bad in (torch.tensor([1 + 5j]), torch.tensor([True]), torch.tensor([1])):
        with pytest.raises(ValueError, match=rf"^fp8fx\.quantize_static: the static input scale is {bad.dtype}; a "
                                             r"static scale is a floating-point tensor \(float32\)$"):
            torch.ops.fp8fx.quantize_static(x, bad)
    xq, xs = quant.quantize(x, [1, -1])
    w1, s1 = quant.quantize(torch.randn(32, 64, generator=g), [1, -1])
    w3, s3 = quant.quantize(torch.randn(32, 64, generator=g), [1, -1])
    w2, s2 = quant.quantize(torch.randn(48, 32, generator=g), [1, -1])
    with pytest.raises(ValueError, match=r"^fp8fx\.gated_mlp: h_static is torch\.int64"):
        torch.ops.fp8fx.gated_mlp(xq, xs, w1, s1, w3, s3, w2, s2, None, [1, -1], [1, -1], [-1, -1], [1, -1],
                                  torch.tensor([1]), "silu", torch.bfloat16, torch.bfloat16)
    for kwargs, match in ((dict(input_scale=torch.tensor([-1.0])), r"^fp8fx\.dequantize: input_scale is -1\.0"),
                          (dict(input_scale=torch.tensor([0.1, 0.2])), r"^fp8fx\.dequantize: input_scale must have "
                                                                       r"one element, got shape \[2\]"),
                          (dict(act_block=[0, 5]), r"^fp8fx: act_block=\[0, 5\] is not a block")):
        with pytest.raises(ValueError, match=match):
            torch.ops.fp8fx.dequantize(w1, s1, [1, -1], torch.float32, **kwargs)
    assert torch.ops.fp8fx.dequantize(w1, s1, [1, -1], torch.float32, torch.tensor([0.1]), [1, -1]).shape == (32, 64)
    wts, ids = torch.rand(3, 2, generator=g), torch.tensor([[0, 1], [1, 0], [0, 0]])
    q13, s13 = quant.quantize(torch.randn(2, 64, 64, generator=g) / 8, [1, -1])
    q2, s2e = quant.quantize(torch.randn(2, 64, 32, generator=g) / 6, [1, -1])
    with pytest.raises(ValueError, match=r"^fp8fx\.fused_moe: a2_scale \(a static per-tensor scale of the "
                                         r"intermediate\) with act_block=\[1, 32\]; a static scale is per tensor"):
        torch.ops.fp8fx.fused_moe(x, wts, ids, q13, s13, q2, s2e, [1, -1], [1, 32], torch.float32,
                                  a2_scale=torch.tensor([0.1]))


def test_direct_calls_take_their_arguments_by_keyword():
    """fp8fx.ops.direct.<op>(x=..., block=...) picked its kernel by args[0]: a bare IndexError, naming nothing."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    q, s = ops.direct.quantize(x=x, block=[1, -1])
    want = torch.ops.fp8fx.quantize(x, [1, -1])
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1])
