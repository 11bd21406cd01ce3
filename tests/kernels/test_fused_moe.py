"""fp8fx.fused_moe: the CPU reference against a per-(token, k) loop and against unquantized float64
experts; odd token counts, experts without tokens, every token on one expert, expert-parallel
sentinels; the op's registration (schema, fake impl). The Triton kernel (fp8fx.kernels.fused_moe)
against the reference: its routing (``align``, plain torch) on CPU, the kernels under Triton's
interpreter (their fp8 loads and dots are exact there; its fp32 -> fp8 conversion, wrong for ~3% of
values, replaced by torch's round to nearest, ``tests/triton_rounding.py``, so the kernels' quantization
is held to fp8fx.quant's bits), and on the GPU."""
import re
import textwrap

import numpy as np

import pytest
import torch
import torch.nn.functional as F

from fp8fx import ops, quant
from tests.conftest import rel_err, run_under_triton_interpreter

E, H, I, K = 8, 256, 128, 2
SCHEMES = {  # name: (w_block, act_block, static)
    "per-channel": ([1, -1], [1, -1], False),
    "per-tensor": ([-1, -1], [-1, -1], False),
    "block": ([64, 128], [1, 128], False),
    "static": ([-1, -1], [-1, -1], True),
}


def experts(w_block, seed=0):
    """(w13 fp8 [E, 2I, H], its scale, w2 fp8 [E, H, I], its scale, the float weights)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    q13, s13 = quant.quantize(w13, w_block)
    q2, s2 = quant.quantize(w2, w_block)
    return q13, s13, q2, s2, w13, w2


def routed(t, seed=1, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K)
    w = torch.rand(ids.shape, generator=g)
    return x, (w / w.sum(-1, keepdim=True)).float(), ids.long()


def run(x, w, ids, q13, s13, q2, s2, scheme, w13=None):
    """The op; static scheme: input scales calibrated as amax / 448 on these tokens (float weights w13)."""
    w_block, act_block, static = SCHEMES[scheme]
    a13 = a2 = None
    if static:
        gate, up = (x.double() @ w13.double().transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I]: every expert
        a13, a2 = (torch.tensor([float(t.abs().max()) / 448]) for t in (x, F.silu(gate) * up))
    return torch.ops.fp8fx.fused_moe(x, w, ids, q13, s13, q2, s2, w_block, act_block, torch.bfloat16, a13, a2), (a13, a2)


def loop(x, w, ids, q13, s13, q2, s2, scheme, a13, a2):
    """The op's definition written the other way round: token by token, k by k, in float64."""
    w_block, act_block, _ = SCHEMES[scheme]
    t = x.shape[0]

    def act(a, static):  # quantize -> dequantize as the GEMM sees it
        if static is not None:
            return quant.dequantize(quant.quantize_with_scale(a, static, [-1, -1]), static, [-1, -1])
        return quant.dequantize(*quant.quantize(a, act_block), act_block)

    xd = act(x.float(), a13).double()
    pairs = [(i, k) for i in range(t) for k in range(K)]
    inter = torch.zeros(len(pairs), I, dtype=torch.float64)
    for p, (i, k) in enumerate(pairs):
        e = int(ids[i, k])
        if 0 <= e < E:
            gate, up = (quant.dequantize(q13[e], s13[e], w_block).double() @ xd[i]).chunk(2)
            inter[p] = F.silu(gate) * up
    inter = act(inter.float(), a2).double()
    out = torch.zeros(t, H, dtype=torch.float64)
    for p, (i, k) in enumerate(pairs):
        e = int(ids[i, k])
        if 0 <= e < E:
            out[i] += w[i, k].double() * (quant.dequantize(q2[e], s2[e], w_block).double() @ inter[p])
    return out


