"""The gated MLP's two kernels (fp8fx.kernels.gated_mlp) and the ``fp8fx.gated_mlp`` op.

On CPU (CI) under Triton's interpreter, in a subprocess, with the GPU's float conversions
(``tests/triton_rounding.py``: the interpreter's own truncate bf16 and get ~3% of fp8 codes wrong): the
gate/up kernel's intermediate, its partial row maxima and the tickets it zeroes, and the whole MLP against
its unfused ops, row by row to 1% (2.5e-4 seen; swapped gate/up scales were 39% off, a per-tensor h run per
row 95%). On the GPU: the op against its unfused ops and float64, CUDA-graph replays, PDL on and off.
"""
import math
import textwrap

import pytest
import torch

import fp8fx
from fp8fx import ops, quant
from tests.conftest import assert_graph_replays_equal, run_under_triton_interpreter

SCHEMES = {  # x block, weight block, h block, static h scale
    "per-token/per-channel": ([1, -1], [1, -1], [1, -1], None),
    "per-tensor/per-tensor": ([-1, -1], [-1, -1], [-1, -1], None),
    "per-token/per-tensor": ([1, -1], [-1, -1], [1, -1], None),
    "static h": ([1, -1], [1, -1], [-1, -1], 0.02),
    "h in 1x128 groups": ([1, -1], [1, -1], [1, 128], None),  # Fp8Backend(mlp_h_group=128)
}


@pytest.fixture(autouse=True)
def own_prefill_plans(monkeypatch):
    """Each test starts with no ``PrefillPlan`` and leaves its own behind it: a plan made by another test for the
    same shapes would take a test's first prefill call past the general route it checks."""
    from fp8fx.kernels import gated_mlp as module

    monkeypatch.setattr(module, "_PLANS", {})


def h_quant_of(h_block, h_static):
    """The two-kernel function's (h_quant, h_group) for an h block / static scale, as fp8fx.gated_mlp picks them."""
    from fp8fx.kernels import fp8_gemm as K
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS

    if h_static is not None:
        return K.QUANT_STATIC, 0
    if h_block[1] != -1:
        return QUANT_GROUPS, h_block[1]
    return (K.QUANT_TENSOR if h_block == [-1, -1] else K.QUANT_ROWS), 0


def mlp_operands(m, k, i, n, scheme, device="cpu", seed=0, row_gain=None, dtype=torch.bfloat16, act="silu"):
    """Quantized x and weights, bias, static scale; float weights for a float64 truth. ``row_gain``
    multiplies each row of x (rows far apart in magnitude)."""
    x_block, w_block, h_block, static = SCHEMES[scheme]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if row_gain is not None:
        x *= row_gain[:, None]
    xq, xs = quant.quantize(x.to(dtype), x_block)
    # gate, up and down at different magnitudes, so their scales cannot stand in for one another
    ws = [torch.randn(r, c, generator=g) * gain / c**0.5
          for (r, c), gain in (((i, k), 0.5), ((i, k), 4.0), ((n, i), 1.0))]
    qs = [quant.quantize(w, w_block) for w in ws]
    bias = torch.randn(n, generator=g)
    h_static = None if static is None else torch.tensor([static])
    args = (xq, xs, qs[0][0], qs[0][1], qs[1][0], qs[1][1], qs[2][0], qs[2][1], bias, x_block, w_block, h_block,
            w_block, h_static, act, dtype, dtype, False)
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args], [w.to(device) for w in ws]


# The activations by their formulas, not fp8fx's table (ops.GATED_ACTIVATIONS): a wrong entry there must fail
TRUE_ACTIVATIONS = {
    "silu": lambda g: g / (1 + torch.exp(-g)),
    "gelu": lambda g: 0.5 * g * (1 + torch.erf(g / math.sqrt(2))),
    "gelu_tanh": lambda g: 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))),
}


def truth(args, ws):
    """float64 down(act(gate(x)) * up(x)) + bias on the dequantized x and the unquantized weights."""
    xq, xs, x_block, bias = args[0], args[1], args[9], args[8]
    x = quant.dequantize(xq.cpu(), xs.cpu(), x_block, torch.float64)
    w1, w3, w2 = (w.cpu().double() for w in ws)
    h = TRUE_ACTIVATIONS[args[14]](x @ w1.t()) * (x @ w3.t())
    return h @ w2.t() + bias.cpu().double()


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


