"""The report: sites with weight shape, bytes saved and kernel; JSON schema; table; one log line per graph."""
import dataclasses
import gc
import io
import json
import logging
import re
import weakref

import pytest
import torch
from torch import nn

import fp8fx
from fp8fx.report import SCHEMA, Report, Site, gemm_kernels, generated_kernels
from tests.passes.test_dumps import Broken


class ThreeLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(64, 128), nn.Linear(128, 64, bias=False), nn.Linear(64, 16)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.fixture(scope="module")
def report():
    torch._dynamo.reset()
    model = ThreeLayer().to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["head"]))
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16))
    return backend.report


def test_sites_carry_shape_bytes_and_kernel(report):
    sites = {s.fqn: s for s in report.sites}
    assert sites["a"].weight_shape == (128, 64) and sites["head"].weight_shape == (16, 64)
    # bf16 [N, K] -> fp8 [N, K] + float32 per-channel scales [N, 1]
    assert sites["a"].bytes_saved == 128 * 64 * 2 - 128 * 64 - 128 * 4
    assert sites["b"].bytes_saved == 64 * 128 * 2 - 64 * 128 - 64 * 4
    assert sites["head"].bytes_saved == 0
    assert report.bytes_saved == sites["a"].bytes_saved + sites["b"].bytes_saved
    # on CPU the fp8fx ops stay opaque extern kernels; the ignored layer is Inductor's addmm
    assert sites["a"].kernel == sites["b"].kernel == "extern fp8fx.scaled_mm"
    assert sites["head"].kernel == "extern addmm"
    assert report.kernels[0] and all(k.startswith("cpp_") for k in report.kernels[0])


@pytest.mark.skipif("lite" not in fp8fx.lowerings.compat.inductor_modes(), reason="this torch has no mode='lite'")
def test_lite_mode_s_code_names_no_node_and_the_report_says_so(report):
    """torch.compile(mode="lite") retraces the graph into nodes that keep no origin: every "Source Nodes" comment of
    its code is empty, and every kernel read "-" as if none were known, unsaid. An fp8fx op called as often as the
    graph holds it is its sites' kernel; the others' stay "-", and a line says why (none in another mode)."""
    model = fp8fx.quantize_(ThreeLayer().to(torch.bfloat16), fp8fx.Fp8Config(ignored_layers=["head"]))
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        torch.compile(model, backend=backend, mode="lite")(torch.randn(4, 64, dtype=torch.bfloat16))
    kernels = {s.fqn: s.kernel for s in backend.report.sites}
    assert kernels == {"a": "extern fp8fx.scaled_mm", "b": "extern fp8fx.scaled_mm", "head": ""}
    why = backend.report.to_dict()["graphs"][0]["kernels_unnamed"]
    assert "mode='lite'" in why and why in str(backend.report).splitlines()
    assert not report.unnamed and "kernels_unnamed" not in report.to_dict()["graphs"][0]


def test_json_schema(report):
    data = json.loads(report.to_json())
    assert set(data) == {"schema", "totals", "graphs", "sites", "topk"} and data["schema"] == SCHEMA
    assert data["topk"] == []  # (the model has no top-k: tests/passes/test_routing_passes.py has the list's rows)
    assert data["totals"] == {
        "graphs": 1,
        "sites": 3,
        "rewritten": 2,
        "not_rewritten": 1,
        "bytes_saved": report.bytes_saved,
        "kernels": len(report.kernels[0]),
        "recompile_limit_hits": 0,
    }
    assert data["graphs"] == [{"index": 0, "kernels": report.kernels[0]}]
    fields = {f.name: f.type for f in dataclasses.fields(Site) if f.name != "weight_id"}  # an id() of this process
    types = {"str": str, "bool": bool, "int": int, "tuple[int, ...]": list}
    for site in data["sites"]:
        assert set(site) == set(fields)
        for name, value in site.items():
            assert isinstance(value, types[fields[name]]), (name, value)
    assert [s["fqn"] for s in data["sites"]] == ["a", "b", "head"]
    assert data["sites"][2]["reason"] == "not quantized: in ignored_layers"
    assert json.loads(report.to_json(0)) == data  # one graph: the graph's report is the whole report
    assert data == report.to_dict()  # (weight_shape was a tuple there, a list after the JSON)


def test_table(report):
    lines = str(report).splitlines()
    assert lines[0].split() == ["graph", "kind", "site", "weight", "rewritten", "kernel", "scheme", "/", "reason"]
    assert lines[2].split()[:6] == ["0", "linear", "a", "128x64", "yes", "extern"]
    assert lines[-1].startswith("2 of 3 sites rewritten in 1 graph(s); 15.2 KiB of weights saved; ")


def test_one_log_line_per_graph(caplog):
    model = ThreeLayer().to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["head"]))
    backend = fp8fx.Fp8Backend(compiler="eager")
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level(logging.INFO, logger="fp8fx"), torch.no_grad():
        compiled(torch.randn(4, 64, dtype=torch.bfloat16))
        compiled(torch.randn(4, 64, dtype=torch.bfloat16))  # no new graph: no new line
    lines = [r.getMessage() for r in caplog.records if r.name == "fp8fx" and "sites rewritten" in r.getMessage()]
    assert lines == [
        "fp8fx: graph 0: 2 of 3 sites rewritten, 15.2 KiB of weights saved; not rewritten: head "
        "(not quantized: in ignored_layers)"
    ]


def test_fp8_backends_graphs_are_told_apart_in_the_log(caplog):
    """fp8_backend compiles each graph with a new backend: both graphs of a model with a graph break were logged as
    "graph 0"."""
    model = Broken().to(torch.bfloat16)
    fp8fx.quantize_(model)
    with caplog.at_level(logging.INFO, logger="fp8fx"), torch.no_grad():
        torch.compile(model, backend=fp8fx.fp8_backend)(torch.randn(2, 64, dtype=torch.bfloat16))
    lines = [r.getMessage() for r in caplog.records if r.name == "fp8fx" and "sites rewritten" in r.getMessage()]
    assert len(lines) == 2 and len(set(lines)) == 2, lines
    assert all(re.match(r"fp8fx: fp8_backend #\d+, graph 0: 1 of 1 sites rewritten", line) for line in lines), lines


