"""The MoE pass on Dynamo graphs: HF transformers 5 experts (grouped_mm, batched_mm; bf16 and fp32),
the unrolled per-expert loop of examples/moe_reference.py, and experts it must leave alone (each
reported with its reason, the graph unchanged)."""
import hashlib
import importlib.util
import logging
import operator
import pathlib
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8fx
import fp8fx.testing
from fp8fx import ops
from fp8fx.passes import MoePass, default_passes
from tests.conftest import rel_err

transformers = pytest.importorskip("transformers")

E, H, I, K, T = 4, 128, 64, 2, 9
_GROUPED_FNS = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("moe_reference", ROOT / "examples" / "moe_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("moe_reference", module)  # Dynamo looks classes' modules up there
    spec.loader.exec_module(module)
    return module


class Block(nn.Module):
    """Something around the experts, so that they are a submodule and their output has a consumer."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, top_k_index, top_k_weights):
        return x + self.experts(x, top_k_index, top_k_weights)


def hf_experts(impl, dtype, expert_parallel=False):
    """``expert_parallel``: the module's code guards against expert-parallel sentinel ids (>= E), as every
    transformers 5.17 experts module does (later versions: only modules set up for expert parallelism)."""
    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    nn.init.normal_(experts.gate_up_proj, std=H**-0.5)
    nn.init.normal_(experts.down_proj, std=I**-0.5)
    if expert_parallel:
        experts._is_expert_parallel = True
    return Block(experts).to(dtype).eval()


def inputs(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0] = torch.tensor([3, 0])  # expert 1 and 2 get fewer tokens; the order within a row varies
    w = torch.rand(T, K, generator=g)
    return torch.randn(T, H, generator=g).to(dtype), ids, (w / w.sum(-1, keepdim=True)).to(dtype)


def compile_capture(model, *args, grad=False, **options):
    """(output, the graph after fp8fx's passes, the report), with Fp8Backend's passes (``options``) and no Inductor."""
    backend = fp8fx.Fp8Backend(compiler="eager", **options)
    graphs = []

    def capture(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        graphs.append(gm)
        return compiled

    with torch.set_grad_enabled(grad):
        out = torch.compile(model, backend=capture, fullgraph=True)(*args)  # fullgraph: no graph break
    assert len(graphs) == 1
    return out, graphs[0], backend.report


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def fused_reference(experts, x, ids, w, out_dtype):
    """fused_moe's reference on the module's own fp8 tensors: what the rewritten graph must compute."""
    p = experts._parameters
    scale = "_scale_inv" if experts._fp8fx_block_scales else "_scale"
    return ops.fused_moe_reference(x, w, ids, p["gate_up_proj"], p["gate_up_proj" + scale], p["down_proj"],
                                   p["down_proj" + scale], experts._fp8fx_w_block, experts._fp8fx_act_block, out_dtype)


CONFIGS = {
    "per-channel": fp8fx.Fp8Config(),
    "per-tensor": fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor(), activation_granularity=fp8fx.PerTensor()),
    "block": fp8fx.Fp8Config(weight_block_size=[64, 64]),
}


@pytest.mark.parametrize("impl,dtype,config,ep", [
    ("grouped_mm", torch.bfloat16, "per-channel", False),
    ("grouped_mm", torch.float32, "block", False),  # fp32 weights: HF's transformers::grouped_mm_fallback op
    ("batched_mm", torch.bfloat16, "per-tensor", False),
    ("batched_mm", torch.float32, "per-channel", False),
    # sentinel guards: ids >= E masked (masked_fill_ of the gathered rows, of both GEMMs' outputs, of the
    # routing weights), ids clamped in place (grouped) or not (batched)
    ("grouped_mm", torch.bfloat16, "per-channel", True),
    ("batched_mm", torch.bfloat16, "per-tensor", True),
])
def test_hf_experts_rewritten_into_fused_moe(impl, dtype, config, ep):
    model = hf_experts(impl, dtype, expert_parallel=ep)
    x, ids, w = inputs(dtype)
    with torch.no_grad():
        bf16 = model(x, ids, w)
        fp8fx.quantize_(model, CONFIGS[config])
        out, gm, report = compile_capture(model, x, ids, w)
    (site,) = report.sites
    assert (site.kind, site.fqn, site.rewritten, site.weight_shape) == ("moe", "experts", True, (E, 2 * I, H))
    assert site.scheme == str(CONFIGS[config].scheme()) and site.bytes_saved > 0
    found = targets(gm)
    assert found.count(torch.ops.fp8fx.fused_moe.default) == 1
    assert not {torch.ops.fp8fx.dequantize, torch._grouped_mm, torch.bmm, torch.sort} & set(found)
    # the graph computes exactly fused_moe on the module's fp8 tensors, plus the residual
    assert torch.equal(out, x + fused_reference(model.experts, x, ids, w, dtype))
    assert rel_err(out - x, bf16 - x) < 0.1


def test_static_experts_pass_each_gemm_its_own_input_scale():
    """Static activations: fused_moe takes the gate_up input's scale as a13 and the down input's as a2. The pass's
    order was checked by one e2e test alone, with a modest margin (h153); here the graph's output is fused_moe's
    reference on the module's own tensors, exactly, and not the reference with the two scales swapped."""
    model = hf_experts("grouped_mm", torch.bfloat16)
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        fp8fx.quantize_(model, fp8fx.Fp8Config(activation_scheme="static"),
                        input_scales={"experts.gate_up_proj": 0.02, "experts.down_proj": 0.0005})
        out, gm, report = compile_capture(model, x, ids, w)
    assert report.sites[0].rewritten and targets(gm).count(torch.ops.fp8fx.fused_moe.default) == 1
    experts, p = model.experts, model.experts._parameters
    a13, a2 = experts.gate_up_proj_input_scale, experts.down_proj_input_scale

    def reference(a13, a2):
        return x + ops.fused_moe_reference(x, w, ids, p["gate_up_proj"], p["gate_up_proj_scale"], p["down_proj"],
                                           p["down_proj_scale"], experts._fp8fx_w_block, experts._fp8fx_act_block,
                                           torch.bfloat16, a13, a2)

    assert torch.equal(out, reference(a13, a2)) and rel_err(reference(a2, a13), out) > 0.05


def test_inductor_kernel_column_names_fused_moe():
    """Under Inductor the MoE site's kernel column names the extern fp8fx.fused_moe it runs (it was empty: the
    lookup took GEMMs by "mm" / "mlp" in their names only)."""
    torch._dynamo.reset()
    model = hf_experts("grouped_mm", torch.bfloat16)
    x, ids, w = inputs(torch.bfloat16)
    fp8fx.quantize_(model, CONFIGS["per-channel"])
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(x, ids, w)
    (site,) = backend.report.sites
    assert (site.kind, site.rewritten, site.kernel) == ("moe", True, "extern fp8fx.fused_moe"), str(backend.report)


def test_unrolled_per_expert_loop_of_the_reference_example():
    example = _example()
    torch.manual_seed(0)
    model = Block(example.Experts(E, H, I)).to(torch.bfloat16)
    x, ids, w = inputs(torch.float32)
    x = x.bfloat16()
    with torch.no_grad():
        bf16 = model(x, ids, w)
        fp8fx.quantize_(model)
        out, gm, report = compile_capture(model, x, ids, w)
    fp8fx.testing.assert_rewritten(report, "experts")
    assert [s.kind for s in report.sites] == ["moe"]  # the expert GEMMs are gone before the linear pass runs
    assert targets(gm).count(torch.ops.fp8fx.fused_moe.default) == 1 and torch.ops.fp8fx.dequantize not in targets(gm)
    assert torch.equal(out, x + fused_reference(model.experts, x, ids, w, torch.bfloat16))
    assert rel_err(out - x, bf16 - x) < 0.1


# -- experts the pass must leave alone --------------------------------------------------------------
class LoopExperts(nn.Module):
    """The example's loop with one thing changed at a time."""

    def __init__(self, act=F.silu, scale=1.0, experts=range(E), shift=0, bias=False, eq_method=False, mask_from=None,
                 inplace_mask=False, id_offset=0, routing=None, gemm=F.linear):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / H**0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I, generator=g) / I**0.5)
        self.act, self.scale, self.experts, self.shift = act, scale, experts, shift
        self.bias = nn.Parameter(torch.zeros(H)) if bias else None
        self.eq_method = eq_method  # top_k_index.__eq__(e): how torch 2.11's Dynamo records `top_k_index == e`
        self.mask_from, self.inplace_mask = mask_from, inplace_mask  # masked_fill(top_k_index[:, :1] >= mask_from)
        self.id_offset = id_offset  # expert e's pairs where top_k_index - id_offset == e (an expert-parallel rank)
        self.routing = routing  # (top_k_index, top_k_weights) -> the ones the loop reads
        self.gemm = gemm  # (x, one expert's weight) -> x @ w.T, as the loop spells it

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        if self.routing is not None:
            top_k_index, top_k_weights = self.routing(top_k_index, top_k_weights)
        if self.mask_from is not None:
            mask = top_k_index[:, :1] >= self.mask_from
            if self.inplace_mask:
                x.masked_fill_(mask, 0.0)  # the caller's hidden states
        for e in self.experts:
            ids = top_k_index - self.id_offset if self.id_offset else top_k_index
            hit = ids.__eq__(e) if self.eq_method else ids == e
            weight = (top_k_weights * hit).sum(dim=-1, keepdim=True)
            gate, up = self.gemm(x, self.gate_up_proj[(e + self.shift) % E]).chunk(2, dim=-1)
            y = self.gemm(self.act(gate) * up, self.down_proj[(e + self.shift) % E])
            if self.mask_from is not None and not self.inplace_mask:
                y = y.masked_fill(mask, 0.0)
            out = out + (weight * y if self.scale == 1.0 else self.scale * weight * y)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