INTERPRETER_CHECK = textwrap.dedent("""
    import torch, triton
    import triton.language as tl
    from tests.triton_rounding import round_to_nearest

    round_to_nearest()  # the GPU's conversions: the kernels are held to their reference's bits
    from fp8fx import ops, quant
    from fp8fx.kernels import fp8_gemm as K
    from fp8fx.kernels.gated_mlp import ACTIVATIONS, gated_gemm_kernel, gated_mlp, gated_tile_config
    from tests.kernels.test_gated_mlp import SCHEMES, h_quant_of, mlp_operands, rel

    # 1. gate/up kernel: h = silu(g) * u rounded as the model rounds it, its row maxima per N tile, tickets zeroed
    for m, k, i, scheme, act in [(1, 160, 96, "per-token/per-channel", "silu"),
                                 (5, 300, 270, "per-tensor/per-tensor", "gelu"),
                                 (17, 256, 100, "per-token/per-tensor", "gelu_tanh")]:
        args, _ = mlp_operands(m, k, i, 8, scheme, act=act)
        xq, xs, w1, s1, w3, s3 = args[:6]
        x_block, w_block = args[9], args[10]
        g = ops.scaled_mm(xq, xs, w1, s1, None, x_block, w_block, torch.bfloat16)
        u = ops.scaled_mm(xq, xs, w3, s3, None, x_block, w_block, torch.bfloat16)
        want = ops.GATED_ACTIVATIONS[act](g) * u
        cfg = gated_tile_config(m, i, k)
        h = torch.empty(m, i, dtype=torch.bfloat16)
        parts = torch.full((m, triton.cdiv(i, cfg["BLOCK_N"])), -1.0)
        tickets = torch.full((37,), 7, dtype=torch.int32)
        per_row = s1.numel() > 1
        gated_gemm_kernel[(triton.cdiv(m, cfg["BLOCK_M"]) * parts.shape[1],)](
            xq, w1, w3, xs.reshape(-1), s1.reshape(-1), s3.reshape(-1), h, parts, tickets, m, i, k, 37,
            xq.stride(0), xq.stride(1), w1.stride(0), w1.stride(1), h.stride(0), parts.stride(0),
            A_ROWWISE=xs.numel() > 1, W_ROWWISE=per_row, ACT=ACTIVATIONS[act], IMPRECISE_K=None, **cfg)
        # the reference's bits: g and u are float32 sums in another order than the reference's, which could move
        # one across a bf16 rounding boundary (none did); GELU's erf and tanh forms differ in ~2% of the bits
        same = (h == want).float().mean().item()
        assert same >= 0.99, (scheme, act, m, same)
        close = (h.float() - want.float()).abs() <= want.float().abs() * 2**-6 + 1e-6
        assert close.all() and torch.equal(h.float().abs() <= 1e-30, want.float().abs() <= 1e-30), (scheme, m)
        tiles = torch.nn.functional.pad(h.float().abs(), (0, parts.shape[1] * cfg["BLOCK_N"] - i))
        assert torch.equal(parts, tiles.reshape(m, parts.shape[1], -1).amax(-1)), scheme
        assert torch.equal(tickets, torch.zeros_like(tickets))

    # 2. the whole MLP against its unfused ops (the reference op), split K or not, each h scheme; rows 1000x
    # apart: per token, the small rows keep their own scale; per tensor, they share the large rows' (and
    # mostly flush to zero) - a kernel that mixed the two up fails the small rows
    # (per-token h at 17 tokens: three kernels, quantize_rows between the GEMMs - counted)
    import fp8fx.kernels.gated_mlp as GM
    rows_calls, real_quantize_rows = [], GM.quantize_rows
    GM.quantize_rows = lambda h, parts, *a: rows_calls.append(h.shape[0]) or real_quantize_rows(h, parts, *a)
    worst_seen = 0.0
    shapes = [(1, 160, 96, 72), (3, 300, 200, 130), (17, 256, 300, 64)]  # (17: h's maxima in 3 parts of 128)
    cases = [(*shape, scheme, "silu") for shape in shapes for scheme in SCHEMES]
    cases += [(3, 300, 200, 130, "per-token/per-channel", act) for act in ("gelu", "gelu_tanh")]
    for m, k, i, n, scheme, act in cases:
        args, _ = mlp_operands(m, k, i, n, scheme, row_gain=torch.logspace(0, 3, m), act=act)
        ref = ops._gated_mlp_reference(*args)
        xq, xs, w1, s1, w3, s3, w2, s2, bias, x_block, w_block, h_block, w2_block, h_static = args[:14]
        h_quant, h_group = h_quant_of(h_block, h_static)
        for split in (1, 3):
            cfg2 = {**K.tile_config(m, n, i), "SPLIT_K": split}
            y = gated_mlp(xq, xs, w1, s1, w3, s3, w2, s2, bias, h_quant, h_static, torch.bfloat16,
                          torch.bfloat16, act, configs=(None, cfg2), h_group=h_group)
            worst = max(rel(y[r], ref[r]) for r in range(m))
            worst_seen = max(worst_seen, worst)
            # h a bf16 step off here and there, the odd fp8 code one step off (the kernel quantizes by the
            # scale's reciprocal, the reference divides): a wrong scale, row or weight is off by > 10%
            assert worst < 0.01, (m, scheme, act, split, worst)
    per_token = [name for name, (_, _, h_block, static) in SCHEMES.items() if h_block == [1, -1] and static is None]
    assert rows_calls == [17] * 2 * len(per_token), rows_calls  # each split, each per-token scheme at 17 rows
    GM.quantize_rows = real_quantize_rows

    # 3. h in 1 x G groups: the gate/up kernel's epilogue writes quant.quantize(h, [1, G])'s codes and scales (G its
    # BLOCK_N; 100 and 270 columns leave a ragged last group), rows 1000x apart; a group scale of the wrong row or
    # group, or codes by the per-token scale, would not match
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS
    for m, k, i, g, scheme in [(1, 160, 96, 32, "per-token/per-channel"), (5, 300, 270, 64, "per-tensor/per-tensor"),
                               (17, 256, 100, 128, "per-token/per-tensor")]:
        args, _ = mlp_operands(m, k, i, 8, scheme, row_gain=torch.logspace(0, 3, m))
        xq, xs, w1, s1, w3, s3 = args[:6]
        x_block, w_block = args[9], args[10]
        want = ops.GATED_ACTIVATIONS["silu"](ops.scaled_mm(xq, xs, w1, s1, None, x_block, w_block, torch.bfloat16)) * \
            ops.scaled_mm(xq, xs, w3, s3, None, x_block, w_block, torch.bfloat16)
        want_q, want_s = quant.quantize(want, [1, g])
        cfg = {**gated_tile_config(m, i, k), "BLOCK_N": g}
        hq = torch.empty(m, i, dtype=quant.FP8_DTYPE)
        scales = torch.full((m, triton.cdiv(i, g)), -1.0)
        tickets = torch.full((3,), 7, dtype=torch.int32)
        gated_gemm_kernel[(triton.cdiv(m, cfg["BLOCK_M"]) * scales.shape[1],)](
            xq, w1, w3, xs.reshape(-1), s1.reshape(-1), s3.reshape(-1), hq, scales, tickets, m, i, k, 3,
            xq.stride(0), xq.stride(1), w1.stride(0), w1.stride(1), hq.stride(0), scales.stride(0),
            A_ROWWISE=xs.numel() > 1, W_ROWWISE=s1.numel() > 1, ACT=0, IMPRECISE_K=None, H_GROUPS=True,
            H_DTYPE=tl.bfloat16, EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, **cfg)
        # h's bits can differ from the reference's where g or u sit at a bf16 rounding boundary (section 1: none did)
        assert (hq.float() == want_q.float()).float().mean().item() >= 0.99, (m, g)
        assert torch.allclose(scales, want_s.reshape(m, -1), rtol=2**-7, atol=0), (m, g, scales, want_s)
        assert torch.equal(tickets, torch.zeros_like(tickets))
        # the two kernels against the unfused ops with h in groups, the down GEMM's K split or not
        args[11] = [1, g]
        ref = ops._gated_mlp_reference(*args)
        for split in (1, 3):
            cfg2 = {**K.tile_config(m, 8, i), "SPLIT_K": split}
            y = gated_mlp(*args[:9], QUANT_GROUPS, None, torch.bfloat16, torch.bfloat16, "silu",
                          configs=(None, cfg2), h_group=g)
            worst = max(rel(y[r], ref[r]) for r in range(m))
            worst_seen = max(worst_seen, worst)
            assert worst < 0.01, (m, g, split, worst)

    # 4. h in groups with a NaN (a NaN code in one gate row: h's column 5 NaN in every row) and an all-zero row of x:
    # NaN group scales and codes where quant.quantize has them (a max that drops NaN would make them finite), the
    # zero row's scales the EPS floor
    args, _ = mlp_operands(3, 160, 96, 8, "per-token/per-channel")
    xq, xs, w1, s1, w3, s3 = args[:6]
    w1 = w1.clone()
    w1.view(torch.uint8)[5] = 0x7F  # e4m3fn NaN
    xq = xq.clone()
    xq[1] = 0
    want = ops.GATED_ACTIVATIONS["silu"](ops.scaled_mm(xq, xs, w1, s1, None, [1, -1], [1, -1], torch.bfloat16)) * \
        ops.scaled_mm(xq, xs, w3, s3, None, [1, -1], [1, -1], torch.bfloat16)
    want_q, want_s = quant.quantize(want, [1, 32])
    hq = torch.empty(3, 96, dtype=quant.FP8_DTYPE)
    scales = torch.full((3, 3), -1.0)
    cfg = {**gated_tile_config(3, 96, 160), "BLOCK_N": 32}
    gated_gemm_kernel[(triton.cdiv(3, cfg["BLOCK_M"]) * 3,)](
        xq, w1, w3, xs.reshape(-1), s1.reshape(-1), s3.reshape(-1), hq, scales, scales, 3, 96, 160, 0,
        xq.stride(0), xq.stride(1), w1.stride(0), w1.stride(1), hq.stride(0), scales.stride(0),
        A_ROWWISE=True, W_ROWWISE=True, ACT=0, IMPRECISE_K=None, H_GROUPS=True, H_DTYPE=tl.bfloat16,
        EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX, **cfg)
    want_s = want_s.reshape(3, -1)
    assert want_s.isnan().any() and torch.equal(scales.isnan(), want_s.isnan()), (scales, want_s)
    assert torch.equal(scales.nan_to_num(0.0), want_s.nan_to_num(0.0))
    assert torch.equal(hq.float().isnan(), want_q.float().isnan())
    print("interpreter ok", worst_seen)
""")


def test_gated_mlp_kernels_under_triton_interpreter():
    assert "interpreter ok" in run_under_triton_interpreter(["-c", INTERPRETER_CHECK])


def test_gated_mlp_op_checks_its_arguments():
    args, _ = mlp_operands(2, 32, 16, 8, "per-token/per-channel")
    with pytest.raises(ValueError, match="act='relu'"):
        ops.gated_mlp(*args[:14], "relu", *args[15:])
    bad = list(args)
    bad[4] = args[4][:8]  # up with fewer rows than gate
    with pytest.raises(ValueError, match=r"gate \[16, 32\], up \[8, 32\]"):
        ops.gated_mlp(*bad)
    bad = list(args)
    bad[13] = torch.ones(2)
    with pytest.raises(ValueError, match="h_static must have one element"):
        ops.gated_mlp(*bad)
    bad = list(args)  # a static scale with per-token h: the CPU reference failed, the CUDA kernel ignored h_block
    bad[11], bad[13] = [1, -1], torch.ones(1)
    with pytest.raises(ValueError, match=r"h_static \(a static per-tensor scale\) with h_block=\[1, -1\]"):
        ops.gated_mlp(*bad)