def test_an_empty_report_says_why_and_a_root_linear_has_a_name():
    """Nothing compiled (a compiled model's generate() runs its own forward): the table said "0 of 0 sites" and no
    more. A compiled bare nn.Linear's site had a blank name."""
    backend = fp8fx.Fp8Backend(compiler="eager")
    assert str(backend.report).splitlines()[-1].startswith("no graph compiled yet: call the compiled model (for HF "
                                                           "generate(), compile its forward")
    linear = nn.Linear(64, 64).to(torch.bfloat16)
    fp8fx.quantize_(linear)
    with torch.no_grad():
        torch.compile(linear, backend=backend)(torch.randn(2, 64, dtype=torch.bfloat16))
    lines = str(backend.report).splitlines()
    assert lines[2].split()[:4] == ["0", "linear", "(root", "module)"] and "no graph" not in lines[-1]
    assert backend.report.sites[0].fqn == ""  # (the data keeps the name the module has: none)


def test_an_empty_report_names_vmap_of_a_compiled_model():
    """torch.vmap(torch.compile(model)) runs the model uncompiled (no graph, no fp8 GEMM); the empty report blamed only
    the recompile limit."""
    backend = fp8fx.Fp8Backend(compiler="eager")
    model = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16))
    torch.vmap(torch.compile(model, backend=backend))(torch.randn(3, 4, 64, dtype=torch.bfloat16))
    assert not backend.report.graphs and "torch.compile(torch.vmap(model))" in str(backend.report).splitlines()[-1]


def test_a_model_called_through_functional_call_names_its_sites_by_its_layers():
    """torch.func.functional_call of a model with another fp8 model's state_dict (its tensors carry no tags) named
    the sites after Dynamo's source, "getattr(G.m1, '0')", which assert_rewritten(backend, "0") did not find."""
    from torch.func import functional_call

    def quantized(seed):
        torch.manual_seed(seed)
        return fp8fx.quantize_(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16))

    model, other = quantized(0), quantized(1)
    backend = fp8fx.Fp8Backend(compiler="eager")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        got = torch.compile(lambda p, x: functional_call(model, p, (x,)), backend=backend)(dict(other.state_dict()), x)
    assert [s.fqn for s in backend.report.sites] == ["0", "2"] and all(s.rewritten for s in backend.report.sites)
    fp8fx.testing.assert_rewritten(backend, "0", "2")
    assert (got.float() - other(x).float()).norm() / other(x).float().norm() < 0.05


def test_existing_constructor_still_works():
    site = Site("linear", "x", False, "why", "", 3)
    assert (site.weight_shape, site.bytes_saved, site.kernel, site.node) == ((), 0, "", "")
    report = Report()
    report.add(site)
    assert report.skipped == [site] and "0 of 1 sites rewritten" in str(report)


def test_bytes_saved_counts_a_layer_once_across_graphs():
    report = Report()
    for graph in (0, 1):  # the same layer recompiled for another shape
        report.add(Site("linear", "a", True, "", "s", graph, bytes_saved=100))
    report.add(Site("linear", "b", True, "", "s", 1, bytes_saved=7))
    assert report.bytes_saved == 107


def test_bytes_saved_counts_a_layer_taken_over_or_dequantized_once():
    """A model dropped for another of its class whose calls ran one of the two graphs compiled for the first: the
    other graph's rows kept the freed weights, and bytes_saved counted both models (dropping the second too still
    did). So after dequantize_ and a new graph: the freed fp8 weights were still counted."""
    backend = fp8fx.Fp8Backend(compiler="eager")

    def make():
        return fp8fx.quantize_(nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)).to(
            torch.bfloat16))

    def call(f, rows):
        with torch.inference_mode():
            f(torch.randn(rows, 64, dtype=torch.bfloat16))

    model = make()
    compiled = torch.compile(model, backend=backend)
    call(compiled, 2)
    call(compiled, 3)  # graph 0 (static), graph 1 (dynamic rows)
    one = backend.report.bytes_saved
    assert one == 2 * (64 * 64 * 2 - 64 * 64 - 64 * 4)  # bf16 -> fp8 codes and per-channel float32 scales
    del model, compiled
    gc.collect()
    model = make()
    compiled = torch.compile(model, backend=backend)
    call(compiled, 4)  # graph 1 only, with the new weights
    assert backend.report.graphs == 2 and backend.report.bytes_saved == one
    held = model
    del model, compiled
    gc.collect()  # (the second model is still held: one model's figure; then dropped too: still one model's)
    assert backend.report.bytes_saved == one
    del held
    gc.collect()
    assert backend.report.bytes_saved == one
    # dequantized: its rows save nothing, the model held or dropped (it went back up once the model was dropped)
    backend = fp8fx.Fp8Backend(compiler="eager")
    model = make()
    compiled = torch.compile(model, backend=backend)
    call(compiled, 2)
    assert backend.report.bytes_saved == one
    fp8fx.dequantize_(model)
    gc.collect()
    call(compiled, 5)  # a new graph of the bf16 layers
    assert backend.report.bytes_saved == 0
    del model, compiled
    gc.collect()
    assert backend.report.bytes_saved == 0


