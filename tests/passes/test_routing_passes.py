"""The top-k and router passes on Dynamo graphs: ``torch.topk`` / ``Tensor.topk`` of short rows become
``fp8fx.topk``, every other top-k stays torch's, in the report's ``topk`` list with the reason; HF MoE routers' linears
become ``fp8fx.small_mm``; the output is the model's."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8fx
from fp8fx.passes import default_passes
from fp8fx.passes.base import PassContext
from fp8fx.passes.topk import TopkPass
from fp8fx.report import Report
from tests.conftest import rel_err


class Router(nn.Module):
    """A softmax router's top-k (Qwen3-MoE's), a sigmoid router's with group scores (DeepSeek-V3's form, by methods
    and keywords), and top-ks the pass must leave: over dim 0, of a row too long, returned whole."""

    def __init__(self, e=16, h=32):
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)

    def forward(self, x, wide):
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, 4, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        groups = logits.sigmoid().view(-1, 4, 4).topk(k=2, dim=2, sorted=False)[0].sum(-1)
        low = groups.topk(1, -1, largest=False).indices
        by_token = torch.topk(logits, 2, dim=0)[1]  # (over tokens: not a row)
        long_row = torch.topk(wide, 3)[0]  # (5000 wide)
        whole = torch.topk(probs, 2)
        return weights, ids, low, by_token, long_row, whole


def capture(model, *args, enabled=True, fuse_routing=False):
    """(the model's outputs through the pass, the graph after it, its report)."""
    report, seen = Report(), []

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        TopkPass(enabled, fuse_routing)(gm, PassContext(report, 0, dict(zip(placeholders, example_inputs))))
        gm.graph.lint()
        gm.recompile()
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(*args)
    return out, seen[0], report


def inputs(t=5):
    g = torch.Generator().manual_seed(0)
    return torch.randn(t, 32, generator=g), torch.randn(2, 5000, generator=g)


def test_router_topks_rewritten_others_reported_with_their_reason():
    torch.manual_seed(0)
    model = Router().eval()
    x, wide = inputs()
    out, gm, report = capture(model, x, wide)
    with torch.no_grad():
        want = model(x, wide)
    for got, ref in zip(out[:5], want[:5]):
        assert torch.equal(got, ref)
    assert torch.equal(out[5].values, want[5].values) and torch.equal(out[5].indices, want[5].indices)
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.fp8fx.topk.default]
    assert [n.args[1:] for n in calls] == [(4, True), (2, True), (1, False), (2, True)]
    assert all(u.target is operator.getitem for n in calls for u in n.users)
    rows = [(s.fqn, s.rewritten, s.scheme or s.reason, s.weight_shape) for s in report.topk]
    assert rows == [
        ("", True, "k=4 of 16", (5, 16)),
        ("", True, "k=2 of 4", (5, 4, 4)),
        ("", True, "k=1 of 4 smallest", (5, 4)),
        ("", False, "over dim 0 of a 2-d tensor (fp8fx.topk takes the last dim)", (5, 16)),
        ("", False, "a row of 5000 elements (the kernel takes k-4096)", (2, 5000)),
        ("", True, "k=2 of 16", (5, 16)),
    ], rows
    assert report.sites == []  # (no weight site: the top-k list is apart)
    table = report.table()
    assert "4 of 6 top-k rewritten to fp8fx's top-k ops" in table and "k=1 of 4 smallest" in table, table
    assert report.to_dict()["topk"][0] == dict(fqn="", rewritten=True, reason="", scheme="k=4 of 16", graph=0,
                                               weight_shape=[5, 16], kernel="extern fp8fx.topk", node="topk")


def test_an_exported_programs_topks_are_rewritten_and_reported():
    """The README's export route (torch.compile of an exported program's module()): its graph holds aten.topk, which
    the pass did not see, so report.topk had no row for an exported MoE's router (found by a probe of Mixtral)."""
    torch.manual_seed(0)
    model = Router().eval()
    x, wide = inputs()
    with torch.no_grad():
        exported = torch.export.export(model, (x, wide)).module()
        want = model(x, wide)
    out, gm, report = capture(exported, x, wide)
    for got, ref in zip(out[:5], want[:5]):
        assert torch.equal(got, ref)
    assert [n.args[1:] for n in gm.graph.nodes if n.target is torch.ops.fp8fx.topk.default] == [
        (4, True), (2, True), (1, False), (2, True)]
    assert [(s.rewritten, s.scheme or s.reason) for s in report.topk] == [
        (True, "k=4 of 16"), (True, "k=2 of 4"), (True, "k=1 of 4 smallest"),
        (False, "over dim 0 of a 2-d tensor (fp8fx.topk takes the last dim)"),
        (False, "a row of 5000 elements (the kernel takes k-4096)"), (True, "k=2 of 16")]


