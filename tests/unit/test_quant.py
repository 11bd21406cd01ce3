"""fp8fx.quant: the plain-torch FP8 math, checked against a float64 reference written here.

The reference below does not use fp8fx.quant internals: tile amax is a scatter-reduce over explicit
tile ids, scale expansion is explicit index arithmetic, and the e4m3 rounding bound is derived from
the format (3 mantissa bits, min normal 2**-6, subnormal spacing 2**-9, max 448).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8fx import quant

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS_AMAX = 1e-12  # documented: amax below 1e-12 is treated as 1e-12
F32_EPS = 2.0**-23

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)

BLOCKS = [(-1, -1), (1, -1), (1, 4), (1, 128), (3, 5), (128, 128), (2, -1), (-1, 3), (1, 1), (4, 4)]


# --- float64 reference --------------------------------------------------------------------------
def ref_block(block, rows, cols):
    b_r, b_c = block
    return (rows if b_r == -1 else b_r, cols if b_c == -1 else b_c)


def ref_scale_shape(shape, block):
    *lead, rows, cols = shape
    b_r, b_c = ref_block(block, rows, cols)
    return (*lead, -(-rows // b_r), -(-cols // b_c))


def ref_tile_amax(x: torch.Tensor, block) -> torch.Tensor:
    """float64 max |x| per tile via scatter_reduce over explicit tile ids; x: [..., R, C]."""
    *lead, rows, cols = x.shape
    b_r, b_c = ref_block(block, rows, cols)
    n_r, n_c = -(-rows // b_r), -(-cols // b_c)
    batch = math.prod(lead)
    tile_id = (torch.arange(rows)[:, None] // b_r) * n_c + (torch.arange(cols)[None, :] // b_c)
    tile_id = tile_id[None] + torch.arange(batch)[:, None, None] * (n_r * n_c)
    out = torch.zeros(batch * n_r * n_c, dtype=torch.float64)
    out.scatter_reduce_(0, tile_id.reshape(-1), x.double().abs().reshape(-1), reduce="amax", include_self=True)
    return out.reshape(*lead, n_r, n_c)


def ref_scale(x: torch.Tensor, block) -> torch.Tensor:
    return ref_tile_amax(x, block).clamp(min=EPS_AMAX) / E4M3_MAX


def ref_expand(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """scale [..., nR, nC] -> [..., R, C] by explicit index arithmetic."""
    *lead, rows, cols = shape
    b_r, b_c = ref_block(block, rows, cols)
    scale = scale.reshape(ref_scale_shape(shape, block))
    return scale[..., torch.arange(rows) // b_r, :][..., torch.arange(cols) // b_c]


def e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e4m3 values around |v| (float64): 2**(floor(log2|v|) - 4) for normals,
    2**-10 in the subnormal range (|v| < 2**-6)."""
    a = v.double().abs()
    _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    normal = torch.exp2((e - 1).double() - 4)
    return torch.where(a >= 2.0**-6, normal, torch.full_like(a, 2.0**-10))


def fp8_bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def random_fp8(shape, gen) -> torch.Tensor:
    """Every finite e4m3 value (incl. -0, subnormals, +-448) with equal probability."""
    bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are NaN in e4m3fn
    return bits.view(FP8)


def random_scale(shape, gen) -> torch.Tensor:
    """Positive float32 scales spread over 2**-12 .. 2**12 so tiles are clearly distinct."""
    return torch.exp2(torch.rand(shape, generator=gen, dtype=torch.float64) * 24 - 12).float()