@pytest.mark.parametrize("variant,reason", [
    (dict(act=F.mish), "mish (call_function mish) is not part of an experts computation fused_moe knows"),
    (dict(act=F.relu), "multiplies values that fused_moe does not multiply"),  # relu(gate) * up: no square
    (dict(scale=2.0), "multiplies values that fused_moe does not multiply"),
    (dict(experts=range(E - 1)), f"leaves out experts [{E - 1}]"),
    (dict(shift=1), "weights expert 1 with the routing weight of expert 0"),
    (dict(bias=True), "the experts read l_self_modules_experts_parameters_bias_ (128,) besides their inputs"),
    (dict(mask_from=E - 1), "masks a value with something other than the expert-parallel sentinels (ids >= E)"),
    (dict(mask_from=E, inplace_mask=True), "modifies in place a tensor that may be (a view of) one of the experts'"),
    (dict(id_offset=1), "multiplies values that fused_moe does not multiply"),  # masks of ids - 1, not of the ids
    # only part of the routing, or reordered along k: fused_moe weights every (token, k) pair by its own weight
    *((dict(routing=r), "selects, reorders or broadcasts the routing weights along k") for r in (
        lambda i, w: (i, w[:, :1]),
        lambda i, w: (i, w[:, [1, 0]]),
        lambda i, w: (i, w[:, :1].expand(-1, K)),
        lambda i, w: (i, w.reshape(-1, 1).expand(-1, 2).reshape(-1, 2 * K)[:, :K]),  # refused at the expand
    )),
    *((dict(routing=r), "reads some of the routing ids (top_k_index sliced, reordered or broadcast along k)") for r in (
        lambda i, w: (i[:, :1], w),
        lambda i, w: (i[:, [1, 0]], w),
        lambda i, w: (i[:, :1].expand(-1, K), w),
        lambda i, w: (i.t().reshape(i.shape), w),
    )),
    # ids clamped narrower than [0, E - 1]: pairs of expert E - 1 ran expert E - 2's weights, and were rewritten
    (dict(routing=lambda i, w: (i.clamp(0, E - 2), w)), "multiplies values that fused_moe does not multiply"),
])
def test_other_experts_are_left_as_they_are_with_the_reason(variant, reason):
    model = Block(LoopExperts(**variant)).to(torch.bfloat16)
    x, ids, w = inputs(torch.float32)
    x = x.bfloat16()
    fp8fx.quantize_(model)
    with torch.no_grad():
        eager = model(x, ids, w)  # fp8 weights, dequantized: what the unchanged graph computes
        out, gm, report = compile_capture(model, x, ids, w)
    moe = [s for s in report.sites if s.kind == "moe"]
    assert [(s.fqn, s.rewritten) for s in moe] == [("experts", False)]
    assert reason in moe[0].reason, moe[0].reason
    assert torch.ops.fp8fx.fused_moe.default not in targets(gm) and torch.ops.fp8fx.dequantize in targets(gm)
    assert torch.allclose(out, eager, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("variant", [
    dict(eq_method=True),  # the graph torch 2.11 records for `top_k_index == e`
    dict(mask_from=E),  # outputs masked where top_k_index >= E: never, for the ids fused_moe takes
    dict(routing=lambda i, w: (i.clamp(0, E - 1), w)),  # the identity on every id
    dict(routing=lambda i, w: (i.clamp(min=-1), w)),
    # x @ w.T in the spellings the linear pass takes: x.matmul(w.T) (DBRX's loop) was "not part of an experts
    # computation fused_moe knows"
    dict(gemm=lambda x, w: torch.mm(x, w.t())), dict(gemm=lambda x, w: x.matmul(w.T)),
    dict(gemm=lambda x, w: x @ w.transpose(0, 1)), dict(gemm=lambda x, w: x.mm(w.permute(1, 0))),
])
def test_unrolled_loop_forms_rewritten(variant):
    model = Block(LoopExperts(**variant)).to(torch.bfloat16)
    x, ids, w = inputs(torch.bfloat16)
    fp8fx.quantize_(model)
    with torch.no_grad():
        out, gm, report = compile_capture(model, x, ids, w)
    fp8fx.testing.assert_rewritten(report, "experts")
    assert targets(gm).count(torch.ops.fp8fx.fused_moe.default) == 1 and torch.ops.fp8fx.dequantize not in targets(gm)
    assert torch.equal(out, x + fused_reference(model.experts, x, ids, w, torch.bfloat16))


class GatheredExperts(nn.Module):
    """Each (token, k) pair's expert weights gathered by an index of the routing ids (``index(ids)``), as
    transformers' batched experts do with the ids themselves."""

    def __init__(self, index):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / H**0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I, generator=g) / I**0.5)
        self.index = index

    def forward(self, x, top_k_index, top_k_weights):
        ids = self.index(top_k_index.reshape(-1))
        xs = x.repeat_interleave(K, dim=0)
        gate, up = torch.bmm(self.gate_up_proj[ids], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (y * top_k_weights.reshape(-1, 1)).view(x.shape[0], K, H).sum(dim=1).to(x.dtype)


@pytest.mark.parametrize("index,rewritten", [(lambda ids: ids, True), (lambda ids: (E - 1) - ids, False),
                                             (lambda ids: ids.clamp(0, E - 2), False)])
def test_expert_weights_gathered_by_other_than_the_ids_are_left_alone(index, rewritten):
    """``w[E - 1 - ids]`` or ``w[ids.clamp(0, E - 2)]`` gathers other experts than the ids name: rewritten, fused_moe
    ran each pair on its id's expert (a relative error of 1.2 against the model)."""
    model = Block(GatheredExperts(index)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        eager = model(x, ids, w)
        out, gm, report = compile_capture(model, x, ids, w)
    moe = [s for s in report.sites if s.kind == "moe"]
    assert [(s.fqn, s.rewritten) for s in moe] == [("experts", rewritten)], moe
    if rewritten:
        assert rel_err(out - x, eager - x) < 0.1
    else:
        assert "gathers an expert weight by an index computed from the routing ids" in moe[0].reason
        assert torch.equal(out, eager)


class PairsSummed(GatheredExperts):
    """The gathered pairs [T * K, H] weighted and summed per token, ``tail(y, w, t)`` standing for how."""

    def __init__(self, tail):
        super().__init__(lambda ids: ids)
        self.tail = tail

    def forward(self, x, top_k_index, top_k_weights):
        ids = top_k_index.reshape(-1)
        xs = x.repeat_interleave(K, dim=0)
        gate, up = torch.bmm(self.gate_up_proj[ids], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return self.tail(y, top_k_weights, x.shape[0]).to(x.dtype)


ODD_SUMS = {  # each rewritten into fused_moe before, computing something else (relative errors 0.86-1.07, or 0 vs 18.8)
    "k-major pairs summed over dim 0": (
        lambda: PairsSummed(lambda y, w, t: (y * w.reshape(-1, 1)).view(K, t, H).sum(dim=0)),
        "sums something other than the k weighted expert outputs"),
    "weights cast to int64": (
        lambda: PairsSummed(lambda y, w, t: (y * w.to(torch.int64).reshape(-1, 1)).view(t, K, H).sum(dim=1)),
        "casts a value to torch.int64, which changes it"),
    "a loop's weights summed over every pair": (
        lambda: LoopExperts(routing=lambda ids, w: (ids.reshape(-1), w.reshape(-1))),
        "sums something other than the k weighted expert outputs"),
    "weights rounded through float8": (
        lambda: PairsSummed(lambda y, w, t: (y * w.to(torch.float8_e4m3fn).to(y.dtype).reshape(-1, 1)).view(t, K, H)
                            .sum(dim=1)),
        "casts a value to torch.float8_e4m3fn, which changes it"),
    "the combined output added to itself": (
        lambda: PairsSummed(lambda y, w, t: (lambda s: s + s)((y * w.reshape(-1, 1)).view(t, K, H).sum(dim=1))),
        "adds the outputs of every expert to a partial sum"),
    "pairs index_added with alpha=2": (
        lambda: PairsSummed(lambda y, w, t: torch.zeros(t, H, dtype=y.dtype).index_add_(
            0, torch.arange(t * K) // K, y * w.reshape(-1, 1), alpha=2)),
        "adds scaled (alpha) expert outputs"),
}


@pytest.mark.parametrize("case", list(ODD_SUMS))
def test_pairs_weighted_or_summed_otherwise_are_left_alone(case):
    """Pairs viewed k-major and summed over k's dim (other tokens' pairs added), routing weights cast to an integer
    (all 0) or rounded through float8, a loop's masked weights summed over all pairs flattened (one weight for every
    token), the weighted sum returned as s + s (fused_moe's s), pairs index_add_-ed with alpha=2 (fused_moe adds them
    once): each was rewritten into fused_moe. Each is left alone now, with the reason, and computes what the model
    does."""
    make, reason = ODD_SUMS[case]
    model = Block(make()).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        eager = model(x, ids, w)
        out, gm, report = compile_capture(model, x, ids, w)
    (moe,) = [s for s in report.sites if s.kind == "moe"]
    assert not moe.rewritten and reason in moe.reason, moe
    assert torch.ops.fp8fx.fused_moe.default not in targets(gm)
    assert torch.equal(out, eager)


def test_experts_called_twice_are_not_merged():
    class Twice(Block):
        def forward(self, x, top_k_index, top_k_weights):
            return self.experts(x, top_k_index, top_k_weights) + self.experts(x, top_k_index.flip(-1), top_k_weights)

    model = Twice(LoopExperts()).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        _, _, report = compile_capture(model, x, ids, w)
    (site,) = [s for s in report.sites if s.kind == "moe"]
    assert not site.rewritten and "called more than once" in site.reason


@pytest.mark.parametrize("ids_dtype,w_dtype", [(torch.int16, torch.bfloat16), (torch.uint8, torch.bfloat16),
                                               (torch.int64, torch.float64)])
def test_routing_dtypes_fused_moe_does_not_take_are_left_with_the_reason(ids_dtype, w_dtype):
    """int16 / uint8 expert ids or float64 routing weights: fused_moe takes int32 / int64 ids and bf16 / fp16 / fp32
    weights, so the experts stay as they are (they were rewritten, and the compiled model raised when it ran)."""
    model = Block(LoopExperts()).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        out, _, report = compile_capture(model, x, ids.to(ids_dtype), w.to(w_dtype))
        eager = model(x, ids.to(ids_dtype), w.to(w_dtype))
    (site,) = [s for s in report.sites if s.kind == "moe"]
    assert not site.rewritten and site.reason == (
        f"the routing gives {ids_dtype} expert ids and {w_dtype} weights; fused_moe takes int32 / int64 ids and "
        "bf16 / fp16 / fp32 weights")
    assert torch.equal(out, eager)


def test_batched_hidden_states_are_left_with_the_reason():
    """[B, T, H] hidden states and [B, T, K] routing: the reason named one of them (which, by set order) as something
    the experts read besides their inputs ("a bias? a norm?"). It says fused_moe takes [T, H] and what to do."""
    example = _example()
    torch.manual_seed(0)
    model = Block(example.Experts(E, H, I)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    t = x.shape[0] // 2 * 2
    x, ids, w = x[:t].view(2, t // 2, H), ids[:t].view(2, t // 2, -1), w[:t].view(2, t // 2, -1)
    with torch.no_grad():
        out, _, report = compile_capture(model, x, ids, w)
        eager = model(x, ids, w)
    (site,) = [s for s in report.sites if s.kind == "moe"]
    assert not site.rewritten and site.reason.endswith(
        "fused_moe takes [T, H] hidden states and [T, K] routing; flatten the tokens before the experts (x.view(-1, "
        "H))"), site.reason
    assert torch.equal(out, eager)


def test_experts_quantize_skipped_are_reported_with_its_reason():
    model = hf_experts("grouped_mm", torch.bfloat16)
    model.experts.act_fn = torch.nn.Mish()  # what fused_moe does not compute: quantize_ leaves it in bf16
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        out, gm, report = compile_capture(model, x, ids, w)
    (site,) = report.sites
    assert (site.fqn, site.rewritten) == ("experts", False)
    assert site.reason == "not quantized: act_fn=Mish() is not SiLU, GELU (exact or tanh) or the squared ReLU: " \
                          "fp8fx.fused_moe computes act(gate) * up with one of them"
    assert torch.ops.fp8fx.dequantize not in targets(gm) and torch._grouped_mm in targets(gm)


@pytest.mark.parametrize("config", [fp8fx.Fp8Config(ignored_layers=["experts"]),
                                    fp8fx.Fp8Config(weight_block_size=[128, 128])])  # 128 does not divide I = 64
def test_experts_kept_in_bf16_in_a_loop_are_one_site(config):
    """The example's loop over experts that quantize_ kept in bf16 (ignored, or a block that does not divide them):
    one site, the experts', with quantize_'s reason. Each expert GEMM was a linear site of its own too (8 here), each
    telling the user to run quantize_, at WARNING."""
    model = Block(LoopExperts()).to(torch.bfloat16)
    fp8fx.quantize_(model, config)
    with torch.no_grad():
        _, _, report = compile_capture(model, *inputs(torch.bfloat16))
    (site,) = report.sites
    assert (site.kind, site.fqn, site.rewritten) == ("moe", "experts", False)
    assert site.reason.startswith("not quantized: "), site.reason


def nemotron_h_experts(impl, act="relu2"):
    """HF's NemotronHExperts (has_gate=False: down_proj(act_fn(up_proj(x)))) of ``mlp_hidden_act`` ``act``, in a Block."""
    cfg = transformers.NemotronHConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                                       num_experts_per_tok=K, mlp_hidden_act=act)
    cfg._experts_implementation = impl
    experts = transformers.models.nemotron_h.modeling_nemotron_h.NemotronHExperts(cfg)
    torch.manual_seed(0)
    nn.init.normal_(experts.up_proj, std=H**-0.5)
    nn.init.normal_(experts.down_proj, std=I**-0.5)
    return Block(experts).to(torch.bfloat16).eval()


def nemotron_h_exact(experts, x, ids, w):
    """Ungated experts written out in float64 from the module's (bf16 or dequantized) weights."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            u = experts.up_proj[e].double() @ x[t].double()
            out[t] += w[t, k].double() * (experts.down_proj[e].double() @ experts.act_fn(u))
    return x.double() + out


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("act,form", [("relu2", "squared ReLU"), ("silu", "SiLU"), ("gelu", "GELU"),
                                      ("gelu_pytorch_tanh", "GELU (tanh)")])
def test_ungated_experts_in_fp8(impl, act, form):
    """Nemotron-H's experts (has_gate=False: down_proj(act_fn(up_proj(x)))) were left bf16: quantize_ stores up_proj in
    fp8 in w13's place and the MoE pass rewrites HF's code into one fused_moe(gated=False) of that activation, within
    fp8's error of the block in float64 (the model's code on the same fp8 weights: closer still)."""
    model = nemotron_h_experts(impl, act)
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        truth = nemotron_h_exact(model.experts, x, ids, w)
        fp8fx.quantize_(model, strict=True)
        assert model.experts.up_proj.dtype == torch.bfloat16  # the dequantized view the model's code reads
        assert model.experts._parameters["up_proj"].dtype == torch.float8_e4m3fn
        assert not hasattr(model.experts, "gate_up_proj")
        eager = model(x, ids, w)
        out, gm, report = compile_capture(model, x, ids, w)
    (site,) = report.sites
    assert (site.kind, site.fqn, site.rewritten, site.weight_shape) == ("moe", "experts", True, (E, I, H)), site.reason
    assert site.scheme == f"w:per-channel a:per-token (ungated, {form})"
    (fused,) = [n for n in gm.graph.nodes if n.target is torch.ops.fp8fx.fused_moe.default]
    assert fused.args[-1] is False and torch.ops.fp8fx.dequantize not in targets(gm)
    # x + the experts against bf16 weights in float64: measured 0.020-0.035 (0.015-0.024 for the model's own code on
    # the fp8 weights; the rest is x's and the intermediate's fp8; relu2 the most, squaring its errors)
    assert rel_err(out, truth) < 0.05, rel_err(out, truth)
    assert rel_err(out, eager) < 0.04  # measured 0.015-0.026
    assert not report.unhandled_weights(model)


@pytest.mark.parametrize("what,act_fn,reason", [
    ("a plain ReLU", nn.ReLU(), "act_fn=ReLU() is not SiLU, GELU (exact or tanh) or the squared ReLU: fp8fx.fused_moe "
                                "computes act(up) (ungated) with one of them"),
    ("the erf GELU in Python", transformers.activations.GELUActivation(use_gelu_python=True),
     "(GELU's erf formula in Python, use_gelu_python=True) is not SiLU, GELU (exact or tanh) or the squared ReLU"),
])
def test_ungated_experts_of_another_activation_stay_bf16_with_the_reason(what, act_fn, reason):
    model = nemotron_h_experts("grouped_mm")
    model.experts.act_fn = act_fn
    with pytest.raises(ValueError, match=r"experts: act_fn="):
        fp8fx.quantize_(model, strict=True)  # strict refuses what it would leave in bf16, as for other experts
    fp8fx.quantize_(model)
    assert model.experts.up_proj.dtype == torch.bfloat16
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        _, _, report = compile_capture(model, x, ids, w)
    (site,) = report.sites
    assert (site.kind, site.fqn, site.rewritten, site.weight_shape) == ("moe", "experts", False, (E, I, H))
    assert reason in site.reason, site.reason
    assert not report.unhandled_weights(model)


def _ungated_forward(split=False, power=2, relu_only=False, alias=False):
    """NemotronHExperts' batched_mm code with one thing changed."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        ids = top_k_index.reshape(-1)
        x = hidden_states.repeat_interleave(top_k_index.shape[1], dim=0)
        up = torch.bmm(self.up_proj[ids], x.unsqueeze(-1)).squeeze(-1)
        if alias:  # a ReLU in place on a view of up, whose result is not read: up is relu(up) from here on
            F.relu(up.view(up.shape), inplace=True)
            h = F.silu(up)
            y = torch.bmm(self.down_proj[ids], h.unsqueeze(-1)).squeeze(-1) * top_k_weights.reshape(-1, 1)
            return y.view(-1, top_k_index.shape[1], y.shape[-1]).sum(dim=1)
        if split:  # a gate half of an ungated output
            gate, up = up.chunk(2, dim=-1)
            up = F.silu(gate) * up
            up = torch.cat([up, up], dim=-1)
        h = F.relu(up)
        h = h if relu_only else h.pow(power)
        y = torch.bmm(self.down_proj[ids], h.unsqueeze(-1)).squeeze(-1) * top_k_weights.reshape(-1, 1)
        return y.view(-1, top_k_index.shape[1], y.shape[-1]).sum(dim=1)
    return forward


@pytest.mark.parametrize("what,kw,reason", [
    ("relu(x) ** 2 (pow)", {}, None),
    ("relu(x) ** 3", dict(power=3), "raises to the power 3, not 2 (the squared ReLU)"),
    ("a ReLU alone", dict(relu_only=True), "multiplies w2 (expert pairs) with relu"),
    ("a gate half of up's output", dict(split=True), "(ungated experts: up's output has no gate half)"),
    # (rewritten as silu(up) before: the in-place ReLU of an alias was not seen)
    ("an in-place ReLU of a view of up", dict(alias=True), "applies ReLU in place to a view of up, which is read "
                                                           "otherwise too"),
])
def test_ungated_experts_code_variants(monkeypatch, what, kw, reason):
    """What the ungated rules take (relu then pow 2) and what they refuse, each with the node and the reason."""
    model = nemotron_h_experts("batched_mm")
    monkeypatch.setattr(type(model.experts), "forward", _ungated_forward(**kw))
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        fp8fx.quantize_(model)
        eager = model(x, ids, w)
        out, _, report = compile_capture(model, x, ids, w)
    (site,) = report.sites
    if reason is None:
        assert site.rewritten and site.scheme.endswith("(ungated, squared ReLU)"), site.reason
        assert rel_err(out, eager) < 0.04
    else:
        assert not site.rewritten and reason in site.reason, site.reason
        assert torch.equal(out, eager)


def test_experts_split_across_graphs_say_why_and_the_fix():
    """HF's per-expert loop (experts_implementation='eager') breaks the graph at nonzero(): each graph reads one of the
    expert weights. The report said only that, with no cause or fix."""
    model = hf_experts("eager", torch.bfloat16)
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(x, ids, w)
    sites = [s for s in backend.report.sites if s.kind == "moe"]
    assert sites and not any(s.rewritten for s in sites)
    assert {s.reason.partition(":")[0] for s in sites} == {
        f"only {r} of the expert weights are read in this graph" for r in (["w13"], ["w2"])}
    for s in sites:
        assert "split across graphs (a graph break inside it, e.g. at nonzero()" in s.reason
        assert s.reason.endswith("use model.set_experts_implementation('grouped_mm') (or 'batched_mm')")
    assert callable(getattr(transformers.PreTrainedModel, "set_experts_implementation", None))  # the API named


def test_traced_with_autograd_is_not_rewritten():
    model = hf_experts("grouped_mm", torch.bfloat16)
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    x.requires_grad_(True)
    _, _, report = compile_capture(model, x, ids, w, grad=True)
    (site,) = report.sites
    assert not site.rewritten and site.reason.startswith("traced with autograd")


@pytest.mark.parametrize("read", ["under no_grad", "after it"])
def test_frozen_experts_under_no_grad_in_a_graph_traced_with_grad(read):
    """Experts called under torch.no_grad() inside a forward traced with grad (hidden states that require grad): their
    output records no history, so fused_moe needs no autograd formula; they were kept in high precision as "traced
    with autograd" (the linear pass's probe finding, for experts). The fused op goes before the output's first reader:
    where that reader runs with grad on, it would record the op (backward failed: no autograd formula; a review's
    catch), so they are kept there."""

    class Frozen(nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.experts = experts

        def forward(self, x, ids, w):
            with torch.no_grad():
                out = self.experts(x, ids, w)
                if read == "under no_grad":
                    return out * 2
            return out

    model = Frozen(hf_experts("grouped_mm", torch.bfloat16).experts)
    fp8fx.quantize_(model)
    x, ids, w = inputs(torch.bfloat16)
    x.requires_grad_(True)
    backend = fp8fx.Fp8Backend(compiler="eager")
    out = torch.compile(model, backend=backend)(x, ids, w)
    (site,) = [s for s in backend.report.sites if s.kind == "moe"]
    assert site.rewritten == (read == "under no_grad"), site.reason
    if read == "after it":
        assert site.reason.startswith("traced with autograd") and "first read where grad is on" in site.reason
        assert not out.requires_grad
        (x.float() - out.float()).square().mean().backward()  # a distillation loss: its grad reaches x alone
        assert x.grad is not None
        return
    assert not out.requires_grad
    with torch.no_grad():
        assert rel_err(out.float(), model(x, ids, w).float()) < 0.08


def test_float64_experts_are_the_reference_on_purpose(caplog):
    """``model.double()`` of quantized experts is their exact reference: the report said "is not bf16/fp16/fp32" in
    a WARNING whose README row said to cast the model to bf16."""
    model = hf_experts("grouped_mm", torch.bfloat16)
    fp8fx.quantize_(model)
    model.double()
    x, ids, w = inputs(torch.float64)
    with caplog.at_level(logging.INFO, logger="fp8fx"):
        _, _, report = compile_capture(model, x, ids, w)
    (site,) = report.sites
    assert not site.rewritten and site.reason == ("hidden_states dtype torch.float64: the float64 reference, computed "
                                                  "with the dequantized experts")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_an_unbacked_token_count_leaves_the_experts_with_the_reason():
    """A token count marked unbacked (mark_unbacked) answers no comparison of sizes, which the pass's checks make:
    the graph failed to compile. The experts now run as the model wrote them, reported with the reason and the fix;
    Dynamo's runtime assertions on the sizes (``Eq(u1, u0)``) are no part of the experts."""
    model = hf_experts("grouped_mm", torch.bfloat16)
    with torch.no_grad():
        fp8fx.quantize_(model)
        x, ids, w = inputs(torch.bfloat16)
        eager = model(x, ids, w)
        for t in (x, ids, w):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        out, gm, report = compile_capture(model, x, ids, w)
    (site,) = report.sites
    assert not site.rewritten and site.reason.startswith(
        "the experts' shapes cannot be compared at trace time: the token count is unbacked")
    assert "mark the batch dim dynamic instead (torch._dynamo.mark_dynamic)" in site.reason
    assert torch.ops.fp8fx.fused_moe.default not in targets(gm) and torch.equal(out, eager)


def test_pass_runs_first_and_its_uuid_follows_its_source():
    passes = default_passes()
    assert isinstance(passes[0], MoePass)
    assert MoePass().uuid() == MoePass().uuid()
    source = (ROOT / "fp8fx" / "passes" / "moe.py").read_text()
    assert MoePass().uuid() == hashlib.sha256(source.encode()).hexdigest()


def test_device_capability_query_inside_the_experts_is_taken():
    """On CUDA, transformers 5.17's grouped_mm experts ask ``torch.cuda.get_device_capability(w.device)``
    inside their forward; Dynamo on torch 2.11 records the call in the graph (the H200 run of
    2026-11-29 left every MoE site unrewritten for it). CPU graphs lack the call: it is put into the
    captured graph here, inside the experts' region, before the pass runs."""
    model = hf_experts("grouped_mm", torch.bfloat16)
    x, ids, w = inputs(torch.bfloat16)
    backend = fp8fx.Fp8Backend(compiler="eager")
    graphs = []

    def capture(gm, example_inputs):
        first = next(n for n in gm.graph.nodes if n.target is torch._grouped_mm or n.target in _GROUPED_FNS)
        weight = first.args[1]
        with gm.graph.inserting_before(first):
            device = gm.graph.call_function(getattr, (weight, "device"))
            cap = gm.graph.call_function(torch.cuda.get_device_capability, (device,))
            gm.graph.call_function(operator.ge, (cap, (8, 0)))  # unused, as in transformers' check
        for n in (device, cap, cap.next):
            n.meta = dict(first.meta)
        graphs.append(gm)
        return backend(gm, example_inputs)

    with torch.no_grad():
        fp8fx.quantize_(model, CONFIGS["per-channel"])
        out = torch.compile(model, backend=capture, fullgraph=True)(x, ids, w)
    (site,) = backend.report.sites
    assert site.rewritten, site.reason
    assert torch.cuda.get_device_capability not in targets(graphs[0])  # dead once the experts are fused
    assert torch.equal(out, x + fused_reference(model.experts, x, ids, w, torch.bfloat16))


class CrossedUp(LoopExperts):
    """Expert e's SiLU(gate) times expert e+1's up."""

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(E):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)
            gate, _ = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            _, up = F.linear(x, self.gate_up_proj[(e + 1) % E]).chunk(2, dim=-1)
            out = out + weight * F.linear(F.silu(gate) * up, self.down_proj[e])
        return out.to(x.dtype)


class TransposedW13(LoopExperts):
    """H == 2I here: x @ w13[e] (the weight used transposed) has the right shape and computes something else."""

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(E):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)
            gate, up = F.linear(x, self.gate_up_proj[e].t()).chunk(2, dim=-1)
            out = out + weight * F.linear(F.silu(gate) * up, self.down_proj[e])
        return out.to(x.dtype)


class ClampedSwiGLU(LoopExperts):
    """DeepSeek-V4's clamped SwiGLU, silu(gate.clamp(max=limit)) * up.clamp(-limit, limit), with up's bounds
    ``up`` (fused_moe's clamped SiLU takes one limit, symmetric for up)."""

    def __init__(self, limit=0.5, up=(-0.5, 0.5)):
        super().__init__()
        self.limit, self.up = limit, up

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(E):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + weight * F.linear(F.silu(gate.clamp(max=self.limit)) * up.clamp(*self.up), self.down_proj[e])
        return out.to(x.dtype)


class W13BiasTwice(LoopExperts):
    """GPT-OSS's per-expert biases, w13's added twice."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I, generator=g) * 0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g) * 0.5)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(E):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)
            gate, up = (F.linear(x, self.gate_up_proj[e]) + self.gate_up_proj_bias[e] + self.gate_up_proj_bias[e]
                        ).chunk(2, dim=-1)
            out = out + weight * (F.linear(F.silu(gate) * up, self.down_proj[e]) + self.down_proj_bias[e])
        return out.to(x.dtype)


class CrossedDown(LoopExperts):
    """Expert e's w2 on expert e+1's SiLU(gate) * up: fused as expert e's w2 on its own; it stays unfused."""

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        hs = [F.silu(g) * u for g, u in (F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1) for e in range(E))]
        for e in range(E):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)
            out = out + weight * F.linear(hs[(e + 1) % E], self.down_proj[e])
        return out.to(x.dtype)


class OaiSwiGLU(LoopExperts):
    """GPT-OSS's clamped SwiGLU, ``(up.clamp(-u, u) + 1) * gate.clamp(max=g) * sigmoid(gate.clamp(max=s) * alpha)``
    with ``limits`` (g, s, u): with s == u != g it was fused as fused_moe's one limit s; it stays unfused."""

    def __init__(self, limits=(0.5, 0.5, 0.5)):
        super().__init__()
        self.limits = limits

    def forward(self, x, top_k_index, top_k_weights):
        g, s, u = self.limits
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(E):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = (up.clamp(-u, u) + 1) * (gate.clamp(max=g) * torch.sigmoid(gate.clamp(max=s) * 1.702))
            out = out + weight * F.linear(h, self.down_proj[e])
        return out.to(x.dtype)


class TwoW13Biases(W13BiasTwice):
    """Two tensors tagged as w13's bias (``gate_up_proj_bias`` and ``up_proj_bias``), expert 0 adding the second: fused
    with one of them for every expert; it stays unfused."""

    def __init__(self):
        super().__init__()
        self.up_proj_bias = nn.Parameter(torch.randn(E, 2 * I, generator=torch.Generator().manual_seed(2)) * 0.5)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(E):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)
            b13 = self.up_proj_bias if e == 0 else self.gate_up_proj_bias
            gate, up = (F.linear(x, self.gate_up_proj[e]) + b13[e]).chunk(2, dim=-1)
            out = out + weight * (F.linear(F.silu(gate) * up, self.down_proj[e]) + self.down_proj_bias[e])
        return out.to(x.dtype)


class GroupedBiased(nn.Module):
    """HF's grouped_mm experts (``grouped_mm_experts_forward``) with GPT-OSS's biases: pairs sorted by expert
    (``descending``: the rows then do not match the ascending offsets), each GEMM's bias gathered by
    ``bias_ids(ids, sorted_ids)``."""

    def __init__(self, descending=False, bias_ids=lambda ids, ids_g: ids_g, bias=True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / H**0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I, generator=g) / I**0.5)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I, generator=g) * 0.5)
            self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g) * 0.5)
        self.descending, self.bias_ids, self.bias = descending, bias_ids, bias

    def forward(self, x, top_k_index, top_k_weights):
        linear = transformers.integrations.moe._grouped_linear
        ids = top_k_index.reshape(-1)
        ids_g, perm = torch.sort(ids, descending=self.descending)
        offsets = torch.cumsum(torch.histc(ids_g.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
        by = self.bias_ids(ids, ids_g)
        b13, b2 = (self.gate_up_proj_bias[by], self.down_proj_bias[by]) if self.bias else (None, None)
        gate, up = linear(x[perm // K], self.gate_up_proj, offsets, bias=b13).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, self.down_proj, offsets, bias=b2) * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return y[inv].view(x.shape[0], K, H).sum(dim=1).to(x.dtype)


def compiled_experts(make):
    """``Block(make())`` in bf16, quantized, run eagerly and compiled: (its input, the compiled output, the eager one,
    the report's MoE sites, the graph after the passes)."""
    model = Block(make()).to(torch.bfloat16)
    x, ids, w = inputs(torch.bfloat16)
    fp8fx.quantize_(model)
    with torch.no_grad():
        eager = model(x, ids, w)
        out, gm, report = compile_capture(model, x, ids, w)
    return x, out, eager, [s for s in report.sites if s.kind == "moe"], gm


@pytest.mark.parametrize("make,reason", [
    # ids clamped from 1: expert 0's pairs run expert 1 in the model; fused_moe would run them on expert 0
    (lambda: LoopExperts(routing=lambda i, w: (i.clamp(1, E - 1), w)), "multiplies values that fused_moe does not"),
    (lambda: LoopExperts(routing=lambda i, w: (i.clamp(min=1), w)), "multiplies values that fused_moe does not"),
    # expert 0 looped over twice: the model adds its output twice, fused_moe once
    (lambda: LoopExperts(experts=[*range(E), 0]), "adds expert(s) [0] twice"),
    (CrossedUp, ""),
    (TransposedW13, "contracts w13 over its output dim"),
    # each of these was rewritten, fused_moe computing something else (w13-bias-twice: a relative error of 0.37)
    (W13BiasTwice, "adds a bias twice"),
    (lambda: ClampedSwiGLU(up=(0.0, 0.5)), "clamps a half of w13's GEMM other than as GPT-OSS's SwiGLU does"),
    (lambda: ClampedSwiGLU(up=(-0.3, 0.3)), "multiplies values that fused_moe does not multiply"),  # two limits
    # H == 2I: w13[e].permute(0, 1) is w13[e] itself, square; x @ it is not x @ w13[e].T
    (lambda: LoopExperts(gemm=lambda x, w: x @ (w.permute(0, 1) if w.shape[0] == w.shape[1] else w.t())),
     "permutes an expert weight other than its last two dims"),
    # each of these was rewritten, fused_moe computing something else
    (CrossedDown, "multiplies w2 (expert 0) with h (expert 1)"),
    (lambda: OaiSwiGLU(limits=(0.5, 0.25, 0.25)), "multiplies values that fused_moe does not multiply"),
    (TwoW13Biases, "the experts read more than one tensor of a bias"),
    # b[top_k_index] added to rows sorted by expert: other experts' biases on most rows
    (lambda: GroupedBiased(bias_ids=lambda ids, ids_g: ids),
     "adds a bias gathered in the routing order (top_k_index's) to GEMM rows in the experts' ascending order"),
    # sorted descending: rows and offsets disagree (b[sorted ids] no longer follows a known order either)
    (lambda: GroupedBiased(descending=True), "sorts the routing ids in descending order"),
], ids=["clamp-1-E", "clamp-min-1", "an-expert-twice", "crossed-up", "transposed-w13", "w13-bias-twice",
        "up-clamped-from-0", "gate-and-up-limits-differ", "identity-permute", "crossed-down", "sigmoid-limit-differs",
        "two-w13-biases", "bias-in-routing-order", "descending-sort-with-biases"])
def test_experts_computing_something_else_are_left_alone(make, reason):
    x, out, eager, moe, gm = compiled_experts(make)
    assert [(s.fqn, s.rewritten) for s in moe] == [("experts", False)], moe
    assert reason in moe[0].reason, moe[0].reason
    assert torch.ops.fp8fx.fused_moe.default not in targets(gm)
    assert torch.allclose(out, eager, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("make", [ClampedSwiGLU, OaiSwiGLU, LoopExperts, GroupedBiased,
                                  lambda: GroupedBiased(bias=False)],
                         ids=["clamped-swiglu", "oai-swiglu", "loop", "grouped-biased", "grouped"])
def test_the_models_the_refusals_change_are_fused_as_written(make):
    """The hand-written experts the refusals above alter, unaltered (one limit, biases added once and gathered by the
    sorted ids, an ascending sort): each is fused_moe, within fp8's error of the model, so each refusal above is its
    change's."""
    x, out, eager, moe, gm = compiled_experts(make)
    assert [(s.fqn, s.rewritten) for s in moe] == [("experts", True)], moe
    assert torch.ops.fp8fx.fused_moe.default in targets(gm)
    assert rel_err(out - x, eager - x) < 0.1, rel_err(out - x, eager - x)


def test_grouped_experts_without_biases_sorted_descending_are_left_alone():
    """Pairs sorted descending against histc's ascending offsets (row groups run other experts' weights in the model)
    were fused as the ascending sort's experts (a relative error of 1.5 against the model): the sort's order was
    trusted as bookkeeping where no bias is gathered by the sorted ids. They stay unfused, with the reason."""
    x, out, eager, (moe,), gm = compiled_experts(lambda: GroupedBiased(descending=True, bias=False))
    assert rel_err(out - x, eager - x) < 1e-3 and not moe.rewritten, (rel_err(out - x, eager - x), moe)
    assert "sorts the routing ids in descending order" in moe.reason, moe.reason


@pytest.mark.parametrize("fast", [True, False])
def test_fused_moe_takes_the_backends_use_fast_accum(fast):
    model = Block(LoopExperts()).to(torch.bfloat16)
    x, ids, w = inputs(torch.bfloat16)
    fp8fx.quantize_(model)
    _, gm, _ = compile_capture(model, x, ids, w, use_fast_accum=fast)
    [node] = [n for n in gm.graph.nodes if n.target is torch.ops.fp8fx.fused_moe.default]
    assert node.args[12] is fast


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_weight_only_leaves_the_experts_on_their_dequantized_weights(impl):
    """weight_only (forced, or picked on GPUs without fp8 tensor cores) rewrote the linears to 16-bit activations but
    the experts into fused_moe, fp8 activations and all (the MoE pass was never told): they are left to run on their
    dequantized weights now, with the reason, and compute what the dequantized weights give. The experts' site is the
    one site (a loop over the experts added a linear site per expert GEMM, "read through getitem")."""
    model = hf_experts(impl, torch.bfloat16) if impl == "grouped_mm" else Block(LoopExperts()).to(torch.bfloat16)
    x, ids, w = inputs(torch.bfloat16)
    fp8fx.quantize_(model)
    out, gm, report = compile_capture(model, x, ids, w, weight_only=True)
    with torch.no_grad():
        eager = model(x, ids, w)  # (the module's own code on its dequantized .weight views)
    (site,) = report.sites
    assert (site.kind, site.fqn, site.rewritten) == ("moe", "experts", False)
    assert site.reason.startswith("weight-only (16-bit activations): fp8fx.fused_moe computes with fp8 activations")
    assert torch.ops.fp8fx.fused_moe.default not in targets(gm)
    assert torch.equal(out, eager)


def test_experts_left_alone_name_no_kernel_of_the_router():
    """Under Inductor an experts site that is not rewritten (weight_only) showed the router's kernel (``extern
    fp8fx.small_mm``: the two share a node name); its experts run as many kernels, none of them the site's."""
    example = _example()
    torch.manual_seed(0)
    model = example.Stack(num_experts=E, top_k=K, hidden=H, intermediate=I).to(torch.bfloat16).eval()
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(weight_only=True)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 3, H, dtype=torch.bfloat16))
    kernels = sorted((s.kind, s.fqn, s.kernel) for s in backend.report.sites)
    assert kernels == [("linear", f"layers.{i}.router", "extern fp8fx.small_mm") for i in (0, 1)] + [
        ("moe", f"layers.{i}.experts", "") for i in (0, 1)], backend.report


# -- experts stored transposed ([E, H, 2I] / [E, I, H]): Aria's (HF's is_transposed) and Llama-4's dense form ----------
def llama4_experts(cls=None):
    config = transformers.Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, hidden_act="silu")
    torch.manual_seed(0)
    experts = (cls or transformers.models.llama4.modeling_llama4.Llama4TextExperts)(config)
    nn.init.normal_(experts.gate_up_proj, std=H**-0.5)
    nn.init.normal_(experts.down_proj, std=I**-0.5)
    return experts


class DenseBlock(nn.Module):
    """Llama-4's MoE block around its experts: every expert on every token, the router's weights on the rows (zero
    where it did not route the token)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, scores):  # scores [T, E]
        routed = x.repeat(E, 1) * scores.t().reshape(-1, 1)
        return x + self.experts(routed).view(E, -1, H).sum(0)


def router_scores(dtype, top_k=1, seed=2):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    top, idx = logits.topk(top_k, dim=1)
    return torch.sigmoid(torch.full_like(logits, float("-inf")).scatter(1, idx, top)).to(dtype)


@pytest.mark.parametrize("config,top_k", [("per-channel", 1), ("per-tensor", 2), ("block", 1)])
def test_llama4_dense_experts_rewritten_into_fused_moe(config, top_k):
    model = DenseBlock(llama4_experts()).to(torch.bfloat16).eval()
    x, scores = inputs(torch.bfloat16)[0], router_scores(torch.bfloat16, top_k)
    with torch.no_grad():
        bf16 = model(x, scores)
        fp8fx.quantize_(model, CONFIGS[config])
        assert model.experts.gate_up_proj.shape == (E, H, 2 * I)  # the model's layout, a view of fused_moe's
        eager = model(x, scores)
        out, gm, report = compile_capture(model, x, scores)
    (site,) = report.sites
    assert (site.kind, site.fqn, site.rewritten, site.weight_shape) == ("moe", "experts", True, (E, 2 * I, H))
    assert site.scheme == str(CONFIGS[config].scheme()) + fp8fx.passes.moe.DENSE
    found = targets(gm)
    assert found.count(torch.ops.fp8fx.fused_moe.default) == 1 and torch.bmm not in found
    # exactly fused_moe on the module's fp8 tensors, row r on expert r // T with weight 1
    routed = x.repeat(E, 1) * scores.t().reshape(-1, 1)
    ids = torch.arange(E).repeat_interleave(T).view(-1, 1)
    ones = torch.ones(E * T, 1, dtype=torch.bfloat16)
    assert torch.equal(out, x + fused_reference(model.experts, routed, ids, ones, torch.bfloat16).view(E, T, H).sum(0))
    assert rel_err(out - x, eager - x) < 0.05  # activation quantization
    assert rel_err(out - x, bf16 - x) < 0.1


class DenseReversed(transformers.models.llama4.modeling_llama4.Llama4TextExperts):
    """Rows reversed before the dense GEMMs: row r runs expert (R - 1 - r) // T, not r // T."""

    def forward(self, hidden_states):
        rows = hidden_states.shape[0]
        return super().forward(hidden_states[torch.arange(rows - 1, -1, -1)])


class DenseSwapped(transformers.models.llama4.modeling_llama4.Llama4TextExperts):
    """Rows token-major ([T, E, H] made expert-major by a transpose): row r runs expert r % E."""

    def forward(self, hidden_states):
        x = hidden_states.view(-1, E, H).transpose(0, 1)
        gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(up * self.act_fn(gate), self.down_proj).transpose(0, 1).reshape(-1, H)


class DenseSummed(transformers.models.llama4.modeling_llama4.Llama4TextExperts):
    """The experts' outputs summed inside the module: one row per token, no longer each row's expert output."""

    def forward(self, hidden_states):
        return super().forward(hidden_states).view(E, -1, H).sum(0)


class DenseOutput(DenseBlock):
    def forward(self, x, scores):
        routed = x.repeat(E, 1) * scores.t().reshape(-1, 1)
        out = self.experts(routed)
        return x + (out if out.shape[0] == x.shape[0] else out.view(E, -1, H).sum(0))


@pytest.mark.parametrize("cls,reason", [
    (DenseReversed, "is not a GEMM for w13 stacked"),
    (DenseSwapped, "transposes a hidden state"),
    (DenseSummed, "the experts do not read hidden_states"),  # (an output of other rows: no input is its x)
], ids=["reversed-rows", "token-major", "summed-inside"])
def test_dense_experts_computing_something_else_are_left_alone(cls, reason):
    model = DenseOutput(llama4_experts(cls)).to(torch.bfloat16).eval()
    x, scores = inputs(torch.bfloat16)[0], router_scores(torch.bfloat16)
    fp8fx.quantize_(model)
    with torch.no_grad():
        eager = model(x, scores)
        out, gm, report = compile_capture(model, x, scores)
    (site,) = [s for s in report.sites if s.kind == "moe"]
    assert not site.rewritten and reason in site.reason, site.reason
    assert torch.ops.fp8fx.fused_moe.default not in targets(gm)
    assert torch.allclose(out, eager, rtol=0.02, atol=0.02)


class DenseBroadcast(transformers.models.llama4.modeling_llama4.Llama4TextExperts):
    """Every row on every expert: the rows [1, R, H] broadcast against the stacked weights, [E, R, H] out."""

    def forward(self, hidden_states):
        gate, up = torch.matmul(hidden_states.view(1, -1, H), self.gate_up_proj).chunk(2, dim=-1)
        return torch.matmul(up * self.act_fn(gate), self.down_proj)


class BroadcastBlock(DenseBlock):
    def forward(self, x):
        return x + self.experts(x).sum(0)


def test_dense_gemm_of_rows_broadcast_to_every_expert_is_not_the_dense_form():
    """A batched GEMM of [1, R, H] rows (not E leading row groups) against the stacked weights runs every expert on
    every row, not on its E-th of them: unchecked, it was taken for the dense form's GEMM (the output's shape refused it
    later, naming no GEMM). It is refused at that GEMM, with the reason."""
    model = BroadcastBlock(llama4_experts(DenseBroadcast)).to(torch.bfloat16).eval()
    x = inputs(torch.bfloat16)[0][:E]  # E rows: the experts' [E, E, H] output has the hidden states' leading size
    fp8fx.quantize_(model)
    with torch.no_grad():
        eager = model(x)
        out, gm, report = compile_capture(model, x)
    (site,) = [s for s in report.sites if s.kind == "moe"]
    assert not site.rewritten and "(call_function matmul) is not a GEMM for w13 stacked" in site.reason, site.reason
    assert torch.ops.fp8fx.fused_moe.default not in targets(gm)
    assert torch.equal(out, eager)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_aria_transposed_experts_rewritten_into_fused_moe(impl):
    """HF's is_transposed experts (Aria: [E, H, 2I] / [E, I, H], which its checkpoints hold) were left bf16: fp8fx
    stores fused_moe's layout and hands the model transposed views."""
    config = transformers.AriaTextConfig(hidden_size=H, intermediate_size=I, moe_num_experts=E, moe_topk=K)
    config._experts_implementation = impl
    torch.manual_seed(0)
    experts = transformers.models.aria.modeling_aria.AriaExperts(config)
    if "gate_up_proj" not in experts._parameters:  # (transformers 5.17's AriaExperts: a grouped GEMM of its own)
        pytest.skip(f"transformers {transformers.__version__}'s AriaExperts holds no gate_up_proj")
    nn.init.normal_(experts.gate_up_proj, std=H**-0.5)
    nn.init.normal_(experts.down_proj, std=I**-0.5)
    model = Block(experts).to(torch.bfloat16).eval()
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        bf16 = model(x, ids, w)
        fp8fx.quantize_(model)
        assert model.experts.gate_up_proj.shape == (E, H, 2 * I)
        out, gm, report = compile_capture(model, x, ids, w)
    (site,) = report.sites
    assert site.rewritten and site.scheme == str(fp8fx.Fp8Config().scheme()), site
    assert torch.equal(out, x + fused_reference(model.experts, x, ids, w, torch.bfloat16))
    assert rel_err(out - x, bf16 - x) < 0.1


# -- Llama-4's MoE block: the dense form routed by the router's top-k -----------------------------------------------
def llama4_block(top_k, router_forward=None):
    l4 = transformers.models.llama4.modeling_llama4
    config = transformers.Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, hidden_act="silu",
                                           num_experts_per_tok=top_k)
    torch.manual_seed(0)
    block = l4.Llama4TextMoe(config)
    nn.init.normal_(block.experts.gate_up_proj, std=H**-0.5)
    nn.init.normal_(block.experts.down_proj, std=I**-0.5)
    if router_forward is not None:
        block.router.forward = types.MethodType(router_forward, block.router)
    return block.to(torch.bfloat16).eval()


def zero_filled(self, hidden_states):
    """sigmoid of the top-k scattered into zeros: the experts the router did not pick get weight 0.5, not 0."""
    logits = F.linear(hidden_states, self.weight)
    top, idx = torch.topk(logits, self.top_k, dim=1)
    return torch.sigmoid(torch.zeros_like(logits).scatter_(1, idx, top).float()).to(logits.dtype), logits


def softmax_scores(self, hidden_states):
    logits = F.linear(hidden_states, self.weight)
    return torch.softmax(logits.float(), dim=1).to(logits.dtype), logits


def sigmoid_twice(self, hidden_states):
    """A sigmoid in the chain, but sigmoid(sigmoid(-inf)) = 0.5: every expert weighs."""
    scores, logits = Llama4Router_forward(self, hidden_states)
    return torch.sigmoid(scores), logits


def values_changed(self, hidden_states):
    """The top-k values changed in place after the model scattered them: routed rows built later read the change."""
    logits = F.linear(hidden_states, self.weight)
    top, idx = torch.topk(logits, self.top_k, dim=1)
    scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, idx, top).float()).to(logits.dtype)
    top.mul_(-1.0)
    return scores, logits


