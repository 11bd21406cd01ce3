"""Load-time weight hooks for Mixture-of-Experts layers (the lifecycle of vLLM's ``Fp8MoEMethod``).

An experts module holds all its experts in two 3-D tensors, as HF transformers 5 experts modules
(``MixtralExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``) and vLLM's ``FusedMoE`` do::

    gate_up_proj: [E, 2I, H]   (vLLM ``w13_weight``: rows [0, I) = w1 (gate), [I, 2I) = w3 (up))
    down_proj:    [E, H, I]    (vLLM ``w2_weight``)

After quantization the module stores, under its own attribute names (``state_dict()`` keys):

=====================  ==========================  ==========================  =======================
granularity            ``gate_up_proj_scale[_inv]``  ``down_proj_scale[_inv]``   while loading
=====================  ==========================  ==========================  =======================
per-tensor             ``_scale`` ``[E]``            ``_scale`` ``[E]``          w13: ``[E, 2]`` (w1, w3)
per-channel (online)   ``_scale`` ``[E, 2I, 1]``     ``_scale`` ``[E, H, 1]``
block ``[bn, bk]``     ``_scale_inv`` ``[E, 2I/bn, ceil(H/bk)]``  ``_scale_inv`` ``[E, ceil(H/bn), ceil(I/bk)]``
=====================  ==========================  ==========================  =======================

with ``gate_up_proj`` / ``down_proj`` in float8_e4m3fn, and for static activations
``gate_up_proj_input_scale`` / ``down_proj_input_scale`` ``[1]`` (``[E]`` while loading: their max).
The loader also takes vLLM's names (``w13_weight``, ``w13_weight_scale``, ``w13_weight_scale_inv``,
``w13_input_scale``, ``w2_...``) and shard ids ``"w1"``, ``"w3"``, ``"w2"``.

The module's class becomes a subclass of its own whose ``gate_up_proj`` / ``down_proj`` attributes are
dequantized views (``torch.ops.fp8fx.dequantize`` of the fp8 tensor and its scale, scale
``[E, rows/bR, cols/bC]``): the model's own experts code keeps working in eager mode, and under
``torch.compile`` the views mark the experts computation for the MoE pass (``fp8fx.passes.moe``).
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import nn

from fp8fx import quant
from fp8fx.config import Fp8Config, LayerScheme, PerBlock, PerRow, PerTensor, granularity_from_block
from fp8fx.weights import chunked, views
from fp8fx.weights.linear import check_codes_held, check_create_arguments, check_online, fp8_apply, fp8_delattr
from fp8fx.weights.linear import as_index, fp8_load_from_state_dict, foreign_tensor_reason
from fp8fx.weights.linear import reduce_made_class, refuse_script, same_layout
from fp8fx.weights.linear import RANGE_CHECKED, _overflow, check_create_target, float16_range_error, method_config
from fp8fx.weights.linear import _bias_in, check_bias_values, created_by, refuse_meta, setstate_made_class
from fp8fx.weights.linear import refuse_again

log = logging.getLogger("fp8fx")

W13, W2 = "gate_up_proj", "down_proj"
UP = "up_proj"  # ungated experts' first weight, in w13's place (HF's has_gate=False: Nemotron-H's [E, I, H])
ROLES = {W13: "w13", UP: "w13", W2: "w2"}  # tagged on the fp8 tensors as ``_fp8fx_moe_role`` for the MoE pass
# the experts' biases (GPT-OSS), high precision as the model holds them, tagged for the MoE pass too
BIASES = {W13 + "_bias": "b13", UP + "_bias": "b13", W2 + "_bias": "b2"}

_ALIASES = {
    f"{v}_{suffix}": f"{hf}{hf_suffix}"
    for v, hf in (("w13", W13), ("w2", W2))
    for suffix, hf_suffix in (
        ("weight", ""), ("weight_scale", "_scale"), ("weight_scale_inv", "_scale_inv"), ("input_scale", "_input_scale")
    )
}
_SHARDS = {W13: ("w1", "w3"), UP: (), W2: ("w2",)}
_UNLOADED = torch.finfo(torch.float32).min  # marks a scale that was never loaded
_FP8_CLASSES: dict[tuple[type, str], type] = {}  # (class, first weight name) -> its fp8 subclass


# -- the dequantized views --------------------------------------------------------------------
def _view(name: str) -> property:
    def get(self) -> torch.Tensor:
        p = self._parameters
        check_codes_held(self, name)
        scale = p[name + ("_scale_inv" if self._fp8fx_block_scales else "_scale")]
        w = torch.ops.fp8fx.dequantize(
            p[name], scale, self._fp8fx_w_block, self._fp8fx_dtype, p.get(name + "_input_scale"), self._fp8fx_act_block
        )
        # experts the model stores transposed (``is_transposed``) see their own layout; fp8fx keeps fused_moe's
        # (getattr: a module pickled before fp8fx held transposed experts has no flag, and is not transposed)
        w = w.transpose(1, 2) if getattr(self, "_fp8fx_transposed", False) else w
        return views.dequantized(w, self, name)

    return property(get, doc=f"{name} dequantized from its fp8 tensor and scale (fp8fx)")


def fp8_experts_class(cls: type, first: str = W13) -> type:
    """The subclass of ``cls`` whose ``first`` weight (``gate_up_proj``, or ``up_proj`` of ungated experts) and
    ``down_proj`` are dequantized views (cached); the other first name stays as ``cls`` has it."""
    if getattr(cls, "_fp8fx_moe", False):
        return cls
    if (cls, first) not in _FP8_CLASSES:
        attrs = {first: _view(first), W2: _view(W2), "_apply": fp8_apply, "_fp8fx_moe": True,
                 "__module__": cls.__module__, "_load_from_state_dict": fp8_load_from_state_dict,
                 "__delattr__": fp8_delattr, "__prepare_scriptable__": refuse_script,
                 "__reduce_ex__": reduce_made_class, "__setstate__": setstate_made_class,
                 "_fp8fx_maker": functools.partial(fp8_experts_class, first=first)}  # (a pickle remakes it so)
        _FP8_CLASSES[(cls, first)] = type(f"Fp8{cls.__name__}", (cls,), attrs)
    return _FP8_CLASSES[(cls, first)]


def is_quantized_experts(module: nn.Module) -> bool:
    return getattr(type(module), "_fp8fx_moe", False)


def is_experts(module: nn.Module) -> bool:
    """A module holding experts as 3-D ``gate_up_proj`` and ``down_proj`` parameters (bf16 or fp8)."""
    p = module._parameters
    return all(isinstance(p.get(n), torch.Tensor) and p[n].dim() == 3 for n in (W13, W2))


def is_any_experts(module: nn.Module) -> bool:
    """Gated experts (``is_experts``) or ungated ones (``is_ungated_experts``): what ``quantize_``, ``calibrate``, the
    MoE pass and the checkpoint code take."""
    return is_experts(module) or is_ungated_experts(module)


def w13_name(module: nn.Module) -> str:
    """The name of the experts' first weight (fused_moe's w13): ``gate_up_proj``, or ``up_proj`` for ungated experts."""
    return UP if is_ungated_experts(module) else W13


def is_transposed(module: nn.Module) -> bool:
    """Whether the experts ``module`` holds its weights transposed, [E, H, 2I] / [E, I, H] (its code computes
    ``x @ w``): HF's ``is_transposed`` flag says so (Aria), or, with no flag, the shapes do (Llama-4's
    ``Llama4TextExperts``; the two layouts cannot be confused: [E, a, b] with w2 [E, b, a/2] against w2 [E, b/2, a]).
    fp8fx stores the fp8 tensors of either in fused_moe's [E, 2I, H] / [E, H, I] and hands the model transposed views
    (``_fp8fx_transposed``); the state dict and checkpoints hold fused_moe's layout."""
    if is_quantized_experts(module):
        return getattr(module, "_fp8fx_transposed", False)
    flag = getattr(module, "is_transposed", None)
    if flag is not None or is_ungated_experts(module):  # (ungated [E, a, b] / [E, b, a]: no shape tells them apart)
        return flag is True
    e, a, b = module._parameters[W13].shape
    return b % 2 == 0 and tuple(module._parameters[W2].shape) == (e, b // 2, a)


def is_interleaved(module: nn.Module) -> bool:
    """Whether the experts ``module``'s gate and up rows alternate (HF's ``is_concatenated=False``: GPT-OSS)."""
    if is_quantized_experts(module):
        return getattr(module, "_fp8fx_interleaved", False)
    return getattr(module, "is_concatenated", True) is False


def sizes(module: nn.Module) -> tuple[int, int, int]:
    """(E, H, I) of an experts module (gated or not): high precision in either layout (``is_transposed``), or
    quantized."""
    e, a, b = module._parameters[w13_name(module)].shape
    h, rows = (a, b) if is_transposed(module) and not is_quantized_experts(module) else (b, a)
    return e, h, rows // 2 if w13_name(module) == W13 else rows


def is_ungated_experts(module: nn.Module) -> bool:
    """Experts with no gate (HF's ``has_gate=False``, Nemotron-H: ``down_proj(act_fn(up_proj(x)))``): 3-D
    ``up_proj`` [E, I, H] and ``down_proj`` (bf16 or fp8), no ``gate_up_proj``. fused_moe computes them with
    ``gated=False``."""
    p = module._parameters
    # (Inkling's shared experts hold 3-D gate_proj, up_proj and down_proj: gated, in a layout fp8fx does not read)
    return W13 not in p and "gate_proj" not in p and getattr(module, "has_gate", False) is False and all(
        isinstance(p.get(n), torch.Tensor) and p[n].dim() == 3 for n in (UP, W2))


def foreign_experts(module: nn.Module) -> Optional[str]:
    """Why fp8fx leaves ``module``'s experts as they are, where it holds experts in a layout fp8fx does not read
    (DBRX's ``DbrxExperts``: ``mlp.w1`` / ``v1`` / ``w2``, 2-D [E * I, H]; Inkling's shared experts: 3-D ``gate_proj``,
    ``up_proj``, ``down_proj``): a class named ``*Experts`` with a ``num_experts`` of 2 or more or 3-D parameters of
    its own, and parameters no ``nn.Linear`` owns; else None. Nothing quantized them, and they were in no report line
    (their router was quantized, as no experts module was found beside it)."""
    count = getattr(module, "num_experts", None)
    stacked = any(p.dim() == 3 for p in module.parameters(recurse=False))
    if (not type(module).__name__.endswith("Experts") or not (type(count) is int and count >= 2 or stacked)
            or is_any_experts(module) or is_quantized_experts(module)):
        return None
    owners = {id(p) for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    names = [n for n, p in module.named_parameters() if id(p) not in owners]
    if not names:  # a list of MLPs of nn.Linear layers: those are quantized one by one
        return None
    return (f"{type(module).__name__} holds its {f'{count} ' if type(count) is int else ''}experts as "
            f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}, a layout fp8fx does not read: left in high "
            "precision")


def routers(model: nn.Module, prefix: str = "") -> dict[str, str]:
    """fqn -> why it stays in high precision, for the ``nn.Linear`` layers that route tokens to experts: in the
    MoE block holding an experts module, a linear child of the block, or the only linear of a child of the
    block (a linear inside an MLP, such as a shared expert's, is none), with as many outputs as there are
    experts (the router: Phimoe's ``router``, AfMoE's ``router.gate``; LongCat-Flash's ``router.classifier`` scores
    its block's ``zero_expert_num`` identity experts too) or one (Qwen2-MoE's ``shared_expert_gate``, which routes no
    token: its sigmoid scales the shared expert's output, and its reason says so). vLLM builds
    them unquantized: fp8 router logits flip top-k choices (Phimoe: 0.24 against 0.18 relative error of the logits
    with them in bf16)."""
    modules = dict(model.named_modules(prefix=prefix))
    found: dict[str, list[str]] = {}  # router -> the experts modules of its block (JetMoE's: two)
    gates: set[str] = set()  # those of one output: a shared expert's gate (its sigmoid scales that expert's output)
    for fqn, experts in modules.items():
        if fqn == prefix or not (is_any_experts(experts) or foreign_experts(experts)):
            continue
        parent = fqn.rpartition(".")[0]  # the MoE block
        if is_any_experts(experts):
            count, hidden, _ = sizes(experts)
        else:  # (DBRX's router: a linear inside a router module; experts with no count route through no router here)
            count, hidden = getattr(experts, "num_experts", None), getattr(experts, "hidden_size", None)
            if count is None:
                continue
        # LongCat-Flash's router scores its "zero experts" (identity experts, no weights) too: count + that many
        zero = getattr(modules[parent], "zero_expert_num", 0)
        outputs = (count, 1) + ((count + zero,) if type(zero) is int and zero > 0 else ())
        for child_name, child in modules[parent].named_children():
            linears = [(n, m) for n, m in child.named_modules() if isinstance(m, nn.Linear)]
            weight = child._parameters.get("weight")
            router_shape = isinstance(weight, torch.Tensor) and tuple(weight.shape) in ((n, hidden) for n in outputs)
            if not linears and router_shape:
                # a router module of its own that is no nn.Linear (transformers 5's MixtralTopKRouter: F.linear on
                # its weight): never quantized, named here for the report
                full, rows = (f"{parent}.{child_name}" if parent else child_name), weight.shape[0]
            elif len(linears) == 1 and "." not in linears[0][0] and linears[0][1].out_features in outputs:
                full, rows = ".".join(p for p in (parent, child_name, linears[0][0]) if p), linears[0][1].out_features
            else:  # an MLP's linears (a shared expert's) route nothing
                continue
            found.setdefault(full, []).append(fqn)
            if rows == 1 and count != 1:  # (one expert's router has one output too)
                gates.add(full)
    return {router: router_reason(" and ".join(experts), router in gates) for router, experts in found.items()}


_KEPT = " (an MoE router or gate: high precision, as vLLM keeps it)"  # how every router's reason ends


def router_reason(experts: str, shared_gate: bool = False) -> str:
    """The reason ``routers`` gives a router of ``experts`` (their names), or the gate of the shared expert beside
    them (``shared_gate``): what ``quantize_`` tags such a weight with, and the router pass finds it by."""
    return f"{'gates the shared expert beside' if shared_gate else 'routes tokens to'} {experts}{_KEPT}"


def is_router_reason(reason: object) -> bool:
    """Whether ``reason`` (a weight's ``_fp8fx_skip_reason``) is ``routers``': the router pass finds them by it."""
    return isinstance(reason, str) and reason.endswith(_KEPT)


def tag_routers(model: nn.Module, found: dict[str, str], prefix: str = "") -> None:
    """Tags the weights of ``found``'s routers that are no ``nn.Linear`` (``routers``) with why they stay in high
    precision, which the compile report reads back (it said "not an fp8fx-quantized weight: run quantize_")."""
    modules = dict(model.named_modules(prefix=prefix))
    for fqn, reason in found.items():
        module = modules.get(fqn)
        if module is not None and not isinstance(module, nn.Linear):
            module._parameters["weight"]._fp8fx_skip_reason = reason
            module._parameters["weight"]._fp8fx_fqn = fqn


def tag_left_alone(module: nn.Module, fqn: str, reason: str) -> None:
    """Tags the parameters of ``module`` (``fqn``) that no ``nn.Linear`` of it owns, left in high precision for
    ``reason`` (experts in a layout fp8fx does not read, a linear-like module that is no ``nn.Linear``), with the
    reason and their module's name: the compile report names the linears that read them (``F.linear(x,
    self.weight[e])``: JetMoE's experts) by that module and that reason (it named them by paths inside the frame
    Dynamo traced and told the user to run the quantize_ that had been run)."""
    owners = {id(p) for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    for name, sub in module.named_modules(prefix=fqn):
        for p in sub.parameters(recurse=False):
            # a tag of its own stays: an experts module inside (quantized or skipped), a linear elsewhere that shares
            # the weight (a tied lm_head's "weight tied to ...")
            if id(p) not in owners and not hasattr(p, "_fp8fx_fqn"):
                p._fp8fx_skip_reason, p._fp8fx_fqn = reason, name


def input_scale_names(fqn: str, module: Optional[nn.Module] = None) -> tuple[str, str]:
    """The names of an experts module's two static activation scales in ``calibrate``'s and ``quantize_``'s
    ``input_scales``: those of its gate_up_proj's (ungated ``module``: up_proj's) and its down_proj's inputs."""
    prefix = f"{fqn}." if fqn else ""  # (experts quantized as the model itself: no leading dot)
    return f"{prefix}{W13 if module is None else w13_name(module)}", f"{prefix}{W2}"


def experts_scheme(module: nn.Module) -> LayerScheme:
    """The scheme a quantized experts module runs with, read back from the module."""
    static = f"{w13_name(module)}_input_scale" in module._parameters
    act = granularity_from_block([-1, -1] if static else module._fp8fx_act_block)
    return LayerScheme(granularity_from_block(module._fp8fx_w_block, weight=True), act, static)


def block_error(scheme: LayerScheme, intermediate: int, tp_size: int = 1, gated: bool = True) -> Optional[str]:
    """Why ``scheme``'s weight blocks cannot cut experts of ``intermediate_size`` I, or None: w1 and w3
    are stacked in w13, so a scale block must not span both (I % block_n; ungated experts have up alone); a sharded
    I is w2's K dim on every rank, so it must hold whole blocks (I % block_k)."""
    w = scheme.weight
    if not isinstance(w, PerBlock):
        return None
    if gated and intermediate % w.block_n:
        return (
            f"intermediate_size={intermediate} is not divisible by weight_block_size block_n={w.block_n} "
            "(a scale block of gate_up_proj would span gate and up); use per-channel scales or a block_n dividing it"
        )
    if not gated and tp_size > 1 and intermediate % w.block_n:  # (a rank's up rows straddled two scale blocks)
        return (
            f"intermediate_size={intermediate} per shard (tp_size={tp_size}) is not divisible by weight_block_size "
            f"block_n={w.block_n}: a rank's up_proj rows would start inside a scale block; use a tp_size that keeps "
            "whole blocks on every rank"
        )
    if tp_size > 1 and intermediate % w.block_k:
        return (
            f"intermediate_size={intermediate} per shard (tp_size={tp_size}) is not divisible by "
            f"weight_block_size block_k={w.block_k}; use a tp_size that keeps whole blocks on every rank"
        )
    return None


def skip_reason(module: nn.Module, fqn: str, config: Fp8Config) -> Optional[str]:
    """Why the experts ``module`` cannot be quantized with ``config`` (by ``quantize_``), or None."""
    if config.is_ignored(fqn):
        return "in ignored_layers"
    why = layout_reason(module)
    if why is not None:
        return why
    from fp8fx.weights.quantize import fused_activation  # quantize imports this module

    # fused_moe computes act(gate) * up (ungated: act(up)) with SiLU, the GELUs or the squared ReLU: experts with
    # another act_fn would be quantized and never fused (fp8 error, no speedup). A module with no act_fn (a loop
    # calling F.silu; GPT-OSS's _apply_gate) is left to the MoE pass, which reads its graph.
    act = getattr(module, "act_fn", None)
    if act is not None and fused_activation(module) is None:
        inner = getattr(getattr(act, "act", None), "__name__", "")
        python = {"_gelu_tanh_python": " (GELU's tanh formula in Python, use_gelu_tanh_python=True)",
                  "_gelu_python": " (GELU's erf formula in Python, use_gelu_python=True)"}.get(inner, "")
        formula = "act(gate) * up" if is_experts(module) else "act(up) (ungated)"
        return (f"act_fn={act!r}{python} is not SiLU, GELU (exact or tanh) or the squared ReLU: fp8fx.fused_moe "
                f"computes {formula} with one of them")
    w13, w2 = module._parameters[w13_name(module)], module._parameters[W2]
    why = foreign_tensor_reason(w13) or foreign_tensor_reason(w2)
    if why is not None:  # (another library's tensor subclass failed in that library's dispatch, naming no module)
        return why
    if w13.dtype not in quant.HIGH_PRECISION or w2.dtype not in quant.HIGH_PRECISION:
        return f"expert weight dtype {w13.dtype} is not bf16/fp16/fp32"
    if w13.dtype != w2.dtype:  # (the fp8 module dequantizes both to one dtype, w13's)
        return f"{w13_name(module)} is {w13.dtype} but down_proj {w2.dtype}: fp8fx's experts take one dtype for both"
    return block_error(config.scheme(), sizes(module)[2], gated=is_experts(module))


def layout_reason(module: nn.Module) -> Optional[str]:
    """Why fp8fx's experts cannot hold ``module``'s weights, or None: a layout HF's flags declare that fused_moe does
    not compute, or weights that are neither [E, 2I, H] / [E, H, I] nor, transposed, [E, H, 2I] / [E, I, H].
    Interleaved gate/up rows (``is_concatenated=False``) and biases (``has_bias``: ``gate_up_proj_bias`` [E, 2I],
    ``down_proj_bias`` [E, H], kept as they are) are GPT-OSS's, which fused_moe computes."""
    if getattr(module, "has_post_expert_norm", False) is True:  # HF @use_experts_implementation's flag
        return "a norm after each expert is not supported by fp8fx.fused_moe"
    # (Ergo's experts: a post_expert_norm submodule of per-expert weights, no flag; quantized, the MoE pass left them)
    norms = [n for n, m in module.named_children() if "norm" in n.lower() and next(m.parameters(), None) is not None]
    if norms:
        return f"a norm after each expert ({norms[0]}) is not supported by fp8fx.fused_moe"
    why = shape_reason(module)
    if why is not None:
        return why
    name13 = w13_name(module)
    e, h, _ = sizes(module)
    rows = module._parameters[name13].shape[2 if is_transposed(module) else 1]
    for name, shape in ((name13 + "_bias", (e, rows)), (W2 + "_bias", (e, h))):
        bias = module._parameters.get(name)
        if bias is not None and tuple(bias.shape) != shape:
            return f"{name} {list(bias.shape)} is not {list(shape)} (each expert's bias)"
    return None


def shape_reason(module: nn.Module, transposed: Optional[bool] = None) -> Optional[str]:
    """Why the high-precision experts ``module``'s weights are not [E, 2I, H] / [E, H, I] (ungated: [E, I, H] /
    [E, H, I]) or, ``transposed`` (default: ``is_transposed``), [E, H, 2I] / [E, I, H] ([E, H, I] / [E, I, H]); else
    None."""
    name13 = w13_name(module)
    gated = name13 == W13
    w13, w2 = module._parameters[name13], module._parameters[W2]
    rows13 = "2I" if gated else "I"
    if is_transposed(module) if transposed is None else transposed:
        e, h, rows = w13.shape
        i = rows // 2 if gated else rows
        fits, layout = tuple(w2.shape) == (e, i, h), f"[E, H, {rows13}] and [E, I, H] (is_transposed)"
    else:
        e, rows, h = w13.shape
        i = rows // 2 if gated else rows
        fits, layout = tuple(w2.shape) == (e, h, i), f"[E, {rows13}, H] and [E, H, I]"
    if (gated and rows % 2) or not fits:
        return f"{name13} {list(w13.shape)} and down_proj {list(w2.shape)} are not {layout}"
    return None


class Fp8MoEMethod:
    """create_weights -> weight_loader (whole tensors, experts, or w1/w3/w2 shards of an expert) ->
    process_weights_after_loading, for an experts module (layout in the module docstring).

    Online (``is_checkpoint_fp8_serialized=False``): each expert's bf16 tensor is quantized as soon as
    it is complete (a whole tensor at once, or when both of w13's shards w1 and w3 have arrived) and the
    bf16 copy is dropped, so loading holds at most one expert's w13 in bf16 per module. Scales are per
    expert: per-channel by default, per-tensor or blocks when configured. Serialized: fp8 tensors and
    scales are copied as stored; ``process_weights_after_loading`` requantizes w13's two per-tensor
    scales of each expert to their max and collapses static input scales to their max over experts.
    """

    def __init__(self, config: Fp8Config, scheme: Optional[LayerScheme] = None):
        self.config = method_config(config, type(self).__name__)
        self.scheme = scheme or self.config.scheme()

    # -- create ------------------------------------------------------------------------------
    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
        device: Optional[torch.device] = None,
        *,
        tp_size: int = 1,
        prefix: str = "",
        transposed: bool = False,
        interleaved: bool = False,
        gated: bool = True,
    ) -> None:
        """Registers the fp8 tensors and scales on ``layer`` (replacing any bf16 ``gate_up_proj`` /
        ``down_proj``) and swaps its class; ``intermediate_size`` is this rank's I. ``transposed``: the model's code
        reads [E, H, 2I] / [E, I, H] (``is_transposed``): the fp8 tensors, and what ``weight_loader`` takes, are still
        [E, 2I, H] / [E, H, I]; the views the model reads are transposed. ``interleaved``: w13's gate and up rows
        alternate (GPT-OSS's; HF's ``is_concatenated=False``): its w1 / w3 shards have no rows of their own.
        ``gated=False``: ungated experts (Nemotron-H's): ``up_proj`` [E, I, H] in gate_up_proj's place, loaded whole
        (no w1 / w3 shards)."""
        e, h, i = num_experts, hidden_size, intermediate_size
        prefix = prefix or type(layer).__name__
        check_create_arguments(prefix, params_dtype, num_experts=e, hidden_size=h, intermediate_size=i,
                               tp_size=tp_size)
        error = block_error(self.scheme, i, tp_size, gated)
        if error:
            raise ValueError(f"{prefix}: {error}")
        if interleaved and not gated:
            raise ValueError(f"{prefix}: interleaved=True with gated=False: ungated experts have no gate rows")
        check_create_target(prefix, layer, is_quantized_experts(layer), device)
        w13 = W13 if gated else UP
        w = self.scheme.weight

        def param(shape, dtype=torch.float32, fill=None) -> nn.Parameter:
            t = torch.empty(shape, dtype=dtype, device=device) if fill is None else torch.full(
                shape, fill, dtype=dtype, device=device)
            return nn.Parameter(t, requires_grad=False)

        # the tensors first (an allocation that fails leaves the layer as it was), then the layer's attributes
        serialized = self.config.is_checkpoint_fp8_serialized
        new = {}
        for name, (rows, cols) in ((w13, (2 * i if gated else i, h)), (W2, (h, i))):
            new[name] = param((e, rows, cols), quant.FP8_DTYPE)
            if isinstance(w, PerBlock):
                new[name + "_scale_inv"] = param(quant.scale_shape((e, rows, cols), w.block), fill=_UNLOADED)
            elif isinstance(w, PerRow):
                new[name + "_scale"] = param((e, rows, 1), fill=_UNLOADED)
            else:  # per-tensor: one per expert; w13 arrives as one per shard (w1, w3) from checkpoints
                shape = (e, 2) if serialized and name == W13 else (e,)  # (ungated: up, one scale)
                new[name + "_scale"] = param(shape, fill=_UNLOADED)
            if self.scheme.static_activation:
                new[name + "_input_scale"] = param((e,), fill=_UNLOADED)
        layer._fp8fx_prefix = prefix
        layer._fp8fx_dtype = params_dtype
        layer._fp8fx_w_block = list(w.block)
        layer._fp8fx_act_block = list(self.scheme.activation.block)
        layer._fp8fx_block_scales = isinstance(w, PerBlock)
        layer._fp8fx_intermediate = i
        layer._fp8fx_transposed = transposed
        layer._fp8fx_interleaved = interleaved
        layer._fp8fx_processed = False
        # (on the CPU: bookkeeping, not a torch.device("meta") block's)
        layer._fp8fx_done = {n: torch.zeros(e, dtype=torch.int64, device="cpu") for n in (w13, W2)}
        # (name, expert_id, shard_id) of the weights and scales loaded (None: all experts / the whole expert): no
        # load may overlap an earlier one (the completeness check counts elements; online, a repeat would be
        # dropped; a scale's repeat replaced the first, an input scale's was lost in the max)
        layer._fp8fx_arrived = set()
        layer._fp8fx_staging = {}  # (name, expert) -> bf16 [rows, cols] while its shards arrive (online)
        layer._fp8fx_device = device  # (where a bias on meta is made as it loads)
        # bias name -> the experts loaded through weight_loader ("all": whole): one on meta must arrive so, for every
        # expert; one built on its device may come in a plain copy instead, but once an expert's came through
        # weight_loader, every expert's must (the others kept their initial values, silently)
        biases = [n for n in (w13 + "_bias", W2 + "_bias") if isinstance(layer._parameters.get(n), torch.Tensor)]
        layer._fp8fx_bias_loaded = {n: set() for n in biases}
        layer._parameters.update(new)
        layer.__class__ = fp8_experts_class(type(layer), w13)

    # -- load --------------------------------------------------------------------------------
    def weight_loader(
        self,
        layer: nn.Module,
        name: str,
        loaded: torch.Tensor,
        shard_id: Optional[str] = None,
        expert_id: Optional[int] = None,
        *,
        values_checked: bool = False,
    ) -> None:
        """Copy ``loaded`` into ``layer.<name>`` (an HF or vLLM name, see the module docstring): all
        experts (``expert_id=None``: ``[E, ...]``), one expert, or shard ``"w1"`` / ``"w3"`` (gate / up
        rows of gate_up_proj) or ``"w2"`` of one expert. Online, bf16 tensors are quantized here, after a pass
        that refuses NaN/Inf - skipped with ``values_checked`` where the caller's own pass over the tensor did that
        (``fp8fx.load_checkpoint``: one pass over each expert tensor, not two). Online, the load that completes an
        expert quantizes it; where that fails (out of memory) the load is not counted: the same tensor loads again."""
        prefix = created_by(layer, "Fp8MoEMethod")
        w13 = w13_name(layer)
        name = _ALIASES.get(name, name)
        if w13 == UP and name.startswith(W13):  # vLLM's w13_ names: the first weight, up_proj here
            name = UP + name[len(W13):]
        if name in (w13 + "_bias", W2 + "_bias"):  # (GPT-OSS's: high precision, not a scale)
            return self._load_bias(layer, name, loaded, shard_id, expert_id)
        refuse_meta(f"{prefix}.{name} (expert {expert_id}, shard {shard_id})", loaded)
        base = w13 if name.startswith(w13) else W2 if name.startswith(W2) else None
        if base is None or name not in layer._parameters:
            accepted = sorted(n for n in layer._parameters if n.startswith((w13, W2)))
            raise KeyError(f"{prefix}: no fp8fx expert tensor {name!r}; it takes {accepted} (or vLLM's w13_/w2_ names)")
        if shard_id is not None and shard_id not in _SHARDS[base]:
            raise ValueError(f"{prefix}.{name}: shard_id={shard_id!r}; {base} takes {list(_SHARDS[base])} or None"
                             + (" (ungated experts: up_proj whole, all experts or one expert's [I, H])"
                                if base == UP else ""))
        if shard_id is not None and expert_id is None:
            raise ValueError(f"{prefix}.{name}: shard_id={shard_id!r} needs an expert_id")
        if shard_id in ("w1", "w3") and getattr(layer, "_fp8fx_interleaved", False):
            raise ValueError(f"{prefix}.{name}: shard_id={shard_id!r} of experts whose gate and up rows alternate "
                             "(interleaved, as GPT-OSS's): load gate_up_proj whole, all experts or one expert's "
                             "[2I, H]")
        experts = layer._parameters[name].shape[0]
        if expert_id is not None:  # an int (True is 1 and indexes as a mask: data[True] = q wrote every expert)
            given, expert_id = expert_id, as_index(expert_id)
            if expert_id is None:
                raise ValueError(f"{prefix}.{name}: expert_id={given!r} is not an expert's index; pass an int")
        if expert_id is not None and not 0 <= expert_id < experts:
            raise ValueError(f"{prefix}.{name}: expert_id={expert_id} is out of range for {experts} experts")
        online = not self.config.is_checkpoint_fp8_serialized
        if online and name != base and not name.endswith("_input_scale"):
            raise ValueError(f"{prefix}.{name}: online quantization computes the scales; load only {base} (bf16)")
        if layer._fp8fx_processed:  # (a scale's load failed in an IndexError, naming nothing)
            raise ValueError(f"{prefix}.{name} (expert {expert_id}, shard {shard_id}): process_weights_after_loading "
                             "already ran on these experts, which merged their scales; load every tensor before it "
                             "(nothing was loaded)")
        arrival = (name, expert_id, None if shard_id == "w2" else shard_id)  # an expert's w2 is all of its w2
        earlier = self._overlap(layer, *arrival)  # (w1's and w3's input scales, one slot, are two arrivals: the max)
        if earlier is not None:  # (a weight: the completeness check counts elements; a scale: the second replaced
            # the first, silently)
            raise ValueError(
                f"{prefix}.{name} (expert {expert_id}, shard {shard_id}) overlaps what was loaded before (expert "
                f"{earlier[0]}, shard {earlier[1]}; None: all of them); each expert's w1, w3 and w2 and their scales "
                "must arrive once (nothing was loaded)"
            )
        if name == base and online:
            check_online(f"{prefix}.{name} (expert {expert_id}, shard {shard_id})", loaded, layer._fp8fx_dtype,
                         prefix, "expert weights", values_checked)
            self._load_online(layer, base, loaded, shard_id, expert_id)
            layer._fp8fx_arrived.add(arrival)
            return
        if name == base and loaded.dtype != quant.FP8_DTYPE:
            raise ValueError(
                f"{prefix}.{name}: the checkpoint tensor is {loaded.dtype}, expected float8_e4m3fn "
                "(is_checkpoint_fp8_serialized=True); use an online config for bf16 experts"
            )
        bad = chunked.count_nonfinite(loaded.detach()) if name == base and not values_checked else 0
        if bad:  # (NaN codes: the experts' outputs NaN, silently)
            raise ValueError(f"{prefix}.{name} (expert {expert_id}, shard {shard_id}) has {bad} NaN fp8 codes: "
                             "re-export the checkpoint")
        dest = self._slice(layer, name, base, shard_id, expert_id)
        one_value = name.endswith("_input_scale") or isinstance(self.scheme.weight, PerTensor) and name != base
        if one_value and shard_id is None and 0 < loaded.numel() < dest.numel():
            # scales as fp8fx's processed experts hold them (w13's one per expert [E], an input scale [1]) or one for
            # every expert: each slot they stand for (w1 and w3 sharing one, as the linear loader takes a fused
            # layer's one scale for every shard); load_checkpoint expands them so too
            if loaded.numel() == 1:
                loaded = loaded.reshape(()).expand(dest.shape)
            elif dest.dim() == 2 and loaded.numel() == dest.shape[0]:
                loaded = loaded.reshape(-1, 1).expand(dest.shape)
        weight_like = "weight" if name == base else name  # a weight must match exactly, a scale as [N] ~ [N, 1]
        if not same_layout(weight_like, tuple(loaded.shape), tuple(dest.shape)):
            raise ValueError(
                f"{prefix}.{name} (expert {expert_id}, shard {shard_id}): checkpoint tensor of shape "
                f"{tuple(loaded.shape)} does not fit the slice of shape {tuple(dest.shape)}"
            )
        if name != base:
            self._check_scales(f"{prefix}.{name} (expert {expert_id}, shard {shard_id})", loaded)
        loaded = loaded.reshape(dest.shape).to(dest.device)
        if name.endswith("_input_scale"):  # w1 and w3 bring one each: keep the max
            dest.copy_(torch.maximum(dest, loaded.float()))
        else:
            dest.copy_(loaded)
        layer._fp8fx_arrived.add(arrival)
        if name == base:
            self._count(layer, base, expert_id, dest.numel())

    @staticmethod
    def _load_bias(layer: nn.Module, name: str, loaded: torch.Tensor, shard_id, expert_id) -> None:
        """An expert bias (GPT-OSS's ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H]), high precision: all
        experts or one expert's. It went through the scale checks (a negative bias was refused as a scale)."""
        prefix, target = layer._fp8fx_prefix, layer._parameters.get(name)
        if target is None:
            raise ValueError(f"{prefix}.{name}: the experts have no such bias; leave the checkpoint's out (nothing was "
                             "loaded)")
        if shard_id not in (None, "w2"):
            raise ValueError(f"{prefix}.{name}: shard_id={shard_id!r}; an expert bias loads whole, all experts or one "
                             "expert's (nothing was loaded)")
        check_bias_values(f"{prefix}.{name} (expert {expert_id})", loaded, layer._fp8fx_dtype)
        index = as_index(expert_id) if expert_id is not None else None
        if expert_id is not None and (index is None or not 0 <= index < target.shape[0]):
            raise ValueError(f"{prefix}.{name}: expert_id={expert_id!r} is not an expert's index of {target.shape[0]}")
        shape = tuple(target.shape) if index is None else tuple(target.shape[1:])
        if tuple(loaded.shape) != shape:
            raise ValueError(f"{prefix}.{name} (expert {expert_id}): checkpoint tensor of shape {tuple(loaded.shape)}, "
                             f"where the bias takes {list(shape)} (nothing was loaded)")
        arrived = getattr(layer, "_fp8fx_bias_loaded", {}).get(name)
        refuse_again(f"{prefix}.{name}", arrived, index, "expert", "bias")
        if target.is_meta or target.dtype != layer._fp8fx_dtype:  # (in the experts' dtype: see _bias_in)
            target = nn.Parameter(_bias_in(layer, target, loaded.device), requires_grad=target.requires_grad)
            layer._parameters[name] = target
        with torch.no_grad():
            (target if index is None else target[index]).copy_(loaded)
        if arrived is not None:
            arrived.add("all" if index is None else index)

    @staticmethod
    def _check_scales(what: str, scales: torch.Tensor) -> None:
        """Every scale a positive finite float, as load_checkpoint's (``checkpoint.experts.check_scale_values``):
        fused_moe multiplies by them, so a 0, <0, NaN or Inf made the experts' outputs zero or NaN, silently."""
        why = quant.bad_scales(scales.float().reshape(scales.shape or (1,)))
        if why:
            raise ValueError(f"{what}: {why}: re-export the checkpoint")

    @staticmethod
    def _overlap(layer, name: str, expert_id: Optional[int], shard_id: Optional[str]):
        """(expert, shard) of an earlier load of ``name`` (a weight or its scale) that covers part of this one, or
        None: the same expert or all experts (None), the same shard or the whole expert (None)."""
        for b, e, s in layer._fp8fx_arrived:
            same_expert = e is None or expert_id is None or e == expert_id
            same_rows = s is None or shard_id is None or s == shard_id
            if b == name and same_expert and same_rows:
                return e, s
        return None

    @staticmethod
    def _rows(shard_id: str, rows: int) -> slice:
        """The rows of one expert's w13 (or of its per-channel / row-blocked scale, ``rows`` rows) that
        shard ``"w1"`` (gate: the first half) or ``"w3"`` (up: the second half) owns."""
        half = rows // 2
        return slice(0, half) if shard_id == "w1" else slice(half, rows)

    def _slice(self, layer, name: str, base: str, shard_id, expert_id) -> torch.Tensor:
        dest = layer._parameters[name].data
        if expert_id is None:
            return dest
        dest = dest[expert_id]
        if name.endswith("_input_scale") or shard_id in (None, "w2"):
            return dest
        if dest.dim() == 1:  # per-tensor w13 scales while loading: [w1, w3]
            return dest[0:1] if shard_id == "w1" else dest[1:2]
        return dest[self._rows(shard_id, dest.shape[0])]

    def _count(self, layer, base: str, expert_id: Optional[int], numel: int) -> None:
        done = layer._fp8fx_done[base]
        if expert_id is None:
            done.fill_(layer._parameters[base][0].numel())
        else:
            done[expert_id] += numel

    def _load_online(self, layer, base: str, loaded: torch.Tensor, shard_id, expert_id) -> None:
        target = layer._parameters[base]
        if expert_id is None:  # all experts at once: quantize expert by expert, no copy
            if tuple(loaded.shape) != tuple(target.shape):
                raise ValueError(
                    f"{layer._fp8fx_prefix}.{base}: tensor of shape {tuple(loaded.shape)} does not fit "
                    f"{tuple(target.shape)}"
                )
            for e in range(target.shape[0]):
                self._quantize_expert(layer, base, e, loaded[e])
            return
        expert_shape = target.shape[1:]
        if shard_id in (None, "w2"):
            if tuple(loaded.shape) != tuple(expert_shape):
                raise ValueError(
                    f"{layer._fp8fx_prefix}.{base} expert {expert_id}: tensor of shape {tuple(loaded.shape)} does "
                    f"not fit {tuple(expert_shape)}"
                )
            self._quantize_expert(layer, base, expert_id, loaded)
            return
        key = (base, expert_id)
        rows = self._rows(shard_id, expert_shape[0])
        fits = torch.empty(expert_shape, device="meta")[rows].shape  # checked before a staging buffer is made
        if not same_layout("weight", tuple(loaded.shape), tuple(fits)):
            raise ValueError(
                f"{layer._fp8fx_prefix}.{base} expert {expert_id} shard {shard_id}: tensor of shape "
                f"{tuple(loaded.shape)} does not fit the slice of shape {tuple(fits)}"
            )
        staging = layer._fp8fx_staging.get(key)
        if staging is None:
            staging = torch.empty(expert_shape, dtype=layer._fp8fx_dtype, device=target.device)
            layer._fp8fx_staging[key] = staging
            layer._fp8fx_staging[key + ("rows",)] = set()
        dest = staging[rows]
        dest.copy_(loaded.reshape(dest.shape))
        arrived = layer._fp8fx_staging[key + ("rows",)]
        if arrived | {shard_id} == {"w1", "w3"}:
            # both halves: quantize this expert, then drop the bf16 copy; a quantization that fails (out of memory)
            # leaves the copy with the other half's rows and this shard unloaded, to be loaded again (the copy was
            # dropped first: the other half, counted as arrived, was refused as loaded before, and
            # process_weights_after_loading asked for the expert: the experts could not be finished)
            self._quantize_expert(layer, base, expert_id, staging)
            del layer._fp8fx_staging[key], layer._fp8fx_staging[key + ("rows",)]
        else:
            arrived.add(shard_id)

    def _quantize_expert(self, layer, base: str, e: int, w: torch.Tensor) -> None:
        """One expert's high-precision ``w: [rows, cols]`` -> fp8 slot ``e`` and its scale, quantized from the layer's
        dtype as the shards' staging buffer holds them (an fp32 tensor quantized as it came gave other codes than the
        same values in w1 / w3 shards, and than linear layers, which the loader takes through that dtype too)."""
        w = w.to(device=layer._parameters[base].device, dtype=layer._fp8fx_dtype)
        q, scale = chunked.quantize(w, self.scheme.weight.block)
        scale_name = base + ("_scale_inv" if layer._fp8fx_block_scales else "_scale")
        dest = layer._parameters[scale_name].data[e]
        scale = scale.reshape(dest.shape)  # (shapes checked before either tensor is written)
        layer._parameters[base].data[e] = q
        dest.copy_(scale)
        layer._fp8fx_done[base][e] = q.numel()

    # -- finish ------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Runs once (idempotent): checks every expert arrived, requantizes per-tensor w13 to one scale
        per expert (the max of w1's and w3's), collapses static input scales to their max."""
        prefix = created_by(layer, "Fp8MoEMethod")
        if layer._fp8fx_processed:
            return
        params = layer._parameters
        w13 = w13_name(layer)
        for base in (w13, W2):
            per_expert = params[base][0].numel()
            missing = (layer._fp8fx_done[base] < per_expert).nonzero().flatten().tolist()
            if missing:
                raise RuntimeError(
                    f"{prefix}.{base}: experts {missing[:8]}{' ...' if len(missing) > 8 else ''} were not (fully) "
                    "loaded; load every expert (w1 and w3 of gate_up_proj) before process_weights_after_loading"
                )
            for name in (base + "_scale", base + "_scale_inv", base + "_input_scale"):
                if name in params and (params[name].data == _UNLOADED).any():
                    unloaded = params[name].data == _UNLOADED
                    experts = unloaded.reshape(unloaded.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
                    shards = ""
                    if name == w13 + "_scale" and unloaded.dim() == 2 and unloaded.shape[1] == 2:  # ([E, 2]: w1, w3)
                        shards = " (shards " + ", ".join(f"{e}: {['w1', 'w3'][j]}" for e, j in unloaded.nonzero()
                                                         .tolist()[:8]) + ")"
                    raise ValueError(f"{prefix}.{name} was never loaded for experts {experts[:8]}"
                                     f"{' ...' if len(experts) > 8 else ''}{shards}; load it from the checkpoint")
                if name in params:  # (weight_loader refuses a 0, <0, NaN or Inf scale; one copied into the
                    # parameter itself, vLLM's default loader's way, made the experts' outputs NaN or zero, silently)
                    self._check_scales(f"{prefix}.{name} (copied into the parameter, not through weight_loader)",
                                       params[name].data)
        for bias, arrived in getattr(layer, "_fp8fx_bias_loaded", {}).items():  # (on meta: zeros where none came;
            # made real otherwise - load_state_dict(assign=True) - the caller's)
            missing = [e for e in range(params[w13].shape[0]) if e not in arrived] if "all" not in arrived else []
            if missing and (params[bias].is_meta or arrived):
                why = ("the experts were built with their biases on the meta device" if params[bias].is_meta else
                       f"experts {sorted(arrived)[:8]} came through weight_loader, the others kept initial values")
                raise ValueError(f"{prefix}.{bias}: experts {missing[:8]}{' ...' if len(missing) > 8 else ''} never "
                                 f"loaded ({why}); load them through weight_loader(layer, {bias!r}, ...) first (the "
                                 "experts are as they were)")
        # (load_checkpoint, load_state_dict and .half() refuse it too; load_checkpoint's own check names the entry)
        if layer._fp8fx_dtype == torch.float16 and not getattr(layer, RANGE_CHECKED, False):
            self._check_float16(layer)
        if isinstance(self.scheme.weight, PerTensor) and params[w13 + "_scale"].dim() == 2:
            self._requantize_w13(layer)
        for base in (w13, W2):
            name = base + "_input_scale"
            if name in params:
                scales = params[name].data
                if scales.numel() > 1 and scales.min() != scales.max():  # (vLLM says so too)
                    log.warning("fp8fx: %s.%s: the experts' static input scales differ (%.6g to %.6g): fused_moe "
                                "takes one, their max (no expert's activations clip; those of smaller scales lose "
                                "precision)", prefix, name, scales.min().item(), scales.max().item())
                params[name] = nn.Parameter(scales.max().reshape(1), requires_grad=False)
            params[base]._fp8fx_moe_role = ROLES[base]
        tag_biases(layer)
        layer._fp8fx_processed = True

    @staticmethod
    def _check_float16(layer: nn.Module) -> None:
        """Float16 experts whose scales times fp8 values float16 cannot hold (inf weights, NaN outputs): refused before
        processing changes anything. Per-tensor w13 scales ``[E, 2]`` count each shard's rows under its own."""
        params = layer._parameters
        scale = params.get(W13 + "_scale")
        if scale is not None and scale.dim() == 2 and scale.shape[1] == 2:  # (w1, w3 of each expert)
            i = layer._fp8fx_intermediate
            rows = scale.data.float().repeat_interleave(i, dim=1)  # [E, 2I]: gate's rows, then up's
            if getattr(layer, "_fp8fx_interleaved", False):  # gate, up, gate, up, ...
                rows = scale.data.float().repeat(1, i)
            found = (_overflow(layer, torch.float16, {W13: params[W13], W13 + "_scale": rows.unsqueeze(-1)},
                               block=(1, -1))
                     or _overflow(layer, torch.float16, {W2: params[W2], W2 + "_scale": params[W2 + "_scale"]}))
        else:
            found = _overflow(layer, torch.float16, params)
        if found is not None:
            raise float16_range_error(f"{layer._fp8fx_prefix}.{found[2]}", *found, experts=True)

    @staticmethod
    def _requantize_w13(layer: nn.Module) -> None:
        """w13 scales ``[E, 2]`` (w1, w3) -> ``[E]``, each expert's fp8 rows requantized to the max: w1's rows and
        w3's, the first and second half, or the even and odd rows of interleaved experts (requantized by halves, the
        interleaved experts' weights came out 89% off)."""
        params = layer._parameters
        q, scales = params[W13].data, params[W13 + "_scale"].data
        i = layer._fp8fx_intermediate
        interleaved = getattr(layer, "_fp8fx_interleaved", False)
        for e in range(q.shape[0]):
            if scales[e, 0] != scales[e, 1]:
                rows = torch.cat([q[e, 0::2], q[e, 1::2]]) if interleaved else q[e]
                out, _ = quant.requantize_shards(rows, [scales[e, 0], scales[e, 1]], [i, i])
                if interleaved:
                    q[e, 0::2], q[e, 1::2] = out[:i], out[i:]
                else:
                    q[e] = out
                # its scales now the max too: a requantization that fails at a later expert (out of memory) leaves
                # this one done, skipped when processing runs again (it was requantized again from rows already at
                # the max, read as at w1's and w3's own scales: its weights wrong, silently)
                scales[e] = scales[e].max()
        params[W13 + "_scale"] = nn.Parameter(scales.amax(dim=1), requires_grad=False)


class Fp8OnlineMoEMethod(Fp8MoEMethod):
    """vLLM's method for experts of a bf16 checkpoint quantized as they load: ``Fp8MoEMethod`` with a config that is
    not fp8-serialized (each expert quantized once its tensors are complete, per-channel scales by default, per-tensor
    or blocks as configured), which ``Fp8Config.get_quant_method`` gives such a config's experts. A serialized config
    is refused: its experts load through ``Fp8MoEMethod``."""

    def __init__(self, config: Fp8Config, scheme: Optional[LayerScheme] = None):
        super().__init__(config, scheme)
        if self.config.is_checkpoint_fp8_serialized:
            raise ValueError("Fp8OnlineMoEMethod quantizes bf16 experts as they load, and this config says the "
                             "checkpoint is fp8 (is_checkpoint_fp8_serialized=True): load its experts with "
                             "Fp8MoEMethod, or pass a config with is_checkpoint_fp8_serialized=False")


def tag_biases(module: nn.Module) -> None:
    """Tags the experts' biases (GPT-OSS's ``gate_up_proj_bias`` / ``down_proj_bias``) for the MoE pass, which passes
    them to fused_moe: where the weights are quantized, and where ``load_checkpoint`` puts the checkpoint's in."""
    for name, role in BIASES.items():
        if isinstance(module._parameters.get(name), torch.Tensor):
            module._parameters[name]._fp8fx_moe_role = role


def quantize_experts(module: nn.Module, fqn: str, config: Fp8Config,
                     input_scales: Optional[tuple[float, float]] = None) -> None:
    """``quantize_``'s step for one experts module (checked by ``skip_reason``): bf16 -> fp8, in place;
    the bf16 tensors are released when this returns. ``input_scales``: the static activation scales of
    gate_up_proj's and down_proj's inputs (``calibrate``), with ``activation_scheme='static'``."""
    name13 = w13_name(module)
    w13, w2 = module._parameters[name13], module._parameters[W2]
    e, h, i = sizes(module)
    transposed = is_transposed(module)
    if transposed:  # fp8fx stores fused_moe's layout (the views transpose it back)
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    method = Fp8MoEMethod(config)
    method.create_weights(module, e, h, i, w13.dtype, device=w13.device, prefix=fqn, transposed=transposed,
                          interleaved=is_interleaved(module), gated=name13 == W13)
    method.weight_loader(module, name13, w13.detach())
    method.weight_loader(module, W2, w2.detach())
    del w13, w2
    if method.scheme.static_activation:  # every expert's: the max over experts is what the module keeps
        for base, scale in zip((name13, W2), input_scales):
            method.weight_loader(module, base + "_input_scale", torch.full((e,), scale, dtype=torch.float32))
    method.process_weights_after_loading(module)
    for base in (name13, W2):
        module._parameters[base]._fp8fx_fqn = fqn
    if getattr(getattr(module, "config", None), "_experts_implementation", None) == "eager":
        log.warning(
            "fp8fx: %s uses HF's per-expert loop (experts_implementation='eager'), which torch.compile splits at "
            "nonzero(): its experts run eagerly on dequantized weights, not in fp8; use "
            "model.set_experts_implementation('grouped_mm') (HF's default) or 'batched_mm'", fqn
        )


def tag_skipped(module: nn.Module, fqn: str, reason: str) -> None:
    """Marks the bf16 expert tensors of a module ``quantize_`` left alone, for the MoE pass's report."""
    for base in (W13, UP, W2):
        p = module._parameters.get(base)
        if p is not None:
            p._fp8fx_skip_reason, p._fp8fx_fqn, p._fp8fx_moe_role = reason, fqn, ROLES[base]
