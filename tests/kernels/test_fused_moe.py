"""fp8fx.fused_moe: the CPU reference against a per-(token, k) loop and against unquantized float64
experts; odd token counts, experts without tokens, every token on one expert, expert-parallel
sentinels; the op's registration (schema, fake impl)."""
import pytest
import torch
import torch.nn.functional as F

from fp8fx import ops, quant
from tests.conftest import rel_err

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


def test_no_tokens():
    q13, s13, q2, s2, *_ = experts([1, -1])
    x, w, ids = routed(0)
    out, _ = run(x, w, ids, q13, s13, q2, s2, "per-channel")
    assert out.shape == (0, H)


def test_registration_schema_and_fake():
    q13, s13, q2, s2, *_ = experts([1, -1])
    x, w, ids = routed(3)
    args = (x, w, ids, q13, s13, q2, s2, [1, -1], [1, -1], torch.bfloat16, None, None)
    torch.library.opcheck(torch.ops.fp8fx.fused_moe.default, args, test_utils=("test_faketensor",))


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
    assert ops.fused_moe_reference is not None