def exact(x, w, ids, w13, w2):
    """Unquantized experts in float64."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for i in range(x.shape[0]):
        for k in range(K):
            gate, up = (w13[ids[i, k]].double() @ x[i].double()).chunk(2)
            out[i] += w[i, k].double() * (w2[ids[i, k]].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("t", [1, 3, 40])
def test_reference_matches_the_loop_and_float64(scheme, t):
    q13, s13, q2, s2, w13, w2 = experts(SCHEMES[scheme][0])
    x, w, ids = routed(t)
    out, (a13, a2) = run(x, w, ids, q13, s13, q2, s2, scheme, w13)
    assert out.shape == (t, H) and out.dtype == torch.bfloat16
    # same quantization, other loop order and float64: only the final bf16 cast (and, rarely, an fp8
    # rounding of the intermediate that float32 and float64 round differently) differ
    assert rel_err(out, loop(x, w, ids, q13, s13, q2, s2, scheme, a13, a2)) < 5e-3
    # three fp8 roundings (x, weights, intermediate): ~0.06 measured; per-tensor scales are coarser
    assert rel_err(out, exact(x, w, ids, w13, w2)) < (0.1 if SCHEMES[scheme][0] == [-1, -1] else 0.08)


def test_idle_experts_one_expert_and_sentinels():
    q13, s13, q2, s2, w13, w2 = experts([1, -1])
    x, w, ids = routed(257, ids=torch.zeros(257, K, dtype=torch.long))  # every token on expert 0, twice
    out, _ = run(x, w, ids, q13, s13, q2, s2, "per-channel")
    assert rel_err(out, exact(x, w, ids, w13, w2)) < 0.08
    # -1 and E (expert-parallel sentinels) contribute nothing: as if their routing weight were 0
    x, w, ids = routed(5)
    ids[1, 0], ids[3, 1] = -1, E
    out, _ = run(x, w, ids, q13, s13, q2, s2, "per-channel")
    w0 = w.clone()
    w0[1, 0] = w0[3, 1] = 0
    ref, _ = run(x, w0, ids.clamp(0, E - 1), q13, s13, q2, s2, "per-channel")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_no_tokens(scheme, out_dtype):
    """Zero tokens: an empty [0, H] of out_dtype, as the loop gives (static scales given: no tokens to calibrate)."""
    w_block, act_block, static = SCHEMES[scheme]
    q13, s13, q2, s2, *_ = experts(w_block)
    x, w, ids = routed(0)
    a13 = a2 = torch.tensor([0.01]) if static else None
    out = torch.ops.fp8fx.fused_moe(x, w, ids, q13, s13, q2, s2, w_block, act_block, out_dtype, a13, a2)
    assert out.shape == (0, H) and out.dtype == out_dtype and out.device == x.device
    assert torch.equal(out, loop(x, w, ids, q13, s13, q2, s2, scheme, a13, a2).to(out_dtype))


def test_registration_schema_and_fake():
    q13, s13, q2, s2, *_ = experts([1, -1])
    x, w, ids = routed(3)
    args = (x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16, None, None)
    torch.library.opcheck(torch.ops.fp8fx.fused_moe.default, args, test_utils=("test_faketensor",))
    gated = (*args, False, *gpt_oss_form().values())
    torch.library.opcheck(torch.ops.fp8fx.fused_moe.default, gated, test_utils=("test_faketensor",))


def test_bad_shapes_name_the_tensors():
    q13, s13, q2, s2, *_ = experts([1, -1])
    x, w, ids = routed(3)
    with pytest.raises(RuntimeError, match=r"fp8fx.fused_moe: x \(3, 255\) is not \[T, 256\]"):
        torch.ops.fp8fx.fused_moe(x[:, :255], w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"topk_ids \(3, 1\) and topk_weights \(3, 2\) are not both"):
        torch.ops.fp8fx.fused_moe(x, w, ids[:, :1], q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"w13 \(8, 256, 256\) and w2 \(8, 256, 127\) are not"):
        torch.ops.fp8fx.fused_moe(x, w, ids, q13, s13, q2[..., :127], s2, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_block=\[0, 1\] is not a block"):
        torch.ops.fp8fx.fused_moe(x, w, ids, q13, s13, q2, s2, [0, 1], [1, -1], torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"w13 \(8, 255, 256\) has an odd number of rows"):
        torch.ops.fp8fx.fused_moe(x, w, ids, q13[:, :255], s13[:, :255], q2, s2, [1, -1], [1, -1], torch.bfloat16)
    # the same operands, with nothing cut: taken (each error above is the cut tensor's)
    out = torch.ops.fp8fx.fused_moe(x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16)
    assert out.shape == (3, H) and out.dtype == torch.bfloat16


def test_bad_dtypes_and_scale_sizes_name_the_tensors():
    """What the reference would compute from wrongly (a float id, bf16 experts) or fail on with a bare reshape
    error (scales of the wrong size): refused, naming the tensor."""
    q13, s13, q2, s2, w13, _ = experts([1, -1])
    x, w, ids = routed(3)
    moe = torch.ops.fp8fx.fused_moe
    for bad_ids in (ids.float(), ids.to(torch.int8)):  # int8: the CUDA routing overflowed at 128 experts
        with pytest.raises(ValueError, match=rf"fused_moe: topk_ids is {bad_ids.dtype}; expert ids are int32 or "):
            moe(x, w, bad_ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16)
    # fp8 codes as x (their scale dropped), integer routing weights, an integer output: computed garbage
    with pytest.raises(ValueError, match=r"fused_moe: x is torch.float8_e4m3fn; it takes bf16/fp16/fp32"):
        moe(x.to(torch.float8_e4m3fn), w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"fused_moe: topk_weights is torch.int64; routing weights are"):
        moe(x, w.long(), ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"fused_moe: out_dtype=torch.int32; the result is"):
        moe(x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.int32)
    with pytest.raises(ValueError, match=r"fused_moe: w13 is torch.bfloat16; the experts' weights must be"):
        moe(x, w, ids, w13.bfloat16(), s13, q2, s2, [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"fused_moe: w2_scale has 8 elements .* block \[1, -1\] of w2 "
                                         r"\[8, 256, 128\] needs 2048"):
        moe(x, w, ids, q13, s13, q2, s2[:, :1], [1, -1], [1, -1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"fused_moe: a13_scale must have one element, got shape \[2\]"):
        moe(x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16, torch.ones(2), torch.ones(1))
    for bad in (0.0, -1.0, float("inf"), float("nan")):  # 0: every output 0; Inf / NaN: every output NaN
        with pytest.raises(ValueError, match=r"fused_moe: a2_scale is .*; a static scale must be a positive finite"):
            moe(x, w, ids, q13, s13, q2, s2, [1, -1], [-1, -1], torch.bfloat16, torch.ones(1), torch.tensor([bad]))
    for block in ([1, -1], [1, 32]):  # x's static scale is per tensor: the block was silently ignored
        with pytest.raises(ValueError, match=rf"fused_moe: a13_scale \(a static per-tensor scale of x\) with "
                                             rf"act_block=\{block}; a static scale is per tensor: act_block="):
            moe(x, w, ids, q13, s13, q2, s2, [1, -1], block, torch.bfloat16, torch.ones(1), torch.ones(1))


def gpt_oss_form(seed=2):
    """fused_moe's GPT-OSS arguments: biases of each expert, interleaved gate/up rows, the clamped SwiGLU at a limit
    these random experts reach (most gates and ups are clamped at GPT-OSS's 7 only for real activations)."""
    g = torch.Generator().manual_seed(seed)
    return dict(w13_bias=torch.randn(E, 2 * I, generator=g).bfloat16(),
                w2_bias=torch.randn(E, H, generator=g).bfloat16(), interleaved=True, activation="swiglu_oai",
                swiglu_alpha=1.702, swiglu_limit=0.75)


def exact_gpt_oss(x, w, ids, w13, w2, form):
    """GPT-OSS's experts (HF's GptOssExperts: interleaved gate/up, biases, clamped SwiGLU; or ``silu_clamped``,
    DeepSeek-V4's), unquantized, float64."""
    b13, b2 = form["w13_bias"].double(), form["w2_bias"].double()
    alpha, limit = form["swiglu_alpha"], form["swiglu_limit"]
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for i in range(x.shape[0]):
        for k in range(K):
            e = ids[i, k]
            gu = w13[e].double() @ x[i].double() + b13[e]
            gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
            h = {"silu_clamped": lambda: F.silu(gate) * up, "swiglu_oai": lambda: gate * torch.sigmoid(alpha * gate) * (
                up + 1), "gelu_tanh": lambda: F.gelu(gu[0::2], approximate="tanh") * gu[1::2],
                 "gelu": lambda: F.gelu(gu[0::2]) * gu[1::2], "relu2": lambda: F.relu(gu[0::2]) ** 2 * gu[1::2],
                 }[form["activation"]]()
            out[i] += w[i, k].double() * (w2[e].double() @ h + b2[e])
    return out


@pytest.mark.parametrize("scheme", ["per-channel", "block"])
@pytest.mark.parametrize("activation", ["swiglu_oai", "silu_clamped", "gelu_tanh", "gelu", "relu2"])
def test_reference_gpt_oss_form_matches_float64(scheme, activation):
    """Biases, interleaved rows and the clamped SwiGLU (or DeepSeek-V4's clamped SiLU) against the experts in float64;
    each of them left out (or another limit, alpha or activation) misses it by far more than fp8's error."""
    w_block, act_block, _ = SCHEMES[scheme]
    q13, s13, q2, s2, w13, w2 = experts(w_block)
    x, w, ids = routed(40)
    form = {**gpt_oss_form(), "activation": activation}
    other = "silu_clamped" if activation == "swiglu_oai" else "swiglu_oai"
    clamped = activation in ("swiglu_oai", "silu_clamped")
    truth = exact_gpt_oss(x, w, ids, w13, w2, form)
    moe = torch.ops.fp8fx.fused_moe
    out = moe(x, w, ids, q13, s13, q2, s2, w_block, act_block, torch.float32, None, None, False, *form.values())
    # measured 0.022 (clamped), 0.042 (GELUs: larger unclamped intermediates), 0.050 (relu2 * up: a cubic)
    assert rel_err(out, truth) < (0.07 if activation == "relu2" else 0.05)
    wrongs = [dict(w13_bias=None), dict(w2_bias=None), dict(interleaved=False), dict(activation="silu"),
              dict(activation=other)] + [dict(swiglu_limit=7.0)] * clamped + [dict(swiglu_alpha=0.5)] * (
                  activation == "swiglu_oai")
    for wrong in wrongs:
        bad = moe(x, w, ids, q13, s13, q2, s2, w_block, act_block, torch.float32, None, None, False,
                  *{**form, **wrong}.values())
        assert rel_err(bad, truth) > 0.1, wrong


def test_gpt_oss_form_bad_arguments_name_them():
    q13, s13, q2, s2, *_ = experts([1, -1])
    x, w, ids = routed(3)
    form = gpt_oss_form()

    def moe(**kw):
        args = {**form, **kw}
        return torch.ops.fp8fx.fused_moe(x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16, None, None,
                                         False, *args.values())
    with pytest.raises(RuntimeError, match=r"fused_moe: w13_bias has shape \[8, 128\]; it must be \[8, 256\]"):
        moe(w13_bias=form["w13_bias"][:, :I])
    with pytest.raises(RuntimeError, match=r"fused_moe: w2_bias has shape \[256\]; it must be \[8, 256\]"):
        moe(w2_bias=form["w2_bias"][0])
    with pytest.raises(ValueError, match=r"fused_moe: w2_bias is torch.int64; biases are bf16"):
        moe(w2_bias=form["w2_bias"].long())
    with pytest.raises(ValueError, match=r"fused_moe: activation='relu'; it computes \['silu', 'swiglu_oai', "
                                         r"'silu_clamped', 'gelu_tanh', 'gelu', 'relu2'\]"):
        moe(activation="relu")
    for limit in (0.0, -7.0, float("nan")):
        with pytest.raises(ValueError, match=r"swiglu_limit=.*; the clamped SwiGLU takes a finite alpha and a limit"):
            moe(swiglu_limit=limit)
    with pytest.raises(ValueError, match=r"swiglu_alpha=inf"):
        moe(swiglu_alpha=float("inf"))
    assert moe().shape == (3, H)  # the same arguments, none of them wrong


def ungated_experts(w_block, seed=3):
    """Ungated experts (Nemotron-H's ``down(act(up(x)))``): (up fp8 [E, I, H], its scale, w2 fp8 [E, H, I], its scale,
    the float weights, a bias of up [E, I])."""
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(E, I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    return (*quant.quantize(up, w_block), *quant.quantize(w2, w_block), up, w2,
            torch.randn(E, I, generator=g).bfloat16())


UNARY = {"relu2": lambda v: F.relu(v) ** 2, "silu": F.silu, "gelu": F.gelu,
         "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def exact_ungated(x, w, ids, up, w2, activation, b13=None):
    """Ungated experts, unquantized, token by token in float64."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for i in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[i, k]
            u = up[e].double() @ x[i].double() + (0 if b13 is None else b13[e].double())
            out[i] += w[i, k].double() * (w2[e].double() @ UNARY[activation](u))
    return out


@pytest.mark.parametrize("scheme", ["per-channel", "per-tensor", "block", "static"])
@pytest.mark.parametrize("activation", list(UNARY))
def test_reference_ungated_matches_float64(scheme, activation):
    """``gated=False``: w13 is up alone ([E, I, H]) and act one-input (Nemotron-H's squared ReLU among them), with or
    without up's bias, against the float64 experts; the gated reading of the same tensors (a gate of half the rows),
    another activation or a dropped bias misses it by far more than fp8's error."""
    w_block, act_block, static = SCHEMES[scheme]
    q13, s13, q2, s2, up, w2, b13 = ungated_experts(w_block)
    x, w, ids = routed(40)
    moe = torch.ops.fp8fx.fused_moe
    for bias in (None, b13):
        truth = exact_ungated(x, w, ids, up, w2, activation, bias)
        a13 = a2 = None
        if static:
            hidden = UNARY[activation](x.double() @ up.double().transpose(1, 2) + (0 if bias is None else bias.double()
                                                                                   .unsqueeze(1)))
            a13, a2 = (torch.tensor([float(t.abs().max()) / 448]) for t in (x, hidden))

        def run_(**kw):
            form = {**dict(w13_bias=bias, activation=activation, gated=False), **kw}
            return moe(x, w, ids, q13, s13, q2, s2, w_block, act_block, torch.float32, a13, a2, False,
                       form["w13_bias"], None, False, form["activation"], 1.702, 7.0, form["gated"])
        out = run_()
        assert rel_err(out, truth) < 0.06, rel_err(out, truth)  # measured 0.045-0.050 (bias on, every scheme)
        others = [a for a in UNARY if a != activation and {a, activation} != {"gelu", "gelu_tanh"}]
        wrongs = [dict(activation=a) for a in others] + [dict(w13_bias=None if bias is not None else b13)]
        for wrong in wrongs:
            assert rel_err(run_(**wrong), truth) > 0.1, wrong
        if activation == "gelu":  # the tanh approximation is close to the exact GELU, but not within 1e-3
            assert rel_err(run_(activation="gelu_tanh"), out) > 1e-4


def test_ungated_bad_arguments_name_them():
    q13, s13, q2, s2, *_ = ungated_experts([1, -1])
    x, w, ids = routed(3)
    moe = torch.ops.fp8fx.fused_moe

    def call(q13=q13, s13=s13, interleaved=False, activation="relu2", gated=False):
        return moe(x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16, None, None, False, None, None,
                   interleaved, activation, 1.702, 7.0, gated)
    for kw in (dict(interleaved=True), dict(activation="swiglu_oai"), dict(activation="silu_clamped")):
        with pytest.raises(ValueError, match=r"fused_moe: gated=False with interleaved=.*; ungated experts have no gate "
                                             r"rows to interleave, and act is one of \['silu', 'gelu_tanh', 'gelu', "
                                             r"'relu2'\] of up"):
            call(**kw)
    q13g, s13g, *_ = experts([1, -1])  # gated [E, 2I, H] weights called ungated, and the other way round
    with pytest.raises(RuntimeError, match=r"w13 \(8, 256, 256\) and w2 \(8, 256, 128\) are not \[E, I, H\] and "
                                           r"\[E, H, I\]"):
        call(q13=q13g, s13=s13g)
    with pytest.raises(RuntimeError, match=r"are not \[E, 2I, H\] and \[E, H, I\]"):
        call(gated=True)
    assert call().shape == (3, H)


def test_pairs_routed_nowhere_contribute_nothing_whatever_their_weight():
    """A pair routed to -1 (or past the last expert) adds nothing to its token, a NaN weight included: the
    reference agrees with the kernel (which skips such pairs) instead of turning 0 * NaN into a NaN row."""
    q13, s13, q2, s2, *_ = experts([1, -1])
    x, w, _ = routed(3)
    ids = torch.tensor([[0, 1], [2, -1], [3, E]])
    w[1, 1] = w[2, 1] = float("nan")
    y = torch.ops.fp8fx.fused_moe(x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.float32)
    assert torch.isfinite(y).all()
    alone = torch.ops.fp8fx.fused_moe(x[1:], w[1:, :1], ids[1:, :1], q13, s13, q2, s2, [1, -1], [1, -1], torch.float32)
    assert torch.equal(y[1:], alone)  # exactly the routed pairs' sum


# -- the Triton kernel ------------------------------------------------------------------------------
@pytest.mark.parametrize("t,k,block_m", [(1, 2, 16), (7, 2, 4), (40, 3, 16), (0, 2, 16)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])  # routers (and vLLM) often give int32 ids
def test_align_sorts_and_pads_pairs_by_expert(t, k, block_m, id_dtype):
    pytest.importorskip("triton")
    from fp8fx.kernels.fused_moe import align

    g = torch.Generator().manual_seed(t)
    ids = torch.randint(-1, E + 1, (t, k), generator=g).to(id_dtype)  # -1 and E: dropped
    ids[: t // 2] = 3  # a crowded expert; others get none
    sorted_pair, block_expert = align(ids, E, block_m)
    s = t * k
    assert sorted_pair.numel() == block_expert.numel() * block_m
    assert sorted_pair.numel() <= s + min(E, s) * (block_m - 1) + block_m
    flat = ids.reshape(-1)
    rows = sorted_pair.reshape(-1, block_m)
    for b, e in enumerate(block_expert.tolist()):
        pairs = [p for p in rows[b].tolist() if p < s]
        if e < 0:
            assert not pairs
        assert all(int(flat[p]) == e for p in pairs)  # each block holds pairs of its expert only
    seen = sorted(p for p in sorted_pair.tolist() if p < s)
    assert seen == [p for p in range(s) if 0 <= flat[p] < E]  # every routed pair once, dropped ones never
    for e in range(E):  # each expert's pairs in pair order, its blocks contiguous
        mine = [p for p in sorted_pair.tolist() if p < s and int(flat[p]) == e]
        assert mine == sorted(mine)


ALIGN_CHECK = textwrap.dedent(
    """
    import torch
    from fp8fx.kernels.fused_moe import align_one_program, align_torch
    g = torch.Generator().manual_seed(0)
    for t, k, e, block_m in [(1, 1, 8, 16), (1, 8, 128, 16), (16, 8, 128, 16), (16, 2, 8, 16), (5, 3, 6, 4),
                             (32, 8, 128, 64), (7, 2, 8, 4)]:
        for case in ("random", "sentinels", "one expert"):
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            if case == "sentinels":  # expert-parallel ids outside [0, E) are dropped
                ids[::2, 0] = e
                ids[1::3, -1] = -1
            if case == "one expert":
                ids[:] = e - 1
            for dtype in (torch.int64, torch.int32):
                got = align_one_program(ids.to(dtype), e, block_m)
                want = align_torch(ids.to(dtype), e, block_m)
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and torch.equal(a, b), (t, k, e, block_m, case, dtype, a, b)
    print("align ok")
    """
)


COMBINE_CHECK = textwrap.dedent(
    """
    import torch
    from fp8fx.kernels.fused_moe import combine_kernel
    t, k, e, h = 5, 3, 4, 40
    ids = torch.randint(0, e, (t, k))
    ids[1, 2], ids[3, 0] = e, -1  # routed nowhere: their rows of y were never written
    for y_dtype, out_dtype in [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                               (torch.bfloat16, torch.bfloat16)]:
        y = torch.randn(t * k, h).to(y_dtype)
        unrouted = ((ids < 0) | (ids >= e)).reshape(-1)
        ref = torch.where(unrouted[:, None], 0, y.float()).view(t, k, h).sum(1)
        y[unrouted] = float("nan")
        out = torch.empty(t, h, dtype=out_dtype)
        combine_kernel[(t, 2)](y, ids.reshape(-1), out, h, y.stride(0), out.stride(0), E=e, K_TOP=k, BLOCK_H=32)
        if out_dtype == torch.float32:  # three bf16 / float32 terms in order: the same float32 sum
            assert torch.allclose(out, ref, rtol=1e-6, atol=0), (y_dtype, (out - ref).abs().max())
        else:  # the interpreter's float32 -> bf16 cast may be one bf16 step off round-to-nearest
            assert torch.allclose(out.float(), ref, rtol=2**-7, atol=0), (out.float() - ref).abs().max()
    print("combine ok")
    """
)


def test_combine_kernel_under_triton_interpreter():
    """Sums each token's pair rows in float32 in k order; rows of pairs routed nowhere (NaN here) add 0."""
    assert "combine ok" in run_under_triton_interpreter(["-c", COMBINE_CHECK])


def test_align_one_program_matches_torch_under_triton_interpreter():
    """The GPU's one-launch align (decode) gives exactly the torch version's tensors."""
    assert "align ok" in run_under_triton_interpreter(["-c", ALIGN_CHECK])


@pytest.mark.cuda
def test_align_one_program_matches_torch_cuda():
    from fp8fx.kernels.fused_moe import align, align_one_program, align_torch

    g = torch.Generator().manual_seed(1)
    for t, k, e, block_m in [(1, 8, 128, 16), (16, 8, 128, 16), (16, 2, 8, 16), (32, 8, 128, 64), (9, 3, 60, 128)]:
        for case, dtype in [("sentinels", torch.int64), ("sentinels", torch.int32), ("one expert", torch.int64)]:
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            if case == "sentinels":  # dropped: expert-parallel ids past E, and -1
                ids[::3, 0] = e
                ids[1::4, -1] = -1
            else:
                ids[:] = e - 1
            ids = ids.to(dtype).cuda()
            want = align_torch(ids, e, block_m)
            for got in (align_one_program(ids, e, block_m), align(ids, e, block_m)):  # align picks the kernel
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (t, k, e, block_m, case, dtype)


INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from tests.triton_rounding import round_to_nearest
    round_to_nearest()  # the GPU's conversions: the kernels' quantization is held to fp8fx.quant's bits
    from fp8fx import ops, quant
    import functools
    from fp8fx.kernels.fused_moe import (_gemm13, _weight_scale, align, fused_moe, imprecise_k, quantize_act,
                                         torch_quantize_act)
    fused_moe = functools.partial(fused_moe, direct=False)  # the aligned path at 1 token too (DIRECT_CHECK: the other)

    def _gemm13_args(x, ids, q13, s13, wb, ab, cfg):  # fused_moe's first GEMM, BLOCK_N = BLOCK_K = the group
        tiles = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=ab[1], BLOCK_K=ab[1])
        consts = dict(K_GROUPED=True, IMPRECISE_K=imprecise_k(tiles, False), **tiles)
        sorted_pair, block_expert = align(ids, E, tiles["BLOCK_M"])
        xq, x_scale = torch_quantize_act(x, ab, None)
        s13_, strides, rows = _weight_scale(s13, q13, wb)
        extra = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return lambda fuse_group: _gemm13(xq, x_scale, q13, s13_, strides, rows, sorted_pair, block_expert,
                                          ids.shape[1], ids.numel(), fuse_group, False, consts, extra)

    g = torch.Generator().manual_seed(0)
    E, H, I = 5, 72, 40  # ragged against every tile and K group below
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
    # the GEMMs get torch's quantization here (fuse_quant=False), so that they are checked apart from it; the
    # kernels' activation quantization (the first GEMM's epilogue, quantize_rows_kernel) is checked to the bit below
    for wb, ab, static in [([1, -1], [1, -1], False), ([-1, -1], [-1, -1], False), ([-1, -1], [-1, -1], True),
                           ([1, -1], [-1, -1], False), ([8, 32], [1, 32], False), ([1, -1], [1, 32], False),
                           ([8, 32], [1, -1], False), ([8, 32], [-1, -1], True)]:
        q13, s13 = quant.quantize(torch.randn(E, 2 * I, H, generator=g) / 8, wb)
        q2, s2 = quant.quantize(torch.randn(E, H, I, generator=g) / 6, wb)
        a13, a2 = (torch.tensor([0.02]), torch.tensor([0.002])) if static else (None, None)
        for t, k in [(1, 2), (3, 2), (21, 3)]:
            x = torch.randn(t, H, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
            if t == 21:
                ids[:, 0] = 2  # expert 2 crowded, and ...
                ids[ids == 4] = -1  # ... expert 4 idle (its pairs dropped as expert-parallel sentinels)
            w = torch.rand(t, k, generator=g)
            ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, a13, a2)
            y = fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, a13, a2, config=cfg,
                          quantize=torch_quantize_act, fuse_quant=False)
            err = ((y - ref).norm() / ref.norm()).item()
            assert err < 1e-4, (wb, ab, static, t, k, err)
            if t == 21 and static:  # the second GEMM with its own tiles
                cfg2 = {**cfg, "gemm2": dict(BLOCK_N=32, BLOCK_K=64, num_warps=2)}
                y2 = fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, a13, a2, config=cfg2,
                               quantize=torch_quantize_act, fuse_quant=False)
                assert ((y2 - ref).norm() / ref.norm()).item() < 1e-4, (wb, ab, "gemm2 tiles")
        wrong = [("w2", s13, s2 * 1.5, 0.1), ("one w13 block", s13.clone().flatten(), s2, 0.01)]
        for name, bad_s13, bad_s2, bound in wrong:
            if name == "one w13 block":  # one scale entry of expert 2 (crowded): a wrong block index must show
                bad_s13[bad_s13.numel() * 2 // E] *= 4
            bad = fused_moe(x, w, ids, q13, bad_s13.reshape(s13.shape), q2, bad_s2, wb, ab, torch.float32, a13, a2,
                            config=cfg, quantize=torch_quantize_act, fuse_quant=False)
            assert ((bad - ref).norm() / ref.norm()).item() > bound, (wb, ab, name)  # a wrong scale must show
        if ab[1] != -1:  # the first GEMM's epilogue quantizing its 1 x GK groups vs torch on its float32 output:
            # the same codes and scales into the same second GEMM: the unfused output (y, t = 21 above) bit for bit
            fused = fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, a13, a2, config=cfg,
                              quantize=torch_quantize_act)
            assert torch.equal(fused, y), (wb, ab, (fused - y).abs().max())
            assert ((fused - ref).norm() / ref.norm()).item() < 1e-4, (wb, ab)
            gemm13 = _gemm13_args(x, ids, q13, s13, wb, ab, cfg)
            inter = gemm13(None)
            iq, i_scale = gemm13(ab[1])
            routed = (ids >= 0).reshape(-1) & (ids < E).reshape(-1)
            q_ref, s_ref = torch_quantize_act(inter[routed], ab, None)
            assert torch.equal(i_scale[routed], s_ref), (wb, ab)
            same = (iq[routed].view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
            assert same == 1, (wb, ab, same)  # the same IEEE quotients, rounded to nearest
    # GPT-OSS's experts: biases, interleaved gate/up rows (16-row blocks holding both: no halves could have them),
    # the clamped SwiGLU at a limit these values pass; expert 4 idle, expert 2 crowded
    for wb, ab in [([1, -1], [1, -1]), ([16, 32], [1, 32]), ([-1, -1], [-1, -1])]:
        q13, s13 = quant.quantize(torch.randn(E, 2 * I, H, generator=g) / 8, wb)
        q2, s2 = quant.quantize(torch.randn(E, H, I, generator=g) / 6, wb)
        form = dict(w13_bias=torch.randn(E, 2 * I, generator=g).bfloat16(), w2_bias=torch.randn(E, H, generator=g),
                    interleaved=True, activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=1.5)
        x = 3 * torch.randn(21, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(21)])
        ids[:, 0] = 2
        ids[ids == 4] = -1
        w = torch.rand(21, 3, generator=g)
        for activation in ("swiglu_oai", "silu_clamped", "gelu_tanh"):  # (DeepSeek-V4's clamped SiLU, Gemma-4's)
            form["activation"] = activation
            ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, **form)
            y = fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, config=cfg,
                          quantize=torch_quantize_act, fuse_quant=False, **form)
            assert ((y - ref).norm() / ref.norm()).item() < 1e-4, (wb, ab, activation)
    # ungated experts (Nemotron-H's): w13 is up alone [E, I, H]; each one-input activation, with and without up's
    # bias, 8-row weight blocks over its 40 rows
    for wb, ab in [([1, -1], [1, -1]), ([8, 32], [1, 32]), ([-1, -1], [-1, -1])]:
        q13, s13 = quant.quantize(torch.randn(E, I, H, generator=g) / 8, wb)
        q2, s2 = quant.quantize(torch.randn(E, H, I, generator=g) / 6, wb)
        x = 3 * torch.randn(21, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(21)])
        ids[ids == 4] = -1
        w = torch.rand(21, 3, generator=g)
        for activation, bias in [("relu2", None), ("relu2", torch.randn(E, I, generator=g)), ("silu", None),
                                 ("gelu", torch.randn(E, I, generator=g).bfloat16()), ("gelu_tanh", None)]:
            form = dict(w13_bias=bias, activation=activation, gated=False)
            ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, **form)
            y = fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, config=cfg,
                          quantize=torch_quantize_act, fuse_quant=False, **form)
            assert ((y - ref).norm() / ref.norm()).item() < 1e-4, (wb, ab, activation)
            if ab[1] != -1:  # the first GEMM's epilogue quantizing the ungated intermediate in 1 x GK groups
                fused = fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, config=cfg,
                                  quantize=torch_quantize_act, **form)
                assert torch.equal(fused, y), (wb, ab, activation, (fused - y).abs().max())
                assert ((fused - ref).norm() / ref.norm()).item() < 1e-4, (wb, ab, activation, "fused quantization")
    # weight blocks that hold whole N tiles (one weight scale a K step of a tile): 32 intermediate rows, so 16- and
    # 32-row blocks split gate from up; H = 72 ragged against both GEMMs' tiles; one wrong scale of expert 2's first
    # up block, or of its last (ragged) down block, must show
    i32 = 32
    for wb, ab in [([16, 32], [1, 32]), ([32, 32], [1, -1]), ([16, 32], [-1, -1])]:
        q13, s13 = quant.quantize(torch.randn(E, 2 * i32, H, generator=g) / 8, wb)
        q2, s2 = quant.quantize(torch.randn(E, H, i32, generator=g) / 6, wb)
        x = torch.randn(21, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(21)])
        ids[:, 0] = 2
        ids[ids == 4] = -1
        w = torch.rand(21, 3, generator=g)
        ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32)
        y = fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, config=cfg, quantize=torch_quantize_act,
                      fuse_quant=False)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-4, (wb, ab)
        bad13, bad2 = s13.clone(), s2.clone()
        bad13.view(E, 2 * i32 // wb[0], -1)[2, i32 // wb[0], 0] *= 4
        bad2.view(E, -(-H // wb[0]), -1)[2, -1, -1] *= 4
        for bad in ((bad13, s2), (s13, bad2)):
            y_bad = fused_moe(x, w, ids, q13, bad[0], q2, bad[1], wb, ab, torch.float32, config=cfg,
                              quantize=torch_quantize_act, fuse_quant=False)
            assert ((y_bad - ref).norm() / ref.norm()).item() > 0.01, (wb, ab)
    # ids as a strided view (one column of a [T, 2] tensor, a sentinel in every third row): pair p must be
    # read at ids[p] by the align kernel and by the combine
    import fp8fx.kernels.fused_moe as km
    wb = ab = [1, -1]
    q13, s13 = quant.quantize(torch.randn(E, 2 * I, H, generator=g) / 8, wb)
    q2, s2 = quant.quantize(torch.randn(E, H, I, generator=g) / 6, wb)
    wide = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(9)])
    wide[::3, 0] = -1
    ids_view = wide[:, :1]
    assert not ids_view.reshape(-1).is_contiguous() or ids_view.reshape(-1).data_ptr() != ids_view.contiguous().data_ptr()
    x = torch.randn(9, H, generator=g).bfloat16()
    w = torch.rand(9, 1, generator=g)
    ref = ops.fused_moe_reference(x, w, ids_view.contiguous(), q13, s13, q2, s2, wb, ab, torch.float32)
    for aligner in (km.align_one_program, km.align_torch):  # what CUDA picks for decode, and for prefill
        km.align = aligner
        y = fused_moe(x, w, ids_view, q13, s13, q2, s2, wb, ab, torch.float32, config=cfg,
                      quantize=torch_quantize_act)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-4, aligner.__name__
    km.align = align
    # per-row intermediates: the first GEMM leaves each row's amax over each N tile, and the quantization
    # reads those instead of a first pass over the row: the same scales and codes
    wb = ab = [1, -1]
    q13, s13 = quant.quantize(torch.randn(E, 2 * I, H, generator=g) / 8, wb)
    t, k = 21, 3
    x = torch.randn(t, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    ids[ids == 4] = -1
    tiles = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)
    consts = dict(K_GROUPED=False, IMPRECISE_K=imprecise_k(tiles, False), **tiles)
    sorted_pair, block_expert = align(ids, E, 16)
    xq, x_scale = torch_quantize_act(x, ab, None)
    s13_, strides, rows = _weight_scale(s13, q13, wb)
    inter, parts = _gemm13(xq, x_scale, q13, s13_, strides, rows, sorted_pair, block_expert, k, t * k, None, False,
                           consts, dict(num_warps=4, num_stages=1), amax_out=True)
    routed = (ids >= 0).reshape(-1)
    tiles_n = -(-I // 16)
    padded = torch.nn.functional.pad(inter[routed].abs(), (0, tiles_n * 16 - I))
    assert parts.shape == (t * k, tiles_n) and torch.equal(parts[routed], padded.reshape(-1, tiles_n, 16).amax(-1))
    q0, s0 = quantize_act(inter, ab, None)
    q1, s1 = quantize_act(inter, ab, None, amax_parts=parts)
    assert torch.equal(s1[routed], s0[routed])
    assert torch.equal(q1[routed].view(torch.uint8), q0[routed].view(torch.uint8))
    _, s_bad = quantize_act(inter, ab, None, amax_parts=parts * 2)  # the parts are what sets the scale
    assert torch.equal(s_bad[routed], s0[routed] * 2)
    # the kernel's quantization against fp8fx.quant: scales exact (IEEE division), every fp8 code equal (the same
    # IEEE quotient, rounded to nearest; a scale 0.5% off moves ~5% of the dynamic scales' codes: 90% let it pass)
    a = torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 37).unsqueeze(1)
    a[5] = 0  # an all-zero row: finite scale, zero codes
    a_t = a.t().contiguous().t()  # the same values with a column stride of 37
    for ab, static in [([1, -1], None), ([1, 128], None), ([1, 32], None), ([-1, -1], torch.tensor([0.5]))]:
        q, scale = quantize_act(a, ab, static)
        q_t, scale_t = quantize_act(a_t, ab, static)
        assert torch.equal(scale_t, scale) and torch.equal(q_t.view(torch.uint8), q.view(torch.uint8)), ab
        q_ref, scale_ref = torch_quantize_act(a, ab, static)
        assert torch.equal(scale, scale_ref), ab
        same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
        assert same == 1, (ab, same)
        assert torch.equal(q[5].float(), torch.zeros(300)), ab
    print("interpreter ok")
    """
)


def test_fused_moe_kernel_under_triton_interpreter():
    assert "interpreter ok" in run_under_triton_interpreter(["-c", INTERPRETER_CHECK])


DIRECT_CHECK = textwrap.dedent(
    """
    import torch
    from tests.triton_rounding import round_to_nearest
    round_to_nearest()  # the GPU's conversions: the in-kernel quantization is held to quantize_act's bits
    import fp8fx.kernels.fused_moe as km
    from fp8fx import ops, quant

    g = torch.Generator().manual_seed(0)
    E, H, I = 5, 72, 40  # ragged against every tile and K group below
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
    kept = torch.zeros(64, dtype=torch.int32)  # tickets kept across calls, as a CUDA graph's are
    km._tickets.zeroed = lambda device, count: kept[:count]
    empty = torch.empty

    def garbage(*size, **kwargs):  # what a GPU's reused memory may hold: whatever is never written must not be read
        out = empty(*size, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else 12345)

    torch.empty = garbage
    schemes = [([1, -1], [1, -1], False), ([-1, -1], [-1, -1], False), ([-1, -1], [-1, -1], True),
               ([8, 32], [1, 32], False), ([8, 32], [1, -1], False), ([1, -1], [1, 32], False)]
    forms = [(*schemes[i], name) for i in (0, 3) for name in ("gpt_oss", "ungated")]
    cases = [(*scheme, "silu") for scheme in schemes] + forms
    for wb, ab, static, name in cases:
        gated = name != "ungated"
        q13, s13 = quant.quantize(torch.randn(E, (2 if gated else 1) * I, H, generator=g) / 8, wb)
        q2, s2 = quant.quantize(torch.randn(E, H, I, generator=g) / 6, wb)
        form = {"silu": {},
                "gpt_oss": dict(w13_bias=torch.randn(E, 2 * I, generator=g).bfloat16(), interleaved=True,
                                w2_bias=torch.randn(E, H, generator=g), activation="swiglu_oai",
                                swiglu_limit=1.5),
                "ungated": dict(w13_bias=torch.randn(E, I, generator=g), activation="relu2", gated=False)}[name]
        a13, a2 = (torch.tensor([0.02]), torch.tensor([0.002])) if static else (None, None)
        for t, k, out_dtype in [(1, 2, torch.float32), (1, 3, torch.bfloat16), (3, 3, torch.float32)]:
            x = torch.randn(t, H, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
            if t == 3:  # expert-parallel sentinels: a pair routed nowhere in two tokens
                ids[1, 0], ids[2, 2] = -1, E
            w = torch.rand(t, k, generator=g)
            ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, a13, a2, **form)
            run = lambda direct, **kw: km.fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, out_dtype, a13, a2,
                                                    config=cfg, direct=direct, **form, **kw)
            aligned = run(False)
            for direct in (run(True), run(True)):  # twice: the tickets left zero by the first call
                assert torch.equal(direct, aligned), (wb, ab, static, name, t, k, (direct - aligned).abs().max())
                assert not kept.any(), kept
            # the quantization outside the kernels (torch's), as the GEMMs' tests take it
            outside = run(True, quantize=km.torch_quantize_act, fuse_quant=False)
            bound = 1e-4 if out_dtype == torch.float32 else 5e-3
            for y in (aligned, outside):
                assert ((y.float() - ref).norm() / ref.norm()).item() < bound, (wb, ab, static, name, t, k)
    # more routes, per-tensor scales (every routed pair's amax counts, no other): an int64 id of 2**32 (not expert 0
    # after a cast), a token routed nowhere, int32 ids, one expert a token, an fp16 output
    wb = ab = [-1, -1]
    q13, s13 = quant.quantize(torch.randn(E, 2 * I, H, generator=g) / 8, wb)
    q2, s2 = quant.quantize(torch.randn(E, H, I, generator=g) / 6, wb)
    six_tokens = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(6)])  # S = 24 pairs
    for ids, out_dtype in [(torch.tensor([[1, 2], [3, 2**32]]), torch.float32),
                           (torch.tensor([[1, 2], [-1, E]]), torch.float32),
                           (torch.tensor([[4, 0], [2, 3]], dtype=torch.int32), torch.float16),
                           (torch.tensor([[3], [0], [3]]), torch.float32), (six_tokens, torch.float32)]:
        x = 4 * torch.randn(ids.shape[0], H, generator=g).bfloat16()
        if ids.shape == (6, 4):  # the amax in the last token's pairs (20-23): past the second GEMM's first 16 rows
            ids[2, 1] = -1
            x[5] *= 16
        w = torch.rand(ids.shape, generator=g)
        ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32)
        aligned, direct = (km.fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, out_dtype, config=cfg, direct=d)
                           for d in (False, True))
        assert torch.equal(direct, aligned), (ids, (direct - aligned).abs().max())
        assert ((direct.float() - ref).norm() / ref.norm()).item() < (1e-4 if out_dtype == torch.float32 else 2e-3), ids
    # x with a column stride (the kernel's row amax walks H with unit stride)
    wb = ab = [1, -1]
    q13, s13 = quant.quantize(torch.randn(E, 2 * I, H, generator=g) / 8, wb)
    q2, s2 = quant.quantize(torch.randn(E, H, I, generator=g) / 6, wb)
    x = torch.randn(1, 2 * H, generator=g).bfloat16()[:, ::2]
    ids, w = torch.tensor([[3, 1]]), torch.rand(1, 2, generator=g)
    ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32)
    y = km.fused_moe(x, w, ids, q13, s13, q2, s2, wb, ab, torch.float32, config=cfg, direct=True)
    assert x.stride(1) != 1 and ((y - ref).norm() / ref.norm()).item() < 1e-4
    print("direct ok")
    """
)


def test_fused_moe_direct_under_triton_interpreter():
    """The decode path (one program per pair, every quantization and the combine inside the two GEMMs) gives the
    aligned path's output bit for bit, for every scheme and form, with pairs routed nowhere, leaving its tickets
    zero; with torch's quantization outside, the reference's within float32 rounding."""
    assert "direct ok" in run_under_triton_interpreter(["-c", DIRECT_CHECK])


def test_direct_by_default_weighs_rereads_against_launches():
    """One token always (its top-k experts are distinct); a few tokens where re-reading the experts that two tokens
    share costs less than the launches saved: fine-grained experts (Qwen3-30B-A3B's 4.7 MB a pair up to 5 tokens,
    Nemotron-3-Nano's 10 MB up to 4), GPT-OSS-20B's 25 MB up to 2, Mixtral's 176 MB (8 experts, top-2) at one token
    only."""
    pytest.importorskip("triton")
    from fp8fx.kernels.fused_moe import DIRECT_MAX_TOKENS, direct_by_default

    shapes = {"qwen3": (128, 8, 3 * 2048 * 768), "nemotron_h": (128, 6, 2 * 2688 * 1856),
              "gpt_oss": (32, 4, 3 * 2880 * 2880), "mixtral": (8, 2, 3 * 4096 * 14336)}
    want = {"qwen3": 5, "nemotron_h": 4, "gpt_oss": 2, "mixtral": 1}
    for name, (e, k, pair_bytes) in shapes.items():
        direct = [t for t in range(1, 2 * DIRECT_MAX_TOKENS) if direct_by_default(t, k, e, pair_bytes)]
        assert direct == list(range(1, want[name] + 1)), (name, direct)
    assert direct_by_default(3, 2, 8, 1024) and not direct_by_default(DIRECT_MAX_TOKENS + 1, 2, 8, 1024)


def test_fused_moe_config_rows_must_agree():
    pytest.importorskip("triton")
    from fp8fx import quant
    from fp8fx.kernels.fused_moe import fused_moe

    q13, s13 = quant.quantize(torch.randn(2, 16, 32), [1, -1])
    q2, s2 = quant.quantize(torch.randn(2, 32, 8), [1, -1])
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1, gemm2=dict(BLOCK_M=32))
    with pytest.raises(ValueError, match="BLOCK_M 16 and gemm2 BLOCK_M 32"):
        fused_moe(torch.randn(3, 32), torch.rand(3, 1), torch.zeros(3, 1, dtype=torch.long), q13, s13, q2, s2,
                  [1, -1], [1, -1], torch.float32, config=cfg)


def test_fused_moe_config_keys_and_values_are_checked():
    """A config key the GEMMs do not read (a typo) was dropped by Triton's launch unsaid, a missing tile failed as a
    KeyError, a tile that is not a power of 2 of 16 or more deep in Triton: refused before any launch, naming the
    key, its value and what it takes."""
    pytest.importorskip("triton")
    from fp8fx import quant
    from fp8fx.kernels.fused_moe import fused_moe

    q13, s13 = quant.quantize(torch.randn(2, 16, 32), [1, -1])
    q2, s2 = quant.quantize(torch.randn(2, 32, 8), [1, -1])
    args = (torch.randn(3, 32), torch.rand(3, 1), torch.zeros(3, 1, dtype=torch.long), q13, s13, q2, s2, [1, -1],
            [1, -1], torch.float32)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
    for bad, match in [
        (dict(cfg, num_stage=2), r"fused_moe config: keys \['num_stage'\] are not the GEMMs' tile keys; it takes "
                                 r"\['BLOCK_M', .*'gemm2'\] \(fp8fx.kernels.fused_moe.tile_config gives"),
        (dict(cfg, gemm2=dict(BLOCK_N=32, SPLIT_K=2)), r"fused_moe config gemm2: keys \['SPLIT_K'\] are not"),
        (dict(cfg, gemm2=[("BLOCK_N", 32)]), r"gemm2=\[\('BLOCK_N', 32\)\]; it takes a dict"),
        # (not iterable: the PDL keys' check before it read gemm2's keys, a bare TypeError)
        (dict(cfg, gemm2=None), r"gemm2=None; it takes a dict"),
        (dict(cfg, gemm2=256), r"gemm2=256; it takes a dict"),
        (dict(cfg, BLOCK_N=24), r"fused_moe config: BLOCK_N=24; it takes an int, a power of 2 of at least 16"),
        (dict(cfg, BLOCK_K=8), r"fused_moe config: BLOCK_K=8; it takes an int, a power of 2 of at least 32"),
        # (the fp8 dot's K tile: BLOCK_K=16 ran in the interpreter and failed to compile for sm_90)
        (dict(cfg, gemm2=dict(BLOCK_K=16)), r"fused_moe config gemm2: BLOCK_K=16; it takes an int, a power of 2 of "
                                            r"at least 32"),
        (dict(cfg, gemm2=dict(BLOCK_N=64.0)), r"fused_moe config gemm2: BLOCK_N=64.0 is a float; it takes an int, a "
                                              r"power of 2"),
        (dict(cfg, BLOCK_M=np.int64(16)), re.escape(f"BLOCK_M={np.int64(16)!r} is a int64; it takes an int")),
        (dict(cfg, num_warps=6), r"num_warps=6; it takes an int, a power of 2 of at least 1"),
        (dict(cfg, num_stages=0), r"num_stages=0; it takes an int of at least 1"),
        (dict(num_warps=4), r"fused_moe config \{'num_warps': 4\} has no \['BLOCK_M', 'BLOCK_N', 'BLOCK_K'\]; both "
                            r"GEMMs need"),
    ]:
        with pytest.raises(ValueError, match=match):
            fused_moe(*args, config=bad)


def test_fused_moe_pdl_needs_the_direct_path_on_sm90(monkeypatch):
    """``pdl=True`` (the direct GEMMs as programmatic dependents) off a Hopper GPU or on the aligned path, a
    ``DIRECT_PDL_TRIGGER`` outside None / 1 / 2, a config that sets the launch's PDL keys itself (a ``launch_pdl``
    without the programs' wait would race): each an error that names the value and the fix, before any launch."""
    pytest.importorskip("triton")
    from fp8fx import quant
    from fp8fx.kernels import fused_moe as kernel

    q13, s13 = quant.quantize(torch.randn(2, 16, 32), [1, -1])
    q2, s2 = quant.quantize(torch.randn(2, 32, 8), [1, -1])
    args = (torch.randn(3, 32), torch.rand(3, 1), torch.zeros(3, 1, dtype=torch.long), q13, s13, q2, s2, [1, -1],
            [1, -1], torch.float32)
    for direct in (True, False, None):
        with pytest.raises(ValueError, match=r"compute capability 9\.0 or newer; x is on cpu: pass pdl=None or False"):
            kernel.fused_moe(*args, direct=direct, pdl=True)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
    for bad in (dict(cfg, launch_pdl=True), dict(cfg, gemm2=dict(PDL_WAIT=True)), dict(cfg, PDL_TRIGGER=2)):
        with pytest.raises(ValueError, match=r"fused_moe config: \['(launch_pdl|PDL_WAIT|PDL_TRIGGER)'\] are "
                                             r"fused_moe's to set .*drop them from the config"):
            kernel.fused_moe(*args, config=bad, direct=True)
    monkeypatch.setattr(kernel, "_hopper", lambda t, exactly=False: True)  # as on an H200, up to the launches
    with pytest.raises(ValueError, match=r"takes the aligned path \(direct=False, a config given\): pass direct=True"):
        kernel.fused_moe(*args, config=cfg, pdl=True)
    monkeypatch.setattr(kernel, "DIRECT_PDL_TRIGGER", 3)
    with pytest.raises(ValueError, match=r"DIRECT_PDL_TRIGGER=3; it takes None, 1 .* or 2"):
        kernel.fused_moe(*args, direct=True)


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 3, 257])
@pytest.mark.parametrize("scheme", ["per-channel", "per-tensor", "static", "block"])
@pytest.mark.parametrize("routing", ["random", "one expert", "idle experts"])
def test_fused_moe_kernel_cuda(t, scheme, routing):
    """The Triton kernel against the reference on the GPU, every tile configuration (decode and prefill).

    Not a tight bound against the reference: on wgmma tiles (BLOCK_M >= 64) the tensor cores add fp8
    products with ~1e-4 relative error even inside one K step (promotion to fp32 only bounds how it
    grows along K; test_fused_moe_first_gemm_precision_cuda pins that), and requantizing the
    intermediate turns such differences into whole fp8 steps for the values near a rounding boundary:
    0.2-1.8% off the reference on the H200 (2026-11-29), where mma.sync tiles (BLOCK_M = 16) stay
    under 1e-3. What is asserted is that the kernel is as accurate as the reference against the
    unquantized float64 experts, and close to it; a wrong scale or row breaks both."""
    from fp8fx.kernels.fused_moe import fused_moe, tile_config

    w_block, act_block, static = SCHEMES[scheme]
    q13, s13, q2, s2, w13, w2 = experts(w_block)
    idle = torch.randint(0, 2, (t, K), generator=torch.Generator().manual_seed(t))
    ids = {"random": None, "one expert": torch.full((t, K), 5), "idle experts": idle}[routing]
    x, w, ids = routed(t, ids=ids)
    _, (a13, a2) = run(x, w, ids, q13, s13, q2, s2, scheme, w13)
    ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, w_block, act_block, torch.float32, a13, a2)
    truth = exact(x, w, ids, w13, w2)
    ref_err = rel_err(ref, truth)
    cuda = [v.cuda() if isinstance(v, torch.Tensor) else v for v in (x, w, ids, q13, s13, q2, s2)]
    scales = [None if v is None else v.cuda() for v in (a13, a2)]
    for ppe in (1, 32, 1024):
        for fast in (False, True):
            cfg = tile_config(ppe, 2 * I, H, k_grouped=w_block[1] != -1 or act_block[1] != -1)
            y = fused_moe(*cuda, w_block, act_block, torch.float32, *scales, config=cfg, fast_accum=fast).cpu()
            assert rel_err(y, truth) < 1.1 * ref_err + 2e-3, (ppe, fast, rel_err(y, truth), ref_err)
            assert rel_err(y, ref) < 3e-2, (ppe, fast, rel_err(y, ref))
            if ppe == 1:  # mma.sync tiles: float32 accumulation, only rare rounding flips
                assert rel_err(y, ref) < 1e-3, (ppe, fast, rel_err(y, ref))
    y = torch.ops.fp8fx.fused_moe(*cuda, w_block, act_block, torch.bfloat16, *scales)  # the op's CUDA impl
    # its tiles as above (up to 1.8% off the reference, with a bf16 output: 0.0101 once, the ids then unseeded)
    assert rel_err(y.cpu(), ref) < 3e-2 and rel_err(y.cpu(), truth) < 1.1 * ref_err + 5e-3


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 3, 257])
@pytest.mark.parametrize("scheme", ["per-channel", "per-tensor", "block"])
@pytest.mark.parametrize("activation", ["swiglu_oai", "silu_clamped", "gelu_tanh"])
def test_fused_moe_kernel_gpt_oss_cuda(t, scheme, activation):
    """GPT-OSS's form (biases, interleaved rows, clamped SwiGLU) on the GPU, every tile configuration, bounded as
    test_fused_moe_kernel_cuda bounds the SiLU experts."""
    from fp8fx.kernels.fused_moe import fused_moe, tile_config

    w_block, act_block, _ = SCHEMES[scheme]
    q13, s13, q2, s2, w13, w2 = experts(w_block)
    x, w, ids = routed(t)
    form = {**gpt_oss_form(), "activation": activation}
    ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, w_block, act_block, torch.float32, **form)
    truth = exact_gpt_oss(x, w, ids, w13, w2, form)
    ref_err = rel_err(ref, truth)
    cuda = [v.cuda() for v in (x, w, ids, q13, s13, q2, s2)]
    cform = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in form.items()}
    for ppe in (1, 32, 1024):
        cfg = tile_config(ppe, 2 * I, H, k_grouped=w_block[1] != -1 or act_block[1] != -1)
        y = fused_moe(*cuda, w_block, act_block, torch.float32, config=cfg, **cform).cpu()
        assert rel_err(y, truth) < 1.1 * ref_err + 2e-3, (ppe, rel_err(y, truth), ref_err)
        assert rel_err(y, ref) < 3e-2, (ppe, rel_err(y, ref))
    y = torch.ops.fp8fx.fused_moe(*cuda, w_block, act_block, torch.bfloat16, None, None, False, *cform.values())
    assert rel_err(y.cpu(), ref) < 3e-2 and rel_err(y.cpu(), truth) < 1.1 * ref_err + 5e-3


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 3, 257])
@pytest.mark.parametrize("scheme", ["per-channel", "per-tensor", "static", "block"])
@pytest.mark.parametrize("activation", ["relu2", "gelu"])
def test_fused_moe_kernel_ungated_cuda(t, scheme, activation):
    """Ungated experts (Nemotron-H's) on the GPU, every tile configuration, with up's bias, bounded as the SiLU
    experts' test bounds them."""
    from fp8fx.kernels.fused_moe import fused_moe, tile_config

    w_block, act_block, static = SCHEMES[scheme]
    q13, s13, q2, s2, up, w2, b13 = ungated_experts(w_block)
    x, w, ids = routed(t)
    form = dict(w13_bias=b13, activation=activation, gated=False)
    a13 = a2 = None
    if static:
        hidden = UNARY[activation](x.double() @ up.double().transpose(1, 2) + b13.double().unsqueeze(1))
        a13, a2 = (torch.tensor([float(v.abs().max()) / 448]) for v in (x, hidden))
    ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, w_block, act_block, torch.float32, a13, a2, **form)
    truth = exact_ungated(x, w, ids, up, w2, activation, b13)
    ref_err = rel_err(ref, truth)
    cuda = [v.cuda() for v in (x, w, ids, q13, s13, q2, s2)]
    statics = [None if v is None else v.cuda() for v in (a13, a2)]
    cform = {**form, "w13_bias": b13.cuda()}
    for ppe in (1, 32, 1024):
        cfg = tile_config(ppe, I, H, k_grouped=w_block[1] != -1 or act_block[1] != -1)
        y = fused_moe(*cuda, w_block, act_block, torch.float32, *statics, config=cfg, **cform).cpu()
        assert rel_err(y, truth) < 1.1 * ref_err + 2e-3, (ppe, rel_err(y, truth), ref_err)
        assert rel_err(y, ref) < 3e-2, (ppe, rel_err(y, ref))
    y = torch.ops.fp8fx.fused_moe(*cuda, w_block, act_block, torch.bfloat16, *statics, False, cform["w13_bias"], None,
                                  False, activation, 1.702, 7.0, False)
    assert rel_err(y.cpu(), ref) < 3e-2 and rel_err(y.cpu(), truth) < 1.1 * ref_err + 5e-3


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["per-channel", "per-tensor", "static", "block"])
@pytest.mark.parametrize("form", ["silu", "gpt_oss", "ungated"])
def test_fused_moe_direct_cuda(scheme, form):
    """The decode path on the GPU (one program per pair; x and the intermediate quantized in the GEMMs; the combine
    in the second GEMM): bit for bit the aligned path's output at 1 and 3 tokens, pairs routed nowhere among them,
    bf16 and float32 outputs. Captured into a CUDA graph (kept tickets, never zeroed by the graph) and replayed with
    new tokens and routes: each replay bit for bit the eager call's."""
    from fp8fx.kernels.fused_moe import fused_moe

    w_block, act_block, static = SCHEMES[scheme]
    g = torch.Generator().manual_seed(7)
    rows = I if form == "ungated" else 2 * I
    q13, s13 = quant.quantize(torch.randn(E, rows, H, generator=g) / H**0.5, w_block)
    q2, s2 = quant.quantize(torch.randn(E, H, I, generator=g) / I**0.5, w_block)
    extra = {"silu": {}, "gpt_oss": dict(w13_bias=torch.randn(E, 2 * I, generator=g).bfloat16(), interleaved=True,
                                         w2_bias=torch.randn(E, H, generator=g), activation="swiglu_oai"),
             "ungated": dict(w13_bias=torch.randn(E, I, generator=g), activation="relu2", gated=False)}[form]
    extra = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in extra.items()}
    scales = (torch.tensor([0.01]).cuda(), torch.tensor([0.004]).cuda()) if static else (None, None)
    weights = [v.cuda() for v in (q13, s13, q2, s2)]

    def call(x, w, ids, out_dtype, direct=None):
        return fused_moe(x, w, ids, *weights, w_block, act_block, out_dtype, *scales, fast_accum=True, direct=direct,
                         **extra)

    for t in (1, 3):
        x, w, ids = routed(t, seed=t)
        if t == 3:
            ids[1, 0], ids[2, 1] = -1, E  # expert-parallel sentinels
        x, w, ids = x.cuda(), w.cuda(), ids.cuda()
        for out_dtype in (torch.bfloat16, torch.float32):
            direct, aligned = call(x, w, ids, out_dtype, True), call(x, w, ids, out_dtype, False)
            assert torch.equal(direct, aligned), (t, out_dtype, (direct.float() - aligned.float()).abs().max())
        ref = ops.fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), q13, s13, q2, s2, w_block, act_block,
                                      torch.float32, *(None if v is None else v.cpu() for v in scales),
                                      **{n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in extra.items()})
        assert rel_err(direct.cpu(), ref) < 1e-3, rel_err(direct.cpu(), ref)
    x, w, ids = (v.cuda() for v in routed(1, seed=11))
    call(x, w, ids, torch.bfloat16)  # outside capture: the ticket reserve is topped up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call(x, w, ids, torch.bfloat16)
    for seed in (12, 13, 14):
        new = routed(1, seed=seed)
        for into, value in zip((x, w, ids), new):
            into.copy_(value)
        graph.replay()
        assert torch.equal(y, call(x, w, ids, torch.bfloat16)), seed