def bad_tensor_args(device):
    """(arguments, message) the CUDA kernels accepted: they read a scale by its layout (a one-element scale under a
    per-row block as per-tensor) and failed to compile bf16 codes; every implementation now refuses them alike."""
    args, _ = mlp_operands(3, 32, 16, 8, "per-token/per-channel", device=device)
    cases = []
    for i, name, match in ((1, "x_scale", r"x_scale has 1 elements .* needs 3"),
                           (3, "gate scale", r"\(gate\): w_scale has 1 elements .* needs 16"),
                           (7, "down scale", r"\(down\): w_scale has 1 elements .* needs 8")):
        bad = list(args)
        bad[i] = args[i].reshape(-1)[:1].clone()
        cases.append((bad, match))
    bad = list(args)
    bad[2] = args[2].to(torch.bfloat16)
    cases.append((bad, r"\(gate\): the weight is torch.bfloat16"))
    bad = list(args)
    bad[0] = args[0].to(torch.bfloat16)
    cases.append((bad, "xq is torch.bfloat16"))
    return cases


def test_gated_mlp_op_checks_its_tensors():
    for bad, match in bad_tensor_args("cpu"):
        with pytest.raises(ValueError, match=match):
            ops.gated_mlp(*bad)


@pytest.mark.cuda
def test_gated_mlp_op_checks_its_tensors_cuda():
    for bad, match in bad_tensor_args("cuda"):
        with pytest.raises(ValueError, match=match):
            ops.gated_mlp(*bad)


def test_gated_activations_are_their_formulas():
    """fp8fx's table, which the kernels' activations are held to bit by bit, against the formulas in float64:
    gelu and gelu_tanh are 1e-3 apart, which no MLP's fp8 error (3-4%) would show."""
    g = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    assert set(ops.GATED_ACTIVATIONS) == set(TRUE_ACTIVATIONS)
    for act, formula in TRUE_ACTIVATIONS.items():
        torch.testing.assert_close(ops.GATED_ACTIVATIONS[act](g), formula(g), rtol=1e-12, atol=1e-12, msg=act)


@pytest.mark.parametrize("scheme,act", [(scheme, "silu") for scheme in SCHEMES] + [
    ("per-token/per-channel", "gelu"), ("per-token/per-channel", "gelu_tanh")])
def test_gated_mlp_op_cpu_within_fp8_error_of_float64(scheme, act):
    """The CPU op (the linear pass's ops one by one) against the float64 MLP on unquantized weights."""
    args, ws = mlp_operands(3, 64, 48, 40, scheme, act=act)
    assert rel(ops.gated_mlp(*args), truth(args, ws)) < 0.08


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 16, 24, 33, 64, 65])
@pytest.mark.parametrize("scheme,act", [(scheme, "silu") for scheme in SCHEMES] + [
    ("per-token/per-channel", "gelu"), ("per-token/per-channel", "gelu_tanh")])
def test_gated_mlp_op_cuda(m, scheme, act):
    """Two kernels for m <= 64 (with per-token h three from 17: h quantized once between the GEMMs; 65: the unfused
    ops), the down GEMM's K (8232) split for m <= 16: as accurate against float64 as the unfused ops, and close to
    them, row by row (rows 1000x apart: see the interpreter check). Since the 2-16-row down GEMMs run on wgmma (``SWAP_AB``, run 20), the fused and the unfused
    down GEMM (TMA and cp.async pipelines) no longer give the same bits: on the H200 0.3-0.5% apart in rows near the
    truth, up to 3.3% in rows that per-tensor or static h leaves 50-100% off it (with the 16-row mma.sync tiles
    before, bit-equal; `runs/2026-11-30-h200-run20-call4-diag-fused-vs-unfused.txt`): the closeness bound grows
    with the row's own quantization error. At 17-32 rows (run 33) the unfused gate and up GEMMs (K = 1024, 129 N
    tiles) run the 32-row transposed tiles where the fused kernel computes them its own way, so the two h differ by
    bf16 steps and some of their fp8 codes: up to 2.2% apart (per-token x, per-tensor weights, a row 5% off the truth),
    both as accurate against float64 (worst rows 5.72% and 5.69%; with the 64-row tiles before, the same bits:
    `runs/2026-12-01-h200-run33-call5-fused-vs-unfused-24rows.txt`)."""
    args, ws = mlp_operands(m, 1024, 8192 + 40, 1000, scheme, "cuda", row_gain=torch.logspace(0, 3, m), act=act)
    y = ops.gated_mlp(*args)
    unfused = ops._gated_mlp_reference(*args)
    want = truth(args, ws)
    assert y.shape == (m, 1000) and y.dtype == torch.bfloat16
    for r in range(m):
        assert rel(y[r], want[r]) < rel(unfused[r], want[r]) * 1.25 + 1e-3, r
        # the two differ by sum orders (an h a bf16 step off) and the odd fp8 code: a wrong scale, row or weight
        # is > 10% off
        assert rel(y[r], unfused[r]) < 0.025 + 0.05 * rel(unfused[r], want[r]), r


@pytest.mark.cuda
@pytest.mark.parametrize("down", ["gemv", "mma"])
def test_gated_mlp_cuda_graph_replays(down):
    """Llama-3-8B sizes at M=1: the down GEMM (the GEMV kernel, as by default at one token, or the tensor-core tile)
    splits K behind tickets the gate/up kernel zeroes, so replays of a captured graph must stay bit-equal to plain
    calls."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels.gated_mlp import down_tile_config, gated_mlp

    cfg = down_tile_config(1, 4096, 14336, gemv=down == "gemv")
    assert cfg.get("GEMV", False) == (down == "gemv")
    cfg = {**cfg, "SPLIT_K": 7} if down == "gemv" else cfg  # the GEMV's default does not split this shape
    assert cfg["SPLIT_K"] > 1
    args, _ = mlp_operands(1, 4096, 14336, 4096, "per-token/per-channel", "cuda")
    xq, xs, w1, s1, w3, s3, w2, s2, bias = args[:9]
    run = lambda pdl=None: gated_mlp(xq, xs, w1, s1, w3, s3, w2, s2, bias, kernels.QUANT_ROWS, None,  # noqa: E731
                                     torch.bfloat16, torch.bfloat16, configs=(None, cfg), pdl=pdl)
    check_replays(run, args)


@pytest.mark.cuda
@pytest.mark.parametrize("m,h_group", [(1, 0), (16, 0), (32, 128)])
def test_gated_mlp_with_decode_pdl_cuda(monkeypatch, m, h_group):
    """``fp8_gemm.DECODE_PDL`` with ``PDL_TRIGGER``: the down GEMM (already a programmatic dependent of the gate/up
    kernel) takes the trigger - the GEMV at one token, split tiles at 16, h in groups at 32 - and the op's bits do not
    change from ``DECODE_PDL`` None's, called and as CUDA-graph replays; with ``PRE_WAIT`` too (the GEMV's alone)."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels import gated_mlp as module

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("DECODE_PDL applies on sm_90 only, where it is timed")
    args, _ = mlp_operands(m, 4096, 14336, 4096, "per-token/per-channel", "cuda")
    xq, xs, w1, s1, w3, s3, w2, s2, bias = args[:9]
    h_quant = module.QUANT_GROUPS if h_group else kernels.QUANT_ROWS
    run = lambda: module.gated_mlp(xq, xs, w1, s1, w3, s3, w2, s2, bias, h_quant, None,  # noqa: E731
                                   torch.bfloat16, torch.bfloat16, h_group=h_group)
    monkeypatch.setattr(kernels, "DECODE_PDL", None)
    want = run()
    taken = []
    keys_of = module.decode_pdl_keys
    monkeypatch.setattr(module, "decode_pdl_keys",
                        lambda b, m, gemv=False: taken.append(keys_of(b, m, gemv=gemv)) or taken[-1])
    for keys in ({"PDL_TRIGGER": True}, {"PDL_TRIGGER": True, "PRE_WAIT": 1}):  # (PRE_WAIT: the GEMV's, one token)
        monkeypatch.setattr(kernels, "DECODE_PDL", keys)
        taken.clear()
        assert torch.equal(run(), want)
        assert taken == [keys if m == 1 else {"PDL_TRIGGER": True}], taken
        assert_graph_replays_equal(run, want)