def make_x(shape, seed, exp10, dtype=torch.float32, zero_rows=False) -> torch.Tensor:
    """randn * 10**exp10 with a per-row magnitude jitter of up to 1e+-3 (so tiles differ)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    jitter = 10.0 ** (torch.rand((*shape[:-1], 1), generator=gen, dtype=torch.float64) * 6 - 3)
    x = x * jitter * 10.0**exp10
    if zero_rows and shape[-2] > 1:
        x[..., ::2, :] = 0
    return x.to(dtype)


def check_quantized(x: torch.Tensor, block, q: torch.Tensor, scale: torch.Tensor) -> None:
    """All the properties of q, scale = quantize(x, block), against the float64 reference."""
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32
    assert tuple(scale.shape) == ref_scale_shape(x.shape, block)

    # scale = max(amax, 1e-12) / 448 per tile (float32 rounding of the float64 value)
    amax = ref_tile_amax(x, block)
    expect = ref_scale(x, block)
    torch.testing.assert_close(scale.double(), expect, rtol=2 * F32_EPS, atol=0)
    assert torch.isfinite(scale).all() and (scale > 0).all()

    # q: never NaN, within +-448; each non-degenerate tile reaches +-448 at its amax
    qd = q.double()
    assert not torch.isnan(qd).any()
    assert qd.abs().max() <= E4M3_MAX
    q_amax = ref_tile_amax(qd, block)
    big = amax >= EPS_AMAX
    assert (q_amax[big] == E4M3_MAX).all()

    # q is x / scale rounded to nearest e4m3 (float32 division slop allowed)
    s = ref_expand(scale.double(), x.shape, block)
    x64 = x.double()
    v = x64 / s
    err_q = (qd - v).abs()
    assert (err_q <= e4m3_half_ulp(v) + v.abs() * 2 * F32_EPS).all(), err_q.max()

    # dequantize: exactly q.float() * scale, and within the e4m3 rounding bound of x
    deq = quant.dequantize(q, scale, block)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    assert torch.equal(deq, (qd * s).float())
    err = (deq.double() - x64).abs()
    # element-wise: relative 2**-4 (3 mantissa bits) + subnormal half-spacing 2**-10 * scale
    bound = 2.0**-4 * x64.abs() + 2.0**-10 * s + 4 * F32_EPS * x64.abs()
    assert (err <= bound).all(), (err - bound).max()
    # the tile-amax form of the same bound
    tile_amax = ref_expand(amax, x.shape, block)
    assert (err <= 2.0**-4 * tile_amax + 2.0**-10 * s + 4 * F32_EPS * tile_amax).all()


# --- scale shapes -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, block, expected",
    [
        ((7, 11), (-1, -1), (1, 1)),
        ((7, 11), (1, -1), (7, 1)),
        ((7, 11), (1, 4), (7, 3)),
        ((7, 11), (3, 5), (3, 3)),
        ((7, 11), (128, 128), (1, 1)),
        ((4, 300), (1, 128), (4, 3)),
        ((256, 384), (128, 128), (2, 3)),
        ((257, 385), (128, 128), (3, 4)),
        ((2, 7, 11), (3, 5), (2, 3, 3)),
        ((2, 3, 7, 11), (1, -1), (2, 3, 7, 1)),
        ((3, 5, 8), (-1, -1), (3, 1, 1)),
    ],
)
def test_scale_shape(shape, block, expected):
    assert quant.scale_shape(shape, block) == expected
    x = make_x(shape, seed=0, exp10=0)
    q, scale = quant.quantize(x, block)
    assert tuple(scale.shape) == expected
    check_quantized(x, block, q, scale)


def test_per_block_3x5_on_7x11_explicit():
    x = make_x((7, 11), seed=1, exp10=0)
    _, scale = quant.quantize(x, (3, 5))
    for i, r0 in enumerate(range(0, 7, 3)):
        for j, c0 in enumerate(range(0, 11, 5)):
            amax = x[r0 : r0 + 3, c0 : c0 + 5].double().abs().max()
            assert scale[i, j].item() == pytest.approx(amax.item() / 448.0, rel=2 * F32_EPS, abs=0)


def test_per_tensor_per_row_per_group_explicit():
    x = make_x((5, 300), seed=2, exp10=1)
    x64 = x.double()
    _, s = quant.quantize(x, (-1, -1))
    assert s.shape == (1, 1)
    assert s.item() == pytest.approx(x64.abs().max().item() / 448, rel=2 * F32_EPS, abs=0)
    _, s = quant.quantize(x, (1, -1))
    torch.testing.assert_close(s.double(), x64.abs().amax(1, keepdim=True) / 448, rtol=2 * F32_EPS, atol=0)
    _, s = quant.quantize(x, (1, 128))
    groups = torch.stack([x64[:, g : g + 128].abs().amax(1) for g in (0, 128, 256)], dim=1)
    torch.testing.assert_close(s.double(), groups / 448, rtol=2 * F32_EPS, atol=0)


def test_leading_dims_quantize_each_slice_independently():
    x = make_x((3, 7, 11), seed=3, exp10=0)
    x[1] *= 1000.0  # slices of very different magnitude
    for block in [(-1, -1), (1, -1), (3, 5), (1, 4)]:
        q, scale = quant.quantize(x, block)
        assert scale.shape[0] == 3
        for b in range(3):
            qb, sb = quant.quantize(x[b], block)
            assert torch.equal(fp8_bits(q[b]), fp8_bits(qb))
            assert torch.equal(scale[b], sb)


def test_quantize_needs_2d():
    with pytest.raises(ValueError, match="at least 2 dims"):
        quant.quantize(torch.ones(8), (1, -1))


# --- property: round trip -----------------------------------------------------------------------
@SETTINGS
@given(
    lead=st.sampled_from([(), (2,), (3,), (2, 2)]),
    rows=st.integers(1, 24),
    cols=st.integers(1, 300),
    block=st.sampled_from(BLOCKS),
    exp10=st.integers(-30, 30),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    zero_rows=st.booleans(),
)
def test_quantize_round_trip_property(lead, rows, cols, block, exp10, seed, dtype, zero_rows):
    x = make_x((*lead, rows, cols), seed, exp10, dtype, zero_rows)
    q, scale = quant.quantize(x, block)
    check_quantized(x, block, q, scale)
    # static quantization with the same scale gives the same q
    assert torch.equal(fp8_bits(quant.quantize_with_scale(x, scale, block)), fp8_bits(q))


@pytest.mark.parametrize("block", [(-1, -1), (1, -1), (1, 128)])
def test_quantize_float16_input(block):
    x = make_x((6, 200), seed=4, exp10=0, dtype=torch.float16)
    q, scale = quant.quantize(x, block)
    check_quantized(x, block, q, scale)


# --- edge magnitudes and AMAX_EPS -------------------------------------------------------------
@pytest.mark.parametrize("shape, block", [((4, 8), (-1, -1)), ((4, 8), (1, -1)), ((7, 11), (3, 5)), ((2, 3, 9), (1, 4))])
def test_all_zero(shape, block):
    x = torch.zeros(shape)
    q, scale = quant.quantize(x, block)
    assert tuple(scale.shape) == ref_scale_shape(shape, block)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    # AMAX_EPS: an all-zero tile gets scale 1e-12 / 448
    torch.testing.assert_close(scale.double(), torch.full(scale.shape, EPS_AMAX / E4M3_MAX, dtype=torch.float64), rtol=1e-6, atol=0)
    assert (fp8_bits(q) == 0).all()  # +0, not -0 or NaN
    deq = quant.dequantize(q, scale, block)
    assert (deq == 0).all() and not torch.signbit(deq).any()


@pytest.mark.parametrize("block, expected", [((-1, -1), (1, 1)), ((1, -1), (0, 1)), ((1, 4), (0, 4)), ((128, 128), (0, 1))])
def test_empty_rows(block, expected):
    """M == 0 activations (an empty batch, an MoE expert with no tokens). Per-tensor means one scale
    whatever the shape (config table: ``[1, 1]``; ``ops._act_scale_shape``, the fake impl of
    torch.ops.fp8fx.quantize, also says (1, 1)); the other layouts have ceil(0 / bR) == 0 rows."""
    x = torch.zeros(0, 16)
    assert quant.scale_shape((0, 16), block) == expected
    q, scale = quant.quantize(x, block)
    assert q.dtype == FP8 and q.shape == (0, 16)
    assert tuple(scale.shape) == expected
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert quant.dequantize(q, scale, block).shape == (0, 16)
    q3, scale3 = quant.quantize_rows(torch.zeros(2, 0, 16), block)
    assert q3.shape == (2, 0, 16) and tuple(scale3.shape) == expected


def test_amax_eps_constant():
    assert quant.AMAX_EPS == EPS_AMAX
    assert quant.FP8_MAX == E4M3_MAX


@pytest.mark.parametrize("block", [(-1, -1), (1, -1), (1, 4), (3, 5)])
def test_huge_values(block):
    x = make_x((7, 11), seed=5, exp10=30)
    x[0, 0] = 3.0e38  # near the float32 max
    q, scale = quant.quantize(x, block)
    check_quantized(x, block, q, scale)
    assert torch.isfinite(quant.dequantize(q, scale, block)).all()


@pytest.mark.parametrize("block", [(-1, -1), (1, -1), (3, 5)])
def test_float64_values_past_float32_s_range_are_refused_naming_the_amax(block):
    """A float64 tensor holding 1e39 got an inf scale and NaN codes (it is read in float32, where 1e39 is inf), its
    other values in the tile NaN with it, silently; it is refused, naming the amax and the dtype. A float64 value
    that rounds to float32's max, and an inf, which every dtype holds, are taken as before."""
    x = make_x((7, 11), seed=5, exp10=0, dtype=torch.float64)
    x[2, 3] = -1e39
    for quantize in (lambda t: quant.quantize(t, block), lambda t: torch.ops.fp8fx.quantize(t, list(block))):
        with pytest.raises(ValueError, match=r"^fp8fx: a torch\.float64 tensor of amax 1e\+39 \(1 of its 77 values "
                                             r"past float32's range, 3\.4e\+38\) cannot be quantized: .* bring the "
                                             r"tensor into float32's range \(scale it down\) or keep it in high "
                                             r"precision$"):
            quantize(x)
    x[2, 3] = float(torch.finfo(torch.float32).max) * (1 + 2.0**-26)  # past the max, rounds to it
    q, scale = quant.quantize(x, block)
    assert torch.isfinite(scale).all() and not q.float().isnan().any()
    x[2, 3] = float("inf")
    q, scale = quant.quantize(x, block)
    assert torch.isinf(scale).sum() == 1