def test_a_dynamo_reset_leaves_no_frame_of_the_reports_graphs_to_count():
    """After torch._dynamo.reset() Dynamo numbers frames from 0 again: the report's graphs from before it were counted
    as the new frame's, and the recompile-limit note hid another backend's graph of it ("1 of the 2 are not this
    backend's"), blaming a new shape."""
    backend = fp8fx.Fp8Backend(compiler="eager")

    def call(b, rows):
        model = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16))
        with torch.inference_mode():
            torch.compile(model, backend=b, dynamic=False)(torch.randn(rows, 64, dtype=torch.bfloat16))

    with torch._dynamo.config.patch(recompile_limit=2):
        call(backend, 1)  # frame 0, before the reset
        torch._dynamo.reset()
        call(fp8fx.Fp8Backend(compiler="eager"), 1)  # another backend's graph of the new frame 0
        call(backend, 3)  # this one's: graph 2 of the frame, the limit
    assert "1 of the 2 are not this backend's" in backend.report.limits[max(backend.report.limits)]
    # a compiled model kept across two resets: Dynamo resets the backends of the torch.compile calls made since its
    # last reset, and a graph the backend compiles since puts it among them
    backend = fp8fx.Fp8Backend(compiler="eager")
    compiled = torch.compile(fp8fx.quantize_(nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)), backend=backend,
                             dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), torch.inference_mode():
        compiled(torch.randn(1, 64, dtype=torch.bfloat16))
        torch._dynamo.reset()
        compiled(torch.randn(1, 64, dtype=torch.bfloat16))
        torch._dynamo.reset()
        call(fp8fx.Fp8Backend(compiler="eager"), 1)
        compiled(torch.randn(3, 64, dtype=torch.bfloat16))
    assert "1 of the 2 are not this backend's" in backend.report.limits[max(backend.report.limits)]


def test_a_graph_called_with_a_new_weight_each_time_keeps_nothing_per_call():
    """F.linear(x, w) compiled, called with a new w each time: the backend's watch of the graph's weights kept each
    call's weight token for good, memory that grew by a call's worth at each."""
    import tracemalloc

    backend = fp8fx.Fp8Backend(compiler="eager")
    compiled = torch.compile(lambda x, w: torch.nn.functional.linear(x, w), backend=backend, dynamic=False)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    here = fp8fx.__file__.rpartition("/")[0] + "/*"

    def held():
        gc.collect()
        traces = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, here)])
        return sum(s.size for s in traces.statistics("filename"))

    def calls(n):
        for _ in range(n):
            compiled(x, torch.randn(64, 64, dtype=torch.bfloat16))

    with torch.inference_mode():
        calls(200)
        tracemalloc.start()
        try:
            before = held()
            calls(2000)
            grown = held() - before
        finally:
            tracemalloc.stop()
    assert grown < 16 * 1024, grown  # (it held 28 B a call and the set's growth: 185 KiB over these calls)


def test_bytes_saved_counts_each_weight_once_whatever_its_name():
    """Two models compiled by one backend, or quantize_ run on two submodules, name different weights alike: each
    is saved once (by name, one of them was dropped); the same weight in two graphs still counts once."""
    backend = fp8fx.Fp8Backend(compiler="eager")
    for width in (256, 512):
        model = nn.Sequential(nn.Linear(width, width)).to(torch.bfloat16)
        fp8fx.quantize_(model)
        torch._dynamo.reset()
        with torch.no_grad():
            for rows in (2, 3):
                torch.compile(model, backend=backend, dynamic=False)(torch.randn(rows, width, dtype=torch.bfloat16))
    assert [s.fqn for s in backend.report.rewritten] == ["0"] * 4
    assert backend.report.bytes_saved == sum(w * w - 4 * w for w in (256, 512))
    assert "weight_id" not in backend.report.to_dict()["sites"][0]