def Llama4Router_forward(self, hidden_states):
    return transformers.models.llama4.modeling_llama4.Llama4Router.forward(self, hidden_states)


def _moe_pass_only(model, x, monkeypatch=None):
    graphs, report = [], fp8fx.report.Report()

    def moe_only(gm, example_inputs):
        fp8fx.passes.PassManager([MoePass()], {}).run(gm, example_inputs, report)
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        out = torch.compile(model, backend=moe_only, fullgraph=True)(x)[0]
    torch._dynamo.reset()
    return out, graphs[0], report


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_block_routed_by_its_router(top_k, monkeypatch):
    """Llama-4's block feeds its experts every token once per expert, weighted by a sigmoid of the router's top-k
    scattered into -inf (0 for every expert it did not pick): the pass runs fused_moe on the T * K rows the router
    picked instead of the E * T rows, and gives what the dense rewrite gives (bit for bit at top-1; at top-2 the K
    outputs are added in another order)."""
    model = llama4_block(top_k)
    x = inputs(torch.bfloat16)[0]
    with torch.no_grad():
        bf16 = model(x)[0]
        fp8fx.quantize_(model)
        eager = model(x)[0]
    routed, gm, report = _moe_pass_only(model, x)
    (site,) = [s for s in report.sites if s.kind == "moe"]
    assert site.rewritten and site.scheme.endswith(fp8fx.passes.moe.ROUTED), site
    found = targets(gm)
    assert found.count(torch.ops.fp8fx.fused_moe.default) == 1
    assert fp8fx.passes.moe.router_weighted_rows in found and not {torch.bmm, fp8fx.passes.moe.dense_routing} & set(
        found)
    [node] = [n for n in gm.graph.nodes if n.target is torch.ops.fp8fx.fused_moe.default]
    assert node.meta["example_value"].shape == (T * top_k, H)  # T * K rows, not E * T
    monkeypatch.setattr(fp8fx.passes.moe, "_route_dense", lambda graph, fused: False)
    dense, _, report = _moe_pass_only(model, x)
    assert report.sites[0].scheme.endswith(fp8fx.passes.moe.DENSE)
    if top_k == 1:
        assert torch.equal(routed, dense)
    else:
        assert rel_err(routed, dense) < 0.01
    assert rel_err(routed, eager) < 0.05
    assert rel_err(routed, bf16) < 0.1


