"""fp8fx.testing: each helper passes on a good model and fails, saying why, when it should."""
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


def test_catches_a_graph_break():
    model = mlp()

    def broken(x):
        y = model(x)
        torch._dynamo.graph_break()
        return y * 2

    with pytest.raises(AssertionError, match=r"2 graphs for input 0, graph breaks: \[.*graph_break"):
        testing.assert_compiles_once(broken, inputs(2), backend=eager_backend())

    def branchy(x):  # torch 2.13 records no reason for this break: the message must not say "0 graph breaks"
        y = model(x)
        return y * 2 if y.sum() > 0 else y

    if compat.TORCH_VERSION < (2, 13):  # torch 2.11 traces the branch without a second graph: nothing to report
        return
    with pytest.raises(AssertionError, match=r"2 graphs for input 0, graph breaks: \['a break Dynamo recorded no "
                                             r"reason for|2 graphs for input 0, graph breaks: \[.+\]"):
        testing.assert_compiles_once(branchy, inputs(2), backend=eager_backend())


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
    # a count as a string ("expected 2 ... generated 1" though it was 2), a list of patterns as one argument
    with pytest.raises(TypeError, match=r"assert_kernel_count\(expected='2'\): a count / graph index"):
        testing.assert_kernel_count(fp8fx.Fp8Backend(), "2")
    with pytest.raises(TypeError, match=r"FQN patterns are strings, one argument each .* got \['up'\]"):
        testing.assert_rewritten(fp8fx.Fp8Backend(), ["up"])


def test_assert_compiles_once_lets_a_reset_free_the_backends_dump_folder(tmp_path):
    """The helper compiles through a counting wrapper, which had no ``reset``: torch._dynamo.reset() could not free
    the backend's dump folder, and the next backend of the same folder wrote into backend2/."""
    import fp8fx
    from fp8fx.testing import assert_compiles_once

    backends = []
    for _ in range(2):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
        fp8fx.quantize_(model)
        backends.append(fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path)))
        assert_compiles_once(model, [(torch.randn(2, 64, dtype=torch.bfloat16),)], backend=backends[-1])
    assert [b.dump_dir for b in backends] == [str(tmp_path)] * 2 and not (tmp_path / "backend2").exists()
