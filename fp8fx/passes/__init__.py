"""FX graph passes: one per file, run by ``PassManager`` (see README.md here for the invariants)."""
from fp8fx.passes.base import Fp8Pass, PassContext
from fp8fx.passes.horizontal import HorizontalFusionPass
from fp8fx.passes.linear import LinearPass
from fp8fx.passes.manager import PassManager, default_passes
from fp8fx.passes.mlp import GatedMlpPass
from fp8fx.passes.moe import MoePass
from fp8fx.passes.router import RouterPass
from fp8fx.passes.topk import TopkPass

__all__ = ["Fp8Pass", "GatedMlpPass", "HorizontalFusionPass", "LinearPass", "MoePass", "PassContext", "PassManager",
           "RouterPass", "TopkPass", "default_passes"]
