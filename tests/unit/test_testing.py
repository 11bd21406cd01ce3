"""fp8fx.testing: each helper passes on a good model and fails, saying why, when it should."""
import json
import logging

import pytest
import torch
from torch import nn

import fp8fx
from fp8fx import testing
from fp8fx.lowerings import compat


def mlp(ignored=("head",)):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("up", nn.Linear(64, 128))
    model.add_module("act", nn.ReLU())
    model.add_module("head", nn.Linear(128, 16))
    model = model.to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=list(ignored)))
    return model


def inputs(*batches):
    return [(torch.randn(b, 5, 64, dtype=torch.bfloat16),) for b in batches]


def eager_backend():
    return fp8fx.Fp8Backend(compiler="eager")


def test_rewritten_and_not_rewritten_pass():
    backend = testing.assert_compiles_once(mlp(), inputs(2), backend=eager_backend())
    testing.assert_rewritten(backend, "up")
    testing.assert_rewritten(backend.report, "u*")
    testing.assert_not_rewritten(backend, "head")


def test_catches_a_missing_rewrite():
    backend = testing.assert_compiles_once(mlp(ignored=["up", "head"]), inputs(2), backend=eager_backend())
    with pytest.raises(AssertionError, match=r"up \(graph 0\) was not rewritten: not quantized: in ignored_layers"):
        testing.assert_rewritten(backend, "up")
    with pytest.raises(AssertionError, match=r"head \(graph 0\) was not rewritten"):
        testing.assert_rewritten(backend)  # default: every site


def test_catches_an_unexpected_rewrite_and_a_pattern_matching_nothing():
    backend = testing.assert_compiles_once(mlp(), inputs(2), backend=eager_backend())
    with pytest.raises(AssertionError, match=r"up \(graph 0\) was rewritten \(w:per-channel a:per-token\)"):
        testing.assert_not_rewritten(backend, "up")
    with pytest.raises(AssertionError, match=r"no site matches 'model.layers.\*'"):
        testing.assert_rewritten(backend, "model.layers.*")


def test_no_recompile_across_shapes_with_dynamic_shapes():
    backend = testing.assert_compiles_once(mlp(), inputs(2, 3, 17), backend=eager_backend())
    assert backend.report.graphs == 1


def test_catches_a_recompile():
    with pytest.raises(AssertionError, match=r"input 1 \(\[3, 5, 64\]\) compiled 1 more graph\(s\); Dynamo's reasons: .*size"):
        testing.assert_compiles_once(mlp(), inputs(2, 3), backend=eager_backend(), dynamic=False)


def test_a_recompile_after_a_first_input_of_size_one_says_why():
    """A batch of 1 first, then 2, recompiles under dynamic=True (Dynamo compiles sizes 0 and 1 as constants): the
    failure said "size mismatch at index 0. expected 1, actual 2", and no more."""
    with pytest.raises(AssertionError, match=r"input 0's sizes of 0 or 1 are constants to Dynamo, even with "
                                             r"dynamic=True: give the first input sizes of 2 or more"):
        testing.assert_compiles_once(mlp(), inputs(1, 2), backend=eager_backend())
    for batches in ((2, 3), (1, 2)):  # (static shapes: any new size recompiles, 1 or not; no such hint)
        with pytest.raises(AssertionError) as info:
            testing.assert_compiles_once(mlp(), inputs(*batches), backend=eager_backend(), dynamic=False)
        assert "constants to Dynamo" not in str(info.value)