@pytest.mark.cuda
@pytest.mark.parametrize("trigger", [None, 1, 2])
def test_fused_moe_direct_combine_under_load_cuda(trigger, monkeypatch):
    """Many direct launches of many programs (forced up to 64 tokens, top-8 of 128 experts, pairs routed nowhere, bf16
    and float32 outputs) and 50 CUDA-graph replays with new tokens and routes: each bit for bit the aligned path's.
    The interpreter runs one program after another: only here can a missing barrier before the ticket, a read of
    another pair's row from a stale L1 or a ticket left nonzero for the next launch show. The GEMMs launched plainly
    (``DIRECT_PDL_TRIGGER`` None) and, on sm_90, as programmatic dependents with each trigger: a read before a
    program's wait would race with the kernel before it."""
    from fp8fx.kernels import fused_moe as kernel
    from fp8fx.kernels.fused_moe import fused_moe

    monkeypatch.setattr(kernel, "DIRECT_PDL_TRIGGER", trigger)
    if trigger is not None and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the direct path launches as programmatic dependents by default on sm_90 only")

    e, k, h, i = 128, 8, 1024, 256
    g = torch.Generator().manual_seed(3)
    q13, s13 = quant.quantize(torch.randn(e, 2 * i, h, generator=g) / h**0.5, [1, -1])
    q2, s2 = quant.quantize(torch.randn(e, h, i, generator=g) / i**0.5, [1, -1])
    weights = [v.cuda() for v in (q13, s13, q2, s2)]
    cuda = torch.Generator(device="cuda").manual_seed(4)

    def inputs(t):
        ids = torch.rand(t, e, device="cuda", generator=cuda).topk(k).indices
        ids[torch.rand(t, k, device="cuda", generator=cuda) < 0.05] = -1
        return (torch.randn(t, h, device="cuda", generator=cuda).bfloat16(),
                torch.rand(t, k, device="cuda", generator=cuda), ids)

    def call(x, w, ids, out_dtype, direct):
        return fused_moe(x, w, ids, *weights, [1, -1], [1, -1], out_dtype, fast_accum=True, direct=direct)

    for n, t in enumerate([1, 3, 8, 16, 64] * 8):
        x, w, ids = inputs(t)
        out_dtype = torch.bfloat16 if n % 2 else torch.float32
        assert torch.equal(call(x, w, ids, out_dtype, True), call(x, w, ids, out_dtype, False)), (n, t)
    x, w, ids = inputs(16)
    call(x, w, ids, torch.bfloat16, True)  # outside capture: the ticket reserve is topped up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call(x, w, ids, torch.bfloat16, True)
    for n in range(50):
        for into, value in zip((x, w, ids), inputs(16)):
            into.copy_(value)
        graph.replay()
        assert torch.equal(y, call(x, w, ids, torch.bfloat16, False)), n