class SharedWeight(nn.Module):
    """b.weight = a.weight: both kept in high precision (tied), c quantized."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(64, 64) for _ in range(3))
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(self.b(torch.relu(self.a(x))))


def test_a_second_model_keeps_the_rows_of_layers_sharing_a_weight():
    """Two models of one class through one backend (Dynamo runs the first one's graph for the second): the second's
    rows were named by each weight's tag, which a weight of two layers holds for the last one only, and its row of a
    was lost (a review's catch). Each model has a row for a, b and c, with the tie's reason."""
    backend = fp8fx.Fp8Backend(compiler="eager")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    models = [SharedWeight().to(torch.bfloat16) for _ in range(2)]  # (both live: a freed model's rows are taken over)
    for model in models:
        fp8fx.quantize_(model)
        with torch.no_grad():
            torch.compile(model, backend=backend)(x)
    rows = [(s.fqn, s.rewritten, "tied" in s.reason) for s in backend.report.sites]
    assert rows == [("a", False, True), ("b", False, True), ("c", True, False)] * 2, backend.report


def test_the_rows_of_two_models_of_one_class_are_told_apart_by_sites_of():
    """Two models of one class through one backend (Dynamo runs the first one's graph for the second) give rows
    alike: the same names, the same graph, counted right, but no row said whose it was. sites_of(model) says, by
    the model's tensors, for the model or its compiled wrapper; a model that never ran has none."""
    backend = fp8fx.Fp8Backend(compiler="eager")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    models = [fp8fx.quantize_(ThreeLayer().to(torch.bfloat16), fp8fx.Fp8Config(ignored_layers=["head"]))
              for _ in range(3)]
    compiled = [torch.compile(m, backend=backend) for m in models[:2]]
    with torch.no_grad():
        for c in compiled:
            c(x)
    sites = backend.report.sites
    assert [(s.graph, s.fqn) for s in sites] == [(0, "a"), (0, "b"), (0, "head")] * 2, backend.report
    first, second = backend.report.sites_of(models[0]), backend.report.sites_of(compiled[1])
    assert [s.fqn for s in first] == [s.fqn for s in second] == ["a", "b", "head"]
    assert [id(s) for s in first + second] == [id(s) for s in sites]
    assert backend.report.sites_of(models[2]) == []


def test_sites_of_keeps_the_rows_that_know_no_weight():
    """A layer whose weight something other than a linear reads is a row that knows no weight tensor (not rewritten):
    sites_of left it out, the row the user most needs; it is the model's where the graph is."""
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return self.a(x) + (x @ self.b.weight).relu()

    backend = fp8fx.Fp8Backend(compiler="eager")
    model = fp8fx.quantize_(Reads().to(torch.bfloat16), fp8fx.Fp8Config())
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16))
    assert [(s.fqn, s.rewritten) for s in backend.report.sites] == [("a", True), ("b", False)], backend.report
    assert [s.fqn for s in backend.report.sites_of(model)] == ["a", "b"]
    assert backend.report.sites_of(fp8fx.quantize_(Reads().to(torch.bfloat16), fp8fx.Fp8Config())) == []


def test_blocks_compiled_alone_keep_the_rows_of_layers_sharing_a_weight():
    """Each block's forward compiled alone (Dynamo runs block 0's graph for block 1), blocks with b.weight = a.weight:
    the linear pass looked the block's own path up among the weight's owners (the model's names), and the rows were
    named by the tag of the last one - two rows for blocks.0.b, none for either a (a review's catch)."""
    model = nn.ModuleList([SharedWeight(), SharedWeight()]).to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    for block in model:
        block.forward = torch.compile(block.forward, backend=backend)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        model[1](model[0](x))
    rows = sorted((s.fqn, s.rewritten) for s in backend.report.sites)
    assert rows == [(f"{i}.{n}", n == "c") for i in range(2) for n in "abc"], backend.report


class WithExperts(nn.Module):
    """An embedding, a linear, and stacked expert weights no pass covers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.proj = nn.Linear(64, 64)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(4, 32, 64))
        self.norm = nn.LayerNorm(32)  # 1-D weights: not listed
        self.experts.e_score_correction_bias = nn.Parameter(torch.zeros(1, 4))  # a 2-D bias (Ernie-4.5-MoE's): neither

    def forward(self, ids):
        h = self.proj(self.embed(ids))
        return self.norm(torch.einsum("th,eih->tei", h, self.experts.gate_up_proj).sum(1))


def test_unhandled_weights():
    model = WithExperts()
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.arange(3))
    assert [s.fqn for s in backend.report.sites] == ["proj"]
    assert backend.report.unhandled_weights(model) == [
        ("embed.weight", (10, 64), "float32", "Embedding"),
        ("experts.gate_up_proj", (4, 32, 64), "float32", "Module"),
    ]
    compiled = torch.compile(model, backend=backend)  # the wrapper's names start with _orig_mod.: its module's
    assert backend.report.unhandled_weights(compiled) == backend.report.unhandled_weights(model)


def test_unhandled_weights_list_a_block_scaled_layer_that_never_ran_once():
    """A block-scaled layer's weight_scale_inv [N/128, K/128] is 2-D: it is the layer's scale, not a weight of its own
    (only the weight of a layer that never ran is listed)."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

        def forward(self, x):
            return self.a(x)

    model = Model().to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[128, 128]))
    assert model.b.weight_scale_inv.shape == (2, 2)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 256, dtype=torch.bfloat16))
    assert backend.report.unhandled_weights(model) == [("b.weight", (256, 256), "float8_e4m3fn", "Fp8Linear")]


def test_unhandled_weights_list_linears_in_no_graph():
    """A linear that ran outside the compiled graph (torch.compiler.disable) was in neither the report nor here."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.outside(self.a(x))

        @torch.compiler.disable
        def outside(self, x):
            return self.b(x)

    model = Model()
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 8))
    assert [s.fqn for s in backend.report.sites] == ["a"]
    assert [name for name, *_ in backend.report.unhandled_weights(model)] == ["b.weight"]
    # another model compiled with the same backend, whose own "b" runs: this model's b is still unhandled (the
    # sites were matched by name, and the other model's rewritten "b" hid it)

    class Other(Model):
        def forward(self, x):
            return self.b(self.a(x))

    other = Other()
    fp8fx.quantize_(other)
    with torch.no_grad():
        torch.compile(other, backend=backend)(torch.randn(2, 8))
    assert [s.fqn for s in backend.report.sites] == ["a", "a", "b"]
    assert [name for name, *_ in backend.report.unhandled_weights(model)] == ["b.weight"]
    assert backend.report.unhandled_weights(other) == []
    # the other model's "b" kept in high precision (a site not rewritten, matched by name alone): it hid this one's
    kept = Other()
    fp8fx.quantize_(kept, fp8fx.Fp8Config(ignored_layers=["b"]))
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(kept, backend=backend)(torch.randn(2, 8))
        torch.compile(model, backend=backend)(torch.randn(2, 8))
    assert [(s.fqn, s.rewritten) for s in backend.report.sites] == [("a", True), ("b", False), ("a", True)]
    assert [name for name, *_ in backend.report.unhandled_weights(model)] == ["b.weight"]
    assert backend.report.unhandled_weights(kept) == []
    # a copy that never ran (torch.save / torch.load): none of its weights is the one a site read (a token kept on
    # the tensor travelled with the pickle of its kept bf16 "b", which then counted as run)
    ran = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fp8fx.quantize_(ran, fp8fx.Fp8Config(ignored_layers=["1"]))
    with torch.no_grad():
        torch.compile(ran, backend=backend)(torch.randn(2, 8))
    assert backend.report.unhandled_weights(ran) == []
    buffer = io.BytesIO()
    torch.save(ran, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    assert [name for name, *_ in backend.report.unhandled_weights(copy)] == ["0.weight", "1.weight"]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_blocks_that_run_a_frame_compiled_for_another_are_sites_too(compiler):
    """The graphs of l0's forward run for l1 too (no new graph: its weights are the graphs' inputs), and l1's layers
    ran rewritten but were in no site: the report held 2 of the 4 layers and unhandled_weights listed l1's. They are
    added the first time the graphs run with l1's weights, named by them; a block compiled alone still leaves the
    other block's layers unhandled (they never ran compiled)."""
    torch.manual_seed(0)
    model = nn.Sequential(Broken(), Broken()).to(torch.bfloat16)  # (a graph break in each block's forward)
    fp8fx.quantize_(model)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    backend = fp8fx.Fp8Backend(compiler=compiler)
    with torch.no_grad():
        want = model(x)
        compiled = torch.compile(model, backend=backend)
        got = compiled(x)
        compiled(x)
    assert torch.allclose(got.float(), want.float(), rtol=0.1, atol=0.05)
    sites = [(s.graph, s.fqn, s.rewritten) for s in backend.report.sites]
    assert sorted(sites) == [(0, "0.a", True), (0, "1.a", True), (1, "0.b", True), (1, "1.b", True)]
    assert backend.report.unhandled_weights(model) == []
    assert "graph 0 traced 0's forward, whose code Dynamo runs for any other module of its class" in str(backend.report)
    refs = [weakref.ref(p) for p in model.parameters()]  # the watch keeps no weight alive (it kept the last one)
    del model, compiled, backend
    gc.collect()
    assert not [r for r in refs if r() is not None]
    model = nn.Sequential(Broken(), Broken()).to(torch.bfloat16)
    fp8fx.quantize_(model)
    torch._dynamo.reset()
    backend = fp8fx.Fp8Backend(compiler=compiler)
    with torch.no_grad():
        torch.compile(model[0], backend=backend)(x)
        model[1](x)
    assert [s.fqn for s in backend.report.sites] == ["0.a", "0.b"]
    assert [n for n, *_ in backend.report.unhandled_weights(model)] == ["1.a.weight", "1.b.weight"]