@pytest.mark.parametrize("m", [1, 2, 16])
def test_down_gemm_takes_pre_wait_only_as_a_gemv(monkeypatch, m):
    """``fp8_gemm.DECODE_PDL``'s ``PRE_WAIT`` reaches the fused MLP's down GEMM only where that is the GEMV (one
    token): a tensor-core down tile given it would be refused (``fp8_gemm``: "the GEMV kernel's"). The two kernels
    are stubbed (no GPU here), the launch's config recorded, as on sm_90."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels import gated_mlp as module

    args, _ = mlp_operands(m, 64, 128, 64, "per-token/per-channel", "cpu")
    xq, xs, w1, s1, w3, s3, w2, s2, bias = args[:9]
    for mod in (kernels, module):
        monkeypatch.setattr(mod, "_hopper", lambda t, exactly=False: True)
    monkeypatch.setattr(kernels, "DECODE_PDL", {"PRE_WAIT": 2})

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **kw: None
    monkeypatch.setattr(module, "gated_gemm_kernel", Stub())
    given = []
    monkeypatch.setattr(module, "fp8_gemm", lambda *a, config=None, **kw: given.append(config))
    module.gated_mlp(xq, xs, w1, s1, w3, s3, w2, s2, bias, kernels.QUANT_ROWS, None, torch.bfloat16, torch.bfloat16)
    (cfg,) = given
    assert cfg.get("GEMV", False) == (m == 1) and cfg.get("PRE_WAIT") == (2 if m == 1 else None), cfg


def check_replays(run, args):
    """``run(pdl)``: plain calls bit-equal to each other, with the down GEMM a programmatic dependent launch (the
    default on the H200) or not, and as CUDA-graph replays; close to the unfused ops."""
    eager = [run() for _ in range(3)]
    assert all(torch.equal(e, eager[0]) for e in eager)
    assert rel(eager[0], ops._gated_mlp_reference(*args)) < 0.015
    for pdl in (False, True) if torch.cuda.get_device_capability() >= (9, 0) else (False,):
        assert torch.equal(run(pdl), eager[0]), pdl
    assert_graph_replays_equal(run, eager[0])


def test_h_groups_the_kernels_take():
    """The op's CUDA path takes its two kernels for h in 1 x G groups of the kernels' sizes with a per-tensor or
    per-channel down weight (else the unfused ops: correct, slower)."""
    assert ops._h_group([1, 128], [1, -1]) == 128 and ops._h_group([1, 32], [-1, -1]) == 32
    for h_block, w2_block in (([1, 100], [1, -1]), ([1, 256], [1, -1]), ([1, 128], [128, 128]), ([1, -1], [1, -1]),
                              ([-1, 128], [1, -1]), ([-1, -1], [-1, -1])):
        assert ops._h_group(h_block, w2_block) == 0, (h_block, w2_block)


@pytest.mark.cuda
@pytest.mark.parametrize("m,kernels", [(1, True), (64, True), (65, False)])
def test_gated_mlp_op_runs_its_kernels_for_h_groups(monkeypatch, m, kernels):
    """fp8fx.gated_mlp with h in 1x128 groups on CUDA: the two kernels up to 64 tokens, the unfused ops above."""
    from fp8fx.kernels import gated_mlp as module

    calls = []
    real = module.gated_mlp
    monkeypatch.setattr(module, "gated_mlp", lambda *a, **k: calls.append(k.get("h_group")) or real(*a, **k))
    args, _ = mlp_operands(m, 256, 384, 128, "h in 1x128 groups", "cuda")
    y = ops.gated_mlp(*args)
    assert calls == ([128] if kernels else []), calls
    assert rel(y, ops._gated_mlp_reference(*args)) < 0.015


@pytest.mark.cuda
@pytest.mark.parametrize("m,group", [(1, 128), (16, 128), (24, 128), (64, 128), (1, 32)])
def test_gated_mlp_h_groups_cuda_graph_replays(m, group):
    """h in 1x128 groups at Llama-3-8B sizes, default tiles (the GEMV at M=1; K split in 8 behind the first kernel's
    tickets above), and 1x32 groups at one token (``mlp_h_group="auto"``'s there): plain calls, PDL on and off, and
    graph replays bit-equal; the fused h codes as quant.quantize(h, [1, G])'s, so the unfused ops with that h block
    are close."""
    from fp8fx.kernels.gated_mlp import QUANT_GROUPS, gated_mlp

    args, _ = mlp_operands(m, 4096, 14336, 4096, "h in 1x128 groups", "cuda")
    args[11] = [1, group]
    run = lambda pdl=None: gated_mlp(*args[:9], QUANT_GROUPS, None, torch.bfloat16, torch.bfloat16,  # noqa: E731
                                     pdl=pdl, h_group=group)
    check_replays(run, args)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2])
def test_gated_mlp_op_h_in_1x32_groups_cuda(m):
    """The op with h in 1x32 groups (the fused MLP's default at one token) against float64 and its unfused ops,
    row by row, as ``test_gated_mlp_op_cuda`` holds the other schemes."""
    args, ws = mlp_operands(m, 1024, 8192 + 40, 1000, "h in 1x128 groups", "cuda", row_gain=torch.logspace(0, 3, m))
    args[11] = [1, 32]
    y = ops.gated_mlp(*args)
    unfused = ops._gated_mlp_reference(*args)
    want = truth(args, ws)
    for r in range(m):
        assert rel(y[r], want[r]) < rel(unfused[r], want[r]) * 1.25 + 1e-3, r
        assert rel(y[r], unfused[r]) < 0.015 + 0.05 * rel(unfused[r], want[r]), r


@pytest.mark.cuda
@pytest.mark.parametrize("m", [17, 64])
def test_gated_mlp_rows_pass_cuda_graph_replays(monkeypatch, m):
    """Per-token h at 17-64 tokens, Llama-3-8B sizes, default tiles: the gate/up kernel, quantize_rows and the down
    GEMM (K split behind the first kernel's tickets): plain calls and graph replays bit-equal (no PDL on this path:
    ``pdl`` is ignored), close to the unfused ops."""
    from fp8fx.kernels import fp8_gemm as kernels
    from fp8fx.kernels import gated_mlp as module

    assert m >= ops.GATED_ROWS_MIN_M
    calls, real = [], module.quantize_rows
    monkeypatch.setattr(module, "quantize_rows", lambda h, parts, *a: calls.append(h.shape) or real(h, parts, *a))
    args, _ = mlp_operands(m, 4096, 14336, 4096, "per-token/per-channel", "cuda")
    run = lambda pdl=None: module.gated_mlp(*args[:9], kernels.QUANT_ROWS, None, torch.bfloat16,  # noqa: E731
                                            torch.bfloat16, pdl=pdl)
    check_replays(run, args)
    assert calls and set(calls) == {(m, 14336)}, calls  # the three-kernel route ran


@pytest.mark.cuda
@pytest.mark.parametrize("h_group,tokens", [(None, 4), (None, 40), (128, 4), (128, 40)])
def test_fused_mlp_under_inductor_cudagraph_trees(h_group, tokens):
    """Fp8Backend(fuse_mlp=True, cudagraphs=True) on a decode batch: the MLP runs as fp8fx.gated_mlp and each
    call (warm-up, recording, replays) matches the unfused compiled model (per-token h past 16 tokens: three
    kernels); with h in 1x128 groups (also past 16 tokens) it is as accurate as the unfused model against the float32
    MLP."""
    import copy

    from benchmarks.bench_linear import MLP

    torch.manual_seed(0)
    model = MLP(1024, 8192).cuda().to(torch.bfloat16)  # the down GEMM splits K (>= 8192): tickets in the graph
    for p in model.parameters():
        p.data /= p.shape[1] ** 0.5
    exact = copy.deepcopy(model).float()
    fp8fx.quantize_(model)
    fused_backend = fp8fx.Fp8Backend(fuse_mlp=True, cudagraphs=True, mlp_h_group=h_group)
    fused = torch.compile(model, backend=fused_backend, dynamic=False)
    plain = torch.compile(model, backend=fp8fx.Fp8Backend())
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
            y, want = fused(x).clone(), plain(x)
            if h_group:  # another quantization of h than the unfused per-token one (3.5% apart on CPU, each 6.3% from
                # the float32 MLP): held to the unfused ops with h in the same groups, and as accurate as per token
                xq, xs = quant.quantize(x, [1, -1])
                w = [t for name in ("gate_proj", "up_proj", "down_proj") for t in
                     (getattr(model, name)._parameters["weight"], getattr(model, name).weight_scale)]
                grouped = ops._gated_mlp_reference(xq, xs, *w, None, [1, -1], [1, -1], [1, h_group], [1, -1], None,
                                                   "silu", torch.bfloat16, torch.bfloat16, True)
                truth = exact(x.float())
                assert rel(y, grouped) < 0.02 and rel(y, truth) < rel(want, truth) * 1.05, step
                continue
            # the unfused graph quantizes Inductor's float32 act * mul, the op the model's bf16 one: codes near
            # a rounding boundary differ (~3% of them by one fp8 step)
            assert rel(y, want) < 0.02, step
    how = (f"gated MLP, 2 kernels, h in 1x{h_group} groups)" if h_group else "gated MLP, 2 kernels)" if tokens <= 16
           else "gated MLP, 3 kernels: act * mul in the gate/up GEMM's epilogue, h quantized per token, the down GEMM)")
    assert all(s.scheme.endswith(how) for s in fused_backend.report.sites), str(fused_backend.report)


@pytest.mark.cuda
def test_merged_gate_up_views_on_the_gpu():
    """A merged gate_up layer (Phi-3): the two kernels read the row halves of its weight and scale as views (h per
    token, as the unfused graph quantizes it, so the two are held close)."""
    from tests.passes.test_mlp_pass import MergedMLP

    torch.manual_seed(0)
    model = MergedMLP(1024, 2048).cuda().to(torch.bfloat16)
    for p in model.parameters():
        p.data /= p.shape[1] ** 0.5
    fp8fx.quantize_(model)
    fused_backend = fp8fx.Fp8Backend(fuse_mlp=True, mlp_h_group=None)
    fused = torch.compile(model, backend=fused_backend, dynamic=False)
    plain = torch.compile(model, backend=fp8fx.Fp8Backend(), dynamic=False)
    with torch.no_grad():
        x = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
        assert rel(fused(x), plain(x)) < 0.02
    assert all("gated MLP" in s.scheme for s in fused_backend.report.sites), str(fused_backend.report)


PREFILL_CHECK = textwrap.dedent("""
    import torch, triton
    from tests.triton_rounding import round_to_nearest

    round_to_nearest()  # the GPU's conversions: the kernels are held to their reference's bits
    from fp8fx import ops, quant
    from fp8fx.kernels.gated_mlp import gated_prefill, prefill_fits, prefill_tail_split, quantize_rows
    from tests.kernels.test_gated_mlp import mlp_operands, rel

    # gated_prefill (4 persistent programs over more tiles than that, ragged M, N and K tiles; the last, partial
    # round in half tiles, some of them wholly past M, or not), gate's weight before up's in memory or after it, each
    # scheme and activation, rows 1000x apart; then quantize_rows
    tile = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
    worst_seen = 0.0
    for m, k, i, scheme, act, up_first in [(70, 96, 80, "per-token/per-channel", "silu", False),
                                          (33, 160, 200, "per-tensor/per-tensor", "gelu", True),
                                          (65, 48, 48, "per-token/per-tensor", "gelu_tanh", True)]:
        args, _ = mlp_operands(m, k, i, 24, scheme, row_gain=torch.logspace(0, 3, m), act=act)
        xq, xs, w1, s1, w3, s3 = args[:6]
        x_block, w_block = args[9], args[10]
        pair = torch.empty(2, i, k, dtype=w1.dtype)  # one allocation: which weight comes first is up to the caller
        pair[int(up_first)], pair[1 - int(up_first)] = w1, w3
        w1, w3 = pair[int(up_first)], pair[1 - int(up_first)]
        assert prefill_fits(xq, w1, w3, torch.bfloat16)
        g, u = (ops.scaled_mm(xq, xs, w, s, None, x_block, w_block, torch.float32) for w, s in ((w1, s1), (w3, s3)))
        assert prefill_tail_split(triton.cdiv(m, 32) * triton.cdiv(i, 32), 4, 32) == 2, (m, i)
        # g, u and act(g) in float32, h rounded once (the default); the model's roundings of each (model_rounding)
        for model_rounding, tail_split in ((True, True), (False, True), (False, False)):
            if model_rounding:
                g16, u16 = g.bfloat16(), u.bfloat16()
                want = ops.GATED_ACTIVATIONS[act](g16) * u16
            else:
                want = (ops.GATED_ACTIVATIONS[act](g) * u).bfloat16()
            h, parts = gated_prefill(xq, xs, w1, s1, w3, s3, torch.bfloat16, act, config=tile,
                                     model_rounding=model_rounding, tail_split=tail_split)
            # the bits of the reference's h but where g, u or h sit at a bf16 rounding boundary (float32 sums in
            # another order); GELU's erf and tanh forms differ in ~2% of the bits
            same = (h == want).float().mean().item()
            assert same >= (0.97 if model_rounding or act != "silu" else 0.995), (scheme, act, model_rounding, same)
            # (the erf and tanh forms of GELU also differ near zero, where h is small next to its row's largest)
            row_max = want.float().abs().amax(1, keepdim=True)
            close = (h.float() - want.float()).abs() <= want.float().abs() * 2**-6 + row_max * 2**-12 + 1e-6
            assert close.all(), (scheme, act, h[~close][:5], want[~close][:5])
            tiles = torch.nn.functional.pad(h.float().abs(), (0, parts.shape[1] * 32 - i))
            assert torch.equal(parts, tiles.reshape(m, parts.shape[1], 32).amax(-1)), (scheme, model_rounding)
        # quantize_rows: fp8fx.quant's per-token codes and scales of h, to the bit, from the partial maxima
        for block in ((8, 64), (1, 256)):
            q, s = quantize_rows(h, parts, block)
            want_q, want_s = quant.quantize(h, [1, -1])
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s.float())
        # the three steps of the op's prefill path against the down GEMM of the reference h's codes, row by row
        hq, h_scale = quantize_rows(h, parts)
        y = ops.scaled_mm(hq, h_scale, *args[6:9], [1, -1], args[12], torch.bfloat16)
        ref = ops.scaled_mm(*quant.quantize(want, [1, -1]), *args[6:9], [1, -1], args[12], torch.bfloat16)
        worst = max(rel(y[r], ref[r]) for r in range(m))
        worst_seen = max(worst_seen, worst)
        assert worst < 1e-3, (scheme, act, worst)  # (h's few bits apart from want's can move a code of h)

    # a NaN code in one row of x makes that row of h NaN: its maxima, scale and codes NaN, as quant.quantize has
    # them, and no other row's (a max that dropped NaN would make them finite, one that spread it would reach the
    # others); an all-zero row of x: h zero, its scale the EPS floor
    args, _ = mlp_operands(40, 64, 64, 8, "per-token/per-channel")
    xq, xs, w1, s1, w3, s3 = args[:6]
    xq = xq.clone()
    xq.view(torch.uint8)[2, 7] = 0x7F  # e4m3fn NaN
    xq[1] = 0
    h, parts = gated_prefill(xq, xs, w1, s1, w3, s3, torch.bfloat16, config=tile)
    q, s = quantize_rows(h, parts)
    want_q, want_s = quant.quantize(h, [1, -1])
    nan_rows = s.reshape(-1).isnan()
    assert nan_rows.tolist() == [r == 2 for r in range(40)], nan_rows
    assert torch.equal(s.nan_to_num(0.0), want_s.float().nan_to_num(0.0))
    assert s[1].item() == (torch.tensor(quant.AMAX_EPS) / quant.FP8_MAX).item() and not q[1].float().any()
    assert torch.equal(q.float().isnan(), want_q.float().isnan()) and q[2].float().isnan().all()
    from types import SimpleNamespace
    from fp8fx.kernels.gated_mlp import _compiles_ptx
    assert not _compiles_ptx(SimpleNamespace(is_cuda=True))  # the interpreter runs no inline PTX, CUDA tensors or not
    print("prefill ok", worst_seen)
""")


def test_prefill_kernels_under_triton_interpreter():
    assert "prefill ok" in run_under_triton_interpreter(["-c", PREFILL_CHECK])


def test_prefill_tail_split():
    """The last, partial round of the prefill kernel's tiles runs in half tiles where its halves find a program
    each: Llama-3-8B's gate/up at 4096 tokens (3584 tiles, 20 in the last round on 132 SMs), not at 2048 (76 tiles:
    152 halves), nor where the rounds are full or the halves would have fewer than 16 rows."""
    from fp8fx.kernels.gated_mlp import prefill_tail_split

    assert prefill_tail_split(32 * 112, 132, 128) == 2
    assert prefill_tail_split(16 * 112, 132, 128) == 1
    assert prefill_tail_split(24 * 112, 132, 128) == 2  # 3072 tokens: 48 tiles in the last round
    assert prefill_tail_split(2 * 132, 132, 128) == 1 and prefill_tail_split(66, 66, 128) == 1
    assert prefill_tail_split(9, 4, 32) == 2 and prefill_tail_split(9, 4, 16) == 1
    assert prefill_tail_split(11, 4, 128) == 1  # 3 left over: 6 halves for 4 programs


def test_prefill_fits_and_reasons():
    """What the prefill kernels take (TMA copies: row-major, 16-byte rows; per-token h, per-tensor / per-row
    scales, from GATED_PREFILL_MIN_M tokens), and the reason given for what they do not."""
    from types import SimpleNamespace

    from fp8fx.kernels.gated_mlp import _compiles_ptx, prefill_fits

    # the prefill kernel's PTX epilogue: compiled CUDA kernels only (the interpreter's case: PREFILL_CHECK)
    assert _compiles_ptx(SimpleNamespace(is_cuda=True)) == (torch.version.hip is None)
    assert not _compiles_ptx(torch.empty(1))
    x = torch.empty(4, 64, dtype=quant.FP8_DTYPE)
    w = torch.empty(2, 48, 64, dtype=quant.FP8_DTYPE)
    assert prefill_fits(x, w[0], w[1], torch.bfloat16) and prefill_fits(x, w[1], w[0], torch.float16)
    assert not prefill_fits(x, w[0], w[0], torch.bfloat16)  # one weight for both
    column_major = torch.empty(64, 48, dtype=quant.FP8_DTYPE).t()
    assert not prefill_fits(x, column_major, w[1], torch.bfloat16)  # not row-major
    odd = torch.empty(4, 40, dtype=quant.FP8_DTYPE)
    assert not prefill_fits(odd, torch.empty(48, 40, dtype=quant.FP8_DTYPE), torch.empty(48, 40, dtype=quant.FP8_DTYPE),
                            torch.bfloat16)  # 40-byte rows
    m = ops.GATED_PREFILL_MIN_M
    ok = ([1, -1], [1, -1], [1, -1], [1, -1], None, torch.bfloat16, torch.bfloat16)
    assert ops.gated_prefill_reason(m, 4096, 14336, 4096, *ok) == ""
    assert ops.gated_prefill_reason(m - 1, 4096, 14336, 4096, *ok).startswith(f"{m - 1} tokens")
    for i, value, words in ((2, [-1, -1], "per token"), (4, torch.ones(1), "per token"), (0, [1, 128], "per-row"),
                            (5, torch.float32, "16-bit h"), (6, torch.float16, "bf16 output")):
        bad = list(ok)
        bad[i] = value
        assert words in ops.gated_prefill_reason(m, 4096, 14336, 4096, *bad), (i, value)
    assert "multiples of 16" in ops.gated_prefill_reason(m, 4096, 14330, 4096, *ok)


@pytest.mark.cuda
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_prefill_kernel_cuda(monkeypatch, act):
    """The prefill gate/up kernel as the GPU runs it (the PTX epilogue: silu by tanh.approx, or ex2 / rcp; with
    ``model_rounding``, bf16 roundings of g, u and act(g) by ``_bf16_grid``): h within 2^-6 of the reference's
    (relative) and, but for tanh.approx's silu, its bits but where g, u or h sit at a bf16 rounding boundary, as many
    of them as the epilogue compiled without PTX (``tl.exp``, division, conversions) has, and nearly all of that
    one's bits; its maxima are h's. Not counted: silu(g) for g in [-88.7, -87.3], which the
    ex2 / rcp epilogue flushes to zero (``_inv_one_plus_exp2``; 0.11% of this data's h, whose rows reach 1000x the
    first's). The last round of tiles in half tiles gives those h too."""
    from fp8fx.kernels import gated_mlp as module

    m, k, i = 300, 1024, 1000
    args, _ = mlp_operands(m, k, i, 8, "per-token/per-channel", "cuda", row_gain=torch.logspace(0, 3, m), act=act)
    xq, xs, w1, s1, w3, s3 = args[:6]
    x_block, w_block = args[9], args[10]
    g, u = (ops.scaled_mm(xq, xs, w, s, None, x_block, w_block, torch.float32) for w, s in ((w1, s1), (w3, s3)))
    counted = ((g + 88.0).abs() > 0.8) if act == "silu" else torch.ones_like(g, dtype=torch.bool)
    assert counted.float().mean().item() > 0.99
    for model_rounding, tanh_silu in ((False, True), (False, False), (True, False)):
        if model_rounding:  # the model's: g and u out of bf16 GEMMs, act(g) * u in bf16 ops
            want = ops.GATED_ACTIVATIONS[act](g.bfloat16()) * u.bfloat16()
        else:  # float32 until h (the default, silu by tanh.approx)
            want = (ops.GATED_ACTIVATIONS[act](g) * u).bfloat16()
        h, parts = module.gated_prefill(xq, xs, w1, s1, w3, s3, torch.bfloat16, act, model_rounding=model_rounding,
                                        tanh_silu=tanh_silu)
        row_max = want.float().abs().amax(1, keepdim=True)
        assert ((h.float() - want.float()).abs() <= want.float().abs() * 2**-6 + row_max * 2**-12 + 1e-6).all()
        bn = module.prefill_tile_config(m, i, k)["BLOCK_N"]
        padded = torch.nn.functional.pad(h.float().abs(), (0, parts.shape[1] * bn - i))
        assert torch.equal(parts, padded.reshape(m, parts.shape[1], bn).amax(-1))
        with monkeypatch.context() as patch:
            patch.setattr(module, "_compiles_ptx", lambda t: False)
            plain, _ = module.gated_prefill(xq, xs, w1, s1, w3, s3, torch.bfloat16, act, model_rounding=model_rounding,
                                            tanh_silu=tanh_silu)
        same, plain_same = ((h == want)[counted].float().mean().item(), (plain == want)[counted].float().mean().item())
        as_plain = (h == plain)[counted].float().mean().item()
        if tanh_silu and act == "silu":  # tanh.approx (relative 2^-11) moves h across some bf16 rounding boundaries
            assert same >= 0.8 and as_plain >= 0.8, (same, plain_same, as_plain)
            # where g > 0 silu's error is at most 2^-12 relative: h and the reference's then round to the same bf16
            # value or to neighbours, one unit in the last place apart (<= |want| 2^-7)
            pos = counted & (g > 0)
            assert ((h.float() - want.float()).abs() <= want.float().abs() * 2**-7)[pos].all()
        else:
            assert same >= 0.97 and same >= plain_same - 1e-4, (model_rounding, same, plain_same)
            assert as_plain >= 0.9999, (model_rounding, as_plain)
    # the last round in half tiles: 24 tiles on 10 programs leave 4, run as 8 halves of 64 rows (m64n128 wgmma on each
    # warpgroup where whole tiles run m64n256): the same h as whole tiles, and the maxima of what it wrote
    assert module.prefill_tail_split(24, 10, 128) == 2
    ref, _ = module.gated_prefill(xq, xs, w1, s1, w3, s3, torch.bfloat16, act)
    for tail_split in (True, False):
        h, parts = module.gated_prefill(xq, xs, w1, s1, w3, s3, torch.bfloat16, act, programs=10, tail_split=tail_split)
        assert (h == ref).float().mean().item() >= 0.9999, tail_split
        row_max = ref.float().abs().amax(1, keepdim=True)
        assert ((h.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + row_max * 2**-12).all(), tail_split
        padded = torch.nn.functional.pad(h.float().abs(), (0, parts.shape[1] * bn - i))
        assert torch.equal(parts, padded.reshape(m, parts.shape[1], bn).amax(-1)), tail_split


def _laid_out(w1, w3, layout):
    """gate and up as a model may hold them: apart (gate allocated first), up allocated first, the two row halves of
    one merged weight (Phi-3's gate_up_proj), or gate transposed in memory (a column-major [I, K] view)."""
    if layout == "up first":
        pair = torch.stack([w3, w1])
        return pair[1], pair[0]
    if layout == "merged":
        merged = torch.cat([w1, w3])
        return merged[:w1.shape[0]], merged[w1.shape[0]:]
    if layout == "gate column-major":
        return w1.t().contiguous().t(), w3
    return w1, w3


@pytest.mark.cuda
@pytest.mark.parametrize("m", [ops.GATED_PREFILL_MIN_M, ops.GATED_PREFILL_MIN_M + 77])
@pytest.mark.parametrize("scheme,act,layout", [
    ("per-token/per-channel", "silu", "apart"), ("per-token/per-tensor", "gelu_tanh", "apart"),
    ("per-tensor/per-tensor", "silu", "apart"), ("per-token/per-channel", "silu", "up first"),
    ("per-token/per-channel", "silu", "merged"), ("per-token/per-channel", "silu", "gate column-major")])
def test_gated_mlp_prefill_cuda(monkeypatch, m, scheme, act, layout):
    """From GATED_PREFILL_MIN_M tokens with per-token h (the per-tensor scheme's h made per token): the prefill
    kernels (gate/up with act * mul in its epilogue on wgmma, the streaming quantization of h, cuBLAS's down) - run,
    not the unfused ops - whatever the gate and up weights' places in memory; as accurate against float64 as the
    unfused ops and closer to them row by row than either is to float64 (rows 1000x apart: the two round h apart,
    float32 against the model's bf16 ops, so some fp8 codes of h differ); bit-equal replays of a CUDA graph."""
    from fp8fx.kernels import gated_mlp as module

    calls = []
    real = module._gated_prefill_launch
    monkeypatch.setattr(module, "_gated_prefill_launch",
                        lambda *a, **k: calls.append(a[2].data_ptr() < a[4].data_ptr()) or real(*a, **k))
    args, ws = mlp_operands(m, 512, 400, 272, scheme, "cuda", row_gain=torch.logspace(0, 3, m), act=act)
    args[11] = [1, -1]
    args[2], args[4] = _laid_out(args[2], args[4], layout)
    y = ops.gated_mlp(*args)
    assert calls, "the op ran the unfused ops"
    if layout in ("up first", "merged"):  # the kernel saw gate's weight after up's, or before it
        assert calls[0] == (layout == "merged"), (layout, calls)
    unfused = ops._gated_mlp_reference(*args)
    want = truth(args, ws)
    assert y.shape == (m, 272) and y.dtype == torch.bfloat16
    errs = torch.tensor([[rel(y[r], want[r]), rel(unfused[r], want[r]), rel(y[r], unfused[r])] for r in range(m)])
    assert (errs[:, 0] < errs[:, 1] * 1.25 + 1e-3).all(), errs[:, :2].max(0)
    assert (errs[:, 2] < errs[:, 1] + 1e-3).all() and errs[:, 2].median() < 0.5 * errs[:, 1].median(), errs.median(0)
    assert_graph_replays_equal(lambda: ops.gated_mlp(*args), y)


@pytest.mark.cuda
def test_relaunch_matches_triton_cuda(monkeypatch):
    """The prefill kernels launched through their compiled kernels after the first call (``launch.Relaunch``) give
    the bits of Triton's own launch path, across token counts that share a launch key (256, 512) and ones that do
    not (257: not a multiple of 16), called in an order that reuses each key's kernel."""
    from fp8fx.kernels import gated_mlp as module

    for m in (256, 257, 512, 257, 256):
        args, _ = mlp_operands(m, 512, 384, 8, "per-token/per-channel", "cuda", seed=m)
        xq, xs, w1, s1, w3, s3 = args[:6]
        h, parts = module.gated_prefill(xq, xs, w1, s1, w3, s3, torch.bfloat16)
        got = (h, parts, *module.quantize_rows(h, parts))
        with monkeypatch.context() as patch:  # Triton's path, every call
            patch.setattr(module, "_GATED_PREFILL", module.gated_prefill_kernel)
            patch.setattr(module, "_QUANTIZE_ROWS", module.quantize_rows_kernel)
            h0, parts0 = module.gated_prefill(xq, xs, w1, s1, w3, s3, torch.bfloat16)
            want = (h0, parts0, *module.quantize_rows(h0, parts0))
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8) if a.dtype == quant.FP8_DTYPE else a,
                               b.view(torch.uint8) if b.dtype == quant.FP8_DTYPE else b), m
    assert len(module._GATED_PREFILL._compiled) >= 2  # the two keys' kernels, each reused once at least