def test_disabled_pass_sees_nothing():
    model = Router().eval()
    _, gm, report = capture(model, *inputs(), enabled=False)
    assert report.topk == [] and not any(n.target is torch.ops.fp8fx.topk.default for n in gm.graph.nodes)
    assert "top-k" not in report.table()


def test_backend_option_and_report_of_a_compiled_model():
    """``Fp8Backend()`` runs the pass last (after the MoE pass, which reads Llama-4's router top-k as torch's);
    ``fast_topk=False`` leaves every top-k and is part of the compile-cache key; a graph that failed to compile
    takes its top-ks' rewrites back."""
    names = [type(p).__name__ for p in default_passes()]
    assert names[0] == "MoePass" and names[-1] == "TopkPass"
    model = Router().eval()
    x, wide = inputs(3)
    torch._dynamo.reset()
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x, wide)
        want = model(x, wide)
    assert torch.equal(out[1], want[1]) and torch.allclose(out[0], want[0], rtol=1e-6, atol=0)  # (softmax_topk's)
    assert [s.rewritten for s in backend.report.topk] == [True, True, True, False, False, True]
    assert "fp8fx.topk" in str(backend.report) and "fp8fx.softmax_topk" in str(backend.report)
    off = fp8fx.Fp8Backend(compiler="eager", fast_topk=False)
    assert off.cache_key() != backend.cache_key()
    assert fp8fx.Fp8Backend(compiler="eager", fuse_routing=False).cache_key() not in (off.cache_key(),
                                                                                      backend.cache_key())
    backend.report.fail_graph(0, "a test's failure")
    assert not any(s.rewritten for s in backend.report.topk)
    assert {s.reason for s in backend.report.topk if s.scheme == ""} >= {"a test's failure"}
    backend.report.discard_graph(0)
    assert backend.report.topk == []


def test_a_topk_of_a_graph_recording_grad_is_left():
    model = Router().train()
    x, wide = inputs()
    report, seen = Report(), []

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        TopkPass()(gm, PassContext(report, 0, dict(zip(placeholders, example_inputs))))
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x, wide)  # (grad on: the gate's weight requires it)
    reasons = [s.reason for s in report.topk]
    assert reasons[:3] == ["its input requires grad (fp8fx.topk has no autograd formula)"] * 3, reasons


@pytest.mark.parametrize("k", [0, 33])
def test_k_the_kernel_does_not_take_is_left(k):
    class M(nn.Module):
        def forward(self, x):
            v, i = torch.topk(x, k)
            return v, i

    _, _, report = capture(M(), torch.randn(2, 40))
    assert [s.reason for s in report.topk] == [f"k={k} (the kernel takes 1-32)"]