@pytest.mark.parametrize("block", [(-1, -1), (1, -1), (1, 4), (3, 5)])
def test_tiny_values_flush_to_zero(block):
    """amax = ~1e-30 < AMAX_EPS: scale = 1e-12 / 448, every |x / scale| < 2**-10 so q == 0 and the
    round-trip error is |x| itself (far below the 2**-10 * scale absolute term)."""
    x = make_x((7, 11), seed=6, exp10=-30)
    q, scale = quant.quantize(x, block)
    check_quantized(x, block, q, scale)
    torch.testing.assert_close(scale.double(), torch.full(scale.shape, EPS_AMAX / E4M3_MAX, dtype=torch.float64), rtol=1e-6, atol=0)
    assert (q.float() == 0).all()
    deq = quant.dequantize(q, scale, block)
    assert (deq == 0).all()
    assert ((deq.double() - x.double()).abs() <= x.double().abs()).all()


def test_amax_just_below_eps_keeps_eps_scale():
    """A tile with amax 5e-13 < 1e-12 is quantized on the 1e-12 scale: its max maps to 224, not 448."""
    x = torch.tensor([[5e-13, -2.5e-13, 1e-13, 0.0]])
    q, scale = quant.quantize(x, (-1, -1))
    check_quantized(x, (-1, -1), q, scale)
    assert scale.item() == pytest.approx(EPS_AMAX / E4M3_MAX, rel=1e-6)
    assert q.float().tolist() == [[224.0, -112.0, 44.0, 0.0]]