@pytest.mark.parametrize("router", [zero_filled, softmax_scores, sigmoid_twice, values_changed],
                         ids=["scattered-into-zeros", "softmax", "sigmoid-twice", "values-changed-in-place"])
def test_llama4_block_whose_router_weights_every_expert_stays_dense(router):
    """Scores that are not 0 for the experts the router did not pick: every expert's output counts, so the dense
    rewrite stays (routing by the top-k would drop them); so does a router whose top-k values change after they were
    scattered (routed rows would read the change)."""
    model = llama4_block(1, router)
    x = inputs(torch.bfloat16)[0]
    fp8fx.quantize_(model)
    with torch.no_grad():
        eager = model(x)[0]
    out, gm, report = _moe_pass_only(model, x)
    (site,) = [s for s in report.sites if s.kind == "moe"]
    assert site.rewritten and site.scheme.endswith(fp8fx.passes.moe.DENSE), site
    assert fp8fx.passes.moe.dense_routing in targets(gm)
    assert rel_err(out, eager) < 0.05


@pytest.mark.parametrize("change", [
    lambda x: x.mul_(3.0),
    lambda x: x.scatter_(1, torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device), 5.0),  # (the router's
], ids=["mul_", "scatter_"])                                                                    # own op, elsewhere)
def test_llama4_block_changing_its_hidden_states_after_the_experts_stays_dense(change):
    """The block changes its hidden states in place after the experts read them: routed rows are built from the hidden
    states where the model's rows were, and a change between the router and the combine keeps the dense form."""
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(hidden_states)
        routed = self.experts(hidden_states.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1))
        change(hidden_states)
        out = self.shared_expert(hidden_states)
        return out + routed.reshape(scores.shape[1], -1, routed.shape[-1]).sum(dim=0), logits

    model = llama4_block(1)
    model.forward = types.MethodType(forward, model)
    x = inputs(torch.bfloat16)[0]
    fp8fx.quantize_(model)
    with torch.no_grad():
        eager = model(x.clone())[0]
    out, gm, report = _moe_pass_only(model, x.clone())
    (site,) = [s for s in report.sites if s.kind == "moe"]
    assert site.rewritten and site.scheme.endswith(fp8fx.passes.moe.DENSE), site
    assert rel_err(out, eager) < 0.05