class _Recorder:
    """A triton.jit kernel's launch surface on the real kernel's signature (CPU): ``kernel[grid](*args, **kwargs)``
    logs the launch and returns a stand-in compiled kernel, whose own launches are logged too."""

    def __init__(self, kernel, log):
        self.params, self.arg_names, self.log = kernel.params, kernel.arg_names, log
        self.name = kernel.fn.__name__

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append((self.name, "triton", tuple(grid), args, kwargs))
            return _CompiledStandIn(self.name, self.log)
        return run


class _CompiledStandIn:
    def __init__(self, name, log):
        self.name, self.log, self.packed_metadata, self.function = name, log, (), object()

    def __getitem__(self, grid):
        return lambda *args: self.log.append((self.name, "compiled", tuple(grid), args))


def _same_launch_arg(a, b, fresh):
    """Whether the plan's argument ``a`` stands where the general route's ``b`` stood: the caller's tensors
    themselves, the route's own allocations (``fresh``: h, its maxima, h's codes and scales) alike in shape, strides
    and dtype, descriptors of those over the same shape, strides and block."""
    if hasattr(b, "block_shape"):
        return (_same_launch_arg(a.base, b.base, fresh) and list(a.shape) == list(b.shape)
                and list(a.strides) == list(b.strides) and list(a.block_shape) == list(b.block_shape))
    if isinstance(b, torch.Tensor):
        if any(b is t for t in fresh):
            return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a is not b
        return a is b
    return a == b and type(a) is type(b)