@pytest.mark.parametrize("kept", [True, False], ids=["experts-bf16", "experts-fp8"])
def test_a_frame_with_experts_runs_and_names_its_sites(kept):
    """A GEMM of experts kept in bf16 adds no linear site: its weight was recorded for the frame all the same, and
    the next block's first call failed in the report (IndexError) instead of running. The experts of the blocks that
    run the frame are sites too, fp8 or kept (only the linears were added, and unhandled_weights listed the
    experts of block 1)."""
    from tests.passes.test_moe_pass import H, LoopExperts, inputs

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.experts = nn.Linear(H, H), LoopExperts()

        def forward(self, x, ids, w):
            h = self.q(x)
            h = h + self.experts(h, ids, w)
            torch._dynamo.graph_break()
            return h

    model = nn.Sequential(Decoder(), Decoder()).to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["0.experts", "1.experts"] if kept else []))
    backend = fp8fx.Fp8Backend(compiler="eager")
    x, ids, w = inputs(torch.bfloat16)
    with torch.no_grad():
        want = model[1](model[0](x, ids, w), ids, w)
        compiled = torch.compile(lambda x: model[1](model[0](x, ids, w), ids, w), backend=backend)
        got = compiled(x)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.05  # q's fp8 activations
    sites = sorted((s.kind, s.fqn, s.rewritten) for s in backend.report.sites)
    assert sites == [("linear", "0.q", True), ("linear", "1.q", True), ("moe", "0.experts", not kept),
                     ("moe", "1.experts", not kept)]
    assert backend.report.unhandled_weights(model) == []


def test_unhandled_weights_list_an_embedding_a_kept_lm_head_shares():
    """lm_head tied to the embedding (kept in bf16, its site says why): the shared tensor carries lm_head's name, and
    the embedding, which no pass looks at, vanished from the list."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj, self.lm_head = nn.Embedding(100, 64), nn.Linear(64, 64), nn.Linear(64, 100)
            self.lm_head.weight = self.embed.weight

        def forward(self, ids):
            return self.lm_head(self.proj(self.embed(ids)))

    model = Tied().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.arange(5))
    assert [(s.fqn, s.rewritten) for s in backend.report.sites] == [("proj", True), ("lm_head", False)]
    assert backend.report.unhandled_weights(model) == [("embed.weight", (100, 64), "bfloat16", "Embedding")]


def test_unhandled_weights_of_one_compiled_block_and_of_a_root_linear():
    """One block of a quantized model compiled alone: its sites bear the model's names (``0.q``), its parameters
    the block's (``q.weight``), and both were listed as unhandled though both were rewritten. A quantized root
    linear's site was named after Dynamo's node (``linear``), its weight listed too."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return self.o(torch.relu(self.q(x)))

    model = nn.Sequential(Block(), Block()).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    backend = fp8fx.Fp8Backend(compiler="eager")
    block = torch.compile(model[0], backend=backend)
    with torch.no_grad():
        block(x)
    assert [(s.fqn, s.rewritten) for s in backend.report.sites] == [("0.q", True), ("0.o", True)]
    assert backend.report.unhandled_weights(block) == []
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    fp8fx.quantize_(linear)
    backend = fp8fx.Fp8Backend(compiler="eager")
    compiled = torch.compile(linear, backend=backend)
    with torch.no_grad():
        compiled(x)
    assert [(s.fqn, s.rewritten) for s in backend.report.sites] == [("", True)]
    assert backend.report.unhandled_weights(compiled) == []


Q = "'" * 3  # the triple quote around a kernel's source in the output code
# Trimmed from the output code of a 2-layer MLP that Fp8Backend compiled on the H200 (torch 2.11, M=8):
# Inductor fused each activation quantization into a Triton kernel named after the ops it covers,
# then called the opaque fp8fx.scaled_mm.
CUDA_CODE = f"""
triton_red_fused_quantize_scaled_mm_0 = async_compile.triton('triton_red_fused_quantize_scaled_mm_0', {Q}
def triton_red_fused_quantize_scaled_mm_0(in_ptr0, out_ptr0, out_ptr1, xnumel, r0_numel, XBLOCK, R0_BLOCK):
    pass
{Q}, device_str='cuda')
    def call(self, args):
            # Topologically Sorted Source Nodes: [quantize_default, scaled_mm_default], Original ATen: [fp8fx.quantize, fp8fx.scaled_mm]
            stream0 = get_raw_stream(0)
            triton_red_fused_quantize_scaled_mm_0.run(arg2_1, buf1, buf2, 8, 4096, stream=stream0)
            # Topologically Sorted Source Nodes: [quantize_default, scaled_mm_default], Original ATen: [fp8fx.quantize, fp8fx.scaled_mm]
            buf3 = torch.ops.fp8fx.scaled_mm.default(buf1, buf2, arg0_1, arg1_1, None, [1, -1], [1, -1], torch.bfloat16, True)
            assert_size_stride(buf4, (8, 8192), (8192, 1), 'torch.ops.fp8fx.scaled_mm.default')
"""