def test_a_topk_used_whole_is_left():
    """A graph that uses the top-k's result other than by [0] / [1] (an FX graph of its own: Dynamo's index it)."""
    gm = torch.fx.symbolic_trace(lambda x: torch.topk(x, 2))
    x = torch.randn(3, 8)
    for node in gm.graph.nodes:
        node.meta["example_value"] = x if node.op == "placeholder" else None
    report = Report()
    assert TopkPass()(gm, PassContext(report, 0, {})) == 0
    assert [s.reason for s in report.topk] == ["its result is used whole, not as values [0] and indices [1]"]


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "nemotron_h"])
def test_hf_routers_linear_and_topk_rewritten(name, monkeypatch):
    """A quantized HF MoE layer (tiny dims): its router's linear runs as fp8fx.small_mm (Nemotron-H's float32 router on
    the 16-bit hidden states themselves: the kernel casts as it loads); its top-k with the softmax router's softmax
    and normalization as fp8fx.softmax_topk (Qwen3-MoE's, GPT-OSS's), or the sigmoid router's three top-ks, masks
    and weights as fp8fx.grouped_topk (Nemotron-H's); the output is that of the same compile with all of it left to
    torch (off CUDA the ops are torch's) within a bf16 rounding of the routing weights (rounded once, not after each
    step). The router's site keeps its reason."""
    pytest.importorskip("transformers")
    import sys

    from tests.conftest import record_graphs_after_passes

    monkeypatch.syspath_prepend("benchmarks")
    monkeypatch.delitem(sys.modules, "bench_moe_layer", raising=False)
    from bench_moe_layer import _out, moe_layer

    layer, hidden = moe_layer(name, "cpu", tiny=True)
    fp8fx.quantize_(layer, fp8fx.Fp8Config())
    x = torch.randn(1, 3, hidden, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    outs, codes = [], []
    for on in (True, False):
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(compiler="eager", fast_topk=on, fast_router=on)
        codes.append(record_graphs_after_passes(backend))
        with torch.no_grad():
            outs.append(_out(torch.compile(layer, backend=backend)(x)))
        router = [s for s in backend.report.sites if "routes tokens" in s.reason]
        assert len(router) == 1 and not router[0].rewritten, backend.report
        assert len(backend.report.topk) == ((3 if name == "nemotron_h" else 1) if on else 0), backend.report.topk
    fast, slow = codes[0][0], codes[1][0]
    assert fast.count("torch.ops.fp8fx.small_mm.default(") == 1 and "small_mm" not in slow, fast
    sigmoid = name == "nemotron_h"  # (a sigmoid router: its three top-ks, sigmoid, masks and weights in one op)
    assert "torch.ops.fp8fx.topk.default(" not in fast and "torch.topk(" not in fast and "sigmoid" not in fast, fast
    assert fast.count("torch.ops.fp8fx.softmax_topk.default(") == (not sigmoid) and "softmax(" not in fast, fast
    assert fast.count("torch.ops.fp8fx.grouped_topk.default(") == sigmoid, fast
    assert rel_err(outs[0], outs[1]) < 2e-3, rel_err(outs[0], outs[1])
    if name == "nemotron_h":  # (the 16-bit hidden states go in, not their float32 cast)
        call = next(line for line in fast.splitlines() if "small_mm.default(" in line)
        assert "small_mm.default(hidden_states, l_self_modules_gate_parameters_weight_, None, torch.float32)" in call \
            and ".type(torch.float32)" not in fast, fast


def test_inductor_calls_the_ops():
    """Through Inductor (CPU) the rewritten top-ks run as fp8fx's op, called directly by its code; the output is that of
    the same compile with torch's top-k (Inductor's softmax and sigmoid are not eager's to the last bit)."""
    model = Router().eval()
    x, wide = inputs(4)
    torch._dynamo.reset()
    backend = fp8fx.Fp8Backend(dump_dir=None)
    from torch._inductor.utils import run_and_get_code

    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(model, backend=backend), x, wide)
        torch._dynamo.reset()
        want = torch.compile(model, backend=fp8fx.Fp8Backend(fast_topk=False))(x, wide)
    assert all(torch.equal(a, b) for a, b in zip(out[1:5], want[1:5]))
    assert torch.allclose(out[0], want[0], rtol=1e-6, atol=0)  # (the softmax router's weights: softmax_topk's)
    assert torch.equal(out[5].indices, want[5].indices) and torch.allclose(out[5].values, want[5].values, rtol=1e-6)
    code = "\n".join(code)
    assert code.count("fp8fx_direct.topk(") == 2 and code.count("fp8fx_direct.softmax_topk(") == 2, code
    assert code.count("aten.topk.default(") == 2, code
    assert [s.kernel.removeprefix("extern fp8fx.") for s in backend.report.topk if s.rewritten] == [
        "softmax_topk", "topk", "topk", "softmax_topk"]  # (the last: the probabilities' top-k, its result used whole)


def test_router_linears_the_kernel_would_change_are_left():
    """Under ``torch.autocast`` a float32 router's linear computes in bf16 (the op would say float32), and a bias that
    broadcasts is not the kernel's [N]: both stay torch's, and the output is the model's, in its dtype."""
    from fp8fx.weights.moe import router_reason

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 64))
            self.weight._fp8fx_skip_reason = router_reason("experts")

        def forward(self, x, bias):
            return F.linear(x.float(), self.weight.float()), F.linear(x.float(), self.weight, bias)

    model = Gate().eval()
    x, bias = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(1)
    for autocast in (False, True):
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(compiler="eager")
        from tests.conftest import record_graphs_after_passes

        codes = record_graphs_after_passes(backend)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = torch.compile(model, backend=backend)(x, bias)
            want = model(x, bias)
        assert [o.dtype for o in out] == [w.dtype for w in want] == [torch.bfloat16 if autocast else torch.float32] * 2
        assert all(torch.equal(o, w) for o, w in zip(out, want))
        assert codes[0].count("fp8fx.small_mm.default(") == (0 if autocast else 1), codes[0]