def test_ungated_experts_copied_and_pickled_stay_fused():
    """A deep copy and a torch.save / torch.load round trip of quantized ungated experts keep their class (the view of
    up_proj, none of gate_up_proj) and their tags: the copies are fused as the original is."""
    import copy
    import io

    model = nemotron_h_experts("grouped_mm")
    fp8fx.quantize_(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    x, ids, w = inputs(torch.bfloat16)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert type(other.experts) is type(model.experts)
        assert hasattr(other.experts, "up_proj") and not hasattr(other.experts, "gate_up_proj")
        with torch.no_grad():
            _, _, report = compile_capture(other, x, ids, w)
        (site,) = report.sites
        assert site.rewritten and site.scheme.endswith("(ungated, squared ReLU)"), site.reason


def test_ungated_experts_cast_to_float16_beyond_its_range_are_refused():
    """A cast of quantized experts to float16 where fp8 * scale passes 65504 is refused, as for gated experts (up_proj
    was not checked: its dequantized view held inf)."""
    model = nemotron_h_experts("grouped_mm")
    with torch.no_grad():
        model.experts.up_proj[0, 0, 0] = 1e5
    fp8fx.quantize_(model)
    with pytest.raises(ValueError, match=r"experts: cast to torch.float16, but a scale of .* is beyond torch.float16's "
                                         r"range"):
        model.half()
    assert model.experts.up_proj.dtype == torch.bfloat16


def test_calibrate_refuses_ungated_experts_with_no_act_fn():
    """Gated experts with no act_fn are measured with SiLU (the pass reads their code); ungated ones have no default
    activation: calibrate says so before it runs (it failed with an AttributeError inside its hook)."""
    model = nemotron_h_experts("grouped_mm")
    del model.experts.act_fn
    with pytest.raises(ValueError, match=r"calibrate: experts holds ungated experts with no act_fn; .* give the module "
                                         r"its activation as act_fn, or add it to ignored_layers \(nothing was run\)"):
        fp8fx.calibrate(model, [inputs(torch.bfloat16)])


class SplitGateExperts(nn.Module):
    """Inkling's shared experts' layout: gated, with 3-D gate_proj, up_proj and down_proj of their own."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(2, I, H) / H**0.5)
        self.up_proj = nn.Parameter(torch.randn(2, I, H) / H**0.5)
        self.down_proj = nn.Parameter(torch.randn(2, H, I) / I**0.5)

    def forward(self, x):
        x = x.expand(2, -1, -1)
        h = F.silu(torch.bmm(x, self.gate_proj.transpose(1, 2))) * torch.bmm(x, self.up_proj.transpose(1, 2))
        return torch.bmm(h, self.down_proj.transpose(1, 2)).sum(0)


def test_split_gate_experts_are_not_taken_for_ungated_ones(caplog):
    """3-D up_proj / down_proj beside a 3-D gate_proj are gated experts in a layout fp8fx does not read: not ungated
    experts (quantize_ stored up_proj and down_proj in fp8 and left the gate bf16, never fused), said and kept."""
    model = nn.Sequential(nn.Linear(H, H), SplitGateExperts()).to(torch.bfloat16)
    experts = model[1]
    assert not fp8fx.weights.moe.is_ungated_experts(experts)
    with caplog.at_level("WARNING", logger="fp8fx"):
        fp8fx.quantize_(model)
    assert {p.dtype for p in experts.parameters()} == {torch.bfloat16} and fp8fx.weights.is_quantized(model[0])
    assert "SplitGateExperts holds its experts as gate_proj, up_proj, down_proj, a layout fp8fx does not read" in \
        caplog.text


def test_experts_with_a_norm_submodule_stay_bf16_with_the_reason():
    """Ergo's experts: ungated, with a post_expert_norm submodule of per-expert weights and no HF flag saying so.
    quantize_ stored them in fp8 and the MoE pass then left them unfused (fp8 error, no speedup): they stay bf16, and
    the reason names the norm."""
    model = nemotron_h_experts("grouped_mm")
    model.experts.post_expert_norm = nn.Module()
    model.experts.post_expert_norm.weight = nn.Parameter(torch.ones(E, H, dtype=torch.bfloat16))
    reason = "a norm after each expert (post_expert_norm) is not supported by fp8fx.fused_moe"
    with pytest.raises(ValueError, match=re.escape(f"experts: {reason}")):
        fp8fx.quantize_(model, strict=True)
    fp8fx.quantize_(model)
    assert model.experts.up_proj.dtype == torch.bfloat16


class StackedExperts(nn.Module):
    """JetMoE's ``JetMoeParallelExperts``: 3-D [E, out, in] experts run as one F.linear per expert."""

    def __init__(self, out_features, in_features):
        super().__init__()
        self.num_experts = E
        self.weight = nn.Parameter(torch.randn(E, out_features, in_features) / in_features**0.5)

    def forward(self, x, sizes):
        return torch.cat([F.linear(part, self.weight[e]) for e, part in enumerate(x.split(sizes))])


class StackedRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(H, E, bias=False)

    def forward(self, x):
        ids = self.layer(x).float().topk(1, dim=-1).indices.flatten()
        sizes = torch.bincount(ids, minlength=E).tolist()  # (a graph break, as JetMoE's .tolist())
        return ids.argsort(stable=True), sizes


class StackedMoE(nn.Module):
    """JetMoE's MoE block (``JetMoeMoE``): its router a module of its own, its experts two stacked modules."""

    def __init__(self):
        super().__init__()
        self.router = StackedRouter()
        self.input_linear = StackedExperts(2 * I, H)
        self.output_linear = StackedExperts(H, I)

    def forward(self, x):
        order, sizes = self.router(x)
        gate, up = self.input_linear(x[order], sizes).chunk(2, dim=-1)
        out = self.output_linear(F.silu(gate) * up, sizes)
        return x + torch.zeros_like(x).index_add(0, order, out)


@pytest.mark.parametrize("parts", [False, True])
def test_experts_of_a_foreign_layout_are_named_and_explained_in_every_frame(parts):
    """Experts fp8fx does not read (JetMoE's stacked [E, out, in] weights, one F.linear per expert), in blocks
    that Dynamo compiles as frames of their own (a graph break in the router) and reuses for the second block:
    each per-expert linear was named by its path inside the frame ("input_linear") with "run fp8fx.quantize_"
    as the reason, although quantize_ had run and said why it left them; and the second block's router took
    the first block's reason. Each now has its module's name and quantize_'s reason, each router its block's; also
    where the model is quantized block by block (``parts``), a quantize_ that quantizes nothing of the block."""
    torch.manual_seed(0)
    model = nn.Sequential(StackedMoE(), StackedMoE(), nn.Linear(H, H)).to(torch.bfloat16).eval()
    for prefix, part in [(str(i), model[i]) for i in range(3)] if parts else [("", model)]:
        fp8fx.quantize_(part, prefix=prefix)
    backend = fp8fx.Fp8Backend(compiler="eager")
    x = torch.randn(T, H, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.compile(model, backend=backend)(x)
    sites = {(s.fqn, s.reason) for s in backend.report.sites}
    modules = dict(model.named_modules())
    assert all(fqn in modules for fqn, _ in sites), sorted(sites)
    layout = "not quantized: StackedExperts holds its 4 experts as weight, a layout fp8fx does not read"
    for block in ("0", "1"):
        for experts in ("input_linear", "output_linear"):
            reasons = {r for f, r in sites if f == f"{block}.{experts}"}
            assert len(reasons) == 1 and reasons.pop().startswith(layout)
        (router,) = {r for f, r in sites if f == f"{block}.router.layer"}
        assert router.startswith(f"not quantized: routes tokens to {block}.input_linear and {block}.output_linear "), \
            router
    assert not any("run fp8fx.quantize_" in r for _, r in sites)
    # the last linear, called by nn.Sequential's forward, which Dynamo ran uncompiled after the graph break (torch's
    # own code): its weight's property was all it compiled of it, which the report said was "read by output"
    (last,) = {r for f, r in sites if f == "2"}
    assert last.startswith("the dequantized weight is all this graph computes: the layer ran uncompiled"), last
    assert backend.report.unhandled_weights(model) == []


class _SortedExperts(nn.Module):
    """HF's grouped_mm form written out (rows sorted by expert, grouped GEMMs, un-sorted, summed over k), with the
    order of its rows got wrong in ``variant``."""

    def __init__(self, variant, e=4, h=64, i=32):
        super().__init__()
        self.num_experts, self.variant = e, variant
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) / h**0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) / i**0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from transformers.integrations.moe import _grouped_linear

        k, (t, h) = top_k_index.size(-1), hidden_states.shape
        weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)
        ids_g, perm = torch.sort(ids)
        offsets = torch.cumsum(torch.histc(ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts - 1),
                               dim=0, dtype=torch.int32)
        g = _grouped_linear(hidden_states[perm // k], self.gate_up_proj, offsets)
        gate, up = g.chunk(2, dim=-1)
        y = _grouped_linear(F.silu(gate) * up, self.down_proj, offsets)
        y = y * (weights if self.variant == "weights-in-routing-order" else weights[perm]).unsqueeze(-1)
        if self.variant == "not-unsorted":
            return y.view(t, k, h).sum(dim=1)
        if self.variant == "argsort":
            inverse = torch.argsort(perm)
        else:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.size(0))
        return y[inverse].view(t, k, h).sum(dim=1)


class _SortedMoE(nn.Module):
    def __init__(self, variant, e=4, k=2, h=64):
        super().__init__()
        self.k = k
        self.router = nn.Linear(h, e, bias=False)
        self.experts = _SortedExperts(variant, e, h)

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.router(x).float(), -1), self.k, -1)
        return self.experts(x, ids, (w / w.sum(-1, keepdim=True)).to(x.dtype))


