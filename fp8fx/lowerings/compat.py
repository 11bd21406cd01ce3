"""The one place that touches Inductor internals, for every torch version fp8fx supports
(torch 2.11 on the GPU machine, 2.13+ on CPU machines). Everything else imports from here."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass  # 2.11 and 2.13

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def compile_fx(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config_patches: Optional[dict] = None,
    extra_decompositions: Optional[dict] = None,
):
    """Inductor's compile entry point (``torch._inductor.compile_fx.compile_fx``); extra
    decompositions are added to Inductor's own table (passing a table replaces Inductor's)."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    from torch._inductor.decomposition import select_decomp_table

    decomps = None
    if extra_decompositions:
        decomps = {**select_decomp_table(), **extra_decompositions}
    return _compile_fx(gm, example_inputs, config_patches=config_patches or {}, decompositions=decomps)


__all__ = ["CustomGraphPass", "TORCH_VERSION", "compile_fx"]