@pytest.mark.cuda
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("activation,gated", [("relu2", False), ("gelu", False), ("silu", False),
                                              ("swiglu_oai", True), ("silu_clamped", True)])
def test_fused_moe_nan_stays_nan_cuda(activation, gated, direct):
    """A token whose hidden state holds a NaN gets a NaN output, as the reference gives: the GPU's max of NaN and 0 is
    0, so a squared ReLU by tl.maximum turned it into a finite output, and its min of NaN and the limit is the limit,
    so GPT-OSS's and DeepSeek-V4's clamps did. The other tokens stay finite. Both paths: the direct one quantizes x
    in its first GEMM, the aligned one before."""
    from fp8fx.kernels.fused_moe import fused_moe

    q13, s13, q2, s2, *_ = (experts if gated else ungated_experts)([1, -1])
    x, w, ids = routed(5)
    x[2, 7] = float("nan")
    form = dict(w13_bias=None, w2_bias=None, interleaved=False, activation=activation, swiglu_alpha=1.702,
                swiglu_limit=7.0, gated=gated)
    ref = ops.fused_moe_reference(x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.float32, **form)
    y = fused_moe(*(v.cuda() for v in (x, w, ids, q13, s13, q2, s2)), [1, -1], [1, -1], torch.float32, direct=direct,
                  **form).cpu()
    assert torch.isnan(ref[2]).all() and torch.isnan(y[2]).all()
    rows = [0, 1, 3, 4]
    assert torch.isfinite(y[rows]).all() and rel_err(y[rows], ref[rows]) < 3e-2


