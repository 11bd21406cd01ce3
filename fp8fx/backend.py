"""``fp8_backend`` / ``Fp8Backend``: Dynamo graph -> fp8fx passes -> Inductor."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

from torch import fx

from fp8fx.lowerings import aten, compat
from fp8fx.passes import PassManager, default_passes
from fp8fx.report import Report

log = logging.getLogger("fp8fx")

_COMPILERS = ("inductor", "eager")
_LOWERINGS = ("aten", "op")


class Fp8Backend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=Fp8Backend(...))``.

    Options:
    - ``compiler``: ``"inductor"`` (default) or ``"eager"`` (run the rewritten graph as is: for
      debugging the passes without Inductor).
    - ``dump_dir``: write each graph before and after the passes as Python (``graph_<i>_before.py``,
      ``graph_<i>_after.py``).
    - ``inductor_config``: extra Inductor config patches for this backend's compilations.
    - ``lowering``: ``"aten"`` (default) decomposes fp8fx ops on CUDA into ATen so Inductor fuses the
      activation quantization and picks the GEMM (``fp8fx.lowerings.aten``); ``"op"`` keeps the fp8fx
      ops as opaque kernels.

    ``report`` lists every linear site of every graph this backend compiled.
    """

    def __init__(
        self,
        *,
        compiler: str = "inductor",
        dump_dir: Optional[str] = None,
        inductor_config: Optional[dict[str, Any]] = None,
        lowering: str = "aten",
    ):
        if compiler not in _COMPILERS:
            raise ValueError(f"Fp8Backend(compiler={compiler!r}): use one of {_COMPILERS}")
        if lowering not in _LOWERINGS:
            raise ValueError(f"Fp8Backend(lowering={lowering!r}): use one of {_LOWERINGS}")
        self.lowering = lowering
        self.compiler = compiler
        self.dump_dir = dump_dir
        self.inductor_config = dict(inductor_config or {})
        options = {"compiler": compiler, "lowering": lowering, "inductor_config": sorted(self.inductor_config.items())}
        self.pass_manager = PassManager(default_passes(), options)
        self.report = Report()

    def cache_key(self) -> str:
        """Changes whenever a pass's source or an option changes (fed to Inductor's FX-graph cache)."""
        return self.pass_manager.uuid()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        index = self.report.graphs
        self._dump(gm, index, "before")
        self.pass_manager.run(gm, example_inputs, self.report)
        self._dump(gm, index, "after")
        if self.compiler == "eager":
            return gm.forward
        patches = {**self.inductor_config, "post_grad_custom_post_pass": self.pass_manager}
        decomps = aten.decompositions() if self.lowering == "aten" and aten.applies(example_inputs) else None
        return compat.compile_fx(gm, example_inputs, config_patches=patches, extra_decompositions=decomps)

    def _dump(self, gm: fx.GraphModule, index: int, stage: str) -> None:
        if self.dump_dir is None:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        path = os.path.join(self.dump_dir, f"graph_{index}_{stage}.py")
        with open(path, "w") as f:
            f.write(gm.print_readable(print_output=False))
        log.info("fp8fx: wrote %s", path)


def fp8_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """``torch.compile(model, backend=fp8fx.fp8_backend)``: ``Fp8Backend()`` with default options.
    Each call site of ``torch.compile`` gets the same stateless default; use ``Fp8Backend`` to read
    the report."""
    return Fp8Backend()(gm, example_inputs)
