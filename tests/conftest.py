import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Inductor's caches of this test session apart from earlier ones, set before torch is imported (before anything
# reads it): the FX graph cache's key does not see a custom op's fake impl, so a test compiling fp8fx's ops
# with plain backend="inductor" took a wrapper cached under an older ops.py and failed on the strides it asserts
# (Fp8Backend's key hashes ops.py: its compiles were not affected). A directory the caller names is kept; test
# subprocesses inherit this one, which is removed when the session's process exits.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fp8fx-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import torch  # noqa: E402

import fp8fx  # noqa: F401  (registers the ops)


def pytest_addoption(parser):
    parser.addoption(
        "--failures-file", default=None,
        help="append each failure's traceback to this file as it happens (device runs end at a hard time "
        "limit, before pytest's own summary is printed)",
    )


_failures_file = None  # --failures-file


def pytest_configure(config):
    global _failures_file
    _failures_file = config.getoption("--failures-file")


def pytest_runtest_logreport(report):
    if _failures_file and report.failed:
        with open(_failures_file, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def pytest_collectreport(report):
    pytest_runtest_logreport(report)  # a module that fails to import


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with the device tool)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b`` (float64)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def quantize_stopped_at(model, call: int, *args, **kwargs) -> None:
    """``fp8fx.quantize_(model, *args, **kwargs)`` stopped by an out-of-memory error at its ``call``-th weight
    quantization (a late layer): the model is left half-quantized, as a real one leaves it."""
    from fp8fx.weights import chunked

    real, calls = chunked.quantize, []

    def out_of_memory(*a, **k):
        calls.append(1)
        if len(calls) == call:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunked, "quantize", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            fp8fx.quantize_(model, *args, **kwargs)


def assert_graph_replays_equal(fn, want: torch.Tensor, replays: int = 3) -> None:
    """``fn()`` captured in a CUDA graph: each replay (output zeroed before it) gives exactly ``want``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn()
    for _ in range(replays):
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want)


def record_graphs_after_passes(backend) -> list[str]:
    """``gm.code`` of every graph ``backend`` compiles, as it stands after the fp8fx passes."""
    codes: list[str] = []
    run = backend.pass_manager.run

    def recording_run(gm, example_inputs, report):
        n = run(gm, example_inputs, report)
        codes.append(gm.code)
        return n

    backend.pass_manager.run = recording_run
    return codes


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_under_triton_interpreter(argv: list[str], timeout: int = 300) -> str:
    """``python argv...`` in the repo root with TRITON_INTERPRET=1 (a fresh process: the interpreter is
    chosen when triton is imported); fails with its output unless it exits 0, returns its stdout.
    Skips where the interpreter cannot run: triton 3.6 with numpy >= 2.4 (FACTS.md), the GPU machine's
    case; CI runs these with triton 3.8 (the release on its disk), and they pass with 3.9 too."""
    triton = pytest.importorskip("triton")
    import numpy

    if triton.__version__.startswith("3.6") and tuple(map(int, numpy.__version__.split(".")[:2])) >= (2, 4):
        pytest.skip("triton 3.6's interpreter breaks with numpy >= 2.4 (FACTS.md)")
    proc = subprocess.run([sys.executable, *argv], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