# The shape of a max_autotune Triton GEMM template in the output code (written from Inductor's mm
# template; no run here chose one).
TEMPLATE_CODE = f"""
triton_tem_fused_mm_0 = async_compile.triton('triton_tem_fused_mm_0', {Q}
@triton_heuristics.template(
    num_stages=3,
    num_warps=8,
)
@triton.jit
def triton_tem_fused_mm_0(arg_A, arg_B, out_ptr0):
    GROUP_M : tl.constexpr = 8
    BLOCK_M : tl.constexpr = 64
    BLOCK_N : tl.constexpr = 128
    BLOCK_K : tl.constexpr = 64
{Q}, device_str='cuda')
cpp_fused_relu_1 = async_compile.cpp_pybinding(['bfloat16*'], {Q}
{Q})
    def call(self, args):
        # Topologically Sorted Source Nodes: [linear], Original ATen: [aten.mm]
        triton_tem_fused_mm_0.run(arg1_1, arg0_1, buf0, 4, 1, 1, stream=stream0)
        # Topologically Sorted Source Nodes: [relu, linear_1], Original ATen: [aten.relu, aten.addmm]
        cpp_fused_relu_1(buf0)
        extern_kernels.addmm(arg3_1, buf0, arg2_1, alpha=1, beta=1, out=buf1)
"""


def test_reading_output_code():
    assert generated_kernels(CUDA_CODE) == ["triton_red_fused_quantize_scaled_mm_0"]
    found = gemm_kernels(CUDA_CODE)
    assert found["scaled_mm_default"] == "extern fp8fx.scaled_mm"  # not the quantization kernel before it
    assert generated_kernels(TEMPLATE_CODE) == ["triton_tem_fused_mm_0", "cpp_fused_relu_1"]
    assert gemm_kernels(TEMPLATE_CODE) == {
        "linear": "template triton_tem_fused_mm_0 num_stages=3 num_warps=8 BLOCK_M=64 BLOCK_N=128 BLOCK_K=64",
        "relu": "extern addmm",
        "linear_1": "extern addmm",
    }


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_cpp_wrapper_output_code_is_read_as_the_python_one(device):
    """Inductor's C++ wrapper (``cpp_wrapper=True``) writes its kernels and calls in C++: none was counted, so
    ``assert_kernel_count(backend, 0)`` passed whatever was generated, and no site named its GEMM. Both wrappers of
    one model give the same kernels and the same GEMM a site."""
    found = []
    for cpp_wrapper in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(device, torch.bfloat16)
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["2"]))
        backend = fp8fx.Fp8Backend(inductor_config={"cpp_wrapper": cpp_wrapper})
        with torch.no_grad():
            torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16, device=device))
        found.append((backend.report.kernels, [s.kernel for s in backend.report.sites]))
        (kernels,) = backend.report.kernels.values()
        fp8fx.testing.assert_kernel_count(backend, len(kernels))
        with pytest.raises(AssertionError, match=f"expected {len(kernels) + 1} generated kernels"):
            fp8fx.testing.assert_kernel_count(backend, len(kernels) + 1)
    assert found[0] == found[1]
    if device == "cpu":  # (on CUDA the names are Triton's, the GEMMs' extern kernels the same)
        assert found[0] == ({0: ["cpp_fused_relu_0"]}, ["extern fp8fx.scaled_mm", "extern addmm"])
    else:
        assert found[0][0][0] and found[0][1][0] == "extern fp8fx.scaled_mm"


def test_layers_kept_in_high_precision_by_design_log_at_info(caplog):
    """An ignored layer, an MoE router and a tied lm_head are choices (vLLM keeps routers and tied heads in high
    precision too): INFO, not a WARNING at every compile; any other reason is a WARNING."""
    report = Report()
    by_design = ["not quantized: in ignored_layers", "not quantized: weight tied to model.embed_tokens.weight",
                 "not quantized: routes tokens to model.layers.0.mlp.experts (an MoE router or gate: high precision, "
                 "as vLLM keeps it)"]
    with caplog.at_level(logging.INFO, logger="fp8fx"):
        for i, reason in enumerate(by_design + ["weight is not an fp8fx-quantized weight"]):
            report.add(Site("linear", f"layer{i}", False, reason, "", 0))
    levels = [r.levelno for r in caplog.records if r.name == "fp8fx"]
    assert levels == [logging.INFO] * 3 + [logging.WARNING], levels


def test_the_log_names_a_site_of_the_root_module_as_the_table_does(caplog):
    """A compiled bare nn.Linear: its site's fqn is "" and the log line read "fp8fx: linear  not rewritten: ...",
    naming no layer (found by a README walkthrough); it says "(root module)", as the table, also for a graph that
    failed."""
    report = Report()
    with caplog.at_level(logging.INFO, logger="fp8fx"):
        report.add(Site("linear", "", False, "traced with autograd", "", 0))
        report.add(Site("linear", "", True, "", "per-row", 1))
        report.fail_graph(1, "Inductor failed")
    lines = [r.getMessage() for r in caplog.records if r.name == "fp8fx" and "not rewritten" in r.getMessage()]
    assert lines == ["fp8fx: linear (root module) not rewritten: traced with autograd",
                     "fp8fx: linear (root module) not rewritten: Inductor failed"], lines
    assert report.graph_summary(0).endswith("; not rewritten: (root module) (traced with autograd)")