@pytest.fixture
def recorded_prefill(monkeypatch):
    """The prefill kernels as ``_Recorder``s behind their ``Relaunch``es, ``torch._scaled_mm``'s calls logged (and
    answered with zeros) and ``_gated_prefill_launch``'s (the general route's) counted: (launch log, scaled_mm log,
    count)."""
    from fp8fx.kernels import gated_mlp as module
    from fp8fx.kernels.launch import Relaunch

    log, mm, general = [], [], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # (Relaunch's launch key asks it)
    monkeypatch.setattr(module, "_GATED_PREFILL", Relaunch(_Recorder(module.gated_prefill_kernel, log)))
    monkeypatch.setattr(module, "_QUANTIZE_ROWS", Relaunch(_Recorder(module.quantize_rows_kernel, log)))
    real_launch = module._gated_prefill_launch
    # (nothing computed: the stand-ins leave h unwritten; torch 2.11's CPU _scaled_mm takes per-tensor scales only)
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **k: mm.append(((a, b), k))
                        or torch.zeros(a.shape[0], b.shape[1], dtype=k["out_dtype"]))
    monkeypatch.setattr(module, "_gated_prefill_launch", lambda *a, **k: general.append(1) or real_launch(*a, **k))
    return log, mm, general


def _prefill_call(args, **change):
    from fp8fx.kernels.gated_mlp import prefill_mlp

    names = ("xq", "xs", "w1", "s1", "w3", "s3", "w2", "s2", "bias")
    ops_ = {**dict(zip(names, args[:9])), **change}
    return prefill_mlp(*(ops_[k] for k in names), [1, -1], torch.bfloat16, torch.bfloat16, "silu", True)