def test_catches_a_graph_break():
    model = mlp()

    def broken(x):
        y = model(x)
        torch._dynamo.graph_break()
        return y * 2

    with pytest.raises(AssertionError, match=r"2 graphs for input 0, graph breaks: \[.*graph_break"):
        testing.assert_compiles_once(broken, inputs(2), backend=eager_backend())

    def printing(x):  # the reason's first line alone ("Failed to trace builtin operator") did not name the print
        y = model(x)
        print("between the layers")
        return y * 2

    with pytest.raises(AssertionError, match=r"graph breaks: \[.*builtin operator `print`"):
        testing.assert_compiles_once(printing, inputs(2), backend=eager_backend())

    def branchy(x):  # Dynamo records this break as unsupported alone, no graph break: it was reported with no reason
        y = model(x)
        return y * 2 if y.sum() > 0 else y

    with pytest.raises(AssertionError, match=r"graphs for input 0, graph breaks: \[.*[Dd]ata-dependent branching"):
        testing.assert_compiles_once(branchy, inputs(2), backend=eager_backend())

    def checking(x):  # the same break with nothing after it to compile: one graph, and the helper passed
        y = model(x)
        if torch.isnan(y).any():
            raise ValueError("NaN")
        return y

    with pytest.raises(AssertionError, match=r"1 graphs for input 0, graph breaks: \[.*[Dd]ata-dependent branching"):
        testing.assert_compiles_once(checking, inputs(2), backend=eager_backend())


def test_a_graph_break_is_named_with_the_input_that_hit_it():
    model = mlp()

    def late(x):  # only the second input breaks the graph: it was reported as the first input's
        y = model(x)
        if x.shape[0] > 2:
            print("a big batch")
        return y * 2

    with pytest.raises(AssertionError) as caught:
        testing.assert_compiles_once(late, inputs(2, 3), backend=eager_backend())
    message = str(caught.value)
    assert "for input 0" not in message and "graph breaks" in message, message
    assert "input 1 ([3, 5, 64]): graph breaks: [" in message and "builtin operator `print`" in message, message


class _DisabledHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    @torch.compiler.disable
    def forward(self, x):
        return self.proj(x)


class _WithDisabledHead(nn.ModuleDict):
    def __init__(self):
        super().__init__({"0": nn.Linear(64, 64), "1": _DisabledHead(), "2": nn.Linear(64, 64)})

    def forward(self, x):
        return self["2"](self["1"](self["0"](x)))


def test_assert_rewritten_with_the_model_fails_on_fp8_layers_that_ran_uncompiled():
    """A layer under torch.compiler.disable has no site: assert_rewritten(backend) passes (it checks sites), and
    with the model it names the layer, whose fp8 weight ran in no graph."""
    model = _WithDisabledHead().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = eager_backend()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(3, 64, dtype=torch.bfloat16))
    testing.assert_rewritten(backend)
    testing.assert_rewritten(backend, "0", model=model)
    for patterns in ((), ("1.*",)):
        with pytest.raises(AssertionError, match=r"these fp8 weights ran in no compiled graph .*: 1\.proj\.weight "
                                                 r"\(Fp8Linear\)$"):
            testing.assert_rewritten(backend, *patterns, model=model)


def test_assert_rewritten_with_a_model_of_no_fp8_weight_fails():
    """A model never quantized passed as ``model`` (a forgotten quantize_, the backend shared with a model compiled
    before): nothing tied the report to it, and the sites of that other model passed the check."""
    quantized = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16))
    backend = eager_backend()
    with torch.no_grad():
        torch.compile(quantized, backend=backend)(torch.randn(3, 64, dtype=torch.bfloat16))
    testing.assert_rewritten(backend, "0", model=quantized)
    with pytest.raises(AssertionError, match=r"was given a Sequential that holds no fp8 weight: quantize_ it"):
        testing.assert_rewritten(backend, "0", model=nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16))


def test_assert_rewritten_with_a_compiled_block_names_its_layers_as_its_sites_do():
    """The whole model quantized, one block of it compiled and passed as ``model``: the sites bear the model's names
    ("blocks.0.0"), the unhandled weights the block's ("1.proj.weight"), so the site pattern matched none of them and
    the check passed over a layer that ran in no graph. A layer is matched by either name."""
    model = nn.ModuleDict({"blocks": nn.ModuleList([_WithDisabledHead(), _WithDisabledHead()])}).to(torch.bfloat16)
    fp8fx.quantize_(model)
    block = model["blocks"][0]
    backend = eager_backend()
    with torch.no_grad():
        torch.compile(block, backend=backend)(torch.randn(3, 64, dtype=torch.bfloat16))
    testing.assert_rewritten(backend, "blocks.0.0", "blocks.0.2", model=block)
    for pattern in ("blocks.0.*", "1.*"):
        with pytest.raises(AssertionError, match=r"these fp8 weights ran in no compiled graph .*: 1\.proj\.weight "
                                                 r"\(Fp8Linear\)$"):
            testing.assert_rewritten(backend, pattern, model=block)