def test_mixed_magnitudes_in_one_tile():
    x = torch.tensor([[1e30, 1e-30, -1e25, 3.0], [0.0, -1e30, 1e29, 1.0]])
    q, scale = quant.quantize(x, (-1, -1))
    check_quantized(x, (-1, -1), q, scale)
    # -1e25 / scale = -0.00448 -> 2 subnormal steps of 2**-9; 1e29 / scale = 44.8 -> 44
    assert q.float().tolist() == [[448.0, 0.0, -2 * 2.0**-9, 0.0], [0.0, -448.0, 44.0, 0.0]]


# --- saturation -------------------------------------------------------------------------------
def test_quantize_with_scale_saturates():
    ratios = [-1e6, -500.0, -449.0, -448.0, 0.0, 96.0, 448.0, 449.0, 464.0, 465.0, 1e6, 1e30, math.inf, -math.inf]
    expect = [-448.0, -448.0, -448.0, -448.0, 0.0, 96.0, 448.0, 448.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0]
    scale = torch.tensor([[0.5]])
    x = torch.tensor([ratios]) * 0.5
    q = quant.quantize_with_scale(x, scale, (-1, -1))
    assert q.dtype == FP8
    assert not torch.isnan(q.float()).any()
    assert q.float().tolist() == [expect]
    # 0-dim and [1] scales (checkpoint layouts) work the same
    for s in (torch.tensor(0.5), torch.tensor([0.5])):
        assert torch.equal(fp8_bits(quant.quantize_with_scale(x, s, (-1, -1))), fp8_bits(q))