@pytest.mark.parametrize("layout", ["apart", "up first"])
def test_prefill_plan_launches_what_the_general_route_launches(recorded_prefill, layout):
    """``prefill_mlp``'s second call of a shape goes through its ``PrefillPlan``: the same kernels compiled at the
    first call (no launch key, no general route), on the same grids, with the same arguments in the same places
    and the constexprs Triton bound at the first call, and the same down GEMM; a new x of that shape too."""
    from fp8fx.kernels import gated_mlp as module

    log, mm, general = recorded_prefill
    args, _ = mlp_operands(48, 64, 96, 32, "per-token/per-channel")
    args[2], args[4] = _laid_out(args[2], args[4], layout)
    y1 = _prefill_call(args)
    assert [(e[0], e[1]) for e in log] == [("gated_prefill_kernel", "triton"), ("quantize_rows_kernel", "triton")]
    assert len(general) == 1 and len(module._PLANS) == 1
    x2, xs2 = quant.quantize(torch.randn(48, 64).to(torch.bfloat16), [1, -1])
    for xq, xs in ((args[0], args[1]), (x2, xs2)):
        del log[2:], mm[1:]
        y2 = _prefill_call(args, xq=xq, xs=xs)
        assert len(general) == 1, "the second call took the general route"
        assert [(e[0], e[1]) for e in log[2:]] == [("gated_prefill_kernel", "compiled"),
                                                  ("quantize_rows_kernel", "compiled")]
        (_, _, grid1, a1, k1), (_, _, grid2, a2, k2) = log[:2]
        (_, _, pgrid1, p1), (_, _, pgrid2, p2) = log[2:]
        assert (pgrid1, pgrid2) == (grid1, grid2)
        h, parts = a1[2].base, a1[6]
        fresh = (h, parts, a2[2], a2[3])
        swap = {id(args[0]): xq, id(args[1]): xs}  # this call's x in the first call's places
        want1 = [swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in a1]
        want1 = [type(a)(swap.get(id(a.base), a.base), *list(vars(a).values())[1:]) if hasattr(a, "block_shape")
                 else a for a in want1]
        for kernel, got, want, kwargs in (("gated_prefill_kernel", p1, want1, k1),
                                          ("quantize_rows_kernel", p2, a2, k2)):
            params = getattr(module, kernel).params
            tail = [kwargs[p.name] if p.name in kwargs else p.default for p in params[len(want):]]
            assert len(got) == len(params) and list(got[len(want):]) == tail, kernel
            assert all(_same_launch_arg(g, w, fresh) for g, w in zip(got[:len(want)], want)), kernel
        assert p2[0] is p1[2].base and p2[1] is p1[6]  # quantize_rows reads the h and maxima the first kernel wrote
        (ga, gk), (pa, pk) = mm
        assert pa[0] is p2[2] and pk["scale_a"] is p2[3]  # the down GEMM on this call's codes and scales of h
        assert pa[1].data_ptr() == ga[1].data_ptr() and pa[1].stride() == ga[1].stride() and pa[1].shape == ga[1].shape
        assert torch.equal(pk["scale_b"], gk["scale_b"]) and pk["scale_b"].shape == gk["scale_b"].shape
        assert {k: v for k, v in pk.items() if "scale" not in k} == {k: v for k, v in gk.items() if "scale" not in k}
        assert y2.shape == y1.shape == (48, 32) and y2.dtype == y1.dtype


