import pytest
import torch

import fp8fx  # noqa: F401  (registers the ops)


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