@pytest.mark.parametrize("variant,refusal", [
    ("inverse-by-setitem", None), ("argsort", None),
    ("weights-in-routing-order", r"weights GEMM rows in the experts' ascending order \(a sort of the routing ids\) "
                                 r"with routing weights in the routing order \(top_k_index's\): each row with another "
                                 r"pair's weight"),
    ("not-unsorted", r"sums expert outputs whose rows are still in the experts' order \(a sort of the routing ids\): "
                     r"each token's k rows are not its own; un-sort them first"),
])
def test_the_order_of_sorted_rows_is_followed_through_the_weights_and_the_un_sort(variant, refusal):
    """Experts code that weights rows sorted by expert with the routing weights in top_k_index's order, or sums rows
    still sorted: the pass took the index bookkeeping on trust and rewrote both into fused_moe, whose routed answer
    was 39% / 116% off the model's own (h161). They are refused, naming the node; HF's un-sort (inv[perm] = arange)
    and argsort(perm) are followed, and rewritten, within fp8 error of the model."""
    torch.manual_seed(0)
    model = fp8fx.quantize_(_SortedMoE(variant).to(torch.bfloat16).eval())
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        want, got = model(x), torch.compile(model, backend=backend)(x)
    site = next(s for s in backend.report.sites if s.kind == "moe")
    if refusal is None:
        assert site.rewritten, site.reason
        assert rel_err(got.float(), want.float()) < 0.05
    else:
        assert not site.rewritten and re.search(refusal, site.reason), site.reason
        assert torch.equal(got, want)  # (the model's own code, as it is)