def test_a_root_linear_is_matched_by_the_name_the_table_gives_it():
    """The table names a linear compiled on its own "(root module)", which assert_rewritten said no site matched."""
    linear = fp8fx.quantize_(nn.Linear(64, 64).to(torch.bfloat16))
    backend = eager_backend()
    with torch.no_grad():
        torch.compile(linear, backend=backend)(torch.randn(3, 64, dtype=torch.bfloat16))
    assert "(root module)" in str(backend.report)
    testing.assert_rewritten(backend, "(root module)", model=linear)
    with pytest.raises(AssertionError, match=r"expected the sites matching \['\(root module\)'\] not rewritten"):
        testing.assert_not_rewritten(backend, "(root module)")


def test_catches_a_recompile_that_compiled_no_graph():
    """A guard failure whose new trace holds no graph (the second input takes a branch with no tensor op) is a
    recompile all the same: it passed, counting graphs alone."""
    lin = fp8fx.quantize_(nn.Linear(64, 64).to(torch.bfloat16))

    def fn(x, mode):
        return lin(x) if mode == "a" else x

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match=r"input 1 \(\[4, 64\], 'b'\) recompiled the frame \(no new graph\); "
                                             r"Dynamo's reasons: .*mode == .{1,2}a"):
        testing.assert_compiles_once(fn, [(x, "a"), (x, "b")], backend=eager_backend())


class _BreakInALoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            torch._dynamo.graph_break()
        return x


def test_catches_a_frame_dynamo_skipped():
    """A graph break inside a loop makes Dynamo run the whole forward uncompiled and count no graph break; the one
    graph it compiled (a layer's weight property) passed for "compiled once", with no layer rewritten."""
    model = _BreakInALoop().to(torch.bfloat16)
    fp8fx.quantize_(model)
    with pytest.raises(AssertionError, match=r"input 0: Dynamo skipped 1 frame\(s\) and ran them uncompiled \(a "
                                             r"graph break inside a loop skips the whole frame\); its reasons: "
                                             r"\[.*graph_break\(\)"):
        testing.assert_compiles_once(model, [(torch.randn(3, 64, dtype=torch.bfloat16),)], backend=eager_backend())
    # the report's one row (the first layer's weight property) says how the layers ran, and where the second is
    backend = eager_backend()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(3, 64, dtype=torch.bfloat16))
    [site] = backend.report.sites
    assert site.fqn == "layers.0" and not site.rewritten
    assert "a frame it skipped for a graph break inside a loop" in site.reason
    assert "other layers of its class that ran so reuse this graph and have no row: report.unhandled_weights(model) " \
           "lists them" in site.reason
    assert [w[0] for w in backend.report.unhandled_weights(model)] == ["layers.1.weight"]


def test_the_report_of_fp8_backend_is_asked_for_with_the_fix():
    """assert_compiles_once(..., backend=fp8fx.fp8_backend) returns that function, which keeps no report: the checks
    on it said only "got function"."""
    backend = testing.assert_compiles_once(mlp(), inputs(2), backend=fp8fx.fp8_backend)
    with pytest.raises(TypeError, match=r"got function; fp8fx\.fp8_backend keeps no report: .*Fp8Backend\(\)"):
        testing.assert_rewritten(backend, "*")


def test_many_calls_in_one_process_without_a_reset():
    """Each call compiles anew under a new backend: past Dynamo's recompile limit (8) it ran the model uncompiled
    and the helper failed with "compiled no graph" (user suites that do not reset Dynamo between tests)."""
    model = mlp()
    for _ in range(10):
        testing.assert_compiles_once(model, inputs(2), backend=eager_backend())