def test_quantize_with_scale_rounds_the_float32_quotient_to_even_at_ties():
    """The codes are those of the float32 quotient x / scale, ties to even (the kernels make the same codes): pinned
    at fp8 midpoints the quotient reaches exactly, where x * (1 / scale) can land a float32 ulp off and round to the
    other neighbour (414 / (414 / 84) = 84, between 80 and 88: 80; through the reciprocal, 88). The check allowed
    one step at a tie, and no test failed with the reciprocal in (h151). The reference is independent of torch's
    cast: of two neighbouring codes, the one with an even last bit."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # every finite non-negative code, 0 .. 448
    mids = (values[:-1] + values[1:]) / 2  # exact in float32
    even = torch.where(torch.arange(126) % 2 == 0, values[:-1], values[1:])
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.empty(400, 1, dtype=torch.float64).uniform_(-6, 6, generator=g)).float()
    x = (mids.double() * scale.double()).float()  # [400 scales, 126 midpoints]
    exact = (x.double() / scale.double()).float() == mids  # (float32 division is the float64 quotient rounded)
    q = quant.quantize_with_scale(x, scale, (1, -1)).float()
    assert exact.sum() > 20_000, exact.sum()
    assert torch.equal(q[exact], even.expand_as(x)[exact])
    # the check has power: at some of these ties the reciprocal's product is off the midpoint, and rounds away
    off = (x * (1 / scale) != mids) & exact
    assert off.sum() > 100 and not torch.equal(quant.cast_to_fp8(x * (1 / scale)).float()[off], even.expand_as(x)[off])
    sign = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)  # and symmetric
    assert torch.equal(quant.quantize_with_scale(x * sign, scale, (1, -1)).float()[exact], (even * sign)[exact])


def test_quantize_with_scale_saturates_per_row_and_block():
    scale = torch.tensor([[1.0], [0.01]])
    x = torch.tensor([[1000.0, -1000.0, 104.0], [5.0, -5.0, 0.44]])
    q = quant.quantize_with_scale(x, scale, (1, -1))
    assert q.float().tolist() == [[448.0, -448.0, 104.0], [448.0, -448.0, 44.0]]
    # per-block: only the tile whose scale is too small saturates
    x = torch.full((4, 4), 10.0)
    scale = torch.tensor([[1.0, 0.001], [1.0, 1.0]])
    q = quant.quantize_with_scale(x, scale, (2, 2))
    expected = torch.full((4, 4), 10.0)
    expected[:2, 2:] = 448.0
    assert torch.equal(q.float(), expected)


def test_cast_to_fp8_saturates():
    x = torch.tensor([-1e9, -448.5, 448.5, 1e9, math.inf])
    assert quant.cast_to_fp8(x).float().tolist() == [-448.0, -448.0, 448.0, 448.0, 448.0]


# --- dequantize is exactly q.float() * expanded scale -------------------------------------------
@SETTINGS
@given(
    lead=st.sampled_from([(), (2,), (2, 3)]),
    rows=st.integers(1, 20),
    cols=st.integers(1, 140),
    block=st.sampled_from(BLOCKS),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequantize_bitwise(lead, rows, cols, block, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, rows, cols)
    q = random_fp8(shape, gen)
    scale = random_scale(ref_scale_shape(shape, block), gen)
    expect = (q.double() * ref_expand(scale.double(), shape, block)).float()
    out = quant.dequantize(q, scale, block)
    assert out.dtype == torch.float32 and out.shape == shape
    assert torch.equal(out.view(torch.int32), expect.view(torch.int32))
    # the scale may come in any shape with the right numel (e.g. flattened)
    assert torch.equal(quant.dequantize(q, scale.reshape(-1), block).view(torch.int32), expect.view(torch.int32))
    # dtype: the float32 product cast once
    out_bf16 = quant.dequantize(q, scale, block, torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16.view(torch.int16), expect.to(torch.bfloat16).view(torch.int16))


def test_dequantize_explicit_small():
    q = torch.tensor([[1.0, -2.0, 3.0], [4.0, 0.5, -448.0]]).to(FP8)
    scale = torch.tensor([[2.0, 10.0], [0.5, 0.25]])  # per-block (1, 2)
    out = quant.dequantize(q, scale, (1, 2))
    assert out.tolist() == [[2.0, -4.0, 30.0], [2.0, 0.25, -112.0]]


def test_scale_grad_sums_in_float64_for_a_float64_scale():
    """A float32 grad with a float64 scale: the tile's sum was taken in float32 (the float64 scale's gradient lost
    2**-30 against 1); it is summed in the scale's float64."""
    grad = torch.tensor([[1.0, 2.0**-30]])
    q = torch.ones(1, 2).to(FP8)
    got = quant.dequantize_scale_grad(grad, q, torch.ones(1, 1, dtype=torch.float64), (-1, -1))
    assert got.dtype == torch.float64 and got.item() == 1.0 + 2.0**-30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_mm_takes_16_bit_floats_for_a_float32_output(dtype):
    """Both 16-bit floats cast exactly to float32 (``exact_cast``): fp8fx.small_mm on fp16 x and w with a float32
    output was refused as an inexact cast; it computes the float32 linear, within float32 rounding of float64's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 16, generator=g).to(dtype), torch.randn(4, 16, generator=g).to(dtype)
    assert quant.exact_cast(dtype, torch.float32) and not quant.exact_cast(torch.float32, dtype)
    y = torch.ops.fp8fx.small_mm(x, w, None, torch.float32)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), x.double() @ w.double().t(), rtol=1e-6, atol=1e-6)


# --- requantize_shards / max_input_scale -------------------------------------------------------
@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 6), min_size=3, max_size=3),
    k=st.integers(1, 40),
    exps=st.lists(st.integers(-3, 3), min_size=3, max_size=3),
    scale_layout=st.sampled_from([(), (1,), (1, 1)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_requantize_shards_property(sizes, k, exps, scale_layout, seed):
    gen = torch.Generator().manual_seed(seed)
    qs, scales = [], []
    for size, e in zip(sizes, exps):
        w = torch.randn(size, k, generator=gen) * 10.0**e
        q_i, s_i = quant.quantize(w, (-1, -1))
        qs.append(q_i)
        scales.append(s_i.reshape(scale_layout))
    q = torch.cat(qs)
    q_before = fp8_bits(q).clone()
    out, scale = quant.requantize_shards(q, scales, sizes)
    assert torch.equal(fp8_bits(q), q_before)  # input untouched
    assert out.dtype == FP8 and out.shape == q.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (1,)
    s_max = max(s.item() for s in scales)
    assert scale.item() == s_max
    m = scale.double().item()
    outd = out.double()
    assert not torch.isnan(outd).any() and outd.abs().max() <= E4M3_MAX
    start = 0
    for size, q_i, s_i in zip(sizes, qs, scales):
        new = out[start : start + size]
        if s_i.item() == s_max:
            assert torch.equal(fp8_bits(new), fp8_bits(q_i))
        old_val = q_i.double() * s_i.double().reshape(())
        v = old_val / m
        assert ((new.double() - v).abs() <= e4m3_half_ulp(v) + v.abs() * 4 * F32_EPS).all()
        err = (new.double() * m - old_val).abs()
        assert (err <= 2.0**-4 * old_val.abs() + 2.0**-10 * m + 8 * F32_EPS * old_val.abs()).all()
        start += size


def test_requantize_shards_in_chunks_is_the_same(monkeypatch):
    """A 70B layer's shards are requantized a few rows at a time: every test's shards were smaller than one chunk."""
    torch.manual_seed(0)
    q = (torch.randn(10, 64) * 50).clamp(-448, 448).to(FP8)
    scales = [torch.tensor(0.5), torch.tensor(2.0)]
    whole, _ = quant.requantize_shards(q, scales, [6, 4])
    monkeypatch.setattr(quant, "_REQUANTIZE_NUMEL", 64 * 4)  # 4 rows a chunk: the 6-row shard takes two
    chunked, _ = quant.requantize_shards(q, scales, [6, 4])
    assert torch.equal(fp8_bits(chunked), fp8_bits(whole))


def test_requantize_shards_explicit():
    # shard 0 at scale 1, shard 1 at scale 4 (the max), shard 2 at scale 2
    q = torch.tensor([[448.0, 8.0], [-16.0, 1.0], [96.0, -3.0]]).to(FP8)
    out, scale = quant.requantize_shards(q, [torch.tensor([1.0]), torch.tensor([4.0]), torch.tensor([2.0])], [1, 1, 1])
    assert scale.tolist() == [4.0]
    assert out.float().tolist() == [[112.0, 2.0], [-16.0, 1.0], [48.0, -1.5]]


def test_requantize_shards_equal_max_scales_unchanged():
    gen = torch.Generator().manual_seed(7)
    q = random_fp8((6, 16), gen)
    out, scale = quant.requantize_shards(q, [torch.tensor(0.5), torch.tensor(0.5), torch.tensor(0.5)], [2, 3, 1])
    assert scale.tolist() == [0.5]
    assert torch.equal(fp8_bits(out), fp8_bits(q))


@pytest.mark.parametrize(
    "sizes, n_scales",
    [([2, 2, 2], 3), ([2, 2, 4], 3), ([3, 4], 3), ([2, 2, 3], 2), ([7], 3), ([], 0)],
)
def test_requantize_shards_bad_sizes(sizes, n_scales):
    q = torch.zeros(7, 4).to(FP8)
    with pytest.raises(ValueError, match="do not cover"):
        quant.requantize_shards(q, [torch.tensor(1.0)] * n_scales, sizes)


def test_max_input_scale():
    scales = [torch.tensor(0.1), torch.tensor([0.3]), torch.tensor([[0.2]])]
    out = quant.max_input_scale(scales)
    assert out.dtype == torch.float32 and tuple(out.shape) == (1,)
    assert out.item() == torch.tensor(0.3).item()
    assert quant.max_input_scale([torch.tensor(2.5, dtype=torch.bfloat16)]).tolist() == [2.5]


# --- quantize_rows --------------------------------------------------------------------------
@SETTINGS
@given(
    b=st.integers(1, 3),
    s=st.integers(1, 7),
    k=st.integers(1, 200),
    block=st.sampled_from([(-1, -1), (1, -1), (1, 4), (1, 64), (1, 128), (2, 8)]),
    exp10=st.integers(-5, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_rows_matches_2d_view(b, s, k, block, exp10, seed):
    x = make_x((b, s, k), seed, exp10, torch.bfloat16)
    q, scale = quant.quantize_rows(x, block)
    assert q.shape == x.shape
    assert tuple(scale.shape) == ref_scale_shape((b * s, k), block)
    q2, scale2 = quant.quantize(x.reshape(b * s, k), block)
    assert torch.equal(fp8_bits(q.reshape(b * s, k)), fp8_bits(q2))
    assert torch.equal(scale, scale2)
    check_quantized(x.reshape(b * s, k), block, q.reshape(b * s, k), scale)


# --- scaled_mm_reference ------------------------------------------------------------------------
MM_CASES = [
    # (x lead shape, N, K, x_block, w_block, bias)
    ((5,), 7, 16, (-1, -1), (-1, -1), True),
    ((6,), 5, 12, (-1, -1), (1, -1), True),
    ((4, 3), 6, 33, (1, -1), (1, -1), False),
    ((6,), 5, 12, (1, -1), (-1, -1), False),
    ((9,), 130, 200, (1, 128), (128, 128), True),
    ((2, 5), 256, 384, (1, 128), (128, 128), True),
    ((2, 3), 10, 13, (1, 4), (3, 4), True),
    ((1,), 3, 1, (1, -1), (1, -1), True),
]


def _mm_inputs(lead, n, k, x_block, w_block, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    m = math.prod(lead)
    xq = random_fp8((*lead, k), gen)
    x_scale = random_scale(ref_scale_shape((m, k), x_block), gen)
    wq = random_fp8((n, k), gen)
    w_scale = random_scale(ref_scale_shape((n, k), w_block), gen)
    # bias values representable in bf16, so the bf16-bias test shares the reference
    b = (torch.randn(n, generator=gen) * 100).to(torch.bfloat16).float() if bias else None
    xd = xq.reshape(m, k).double() * ref_expand(x_scale.double(), (m, k), x_block)
    wd = wq.double() * ref_expand(w_scale.double(), (n, k), w_block)
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    if b is not None:
        ref = ref + b.double()
        mag = mag + b.double().abs()
    return xq, x_scale, wq, w_scale, b, ref.reshape(*lead, n), mag.reshape(*lead, n)


@pytest.mark.parametrize("lead, n, k, x_block, w_block, bias", MM_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_scaled_mm_reference(lead, n, k, x_block, w_block, bias, seed):
    xq, x_scale, wq, w_scale, b, ref, mag = _mm_inputs(lead, n, k, x_block, w_block, bias, seed)
    y = quant.scaled_mm_reference(xq, x_scale, x_block, wq, w_scale, w_block, b, torch.float32)
    assert y.dtype == torch.float32 and tuple(y.shape) == (*lead, n)
    err = (y.double() - ref).abs()
    assert (err <= 1e-5 * mag).all(), (err / mag).max()


@pytest.mark.parametrize("lead, n, k, x_block, w_block, bias", MM_CASES[::2])
def test_scaled_mm_reference_bf16_out(lead, n, k, x_block, w_block, bias):
    xq, x_scale, wq, w_scale, b, ref, mag = _mm_inputs(lead, n, k, x_block, w_block, bias, 3)
    b = b.to(torch.bfloat16) if b is not None else None  # exact: b is bf16-representable
    y = quant.scaled_mm_reference(xq, x_scale, x_block, wq, w_scale, w_block, b, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (*lead, n)
    err = (y.double() - ref).abs()
    # bf16 rounding of the float32 result (2**-9 relative) + the float32 accumulation bound
    assert (err <= 2.0**-8 * ref.abs() + 1e-5 * mag).all()


def test_scaled_mm_reference_quantized_linear_close_to_float():
    """End to end on quantized data: W8A8 with per-group x / per-block w is within fp8 error of x @ w.T."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 3, 200, generator=gen)
    w = torch.randn(130, 200, generator=gen) / 14
    xq, xs = quant.quantize_rows(x, (1, 128))
    wq, ws = quant.quantize(w, (128, 128))
    y = quant.scaled_mm_reference(xq, xs, (1, 128), wq, ws, (128, 128), None, torch.float32)
    ref = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    # each product carries <= (1 + 2**-4)**2 - 1 relative error (plus subnormal terms)
    assert ((y.double() - ref).abs() <= 0.13 * mag + 1e-4).all()