@pytest.mark.cuda
def test_fused_moe_cuda_addresses_past_2_31():
    """S * H = (40000 tokens x top-8) x 7168 > 2**31 elements in the [S, H] combine buffer: the pairs past
    that point are only right with 64-bit row bases (x itself, 40000 x 7168, stays under 2**31)."""
    from fp8fx.kernels.fused_moe import fused_moe

    e, h, i, t, k = 8, 7168, 128, 40_000, 8
    g = torch.Generator().manual_seed(5)
    q13, s13 = quant.quantize(torch.randn(e, 2 * i, h, generator=g) / h**0.5, [1, -1])
    q2, s2 = quant.quantize(torch.randn(e, h, i, generator=g) / i**0.5, [1, -1])
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k]
    w = torch.softmax(torch.randn(t, k, device="cuda"), dim=-1)
    y = fused_moe(x, w, ids, q13.cuda(), s13.cuda(), q2.cuda(), s2.cuda(), [1, -1], [1, -1], torch.float32)
    tokens = torch.tensor([0, 1, t // 2, t - 2, t - 1])
    ref = ops.fused_moe_reference(x[tokens].cpu(), w[tokens].cpu(), ids[tokens].cpu(), q13, s13, q2, s2,
                                  [1, -1], [1, -1], torch.float32)
    assert rel_err(y[tokens].cpu(), ref) < 3e-2  # as test_fused_moe_kernel_cuda: requantization flips


@pytest.mark.cuda
def test_fused_moe_first_gemm_precision_cuda():
    """The first GEMM (SiLU(x W1) * x W3, float32, not requantized) against float64 on its fp8 operands,
    K = 4096: with fp32 promotion every K step the error stays that of the tensor cores' additions inside
    a step (mma.sync tiles: float32 throughout); fast accumulation is only bounded loosely here
    (test_fused_moe_kernels_compile_for_sm90 checks that the promotion is compiled in)."""
    from fp8fx.kernels.fused_moe import _gemm13, _weight_scale, align, imprecise_k, quantize_act, tile_config

    e, h, i, t, k = 4, 4096, 256, 257, 2
    g = torch.Generator().manual_seed(3)
    q13, s13 = quant.quantize(torch.randn(e, 2 * i, h, generator=g) / h**0.5, [1, -1])
    x = torch.randn(t, h, generator=g).cuda()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
    xq, xs = quantize_act(x, [1, -1], None)
    xd = quant.dequantize(xq.cpu(), xs.cpu(), [1, -1], torch.float64)
    wd = quant.dequantize(q13, s13, [1, -1], torch.float64)  # [E, 2I, H]
    gate, up = torch.einsum("th,eoh->teo", xd, wd).chunk(2, dim=-1)  # [T, E, I]
    pair_e = ids.cpu().reshape(-1)
    ref = (F.silu(gate) * up)[torch.arange(t).repeat_interleave(k), pair_e]  # [T*K, I]
    s13_, strides, rows = _weight_scale(s13.cuda(), q13, [1, -1])
    errs = {}
    for ppe in (1, 1024):
        for fast in (False, True):
            cfg = tile_config(ppe, 2 * i, h)
            cfg.pop("gemm2", None)  # the first GEMM only
            tiles = {n: cfg.pop(n) for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
            consts = dict(K_GROUPED=False, IMPRECISE_K=imprecise_k(tiles, fast), **tiles)
            sorted_pair, block_expert = align(ids, e, tiles["BLOCK_M"])
            inter = _gemm13(xq, xs, q13.cuda(), s13_, strides, rows, sorted_pair, block_expert, k, t * k, None,
                            False, consts, cfg)
            errs[ppe, fast] = rel_err(inter.cpu(), ref)
    assert errs[1, False] < 1e-5 and errs[1024, False] < 1e-3 and errs[1024, True] < 2e-2, errs


def test_kernel_scheme_boundaries():
    """What the Triton kernel takes; the op's CUDA impl gives the rest (and GPUs older than sm_89) the reference."""
    pytest.importorskip("triton")
    from fp8fx.kernels.fused_moe import supports

    assert supports([1, -1], [1, -1]) and supports([-1, -1], [-1, -1]) and supports([128, 128], [1, 128])
    assert supports([1, -1], [1, 64]) and supports([64, 32], [1, -1])
    assert not supports([128, 256], [1, 256])  # BLOCK_N = BLOCK_K = 256 spills; 512 exceeds shared memory
    assert not supports([128, 128], [1, 64])  # K groups of the two operands differ
    assert not supports([16, 16], [1, 16])  # under the fp8 dot's K minimum on sm_90
    assert not supports([-1, 128], [1, 128])  # whole-column K groups
    assert not supports([128, 128], [1, 128], (8, 2 * 96, 256))  # 128-row blocks straddle gate and up (I=96)


@pytest.mark.cuda
@pytest.mark.parametrize("act_block", [[1, -1], [1, 128], [-1, -1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_act_cuda_is_bit_exact(act_block, dtype):
    """The kernel's quantization (one pass) gives fp8fx.quant's codes and scales exactly on the GPU."""
    from fp8fx.kernels.fused_moe import quantize_act, torch_quantize_act

    g = torch.Generator().manual_seed(0)
    a = (torch.randn(257, 14336, generator=g) * torch.logspace(-4, 4, 257).unsqueeze(1)).to(dtype).cuda()
    a[3] = 0
    a[7, 1000] = float("nan")  # torch's amax keeps NaN: that row's (or group's) scale is NaN
    for static in (None, torch.tensor([0.37]).cuda()):
        if static is not None and act_block != [-1, -1]:
            continue
        q, scale = quantize_act(a, act_block, static)
        q_ref, scale_ref = torch_quantize_act(a, act_block, static)
        torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0, equal_nan=True)


def compile_for_hopper(kernel, pointers: dict, ints: list, consts: dict, cfg: dict):
    """Ahead-of-time compile for sm_90 without a GPU, as the JIT would specialize it (see
    tests/kernels/test_compile_sm90.py): pointers and leading strides divisible by 16."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**pointers, **{n: "fp32" if n in ("alpha", "limit") else "i32" for n in ints},
                 **{n: "constexpr" for n in consts}}
    names = list(signature)
    aligned = list(pointers) + [n for n in ("stride_am", "stride_we", "stride_wn", "stride_wse", "stride_xm",
                                            "stride_qm") if n in ints]
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})


@pytest.mark.parametrize("pairs_per_expert,i,h,grouped,gpt_oss", [  # every tile configuration; Qwen3-30B-A3B,
    (1, 768, 2048, False, False), (32, 14336, 4096, False, False),  # Mixtral-8x7B
    (1024, 768, 2048, False, False), (1024, 14336, 4096, False, False),
    (1, 768, 2048, True, False), (1024, 14336, 4096, True, False),  # 128x128 blocks, 1x128 activation groups
    (1, 2880, 2880, False, True), (1024, 2880, 2880, True, True),  # GPT-OSS: biases, interleaved rows, its SwiGLU
    (32, 704, 2816, False, "gelu"),  # Gemma-4's GELU (tanh)
    (1, 1856, 2688, False, "ungated"), (1024, 1856, 2688, True, "ungated"),  # Nemotron-H's squared ReLU, one up tile
])
def test_fused_moe_kernels_compile_for_sm90(pairs_per_expert, i, h, grouped, gpt_oss):
    """What the interpreter does not check (Triton's front-end rules, the NVIDIA back end, shared memory)."""
    pytest.importorskip("triton")
    from fp8fx import quant
    from fp8fx.kernels.fused_moe import imprecise_k, moe_gemm13_kernel, tile_config

    cfg = tile_config(pairs_per_expert, 2 * i, h, k_grouped=grouped)
    gemm2 = cfg.pop("gemm2", {})
    cfg2 = {**cfg, **gemm2}  # the second GEMM's own tiles
    if grouped:
        cfg["BLOCK_K"] = cfg2["BLOCK_K"] = 128
    # constexprs in the kernels' parameter order
    if grouped:
        cfg["BLOCK_N"] = 128  # the activation groups: the first GEMM quantizes its own output
    schemes = {"K_GROUPED": grouped, "W_BLOCK_N": 128 if grouped else 1, "IMPRECISE_K": imprecise_k(cfg, False)}
    form = {"ROW_STEP": 2 if gpt_oss is True else 1, "HAS_BIAS": gpt_oss is True,
            "ACT": {False: 0, True: 1, "gelu": 3, "ungated": 5}[gpt_oss], "GATED": gpt_oss != "ungated"}
    tiles = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    tiles2 = {k: cfg2[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    quant_out = {"QUANT_OUT": grouped, "AMAX_OUT": not grouped, "EPS": quant.AMAX_EPS, "FP8_MAX": quant.FP8_MAX}
    ptr = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv"}
    routing = {"sorted_pair_ptr": "*i32", "block_expert_ptr": "*i32"}
    strides = ["stride_am", "stride_ak", "stride_we", "stride_wn", "stride_wk"]
    scale_strides = ["stride_asm", "stride_ask", "stride_wse", "stride_wsn", "stride_wsk"]

    def gemm13(schemes, inter="*fp8e4nv" if grouped else "*fp32"):
        return compile_for_hopper(
            moe_gemm13_kernel, {**ptr, "inter_ptr": inter, "a_scale_ptr": "*fp32",
                                "w_scale_ptr": "*fp32", **routing, "inter_scale_ptr": "*fp32", "bias_ptr": "*bf16"},
            ["S", "N", "K", "UP_SHIFT", "E", "alpha", "limit", *strides, "stride_im", "stride_in", *scale_strides,
             "stride_ism", "stride_isg", "stride_be", "stride_bn"],
            {"K_TOP": 8, **schemes, **form, **quant_out, **tiles, "DIRECT": False, "X_QUANT": 0, "ROW_BLOCK": 1024,
             "PDL_WAIT": False, "PDL_TRIGGER": 0}, cfg)

    k13 = gemm13(schemes)
    if not grouped and tiles["BLOCK_M"] >= 64:  # wgmma tiles: promotion per K step shows as fp32 adds
        fast = gemm13({**schemes, "IMPRECISE_K": imprecise_k(cfg, True)})
        assert "wgmma" in k13.asm["ptx"]
        assert k13.asm["ptx"].count("add.f32") > fast.asm["ptx"].count("add.f32")
    k2 = compile_gemm2(ptr, routing, {**schemes, "HAS_BIAS": gpt_oss is True, **tiles2}, cfg2)
    kernels = [k13, k2]
    if grouped:  # 128x128 weight blocks with per-token activations: the float32 intermediate and its row maxima
        quant_out.update(QUANT_OUT=False, AMAX_OUT=True)
        kernels.append(gemm13(schemes, "*fp32"))
    for kernel in kernels:
        assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    if gpt_oss is True:  # its clamps keep a NaN (min.NaN / max.NaN): PTX's min.f32 of NaN and the limit is the limit
        assert not re.search(r"\b(min|max)\.f32\b", k13.asm["ptx"])


def compile_gemm2(ptr: dict, routing: dict, consts: dict, cfg: dict, direct: tuple = (False, 1, 0), pdl: bool = False):
    """moe_gemm2_kernel for sm_90; ``direct``: (DIRECT, K_TOP, A_QUANT); ``pdl``: its PDL_WAIT."""
    from fp8fx import quant
    from fp8fx.kernels.fused_moe import moe_gemm2_kernel

    strides = ["stride_am", "stride_ak", "stride_we", "stride_wn", "stride_wk", "stride_ym", "stride_yn",
               "stride_asm", "stride_ask", "stride_wse", "stride_wsn", "stride_wsk", "stride_be", "stride_bn",
               "stride_om"]
    return compile_for_hopper(
        moe_gemm2_kernel, {**ptr, "y_ptr": "*bf16", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
                           "topk_weights_ptr": "*fp32", **routing, "bias_ptr": "*bf16", "out_ptr": "*bf16",
                           "tickets_ptr": "*i32"},
        ["S", "N", "K", "E", *strides],
        {**consts, "DIRECT": direct[0], "K_TOP": direct[1], "A_QUANT": direct[2], "N_PARTS": 29, "PARTS_BLOCK": 32,
         "EPS": quant.AMAX_EPS, "FP8_MAX": quant.FP8_MAX, "PDL_WAIT": pdl}, cfg)


@pytest.mark.parametrize("i,h,x_quant,a_quant,form,trigger", [  # one token: every in-kernel quantization, each
    # form; as programmatic dependents (the first GEMM's PDL_TRIGGER, 0: launched plainly)
    (768, 2048, 1, 1, "silu", 2), (768, 2048, 2, 2, "silu", 1), (768, 2048, 3, 3, "silu", 2),  # Qwen3-30B-A3B
    (768, 2048, 0, 0, "silu", 2), (2048, 7168, 0, 0, "silu", 0),  # 1x128 groups (DeepSeek-V3's shape): x fp8 already
    (2880, 2880, 1, 1, "gpt_oss", 2), (1856, 2688, 1, 1, "ungated", 0), (1856, 2688, 0, 0, "ungated", 1),
])
def test_direct_moe_kernels_compile_for_sm90(i, h, x_quant, a_quant, form, trigger):
    """The decode path (``DIRECT``): bf16 x quantized in the first GEMM's loads, the intermediate in the second's
    (1 x 128 groups: x quantized before, the intermediate in the first's epilogue), the combine's ticket in the
    second. As programmatic dependents: each program waits before its first access to memory, and the first GEMM
    lets the second launch right after its wait (1) or after its last dot (2)."""
    pytest.importorskip("triton")
    from fp8fx import quant
    from fp8fx.kernels.fused_moe import imprecise_k, moe_gemm13_kernel, tile_config

    grouped = x_quant == 0
    cfg = tile_config(1, 2 * i, h, k_grouped=grouped)
    cfg2 = {**cfg, **cfg.pop("gemm2", {})}
    if grouped:
        cfg["BLOCK_K"] = cfg2["BLOCK_K"] = cfg["BLOCK_N"] = 128
    tiles = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    tiles2 = {k: cfg2[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    schemes = {"K_GROUPED": grouped, "W_BLOCK_N": 128 if grouped else 1, "IMPRECISE_K": imprecise_k(cfg, False)}
    routing = {"sorted_pair_ptr": "*i64", "block_expert_ptr": "*i64"}  # both the ids
    k13 = compile_for_hopper(
        moe_gemm13_kernel, {"a_ptr": "*fp8e4nv" if grouped else "*bf16", "w_ptr": "*fp8e4nv",
                            "inter_ptr": "*fp8e4nv" if grouped else "*fp32",
                            "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", **routing, "inter_scale_ptr": "*fp32",
                            "bias_ptr": "*bf16"},
        ["S", "N", "K", "UP_SHIFT", "E", "alpha", "limit", "stride_am", "stride_ak", "stride_we", "stride_wn",
         "stride_wk", "stride_im", "stride_in", "stride_asm", "stride_ask", "stride_wse", "stride_wsn", "stride_wsk",
         "stride_ism", "stride_isg", "stride_be", "stride_bn"],
        {"K_TOP": 8, **schemes, "ROW_STEP": 2 if form == "gpt_oss" else 1, "HAS_BIAS": form == "gpt_oss",
         "ACT": {"silu": 0, "gpt_oss": 1, "ungated": 5}[form], "GATED": form != "ungated", "QUANT_OUT": grouped,
         "AMAX_OUT": a_quant in (1, 2), "EPS": quant.AMAX_EPS, "FP8_MAX": quant.FP8_MAX, **tiles, "DIRECT": True,
         "X_QUANT": x_quant, "ROW_BLOCK": min(4096, 1 << (h - 1).bit_length()), "PDL_WAIT": trigger > 0,
         "PDL_TRIGGER": trigger}, cfg)
    inter = "*fp8e4nv" if grouped else "*fp32"
    k2 = compile_gemm2({"a_ptr": inter, "w_ptr": "*fp8e4nv"}, routing,
                       {**schemes, "HAS_BIAS": form == "gpt_oss", **tiles2}, cfg2, direct=(True, 8, a_quant),
                       pdl=trigger > 0)
    for ptx in (k13.asm["ptx"], k2.asm["ptx"]):
        wait = ptx.find("griddepcontrol.wait")
        assert (wait >= 0) == (trigger > 0)
        if wait >= 0:  # nothing read or written before the wait (copies to shared memory and reductions too)
            first = [i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.global", "red.global",
                                                         "cp.async")) if i >= 0]
            assert wait < min(first), (wait, first)
    ptx13 = k13.asm["ptx"]
    assert "launch_dependents" not in k2.asm["ptx"] and ptx13.count("griddepcontrol.launch_dependents") == (trigger > 0)
    if trigger:  # 1: before the first dot; 2: after the last, and past the K loop (after every backward branch)
        mma = [m.start() for m in re.finditer(r"\b(wgmma|mma)\.", ptx13)]
        launch = ptx13.index("griddepcontrol.launch_dependents")
        labels = {m.group(1): m.start() for m in re.finditer(r"^(\$L__\w+):", ptx13, re.M)}
        back = [m.start() for m in re.finditer(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ptx13)
                if labels.get(m.group(1), -1) < m.start()]
        assert back, "no K loop found in the PTX"
        if trigger == 1:
            assert launch < mma[0], (launch, mma[0])
        else:
            assert launch > max(mma[-1], max(back)), (launch, mma[-1], max(back))
    for kernel in (k13, k2):
        assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    assert "cvt.rn.satfinite.e4m3x2.f32" in k13.asm["ptx"] and "div.rn.f32" in k13.asm["ptx"]  # as fp8fx.quant
    # the division on the pair's row alone: BLOCK_K / 128 threads per K step, not the 16-row tile's 16x that
    per_step = cfg["BLOCK_K"] // (32 * cfg["num_warps"])
    if x_quant in (1, 2):
        divisions = k13.asm["ptx"].count("div.rn.f32")
        assert divisions <= per_step * cfg["num_stages"] + 2, divisions
    assert ("cvt.rn.satfinite.e4m3x2.f32" in k2.asm["ptx"]) == (a_quant > 0)
    ptx2 = k2.asm["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx2 and "atom.global.gpu.acq_rel.exch" in ptx2  # the ticket, its reset
    # what the interpreter (programs one after another) cannot check: the pair's row stored, then a barrier of the
    # whole program, then the ticket; the other pairs' rows read from L2 (.cg), not a stale L1
    ticket = ptx2.index("atom.global.gpu.acq_rel.add")
    assert 0 <= ptx2.rfind("st.global", 0, ticket) < ptx2.rfind("bar.sync", 0, ticket)
    assert "ld.global.cg" in ptx2[ticket:]


@pytest.mark.parametrize("pairs,experts,block_m", [  # decode shapes and the size limits
    (128, 128, 16), (32, 8, 16), (256, 128, 64), (1024, 32, 128), (4, 8192, 16),
])
def test_align_kernel_compiles_for_sm90(pairs, experts, block_m):
    pytest.importorskip("triton")
    from fp8fx.kernels.fused_moe import ALIGN_ONE_PROGRAM_MAX, _align_rows, _pow2, align_kernel

    assert _pow2(pairs) * _pow2(experts) <= ALIGN_ONE_PROGRAM_MAX
    nb = _align_rows(pairs, experts, block_m) // block_m
    kernel = compile_for_hopper(
        align_kernel, {"ids_ptr": "*i64", "sorted_pair_ptr": "*i32", "block_expert_ptr": "*i32"}, ["S", "NB"],
        dict(E=experts, BLOCK_M=block_m, S_P=_pow2(pairs), E_P=_pow2(experts), NB_P=_pow2(nb)),
        {"num_warps": 8, "num_stages": 1})
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024  # the scan's shared memory


@pytest.mark.parametrize("y_type,out_type,ids_type", [("*bf16", "*bf16", "*i64"), ("*fp32", "*fp32", "*i32"),
                                                      ("*fp32", "*fp16", "*i64")])
def test_combine_kernel_compiles_for_sm90(y_type, out_type, ids_type):
    pytest.importorskip("triton")
    from fp8fx.kernels.fused_moe import combine_kernel

    kernel = compile_for_hopper(
        combine_kernel, {"y_ptr": y_type, "ids_ptr": ids_type, "out_ptr": out_type}, ["H", "stride_y", "stride_o"],
        dict(E=128, K_TOP=8, BLOCK_H=1024), {"num_warps": 4, "num_stages": 1})
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("group,static,parts", [(768, False, 0), (14336, False, 0), (128, False, 0), (2048, True, 0),
                                               (768, False, 8), (14336, False, 128)])
def test_quantize_rows_kernel_compiles_for_sm90(group, static, parts):
    pytest.importorskip("triton")
    from fp8fx import quant
    from fp8fx.kernels.fused_moe import quantize_rows_kernel

    kernel = compile_for_hopper(
        quantize_rows_kernel, {"x_ptr": "*fp32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "static_ptr": "*fp32",
                               "parts_ptr": "*fp32"},
        ["C", "stride_xm", "stride_qm", "stride_sm", "stride_sg", "stride_pm", "n_parts"],
        dict(GROUP=group, CHUNK=min(1024, 1 << (group - 1).bit_length()), STATIC=static, PARTS=parts,
             EPS=quant.AMAX_EPS, FP8_MAX=quant.FP8_MAX), {"num_warps": 4, "num_stages": 1})
    assert kernel.asm["cubin"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in kernel.asm["ptx"]  # round to nearest even, as torch casts
    assert "div.rn.f32" in kernel.asm["ptx"]  # IEEE division, as torch divides