def test_kernel_count():
    backend = testing.assert_compiles_once(mlp(), inputs(2))
    generated = backend.report.kernels[0]
    assert generated  # the ReLU (and what Inductor fuses with it) is a generated C++ kernel
    testing.assert_kernel_count(backend, len(generated))
    testing.assert_kernel_count(backend, len(generated), graph=0)
    with pytest.raises(AssertionError, match=rf"expected {len(generated) + 1} generated kernels in all graphs, "
                                             rf"Inductor generated {len(generated)}"):
        testing.assert_kernel_count(backend, len(generated) + 1)
    # nothing to count passed vacuously: a graph that does not exist, or a backend that ran no Inductor
    with pytest.raises(AssertionError, match=r"no graph 3: Inductor compiled graphs \[0\]"):
        testing.assert_kernel_count(backend, 0, graph=3)
    eager = testing.assert_compiles_once(mlp(), inputs(2), backend=eager_backend())
    with pytest.raises(AssertionError, match=r"no graph was compiled by Inductor"):
        testing.assert_kernel_count(eager, 0)


def test_bad_arguments():
    with pytest.raises(TypeError, match="expected an fp8fx Report or Fp8Backend, got int"):
        testing.assert_rewritten(3)
    with pytest.raises(ValueError, match="needs at least one argument tuple"):
        testing.assert_compiles_once(mlp(), [])
    # bare tensors: a batch of one ran the model on its single row ([64], not [1, 64]) and passed
    with pytest.raises(ValueError, match=r"inputs\[0\] is a Tensor, not an argument tuple; pass \[\(x1,\), \(x2,\)\]"):
        testing.assert_compiles_once(mlp(), [torch.randn(1, 64), torch.randn(2, 64)])
    # torch.compile's spelling of a backend: a TypeError inside Dynamo, blamed on the helper's own wrapper
    with pytest.raises(ValueError, match=r"assert_compiles_once\(backend='inductor'\): a backend callable, e.g. "
                                         r"fp8fx.Fp8Backend"):
        testing.assert_compiles_once(mlp(), inputs(2, 4), backend="inductor")
    # refused before the helper's reset dropped every compiled cache (torch's "Expected enable to be a bool" came
    # after it, naming neither the helper nor the argument)
    compiled = torch.compile(lambda x: x + 1, backend="eager")
    compiled(torch.ones(2))
    for kwargs, match in ((dict(dynamic="false"), r"assert_compiles_once\(dynamic='false'\): True, False or None"),
                          (dict(dynamic=0), r"assert_compiles_once\(dynamic=0\): True, False or None")):
        with pytest.raises(ValueError, match=match):
            testing.assert_compiles_once(mlp(), inputs(2, 4), **kwargs)
    with pytest.raises(ValueError, match=r"assert_compiles_once: fn is a str, not a function or module"):
        testing.assert_compiles_once("mlp", inputs(2, 4))
    from torch._dynamo.utils import counters
    frames = counters["stats"]["unique_graphs"]
    compiled(torch.ones(2))  # (still compiled: no new graph)
    assert counters["stats"]["unique_graphs"] == frames
    # a generator: the checks used it up, no call ran, and an IndexError came out of the helper
    backend = testing.assert_compiles_once(mlp(), (args for args in inputs(2, 4)), backend=eager_backend())
    assert backend.report.rewritten
    # a count as a string ("expected 2 ... generated 1" though it was 2), a list of patterns as one argument
    with pytest.raises(TypeError, match=r"assert_kernel_count\(expected='2'\): a count / graph index"):
        testing.assert_kernel_count(fp8fx.Fp8Backend(), "2")
    with pytest.raises(TypeError, match=r"FQN patterns are strings, one argument each .* got \['up'\]"):
        testing.assert_rewritten(fp8fx.Fp8Backend(), ["up"])


def test_assert_compiles_once_lets_a_reset_free_the_backends_dump_folder(tmp_path):
    """The helper compiles through a counting wrapper, which had no ``reset``: torch._dynamo.reset() could not free
    the backend's dump folder, and the next backend of the same folder wrote into backend2/. One the user still
    holds moves its files out of the way (h131)."""
    import fp8fx
    from fp8fx.testing import assert_compiles_once

    def run():
        model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
        fp8fx.quantize_(model)
        backend = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
        return assert_compiles_once(model, [(torch.randn(2, 64, dtype=torch.bfloat16),)], backend=backend)

    assert [run().dump_dir for _ in range(2)] == [str(tmp_path)] * 2 and not (tmp_path / "backend2").exists()
    held = run()
    assert run().dump_dir == str(tmp_path) and held.dump_dir == str(tmp_path / "backend2")