def test_a_shared_experts_gate_runs_as_small_mm_with_its_own_reason():
    """Qwen2-MoE's shared_expert_gate (one output, an nn.Linear): quantize_ keeps it bf16 saying it gates the shared
    expert (it said it routes tokens, which it does not); the router pass still takes it, one small_mm."""
    transformers = pytest.importorskip("transformers")
    from tests.conftest import record_graphs_after_passes

    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = transformers.Qwen2MoeForCausalLM(cfg).model.layers[0].mlp.to(torch.bfloat16).eval()
    fp8fx.quantize_(block, fp8fx.Fp8Config(), prefix="model.layers.0.mlp")
    backend = fp8fx.Fp8Backend(compiler="eager")
    codes = record_graphs_after_passes(backend)
    x = torch.randn(1, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out, want = torch.compile(block, backend=backend)(x), block(x)
    assert rel_err(out, want) < 0.1  # (the experts' fp8 activations: eager runs them in bf16)
    gate = next(s for s in backend.report.sites if s.fqn == "model.layers.0.mlp.shared_expert_gate")
    assert gate.reason == ("not quantized: gates the shared expert beside model.layers.0.mlp.experts (an MoE router or "
                           "gate: high precision, as vLLM keeps it)") and not gate.rewritten, backend.report
    assert "l_self_modules_shared_expert_gate_parameters_weight_" in "".join(
        line for line in codes[0].splitlines() if "fp8fx.small_mm.default(" in line), codes[0]


class SoftmaxRouters(nn.Module):
    """Softmax routers' forms: Qwen3-MoE's (float32 softmax, ``/=`` its sum, a cast), Mixtral's (the softmax of a
    ``.float()`` cast, ``/`` its sum), GPT-OSS's (the softmax of the k top logits, dim 1), probabilities not
    renormalized that something else also reads (Qwen2-MoE's ``norm_topk_prob=False``); a sum without keepdim and a
    division by another tensor, which stay (the softmax alone joins); top-ks that stay plain: the smallest, bf16
    probabilities."""

    def forward(self, logits, logits32, other):
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top, ids = torch.topk(probs, 4, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        qwen3 = (top.to(logits.dtype), ids)
        top, ids = torch.softmax(logits.float(), -1).topk(2, dim=-1)
        mixtral = (top / top.sum(-1, keepdim=True), ids)
        top, ids = torch.topk(logits, 4, dim=-1)
        gpt_oss = (F.softmax(top, dim=1, dtype=top.dtype), ids)
        probs32 = logits32.softmax(-1)
        top, ids = torch.topk(probs32, 3)
        plain = (top, ids, probs32.sum(-1))
        smallest = torch.topk(probs32, 2, largest=False)
        summed = torch.topk(probs32, 2)[0]
        no_keepdim = summed / summed.sum(-1)[:, None]
        divided = torch.topk(probs32, 2)[0]
        by_other = divided / other
        bf16 = torch.topk(logits.softmax(-1), 2)
        return qwen3, mixtral, gpt_oss, plain, smallest, no_keepdim, by_other, bf16


def test_softmax_routers_join_the_topk_launch():
    """Each softmax router's softmax, top-k, renormalization and cast become one ``fp8fx.softmax_topk`` (the graph
    keeps none of those nodes, but the probabilities another node reads); its ids are torch's, its weights within a
    rounding of the graph's (float32: 1e-6; bf16: one unit in the last place, 2^-7 relative: both round a float32 value
    once). The top-ks it does not take stay plain, their values torch's bit for bit."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 16, generator=g) * 2).to(torch.bfloat16)
    logits32, other = torch.randn(5, 24, generator=g), torch.rand(5, 2, generator=g) + 0.5
    model = SoftmaxRouters()
    out, gm, report = capture(model, logits, logits32, other, fuse_routing=True)
    with torch.no_grad():
        want = model(logits, logits32, other)
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.fp8fx.softmax_topk.default]
    assert [(n.args[0].name, *n.args[1:]) for n in calls] == [
        ("l_logits_", 4, True, torch.bfloat16), ("l_logits_", 2, True, torch.float32),
        ("l_logits_", 4, True, torch.bfloat16), ("l_logits32_", 3, False, torch.float32),
        ("l_logits32_", 2, False, torch.float32), ("l_logits32_", 2, False, torch.float32)]
    left = [n.target for n in gm.graph.nodes if n.op != "placeholder" and n.target is not operator.getitem]
    names = [getattr(t, "__name__", t) for t in left]
    assert names.count("softmax") == 2 and names.count("sum") == 2 and "float" not in names, names
    assert names.count("truediv") == 2 and "itruediv" not in names and "to" not in names, names
    for got, ref in zip(out[:4], want[:4]):
        assert torch.equal(got[1], ref[1])  # the experts, in torch's order
        assert got[0].dtype == ref[0].dtype
        bound = 2 ** -7 if ref[0].dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(got[0].float(), ref[0].float(), rtol=bound, atol=0), (got[0], ref[0])
    assert torch.equal(out[3][2], want[3][2])
    for got, ref in zip(out[5:7], want[5:7]):
        assert torch.allclose(got, ref, rtol=1e-6, atol=0)
    for got, ref in (out[4], want[4]), (out[7], want[7]):
        assert torch.equal(got.values, ref.values) and torch.equal(got.indices, ref.indices)
    rows = [(s.scheme, s.kernel.removeprefix("extern fp8fx.")) for s in report.topk]
    assert rows == [
        ("k=4 of 16 with its softmax, renormalized, bfloat16", "softmax_topk"),
        ("k=2 of 16 with its softmax, renormalized, float32", "softmax_topk"),
        ("k=4 of 16 with the softmax of the k, bfloat16", "softmax_topk"),
        ("k=3 of 24 with its softmax, float32", "softmax_topk"),
        ("k=2 of 24 smallest", "topk"), ("k=2 of 24 with its softmax, float32", "softmax_topk"),
        ("k=2 of 24 with its softmax, float32", "softmax_topk"), ("k=2 of 16", "topk")], rows


def test_softmax_routers_left_whole_without_fuse_routing():
    _, gm, report = capture(SoftmaxRouters(), torch.randn(2, 16).bfloat16(), torch.randn(2, 24), torch.rand(2, 2))
    assert not any(n.target is torch.ops.fp8fx.softmax_topk.default for n in gm.graph.nodes)
    assert [s.kernel for s in report.topk] == ["extern fp8fx.topk"] * 8


class RoutersTheOpWouldChange(nn.Module):
    """Softmax routers whose graph the op would compute otherwise (review of run 52): probabilities written before
    their top-k, logits written between the softmax and the top-k, the softmax of the k in a narrower dtype than the
    values (rounded first), and a widening cast of the k's softmax (its rounding kept)."""

    def forward(self, logits):
        probs = F.softmax(logits, -1, dtype=torch.float)
        probs[:, 0] = 0.0
        masked = torch.topk(probs, 2)
        scaled = logits.float() * 1
        probs = scaled.softmax(-1)
        scaled.mul_(-1)
        flipped = torch.topk(probs, 2)
        top, ids = torch.topk(logits.float(), 2)
        narrow = F.softmax(top, dim=-1, dtype=torch.bfloat16)
        top, ids = torch.topk(logits, 2)
        widened = F.softmax(top, dim=-1).float()
        return masked, flipped, narrow, widened


def test_routers_the_op_would_change_stay_as_they_are():
    """Each keeps the graph's values: the written probabilities and logits and the narrower softmax stay plain
    top-ks (bit for bit torch's), the widened softmax of the k fuses without its cast (bf16 weights, then the graph's
    ``.float()``: within one bf16 rounding of the graph's)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 16, generator=g) * 3).to(torch.bfloat16)
    logits[:, 0] = 20.0  # (expert 0 first by far: zeroed, it must not be chosen)
    model = RoutersTheOpWouldChange()
    out, gm, report = capture(model, logits.clone(), fuse_routing=True)
    with torch.no_grad():
        want = model(logits.clone())
    for got, ref in zip(out[:2], want[:2]):
        assert torch.equal(got.indices, ref.indices) and torch.equal(got.values, ref.values)
    assert not (out[0].indices == 0).any()
    assert torch.equal(out[2], want[2])
    assert out[3].dtype == torch.float32 and torch.allclose(out[3], want[3], rtol=2 ** -7, atol=0)
    assert [(s.scheme, s.kernel.removeprefix("extern fp8fx.")) for s in report.topk] == [
        ("k=2 of 16", "topk"), ("k=2 of 16", "topk"), ("k=2 of 16", "topk"),
        ("k=2 of 16 with the softmax of the k, bfloat16", "softmax_topk")], report.topk
    casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "float"]
    assert len(casts) == 3, casts  # (the widening cast kept, after the op's bf16 weights)


class SoftmaxRouterStep(nn.Module):
    """A softmax router (float32, k=2) with one step after its softmax that the op does not compute: the row sum
    also returned, a sum with keepdim=False ([T, 2] / [T]: divides down the k when T == 2), the k normalized over the
    tokens (dim 0), the probabilities written with ``out=`` between the softmax and the top-k."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, logits):
        probs = F.softmax(logits, -1, dtype=torch.float)
        if self.variant == "out":
            torch.mul(probs, -1.0, out=probs)
        top, ids = torch.topk(probs, 2)
        if self.variant == "sum-returned":
            total = top.sum(-1, keepdim=True)
            return top / total, ids, total
        if self.variant == "no-keepdim":
            return top / top.sum(-1, keepdim=False), ids
        if self.variant == "over-tokens":
            return top / top.sum(0, keepdim=True), ids
        return top, ids


@pytest.mark.parametrize("variant", ["sum-returned", "no-keepdim", "over-tokens", "out"])
def test_softmax_router_steps_the_op_does_not_compute_keep_the_models_outputs(variant):
    """Each was fused as the router's renormalized top-k (the returned row sum: the pass then failed erasing it) or
    its top-k read the softmax before the ``out=`` write; the output is the model's: the experts torch's, the weights
    within float32 rounding."""
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    model = SoftmaxRouterStep(variant)
    out, gm, report = capture(model, logits.clone(), fuse_routing=True)
    with torch.no_grad():
        want = model(logits.clone())
    assert len(out) == len(want) and torch.equal(out[1], want[1]), (out, want)
    for got, ref in zip(out[::2], want[::2]):
        assert torch.allclose(got, ref, rtol=1e-6, atol=0), (got, ref)


def _bench_routing():
    """benchmarks/bench_routing.py as a module (its routers are the forms these tests compile)."""
    import importlib.util
    import os

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_routing", os.path.join(ROOT, "benchmarks", "bench_routing.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GroupedRouter = _bench_routing().GroupedRouter  # DeepSeek-V3's routing as transformers 5 writes it


@pytest.mark.parametrize("fill", [float("-inf"), 0.0])
def test_a_sigmoid_routers_grouped_topk_becomes_one_op(fill):
    """The routing's three top-ks, masks, gather, renormalization and scale become one ``fp8fx.grouped_topk`` (the
    graph keeps none of them); its experts are the graph's (as sets: the graph's top-k is unsorted), its weights
    within float32 rounding; the report's three top-k entries say where they went. Logits in bf16 (the graph's
    sigmoid rounds them) and 160 experts in 8 groups (not a power of 2 where groups are dropped) stay three plain
    top-ks; 160 experts in one group (GLM-4.5's) join."""
    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(5, 64, generator=g) * 2, torch.randn(64, generator=g) * 0.3
    model = GroupedRouter(8, 3, 6, fill=fill)
    out, gm, report = capture(model, logits, bias, fuse_routing=True)
    with torch.no_grad():
        want = model(logits, bias)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.fp8fx.grouped_topk.default]
    assert [c.args[2:] for c in calls] == [(6, 8, 3, True, 1e-20, 2.5, fill)], calls
    left = {getattr(n.target, "__name__", n.target) for n in gm.graph.nodes if n.op != "placeholder"}
    assert left == {"grouped_topk.default", "getitem", "output"}, left
    order, got = want[1].sort(-1), out[1].sort(-1)
    assert torch.equal(got.values, order.values)
    assert torch.allclose(out[0].gather(1, got.indices), want[0].gather(1, order.indices), rtol=1e-6, atol=0)
    op = "extern fp8fx.grouped_topk"
    assert [(s.scheme, s.kernel) for s in report.topk] == [("in fp8fx.grouped_topk", op)] * 2 + [
        ("k=6 of 64 experts in 3 of 8 groups, sigmoid weights, renormalized, times 2.5 (grouped_topk)", op)]
    for x, b in ((logits.bfloat16(), bias.bfloat16()), (torch.randn(5, 160, generator=g), torch.randn(160))):
        out, gm, report = capture(GroupedRouter(8, 3, 6, fill=fill), x, b, fuse_routing=True)
        assert not any(n.target is torch.ops.fp8fx.grouped_topk.default for n in gm.graph.nodes)
        assert [s.kernel for s in report.topk] == ["extern fp8fx.topk"] * 3
    model = GroupedRouter(1, 1, 8, fill=fill)
    x, b = torch.randn(5, 160, generator=g), torch.randn(160, generator=g) * 0.3
    out, gm, report = capture(model, x, b, fuse_routing=True)
    with torch.no_grad():
        want = model(x, b)
    assert [s.kernel for s in report.topk] == ["extern fp8fx.grouped_topk"] * 3
    (got_ids, order), (want_ids, want_order) = out[1].sort(-1), want[1].sort(-1)
    assert torch.equal(got_ids, want_ids)
    assert torch.allclose(out[0].gather(1, order), want[0].gather(1, want_order), rtol=1e-6, atol=0)


def test_deepseek_v3_router_in_one_op():
    """A tiny DeepSeek-V3 (transformers 5, 2 groups, 1 kept, top 2, x2.5) through ``Fp8Backend``: each layer's router
    is one ``fp8fx.grouped_topk``; its logits within a bf16 rounding of the same compile with the routing apart."""
    pytest.importorskip("transformers")
    from tests.conftest import record_graphs_after_passes
    from tests.e2e.test_moe_models import tiny

    model = tiny("deepseek_v3", "grouped_mm")
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    outs = []
    for join in (True, False):
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(compiler="eager", fuse_routing=join)
        codes = record_graphs_after_passes(backend)
        with torch.no_grad():
            outs.append(torch.compile(model, backend=backend, fullgraph=True)(ids).logits.float())
        code = "\n".join(codes)
        assert code.count("fp8fx.grouped_topk.default(") == (2 if join else 0), code
        assert code.count("fp8fx.topk.default(") == (0 if join else 6)
    assert rel_err(outs[0], outs[1]) < 2e-3, rel_err(outs[0], outs[1])


class GroupedRoutersTheOpWouldChange(GroupedRouter):
    """DeepSeek-V3's routing with one step the op would compute otherwise (review of run 52): its mask read
    elsewhere, the experts' top-k values read, the groups' pair top-k over another dim, the choices written before
    the mask, the scores written before their gather, a scatter_ that multiplies; the groups scored by their top 3,
    a scatter_ of zeros, the group mask unsqueezed at dim 1 (4 groups of 4: it expands, transposed), the mask copied
    before the scatter_ fills it, the scores gathered over the tokens (dim 0: T >= E)."""

    def __init__(self, variant):
        super().__init__(2 if variant == "dim" else 4, 1 if variant == "dim" else 2, 4, scale=1.0)
        self.variant = variant

    def forward(self, logits, bias):
        e, v = logits.shape[-1], self.variant
        scores = logits.sigmoid()
        choice = scores + bias
        view = choice.view(-1, self.groups, e // self.groups)
        pair = 3 if v == "pair" else 2
        group_scores = view.topk(pair, dim=1 if v == "dim" else -1)[0].sum(dim=-1)  # (dim: over 2 groups, 2 of them)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        expand = (lambda: group_mask.unsqueeze(1 if v == "unsqueeze" else -1).expand(-1, self.groups, e // self.groups))
        mask = expand().reshape(-1, e) if v == "early" else None  # (a copy of the zeros)
        group_mask.scatter_(1, group_idx, 1, reduce="multiply") if v == "scatter" else group_mask.scatter_(
            1, group_idx, 0 if v == "zeros" else 1)
        mask = expand().reshape(-1, e) if mask is None else mask
        if v == "choice":
            choice[:, :8] = -1.0
        values, ids = torch.topk(choice.masked_fill(~mask.bool(), self.fill), k=self.k, dim=-1, sorted=False)
        if v == "scores":
            scores.mul_(0.5)
        weights = scores.gather(0 if v == "gather" else 1, ids)
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        extra = {"mask": mask, "values": values}.get(v, weights)
        return weights * self.scale, ids, extra


@pytest.mark.parametrize("variant", ["mask", "values", "dim", "choice", "scores", "scatter", "pair", "zeros",
                                     "unsqueeze", "early"])
def test_grouped_routers_the_op_would_change_stay_as_they_are(variant):
    """Each stays three plain top-ks, its outputs the model's (the experts as sets: the graph's top-k is unsorted,
    fp8fx.topk's sorted; the weights bit-equal, but within float32 rounding for the 16 experts of ``unsqueeze``,
    whose renormalization sums them in the top-k's order). The last four were fused as DeepSeek-V3's routing."""
    g = torch.Generator().manual_seed(1)
    e = 16 if variant == "unsqueeze" else 32
    logits, bias = torch.randn(6, e, generator=g) * 2, torch.randn(e, generator=g) * 0.3
    model = GroupedRoutersTheOpWouldChange(variant)
    out, gm, report = capture(model, logits.clone(), bias, fuse_routing=True)
    with torch.no_grad():
        want = model(logits.clone(), bias)
    assert not any(n.target is torch.ops.fp8fx.grouped_topk.default for n in gm.graph.nodes)
    plain = [s.kernel == "extern fp8fx.topk" or s.reason.startswith("over dim 1") for s in report.topk]
    assert all(plain) and len(report.topk) == 3, report.topk  # (dim: fp8fx.topk takes none over dim 1)
    (got_ids, order), (want_ids, want_order) = out[1].sort(-1), want[1].sort(-1)
    assert torch.equal(got_ids, want_ids), (variant, out[1], want[1])
    rtol = 1e-6 if variant == "unsqueeze" else 0.0
    assert torch.allclose(out[0].gather(1, order), want[0].gather(1, want_order), rtol=rtol, atol=0), variant
    extra = (out[2], want[2]) if variant == "mask" else (out[2].gather(1, order), want[2].gather(1, want_order))
    assert torch.allclose(*extra, rtol=rtol, atol=0), variant


def test_scores_gathered_over_the_tokens_are_not_the_routing_weights():
    """``scores.gather(0, ids)`` (T == E, so it runs) was fused as the routing weights, the sigmoid at each token's
    experts; the weights stay the graph's (whether or not the experts' choice joins one op): the scores down the
    token dim at the ids it chose, renormalized."""
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(32, 32, generator=g) * 2, torch.randn(32, generator=g) * 0.3
    model = GroupedRoutersTheOpWouldChange("gather")
    out, gm, report = capture(model, logits.clone(), bias, fuse_routing=True)
    with torch.no_grad():
        want = model(logits.clone(), bias)
    # the experts the eager model's, as sets (fp8fx.topk sorts them; the weights then depend on that order too)
    assert torch.equal(out[1].sort(-1)[0], want[1].sort(-1)[0])
    weights = logits.sigmoid().gather(0, out[1])  # (at the graph's ids, in its order: the gather reads the column)
    assert torch.allclose(out[0], weights / (weights.sum(-1, keepdim=True) + 1e-20), rtol=1e-6, atol=0)


def test_a_reused_frame_repeats_each_of_a_modules_topks():
    """A block whose frame another runs: each of its top-ks (a grouped router's three) is in the report for the
    other block too, under its names (it was once, the first of them)."""
    from fp8fx.report import Site

    report = Report()
    report.frames[0] = "model.layers.0"
    weight = torch.empty(8, 8)
    weight._fp8fx_fqn = "model.layers.1.mlp.gate.weight"
    report.sites.append(Site(kind="linear", fqn="model.layers.0.mlp.gate.weight", rewritten=False, reason="",
                             scheme="", graph=0))
    report.frame_weights[0] = [(0, 1)]
    for scheme in ("in fp8fx.grouped_topk", "in fp8fx.grouped_topk", "k=6 of 128 experts"):
        report.add_topk(Site(kind="topk", fqn="model.layers.0.mlp.gate", rewritten=True, reason="", scheme=scheme,
                             graph=0))
    report.reused(0, [weight])
    assert [(s.fqn, s.scheme) for s in report.topk[3:]] == [
        ("model.layers.1.mlp.gate", "in fp8fx.grouped_topk"), ("model.layers.1.mlp.gate", "in fp8fx.grouped_topk"),
        ("model.layers.1.mlp.gate", "k=6 of 128 experts")], report.topk
    report.reused(0, [weight])  # (the same module again: nothing more)
    assert len(report.topk) == 6