def test_prefill_plan_keys_on_shape_and_gate_up_order(recorded_prefill):
    """Another M, and gate and up swapped in memory (the kernel's UP_FIRST), make plans of their own."""
    from fp8fx.kernels import gated_mlp as module

    _, _, general = recorded_prefill
    args, _ = mlp_operands(48, 64, 96, 32, "per-token/per-channel")
    other, _ = mlp_operands(80, 64, 96, 32, "per-token/per-channel")
    swapped = list(args)
    # (merged: gate's rows before up's in one tensor)
    swapped[2], swapped[4] = _laid_out(args[2], args[4], "up first" if args[2].data_ptr() < args[4].data_ptr()
                                       else "merged")
    assert (swapped[2].data_ptr() < swapped[4].data_ptr()) != (args[2].data_ptr() < args[4].data_ptr())
    for a in (args, other, swapped, args, other, swapped):
        _prefill_call(a)
    assert len(general) == 3 and len(module._PLANS) == 3


def _not_plain(args, case):
    xq, xs, w1, s1, w3, s3, w2, s2 = args[:8]
    if case == "gate column-major":
        return {"w1": w1.t().contiguous().t()}
    if case == "x scale not 16-byte aligned":
        return {"xs": torch.cat([xs.new_zeros(1), xs.reshape(-1)])[1:].reshape(xs.shape)}
    if case == "x scale float64":
        return {"xs": xs.double()}
    if case == "gate per tensor, up per channel":
        return {"s1": s1.reshape(-1)[:1].clone()}
    if case == "down per tensor":
        return {"s2": s2.reshape(-1)[:1].clone()}
    if case == "one weight for gate and up":
        return {"w3": w1, "s3": s1}
    if case == "down transposed":
        return {"w2": w2.t().contiguous().t()}
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["gate column-major", "x scale not 16-byte aligned", "x scale float64",
                                  "gate per tensor, up per channel", "down per tensor", "one weight for gate and up",
                                  "down transposed"])
def test_operands_a_plan_does_not_take_go_the_general_route(recorded_prefill, case):
    """Operands the plans' launches would not read as they are (a copy, a cast or an expansion first; an alignment
    the compiled kernel was not specialized for) go the general route on every call, and make no plan."""
    from fp8fx.kernels import gated_mlp as module

    _, _, general = recorded_prefill
    args, _ = mlp_operands(48, 64, 96, 32, "per-token/per-channel")
    change = _not_plain(args, case)
    for _ in range(2):
        _prefill_call(args, **change)
    assert len(general) == 2 and not module._PLANS, case


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["apart", "up first"])
def test_prefill_plan_gives_the_general_routes_bits_cuda(monkeypatch, layout):
    """On the GPU, the op's prefill calls through a ``PrefillPlan`` (every call of a shape after its first) give the
    general route's bits, for the x the plan was made with and for new ones, with and without a bias; and a CUDA
    graph of the plan's launches replays them bit for bit."""
    from fp8fx.kernels import gated_mlp as module

    general = []
    real = module._gated_prefill_launch
    monkeypatch.setattr(module, "_gated_prefill_launch", lambda *a, **k: general.append(1) or real(*a, **k))
    m = ops.GATED_PREFILL_MIN_M + 16
    args, _ = mlp_operands(m, 512, 400, 272, "per-token/per-channel", "cuda", row_gain=torch.logspace(0, 3, m))
    args[2], args[4] = _laid_out(args[2], args[4], layout)
    others = [mlp_operands(m, 512, 400, 272, "per-token/per-channel", "cuda", seed=s)[0][:2] for s in (1, 2)]
    inputs = [(args[0], args[1]), *others, (args[0], args[1])]
    for bias in (args[8], None):  # (the plan is the same: the bias is added after the down GEMM)
        planned = [ops.gated_mlp(xq, xs, *args[2:8], bias, *args[9:]) for xq, xs in inputs]
        assert len(module._PLANS) == 1 and len(general) == 1, (layout, len(general))
        with monkeypatch.context() as patch:
            patch.setattr(module, "_plain_operands", lambda *a: False)  # the general route, every call
            for (xq, xs), y in zip(inputs, planned):
                assert torch.equal(ops.gated_mlp(xq, xs, *args[2:8], bias, *args[9:]), y), (layout, bias is None)
        assert len(general) == 1 + len(inputs), layout
        del general[1:]
    assert_graph_replays_equal(lambda: ops.gated_mlp(*args), ops.gated_mlp(*args))