def tiny_llama():
    """A one-layer random HF Llama, quantized but for lm_head (as tests/e2e/test_llama.py builds it)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    return model


def test_readme_example_on_a_tiny_llama():
    """README's example with Inductor and dynamic shapes: Dynamo traced the frame again after AOTAutograd raised
    TensorifyScalarRestartAnalysis inside the backend, and the helper counted the discarded attempt as a second
    graph ("2 graphs for input 0, graph breaks: ['a break Dynamo recorded no reason for ...']")."""
    x_small, x_large = torch.randint(0, 512, (2, 8)), torch.randint(0, 512, (4, 32))
    backend = testing.assert_compiles_once(tiny_llama(), [(x_small,), (x_large,)])
    testing.assert_rewritten(backend, "model.layers.*")
    testing.assert_not_rewritten(backend, "lm_head")
    assert backend.report.graphs == 1 and not backend.report.failed


def test_a_retraced_graph_is_reported_once(tmp_path, caplog):
    """The attempt Dynamo discarded (TensorifyScalarRestartAnalysis raised inside the backend) was reported as graph
    0 "failed to compile, nothing in it rewritten", with a WARNING per layer, and every site was listed twice. Now
    it leaves nothing: not in the report, not in the dump folder; the exception still reaches Dynamo."""
    model = tiny_llama()
    backend = fp8fx.Fp8Backend(dump_dir=str(tmp_path))
    calls, retraces = [], []

    def counting(gm, example_inputs):
        calls.append(backend.report.graphs)
        try:
            return backend(gm, example_inputs)
        except BaseException as e:
            retraces.append(type(e).__name__)
            raise

    counting.reset = backend.reset
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="fp8fx"), torch.no_grad():
        torch.compile(model, backend=counting, dynamic=True)(torch.randint(0, 512, (2, 16)))
    torch._dynamo.reset()
    # the case this checks: the first attempt raised (unchanged) and Dynamo called the backend again for graph 0
    assert retraces == ["TensorifyScalarRestartAnalysis"] and calls == [0, 0]
    report = backend.report
    assert report.graphs == 1 and not report.failed and list(report.kernels) == [0]
    fqns = [s.fqn for s in report.sites]
    assert sorted(fqns) == sorted(set(fqns)) and len(fqns) == 8  # 7 projections and lm_head, each once
    assert {s.fqn for s in report.rewritten} == {f"model.layers.0.{p}" for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    assert "failed to compile" not in str(report) and "7 of 8 sites rewritten in 1 graph(s)" in str(report)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "failed to compile" not in caplog.text
    files = sorted(p.name for p in tmp_path.iterdir())
    assert all(f.startswith("graph000_") or f.startswith("report.") for f in files), files
    assert "failed" not in (tmp_path / "report.json").read_text()
    assert json.loads((tmp_path / "graph000_3_report.json").read_text())["totals"]["sites"] == 8
    assert any(f.startswith("graph000_4_dynamo_bytecode") for f in files)  # the retrace's hook wrote it


@pytest.mark.parametrize("error", [RuntimeError("inductor fell over"),
                                   torch._dynamo.exc.RestartAnalysis("not from the backend's retrace"),
                                   RuntimeError("\ninductor fell over\n  in a pass of yours\n  at line 3")])
def test_a_genuine_failure_in_the_backend_is_still_reported(monkeypatch, error):
    """Only the exception Dynamo traces the frame again for is not a failure: any other (a RestartAnalysis too,
    which Dynamo wraps into BackendCompilerFailed when a backend raises it) leaves the graph reported failed, with
    the first line of its message (a message of many lines broke the report's table)."""
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(compat, "compile_fx", fail)
    backend = fp8fx.Fp8Backend()
    with pytest.raises(Exception, match="inductor fell over|not from the backend's retrace"):
        testing.assert_compiles_once(mlp(), inputs(2), backend=backend)
    why = f"the graph failed to compile ({type(error).__name__}: {str(error).strip().splitlines()[0]})"
    assert backend.report.failed == {0: why}
    assert backend.report.sites and not backend.report.rewritten
    assert {s.fqn: s.reason for s in backend.report.sites} == {"up": why, "head": "not quantized: in ignored_layers"}
    assert f"graph 0 failed to compile, nothing in it rewritten: {why}" in str(backend.report)


def test_a_frame_at_the_recompile_limit_is_named_as_such():
    """A frame Dynamo ran uncompiled at its recompile limit was explained as a graph break inside a loop."""
    model = nn.Linear(64, 32).to(torch.bfloat16)
    fp8fx.quantize_(model)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(AssertionError) as caught:
        testing.assert_compiles_once(model, inputs(2, 3), backend=eager_backend(), dynamic=False)
    message = str(caught.value)
    assert "ran them uncompiled (a frame at Dynamo's recompile limit runs uncompiled); its reasons: " in message
    assert "inside a loop" not in message, message


def test_a_root_linear_is_named_in_the_assertion_message():
    """h131: for a linear compiled on its own the message read "expected the sites matching [''] rewritten;  (graph 0)
    was not rewritten": no name, where the table calls the site "(root module)"."""
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    fp8fx.quantize_(lin, fp8fx.Fp8Config(weight_block_size=[128, 128]))  # (32x64: no block divides it, kept bf16)
    backend = testing.assert_compiles_once(lin, inputs(4), backend=eager_backend())
    for check in (lambda: testing.assert_rewritten(backend, "(root module)"), lambda: testing.assert_rewritten(backend)):
        with pytest.raises(AssertionError, match=r"rewritten; \(root module\) \(graph 0\) was not rewritten: not "
                                                 r"quantized: weight \[32, 64\] is not divisible"):
            check()
    with pytest.raises(AssertionError, match=r"^fp8fx: expected the sites matching \['\(root module\)'\] rewritten"):
        testing.assert_rewritten(backend, "(root module)")


def test_assert_compiles_once_says_a_graph_failed_to_compile():
    """h131: under Dynamo's suppress_errors a graph that failed in Inductor ran eagerly, and the message said "graph
    breaks: ['a break Dynamo recorded no reason for ...']" and "a graph break inside a loop": the model had neither."""
    def boom(graph):
        raise RuntimeError("boom")

    model = mlp(ignored=())
    backend = fp8fx.Fp8Backend(inductor_config={"post_grad_custom_post_pass": boom})
    with torch._dynamo.config.patch(suppress_errors=True):
        with pytest.raises(AssertionError, match=r"^fp8fx: expected one graph for every input; input 0: \d graph\(s\) "
                                                 r"failed to compile and ran uncompiled \(torch._dynamo.config."
                                                 r"suppress_errors\): \['InductorError: RuntimeError: boom'"):
            testing.assert_compiles_once(model, inputs(4), backend=backend)
    torch._dynamo.reset()


@pytest.mark.parametrize("error", ["blank", "skip"])
def test_assert_compiles_once_with_a_backend_raising_what_dynamo_takes(error):
    """h132: a backend error whose message is blank made the helper fail with an IndexError of its own; one Dynamo
    takes as a skip (SkipFrame, with suppress_errors off) was said to run uncompiled under suppress_errors."""
    def backend(gm, example_inputs):
        raise RuntimeError("\n") if error == "blank" else torch._dynamo.exc.SkipFrame("this backend skips the frame")

    fn = lambda x: x.sin() + 1  # noqa: E731
    if error == "blank":
        with pytest.raises(Exception) as raised:
            testing.assert_compiles_once(fn, [(torch.randn(4, 8),)], backend=backend)
        assert not isinstance(raised.value, IndexError)
    else:
        with pytest.raises(AssertionError, match=r"input 0: 1 graph\(s\) failed to compile and ran uncompiled: "
                                                 r"\['SkipFrame: this backend skips the frame'\]") as raised:
            testing.assert_compiles_once(fn, [(torch.randn(4, 8),)], backend=backend)
        assert "suppress_errors" not in str(raised.value)
    torch._dynamo.reset()