def test_a_graph_the_report_does_not_hold_is_refused(report):
    """report.table(graph=99) read as an empty graph, "0 of 0 sites rewritten", as if nothing was rewritten."""
    for show in (report.table, report.to_json, report.to_dict):
        with pytest.raises(ValueError, match=r"Report: no graph 99; it holds graphs \[0\]"):
            show(graph=99)
    assert "2 of 3 sites rewritten in graph 0" in report.table(graph=0)


def test_a_discarded_graph_leaves_nothing_of_its_own():
    """Dynamo dropped the attempt (it traces the frame again, as the same graph index): its sites, kernels, failure
    and count go, as the docstring says; another graph's stay."""
    report = Report()
    for graph in (0, 1):
        report.graphs += 1
        report.add(Site("linear", f"l{graph}", True, "", "w:per-channel a:per-token", graph))
        report.kernels[graph] = [f"cpp_fused_{graph}"]
    report.fail_graph(1, "boom")
    report.discard_graph(1)
    assert (report.graphs, [s.fqn for s in report.sites], report.kernels, report.failed) == (
        1, ["l0"], {0: ["cpp_fused_0"]}, {})


def test_new_weights_of_a_compiled_model_take_over_its_rows():
    """load_state_dict(assign=True) of other fp8 weights into a compiled model (an eval loop over checkpoints): each
    call after a swap added every layer's row again, and bytes_saved counted the freed weights too (2 rows, 7.5 KiB
    became 8 rows, 30 KiB after three swaps)."""
    import fp8fx

    def make(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to(torch.bfloat16)
        return fp8fx.quantize_(m)

    model = make(0)
    backend = fp8fx.Fp8Backend(compiler="eager")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled(x)
    rows, saved = [(s.fqn, s.rewritten) for s in backend.report.sites], backend.report.bytes_saved
    for seed in range(1, 4):
        model.load_state_dict(make(seed).state_dict(), assign=True)
        gc.collect()
        with torch.no_grad():
            out, eager = compiled(x).double(), model(x).double()  # (the new weights: fp8 activations against bf16)
        assert ((out - eager).norm() / eager.norm()).item() < 0.05
    assert [(s.fqn, s.rewritten) for s in backend.report.sites] == rows == [("0", True), ("2", True)]
    assert backend.report.bytes_saved == saved > 0
    tokens = {s.weight_id for s in backend.report.sites}
    assert tokens == {fp8fx.Site.known_token(model[i]._parameters["weight"]) for i in (0, 2)}


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_bytes_saved_are_the_state_dicts(scheme):
    """The report's bytes saved are what the state_dict saves: with static activations it left out the float32
    input scale each layer stores (4 bytes a layer more than the model saves)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).to(torch.bfloat16).eval()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    scales = fp8fx.calibrate(model, [(x,)]) if scheme == "static" else None
    fp8fx.quantize_(model, fp8fx.Fp8Config(activation_scheme=scheme), input_scales=scales)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    saved = before - sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert backend.report.bytes_saved == backend.report.to_dict()["totals"]["bytes_saved"] == saved


def test_the_graph_at_dynamo_s_recompile_limit_says_what_follows(caplog):
    """Compiled with dynamic=False, each new batch is a graph of its own; past torch._dynamo.config.recompile_limit
    Dynamo runs the frame uncompiled (high precision on the dequantized weights, no fp8 GEMM), and nothing of fp8fx
    said so: every row of the report read rewritten. The graph at the limit says what a call needing one more does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    outs = []
    with torch._dynamo.config.patch(recompile_limit=3), torch.no_grad(), caplog.at_level(logging.WARNING, "fp8fx"):
        for rows in range(1, 5):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            outs.append((compiled(x), model(x)))
    report = backend.report
    assert report.graphs == 3 and list(report.limits) == [2], report.limits
    frame = re.match(r"graph 2 \(Dynamo's compile id (\d+)/2\)", report.limits[2])  # (frame ids count per process)
    said = (f"graph 2 (Dynamo's compile id {frame and frame[1]}/2) is graph 3 of its frame, which is "
            "torch._dynamo.config.recompile_limit (3): a call that needs another graph (a new shape, each a graph of "
            "its own with dynamic=False, or another value of an argument guarded on) runs the frame uncompiled")
    assert report.limits[2].startswith(said), report.limits
    assert said in report.table() and said not in report.table(graph=1)
    assert [g.get("recompile_limit", "")[:len(said)] for g in report.to_dict()["graphs"]] == ["", "", said]
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    # (what it warns of: the fourth batch ran as the uncompiled model does, the three before did not)
    assert [torch.equal(a, b) for a, b in outs] == [False, False, False, True]
    # after torch._dynamo.reset() the frame compiles again: the line says what was, not what is (h164)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(torch.randn(5, 64, dtype=torch.bfloat16))
    assert report.graphs == 4 and report.limits[2].startswith(
        "until torch._dynamo.reset(), which lets its frame compile again: " + said), report.limits
    torch._dynamo.reset()  # (said once: a second reset adds nothing)
    assert report.limits[2].count("until torch._dynamo.reset()") == 1


def test_dynamo_s_recompile_limit_hits_since_the_first_graph_are_counted():
    """A frame that never gives this backend a graph reaches the limit unseen by ``at_recompile_limit``: Dynamo's own
    count of hits since the report's first graph is in the table and ``to_dict``; a reset starts it again."""
    model = nn.Linear(64, 32).to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    other = torch.compile(lambda t: t * 2, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        other(torch.randn(2))
        other(torch.randn(3))  # a hit before the report's first graph: not its
        torch.compile(model, backend=backend)(x)
        assert backend.report.recompile_limit_hits == 0 and "Dynamo hit" not in backend.report.table()
        other = torch.compile(lambda t: t * 3, backend="eager", dynamic=False)
        other(torch.randn(2))
        other(torch.randn(3))
    report = backend.report
    assert report.recompile_limit_hits == 1 and report.to_dict()["totals"]["recompile_limit_hits"] == 1
    assert ("Dynamo hit torch._dynamo.config.recompile_limit for 1 frame in this process since this report's first "
            "graph: such a frame runs uncompiled from then on") in report.table(), report.table()
    torch._dynamo.reset()  # (the frames it ran uncompiled compile again)
    assert report.recompile_limit_hits == 0 and "Dynamo hit" not in report.table()
    torch._dynamo.utils.counters.clear()  # (a test harness's): a hit after it is counted, though its count is low
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        other = torch.compile(lambda t: t * 4, backend="eager", dynamic=False)
        other(torch.randn(2))
        other(torch.randn(3))
    assert report.recompile_limit_hits == 1, report.table()
    # the limit Dynamo hit is the one named: the accumulated one of a code object many frames share
    with torch._dynamo.config.patch(accumulated_recompile_limit=1, recompile_limit=8), torch.no_grad():
        other = torch.compile(lambda t: t * 5, backend="eager", dynamic=False)
        other(torch.randn(2))
        other(torch.randn(3))
    assert "Dynamo hit torch._dynamo.config.accumulated_recompile_limit for 1 frame" in report.table(), report.table()


def test_a_dynamic_graph_at_the_recompile_limit_blames_no_static_shape():
    """dynamic=True and a new rank each call: the graph at the limit blamed "a new shape, compiled with dynamic=False"
    and advised dynamic=None, which it had."""
    model = nn.Linear(64, 32).to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        for shape in ((3, 64), (2, 3, 64), (2, 2, 3, 64)):
            compiled(torch.randn(*shape, dtype=torch.bfloat16))
    assert list(backend.report.limits) == [1], backend.report.limits
    said = backend.report.limits[1]
    assert ("(one whose inputs fail its guards: a new size of a dim kept static, another rank, dtype or device, or "
            "another value of an argument guarded on) runs the frame uncompiled") in said, said
    assert "dynamic=False" not in said, said
    assert said.endswith("TORCH_LOGS=recompiles names the guards that failed; raise the limit if each graph is needed")


def test_a_flag_argument_at_the_recompile_limit_blames_no_static_shape():
    """dynamic=None (or False, the batch dim marked dynamic), one shape, a string argument that changes each call:
    the note blamed "a new shape, compiled with dynamic=False" and advised the dynamic=None the model had."""
    class Mode(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 32)

        def forward(self, x, mode):
            return self.proj(x) * {"a": 1.0, "b": 2.0, "c": 3.0}[mode]

    model = Mode().to(torch.bfloat16)
    fp8fx.quantize_(model)
    for dynamic in (None, False):  # (False: with the batch dim marked dynamic, which stays symbolic)
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(compiler="eager")
        compiled = torch.compile(model, backend=backend, dynamic=dynamic)
        with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
            for mode in "abc":
                x = torch.randn(3, 64, dtype=torch.bfloat16)
                torch._dynamo.mark_dynamic(x, 0)
                compiled(x, mode)
        assert list(backend.report.limits) == [1], backend.report.limits
        said = backend.report.limits[1]
        assert "another value of an argument guarded on" in said and "dynamic=False" not in said, said


def test_other_backends_graphs_at_the_recompile_limit_are_named():
    """A new backend for each model of one class (comparing options), one shape: Dynamo counts every backend's graphs
    of the frame toward the limit, and the note of the backend at it blamed a new shape and dynamic=False; the backend
    after it, whose model ran uncompiled, said only "call the compiled model" (found by a probe)."""

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 32)

        def forward(self, x):
            return self.proj(x)

    torch._dynamo.reset()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    backends = []
    with torch._dynamo.config.patch(recompile_limit=3), torch.no_grad():
        for _ in range(4):
            model = fp8fx.quantize_(One().to(torch.bfloat16))
            backends.append(fp8fx.Fp8Backend(compiler="eager"))
            torch.compile(model, backend=backends[-1], dynamic=False)(x)
    third, fourth = backends[2].report, backends[3].report
    assert third.graphs == 1 and list(third.limits) == [0], third.limits
    said = third.limits[0]
    assert ("recompile_limit (3); 2 of the 3 are not this backend's: other backends' (torch.compile with another "
            "backend, or a new Fp8Backend, for a model of the same class: use one backend for the models of one class, "
            "or call torch._dynamo.reset() between them), or compiles of the frame that gave no graph (a graph break "
            "before its first op): a call that needs another graph (another backend's, or a new shape") in said, said
    assert not backends[1].report.limits and fourth.graphs == 0
    assert "a call made already ran uncompiled, with no fp8 GEMM, where Dynamo had reached " in str(fourth)
    torch._dynamo.reset()


def test_a_module_whose_weight_takes_a_dropped_one_s_address_is_looked_at():
    """A graph Dynamo runs for each module of a class is watched for new modules' weights (their rows, their fused
    tensors) by comparing the first weight of a call with the last call's. It compared id()s: a dropped model's
    weight's address, taken by the next model's weight, read as the same weight, and that model ran unwatched (its
    fused GEMMs one per layer, no rows in the report)."""
    from unittest import mock

    from fp8fx.backend import _watch_reuse

    report = Report()
    report.frame_weights[0] = [(0, 0)]  # (site 0's weight: the graph's input 0)
    run = _watch_reuse(lambda *args: None, report, 0)
    looked = []
    with mock.patch.object(report, "reused", lambda index, weights: looked.append(index)):  # (holding no weight)
        traced = torch.zeros(4)
        run(traced)  # the module Dynamo traced: its own sites
        weight = torch.zeros(4)
        run(weight)  # another module: its rows
        assert looked == [0]
        address = id(weight)
        del weight
        held = []  # (allocations until one takes the freed address; CPython hands it to the next object of its size)
        while len(held) < 1000 and id(held[-1] if held else None) != address:
            held.append(torch.zeros(4))
        assert id(held[-1]) == address, "no tensor took the dropped weight's address"
        run(held[-1])  # a third module, at the second one's address
    assert looked == [0, 0]
