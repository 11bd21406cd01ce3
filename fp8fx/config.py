"""Fp8Config: what to quantize and how, with the semantics of vLLM's ``Fp8Config``.

Granularity types say which slice of a tensor shares one scale. A granularity is a block
``(rows, cols)`` over the last two dims of a 2-D view, where ``-1`` means "the whole dim":

================  ===========  ================================================
type              block        scale shape for a ``[N, K]`` tensor
================  ===========  ================================================
``PerTensor()``   ``(-1, -1)`` ``[1, 1]`` (stored as ``[]``/``[1]`` in checkpoints)
``PerRow()``      ``(1, -1)``  ``[N, 1]`` (weights: per output channel; activations: per token)
``PerGroup(g)``   ``(1, g)``   ``[N, ceil(K / g)]`` (activations of block-scaled weights)
``PerBlock(b,c)`` ``(b, c)``   ``[ceil(N / b), ceil(K / c)]``
================  ===========  ================================================
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import re
import weakref
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

ACTIVATION_SCHEMES = ("static", "dynamic")


def check_name_list(value: Any, where: str, what: str = "module names") -> None:
    """A list of strings from a checkpoint's config, else a ValueError naming ``where``: a bare string would
    be split into its characters (nothing ignored)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        hint = [value] if isinstance(value, str) else ["lm_head"]
        raise ValueError(f"{where}={value!r} must be a list of {what}, e.g. {hint!r}")


@dataclasses.dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor: scale shape ``[1, 1]``."""

    @property
    def block(self) -> tuple[int, int]:
        return (-1, -1)

    def __str__(self) -> str:
        return "per-tensor"


@dataclasses.dataclass(frozen=True)
class PerRow:
    """One scale per row: ``[N, 1]`` for a weight ``[N, K]`` (per-channel), ``[M, 1]`` for
    activations ``[M, K]`` (per-token)."""

    @property
    def block(self) -> tuple[int, int]:
        return (1, -1)

    def __str__(self) -> str:
        return "per-row"


@dataclasses.dataclass(frozen=True)
class PerGroup:
    """One scale per ``1 x group_size`` slice of a row: scale shape ``[M, ceil(K / group_size)]``."""

    group_size: int = 128

    def __post_init__(self):
        _check_positive_int("PerGroup.group_size", self.group_size)

    @property
    def block(self) -> tuple[int, int]:
        return (1, self.group_size)

    def __str__(self) -> str:
        return f"per-group(1x{self.group_size})"


@dataclasses.dataclass(frozen=True)
class PerBlock:
    """One scale per ``block_n x block_k`` tile: scale shape ``[ceil(N / block_n), ceil(K / block_k)]``
    (the checkpoint's ``weight_scale_inv``)."""

    block_n: int = 128
    block_k: int = 128

    def __post_init__(self):
        _check_positive_int("PerBlock.block_n", self.block_n)
        _check_positive_int("PerBlock.block_k", self.block_k)

    @property
    def block(self) -> tuple[int, int]:
        return (self.block_n, self.block_k)

    def __str__(self) -> str:
        return f"per-block({self.block_n}x{self.block_k})"


Granularity = Union[PerTensor, PerRow, PerGroup, PerBlock]
_WEIGHT_GRANULARITIES = (PerTensor, PerRow, PerBlock)
_ACTIVATION_GRANULARITIES = (PerTensor, PerRow, PerGroup)


def _check_positive_int(field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field}={value!r} must be a positive int")


def granularity_from_block(block: Sequence[int], weight: bool = False) -> Granularity:
    """Inverse of ``Granularity.block``. ``weight``: a weight's, where ``[1, K]`` blocks are ``PerBlock(1, K)``
    (weights have no ``PerGroup``; read back as one, a ``weight_block_size=[1, k]`` layer was saved as per tensor)."""
    rows, cols = block
    if (rows, cols) == (-1, -1):
        return PerTensor()
    if (rows, cols) == (1, -1):
        return PerRow()
    if rows == 1 and not weight:
        return PerGroup(cols)
    return PerBlock(rows, cols)


@dataclasses.dataclass(frozen=True)
class LayerScheme:
    """How one linear layer is quantized, resolved from an ``Fp8Config``."""

    weight: Granularity
    activation: Granularity
    static_activation: bool

    def __str__(self) -> str:
        act = "static per-tensor" if self.static_activation else str(self.activation)
        act = act.replace("per-row", "per-token")
        return f"w:{weight_granularity_name(self.weight)} a:{act}"


def weight_granularity_name(granularity: Granularity) -> str:
    """A weight's scale granularity as the report's schemes name it: per-channel (one scale per output row), not
    per-row."""
    return str(granularity).replace("per-row", "per-channel")


def _granularity(text: Any, field: str) -> Optional[Granularity]:
    """A granularity from its ``str`` (``"per-tensor"``, ``"per-row"``, ``"per-group(1x128)"``,
    ``"per-block(128x128)"``), None for None."""
    if text is None:
        return None
    m = re.fullmatch(r"per-(tensor|row)|per-group\(1x(\d+)\)|per-block\((\d+)x(\d+)\)", str(text))
    if m is None:
        raise ValueError(f"quantization_config: {field}={text!r}; per-tensor, per-row, per-group(1xG) or "
                         "per-block(NxK)")
    if m[1]:
        return PerTensor() if m[1] == "tensor" else PerRow()
    return PerGroup(int(m[2])) if m[2] else PerBlock(int(m[3]), int(m[4]))


class _ModelRules(NamedTuple):
    model: "weakref.ref"  # the model the rules are of
    decide: Any  # quantize_'s LinearDecider of the model
    attentions: frozenset  # the attentions load_checkpoint gives KV-cache scales
    params: dict  # id(parameter) -> a weak reference to it, as the decider saw them (its tied weights are by id)


_MODEL_RULES: dict[int, _ModelRules] = {}  # id(model) -> its rules (by id: a model may define __eq__ / __hash__)


def _model_rules(model: Any, layer: Any) -> _ModelRules:
    """``Fp8Config.get_quant_method``'s rules of ``model``, read once (each call built them again, a walk of the whole
    model per layer), and again where ``layer``'s weight is not the parameter they saw: parameters replaced since
    (``to_empty``, ``load_state_dict(assign=True)``, ``tie_weights()``), whose ids the tied-weight rule reads."""
    rules = _MODEL_RULES.get(id(model))
    weight = getattr(layer, "_parameters", {}).get("weight")
    if rules is not None and rules.model() is model and (
            weight is None or (ref := rules.params.get(id(weight))) is not None and ref() is weight):
        return rules
    from fp8fx.weights.kv_cache import kv_cache_attentions
    from fp8fx.weights.quantize import LinearDecider

    modules = dict(model.named_modules())
    key = id(model)

    def forget(ref: weakref.ref) -> None:  # (only its own entry: the id may be another model's by then)
        if _MODEL_RULES.get(key, None) is not None and _MODEL_RULES[key].model is ref:
            del _MODEL_RULES[key]

    rules = _ModelRules(weakref.ref(model, forget), LinearDecider(model),
                        frozenset(kv_cache_attentions(modules, model)),
                        {id(p): weakref.ref(p) for p in model.parameters()})
    _MODEL_RULES[key] = rules
    return rules


_MXFP8 = ("MXFP8 (1x32 blocks of power-of-two E8M0 scales) is no scheme of fp8fx's; quantize the bf16 model with an "
          "Fp8Config instead")
OTHER_FP8_METHODS = {
    "fbgemm_fp8": "FBGEMM's fp8 checkpoints (per-channel weight scales, per-token activations bounded by "
                  "activation_scale_ub) are not an fp8 config; fp8fx does not load them as such: build the scheme with "
                  "Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=fp8fx.PerRow()) and its ignore list",
    "ptpc_fp8": "vLLM's online per-token / per-channel method; its scheme is Fp8Config(weight_granularity="
                "fp8fx.PerRow()) (fp8fx's default online scheme)",
    # vLLM's online methods (its QuantizationMethods: bf16 weights quantized as they load, each a config class of its
    # own) and MXFP8: read by vLLM's rule ("fp8" in the name), they were per-tensor fp8 checkpoints
    "fp8_per_tensor": "vLLM's online per-tensor method (bf16 weights quantized as they load); its scheme is "
                      "Fp8Config(weight_granularity=fp8fx.PerTensor())",
    "fp8_per_channel": "vLLM's online per-channel method (bf16 weights quantized as they load); its scheme is "
                       "Fp8Config(weight_granularity=fp8fx.PerRow()) (fp8fx's default online scheme)",
    "fp8_per_block": "vLLM's online 128x128-block method (bf16 weights quantized as they load); its scheme is "
                     "Fp8Config(weight_block_size=(128, 128))",
    "mxfp8": _MXFP8,
    "modelopt_mxfp8": _MXFP8,
    "deepseek_v4_fp8": "vLLM reads it with a config class of its own, not as an fp8 config; build its scheme with "
                       "Fp8Config(...) directly",
}


def entry_covers(entry: str, fqn: str) -> bool:
    """An ``ignored_layers`` entry covers ``fqn``: the same module, or one under it."""
    return fqn == entry or fqn.startswith(entry + ".")


def transformers_skips(fqn: str, patterns: Sequence[str]) -> bool:
    """transformers' reading of ``modules_to_not_convert`` (``should_convert_module``, 5.x): an entry matches ``fqn``
    as a regex from its start up to a module boundary (a name or prefix: "layers.1" covers "layers.1.mlp", not
    "layers.11"), or as a suffix of it ("down_proj" covers every down projection)."""
    for p in patterns:
        if fqn.endswith(p) or re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", fqn):
            return True
    return False


def first_named(names: Sequence, shown: int = 0) -> str:
    """The first of ``names`` for a message, with how many more (and the next ``shown`` of them) where there are more:
    no "(and 0 more: [])" after a name that is the only one."""
    names = list(names)
    if len(names) <= 1:
        return str(names[0]) if names else ""
    listed = f": {[str(n) for n in names[1:1 + shown]]}" if shown else ""
    return f"{names[0]} (and {len(names) - 1} more{listed})"


def warn_misspelt(config: Mapping[str, Any], known: frozenset, where: str) -> None:
    """Warns of each key of ``config`` that is not ``known`` but close to a known key it lacks: a misspelt key (an
    "activation_shceme": "static") was read as absent, its value dropped in silence. Other unknown keys (other
    tools' options) are let be, as vLLM and transformers let them be."""
    for unknown in sorted(k for k in config if isinstance(k, str) and k not in known):
        close = difflib.get_close_matches(unknown, sorted(known), n=1, cutoff=0.8)
        if close and close[0] not in config:
            logging.getLogger("fp8fx").warning(
                "fp8fx: %s[%r]=%r is not a key fp8fx reads (did you mean %r?): it is ignored, and %s is left to its "
                "default", where, unknown, config[unknown], close[0], close[0])


# the keys of an fp8 quantization_config that Fp8Config.from_config reads (or knows: transformers' options)
_READ_KEYS = frozenset({
    "quant_method", "activation_scheme", "is_checkpoint_fp8_serialized", "ignored_layers", "modules_to_not_convert",
    "weight_block_size", "weight_granularity", "activation_granularity", "modules_to_convert", "expert_dtype",
    "scale_fmt", "dequantize", "fmt",
})


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """FP8 quantization config (vLLM ``Fp8Config`` semantics, plus explicit granularities).

    - ``is_checkpoint_fp8_serialized``: weights arrive as fp8 with their scales (else bf16/fp16
      weights are quantized online).
    - ``activation_scheme``: ``"dynamic"`` (scales computed per call) or ``"static"`` (an
      ``input_scale`` per layer, from the checkpoint or ``fp8fx.calibrate``).
    - ``ignored_layers``: FQNs or FQN prefixes that stay in high precision.
    - ``modules_to_not_convert``: entries read as transformers reads its fp8 config's ``modules_to_not_convert``, each a
      regex of a name or prefix, or a suffix (MiniMax-M2's ``"gate"``: every module named so), that may name no module
      (transformers lets them be); ``from_config`` sets it (and ``ignored_layers``) from a dict that has no
      ``ignored_layers``. Modules either covers stay in high precision.
    - ``weight_block_size``: ``[block_n, block_k]`` for block-scaled weights (``weight_scale_inv``);
      also allowed for online quantization.
    - ``weight_granularity`` / ``activation_granularity``: override the defaults, which are
      per-channel weights + per-token activations online, per-tensor weights + per-token
      activations for serialized checkpoints without blocks, and 128x128 blocks + 1x128 groups
      with ``weight_block_size``.
    """

    is_checkpoint_fp8_serialized: bool = False
    activation_scheme: str = "dynamic"
    ignored_layers: Optional[tuple[str, ...]] = None
    weight_block_size: Optional[tuple[int, int]] = None
    weight_granularity: Optional[Granularity] = None
    activation_granularity: Optional[Granularity] = None
    modules_to_not_convert: Optional[tuple[str, ...]] = None

    def __post_init__(self):
        if type(self.is_checkpoint_fp8_serialized) is not bool:  # "false" would read as true
            raise ValueError(f"Fp8Config.is_checkpoint_fp8_serialized={self.is_checkpoint_fp8_serialized!r}: True or "
                             "False")
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(
                f"Unsupported activation scheme {self.activation_scheme!r}: Fp8Config.activation_scheme "
                f"must be one of {ACTIVATION_SCHEMES}"
            )
        if self.ignored_layers is not None:
            if isinstance(self.ignored_layers, str):
                raise ValueError(
                    f"Fp8Config.ignored_layers={self.ignored_layers!r} is a string; pass a list of FQNs, "
                    f"e.g. [{self.ignored_layers!r}]"
                )
            check_name_list(self.ignored_layers, "Fp8Config.ignored_layers", "FQNs (strings)")
            object.__setattr__(self, "ignored_layers", tuple(self.ignored_layers))
        if self.modules_to_not_convert is not None:
            check_name_list(self.modules_to_not_convert, "Fp8Config.modules_to_not_convert")
            for pattern in self.modules_to_not_convert:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ValueError(f"modules_to_not_convert entry {pattern!r} is not a regex ({e}); transformers "
                                     "reads each as a name, a regex or a suffix") from None
            object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))
        if self.weight_block_size is not None:
            if not isinstance(self.weight_block_size, (list, tuple)):
                raise ValueError(f"Fp8Config.weight_block_size={self.weight_block_size!r} must be [block_n, block_k], "
                                 "e.g. [128, 128]")
            block = tuple(self.weight_block_size)
            if len(block) != 2:
                raise ValueError(
                    f"The quantization block size of weight must have 2 dimensions, but got {len(block)} "
                    f"(Fp8Config.weight_block_size={list(self.weight_block_size)}); use [block_n, block_k], "
                    "e.g. [128, 128]"
                )
            for name, value in zip(("block_n", "block_k"), block):
                _check_positive_int(f"Fp8Config.weight_block_size {name}", value)
            if self.weight_granularity is not None and self.weight_granularity != PerBlock(*block):
                raise ValueError(
                    f"Fp8Config.weight_granularity={self.weight_granularity} contradicts "
                    f"weight_block_size={list(block)}; set only one of them"
                )
            object.__setattr__(self, "weight_block_size", block)
        wg = self.weight_granularity
        if wg is not None and not isinstance(wg, _WEIGHT_GRANULARITIES):
            raise ValueError(
                f"Fp8Config.weight_granularity={wg!r} is not supported for weights; use PerTensor(), "
                "PerRow() or PerBlock(block_n, block_k)"
            )
        ag = self.activation_granularity
        if ag is not None and not isinstance(ag, _ACTIVATION_GRANULARITIES):
            raise ValueError(
                f"Fp8Config.activation_granularity={ag!r} is not supported for activations; use "
                "PerTensor(), PerRow() (per-token) or PerGroup(group_size)"
            )
        if self.activation_scheme == "static" and ag is not None and not isinstance(ag, PerTensor):
            raise ValueError(
                f"Fp8Config.activation_granularity={ag} needs activation_scheme='dynamic': static "
                "activation scales are per-tensor (one input_scale per layer)"
            )
        w, a = self.weight, self.activation
        if isinstance(w, PerBlock) and self.activation_scheme != "dynamic":
            raise ValueError(
                "The block-wise quantization only supports dynamic activation scheme for now, but got "
                f"activation_scheme={self.activation_scheme!r} with {w} weights; use activation_scheme='dynamic'"
            )
        if isinstance(w, PerBlock) and isinstance(a, PerGroup) and a.group_size != w.block_k:
            raise ValueError(
                f"Fp8Config.activation_granularity={a} must match the weight's block_k={w.block_k}: "
                f"use PerGroup({w.block_k})"
            )
        if isinstance(a, PerGroup) and not isinstance(w, PerBlock):
            raise ValueError(
                f"Fp8Config.activation_granularity={a} needs block-scaled weights; set "
                f"weight_block_size=[128, {a.group_size}] or use PerRow() activations"
            )

    # --- resolved granularities -------------------------------------------------------------
    @property
    def weight(self) -> Granularity:
        if self.weight_granularity is not None:
            return self.weight_granularity
        if self.weight_block_size is not None:
            return PerBlock(*self.weight_block_size)
        return PerTensor() if self.is_checkpoint_fp8_serialized else PerRow()

    @property
    def activation(self) -> Granularity:
        if self.activation_scheme == "static":
            return PerTensor()
        if self.activation_granularity is not None:
            return self.activation_granularity
        w = self.weight
        return PerGroup(w.block_k) if isinstance(w, PerBlock) else PerRow()

    def scheme(self) -> LayerScheme:
        return LayerScheme(self.weight, self.activation, self.activation_scheme == "static")

    def is_ignored(self, fqn: str) -> bool:
        """True when ``fqn`` equals an entry of ``ignored_layers`` or lies under one, or an entry of
        ``modules_to_not_convert`` matches it as transformers matches them."""
        return (any(entry_covers(entry, fqn) for entry in self.ignored_layers or ())
                or transformers_skips(fqn, self.modules_to_not_convert or ()))

    # --- vLLM-compatible API ----------------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    def get_quant_method(self, layer: Any, prefix: str, *, model: Any = None) -> Any:
        """The method that loads module ``layer`` (named ``prefix`` in its model), as vLLM's ``Fp8Config`` picks it:
        ``Fp8LinearMethod`` for a linear layer (``nn.Linear``, transformers' ``Conv1D``), ``Fp8MoEMethod`` for an
        experts module of an fp8 checkpoint and ``Fp8OnlineMoEMethod`` for one quantized as it loads,
        ``Fp8KVCacheMethod`` for an attention with a KV cache (transformers' mark of one: a ``layer_idx``); None where
        the module loads as it is (vLLM's ``UnquantizedLinearMethod``): a layer ``ignored_layers`` names (experts,
        also by an entry under them: ``experts.0.gate_proj``), an fp8 checkpoint's ``lm_head`` (stored in high
        precision, as vLLM loads it: a checkpoint ``save_checkpoint`` wrote with an fp8 ``lm_head`` loads in
        ``load_checkpoint`` alone; a bf16 checkpoint's is quantized as ``quantize_`` does), a layer
        ``quantize_`` keeps in high precision by itself (``nn.MultiheadAttention``'s ``out_proj``, a parametrized
        weight, experts of an activation ``fp8fx.fused_moe`` does not compute, for a bf16 checkpoint), and any other
        module. ``model``: the model ``prefix`` names a module of; with it the rules that need the model hold too,
        as ``quantize_`` / ``load_checkpoint`` apply them (MoE routers, a weight tied to another module's, the output
        embeddings by ``get_output_embeddings()``, the attentions with a KV cache: the decoder's, not a vision or
        audio tower's). For an fp8 checkpoint, which it does not see, the routers, the output embeddings and the
        layers the model keeps out of quantization are taken as stored in high precision (``LinearDecider``'s
        ``stored_high`` None), as fp8 checkpoints store them; ``load_checkpoint`` loads one stored in fp8 as stored.
        The model is read once, at the first call that names it."""
        from fp8fx.weights import kv_cache, moe
        from fp8fx.weights.kv_method import Fp8KVCacheMethod
        from fp8fx.weights.linear import Fp8LinearMethod, is_linear, skip_reason

        rules = _model_rules(model, layer) if model is not None else None
        if is_linear(layer):
            if self._shards_ignored(prefix, model):
                return None
            if self.is_checkpoint_fp8_serialized and rules is None:  # (stored fp8: loaded as stored, but for the
                # output embeddings, which fp8 checkpoints keep in high precision, as vLLM and transformers load them)
                head = prefix.rpartition(".")[2] == "lm_head"
                return None if self.is_ignored(prefix) or head else Fp8LinearMethod(self)
            # (with the model, an fp8 checkpoint's layers as load_checkpoint and inspect decide them: the output
            # embeddings, the routers and the layers the model keeps in high precision kept, as fp8 checkpoints store
            # them; the checkpoint, which would say, is not at hand)
            reason = rules.decide(prefix, layer, self)[0] if rules is not None else skip_reason(layer, prefix, self)
            return None if reason is not None else Fp8LinearMethod(self)
        if moe.is_any_experts(layer):
            # (an ignore list naming the experts one by one, as a checkpoint of per-expert projections writes it: kept
            # bf16 where it names any, as vLLM skips the FusedMoE layer; load_checkpoint refuses a list naming some
            # of its experts only)
            if self.is_ignored(prefix) or any(str(e).startswith(f"{prefix}.") for e in self.ignored_layers or ()):
                return None
            if self.is_checkpoint_fp8_serialized:  # (stored fp8: loaded as stored)
                return moe.Fp8MoEMethod(self)
            return None if moe.skip_reason(layer, prefix, self) is not None else moe.Fp8OnlineMoEMethod(self)
        if kv_cache.is_attention(layer) and (prefix in rules.attentions if rules is not None
                                             else kv_cache.has_kv_cache_mark(layer)):
            return Fp8KVCacheMethod(self)
        return None

    def _shards_ignored(self, prefix: str, model: Any) -> bool:
        """Whether ``prefix`` is a fused layer whose checkpoint shards the ignore lists cover, every one (``qkv_proj``
        by ``q_proj``, ``k_proj`` and ``v_proj``, as vLLM's and ModelOpt's fp8 checkpoints list them): vLLM's
        ``is_layer_skipped`` reads a fused layer so; by both lists, as ``load_checkpoint`` reads a checkpoint's shards.
        The shards: the ``packed_modules_mapping`` of ``model`` (vLLM's models carry one; a model without one, as
        Phi-3's whose checkpoint stores its ``qkv_proj`` fused, is taken as its checkpoint stores it), else, with no
        model, ``load_checkpoint``'s ``FUSED``. A list naming some of them is refused: a fused layer is one GEMM of
        one scheme (``load_checkpoint`` refuses the checkpoint so)."""
        from fp8fx.checkpoint.load import FUSED

        mapping = getattr(model, "packed_modules_mapping", None) if model is not None else FUSED
        head, _, leaf = prefix.rpartition(".")
        parts = mapping.get(leaf) if isinstance(mapping, Mapping) else None
        if not parts or isinstance(parts, str) or self.is_ignored(prefix):
            return False
        names = [f"{head}.{p}" if head else p for p in parts]
        ignored = [n for n in names if self.is_ignored(n)]
        if ignored and len(ignored) < len(names):
            guessed = ("" if model is not None else " (with no model=, its checkpoint is taken to store them apart: "
                       "pass model= for a model whose checkpoint stores the layer fused)")
            raise ValueError(
                f"Fp8Config's ignore list (ignored_layers, modules_to_not_convert) covers {ignored} but not "
                f"{[n for n in names if n not in ignored]}, shards of the fused layer {prefix!r}{guessed}: it is one "
                f"GEMM of one scheme; name all its shards (or {prefix!r}) to keep it in high precision, or none"
            )
        return bool(ignored)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        """Build from a checkpoint's ``quantization_config`` dict (a ``quant_method`` with "fp8" in it, vLLM's rule,
        or none: fp8fx's own ``to_dict``), or a transformers config object of one (``FineGrainedFP8Config``). The
        fp8 methods vLLM reads with config classes of their own (``fbgemm_fp8``, ``ptpc_fp8``, its online
        ``fp8_per_tensor`` / ``_per_channel`` / ``_per_block``, ``mxfp8``) are refused: their schemes are not what
        this dict reads as."""
        if not isinstance(config, dict) and callable(getattr(config, "to_dict", None)):
            config = config.to_dict()
        if not isinstance(config, dict):
            raise ValueError(f"Fp8Config.from_config takes a quantization_config dict; got {type(config).__name__}")
        quant_method = config.get("quant_method", "")
        quant_method = getattr(quant_method, "value", quant_method)  # transformers' QuantizationMethod enum
        if quant_method and "fp8" not in str(quant_method).lower():  # vLLM's rule below reads any other as online
            raise ValueError(
                f"quantization_config quant_method={quant_method!r} is not fp8: Fp8Config reads fp8 configs; "
                "compressed-tensors and ModelOpt checkpoints load with fp8fx.load_checkpoint(model, path) and no "
                "config=: it reads the checkpoint's own quantization_config"
            )
        # fp8 methods whose scheme the fields below do not say: read as this config, they gave per-tensor scales
        other = OTHER_FP8_METHODS.get(str(quant_method).lower())
        if other:
            raise ValueError(f"quantization_config quant_method={quant_method!r}: {other}")
        # transformers' FineGrainedFP8Config.modules_to_convert names nn.Embedding tables (by name suffix) that its
        # checkpoint stores in fp8 (FP8Embedding, transformers 5.24: replace_with_fp8_embedding), on top of the
        # linears. It is not an allowlist of linears, so it cannot be honoured as "everything else is ignored"; and
        # Fp8Config has no way to say "this embedding is fp8" (fp8fx quantizes linear layers only and reads no fp8
        # embedding). Dropping it made the config claim a plain fp8 checkpoint and the load fail later, blaming the
        # layer. Refused here, naming the field; None or [] (what to_dict() writes by default) means nothing extra.
        convert = config.get("modules_to_convert")
        if convert is not None and not (isinstance(convert, (list, tuple)) and len(convert) == 0):
            raise ValueError(
                f"quantization_config['modules_to_convert']={convert!r}: transformers (FineGrainedFP8Config) stores "
                "the embedding tables named there in fp8, and fp8fx reads fp8 linear layers only, not fp8 "
                "embeddings; re-export the checkpoint with those tables in bf16/fp16 and modules_to_convert null "
                "(or [])"
            )
        # FP4-packed experts (FineGrainedFP8Config's expert_dtype="fp4"), which fp8fx does not read. (scale_fmt="ue8m0"
        # is not refused here: DeepSeek-V3.1's checkpoints declare it over float32 power-of-two scales, which load as
        # any; scales stored as E8M0 are refused by their tensors' dtype. ``dequantize`` is a transformers option.)
        if config.get("expert_dtype", "fp8") != "fp8":
            raise ValueError(
                f"quantization_config['expert_dtype']={config['expert_dtype']!r}: fp8fx reads fp8 experts "
                "(expert_dtype='fp8'); load this checkpoint with transformers, or re-export it with fp8 experts"
            )
        fmt = config.get("fmt")  # (DeepSeek-V3's key: "e4m3"; vLLM does not read it)
        # (any spelling of fp8 e4m3: "fp8", "F8_E4M3", "float8-e4m3fn", "torch.float8_e4m3fn"; not e5m2, e4m3fnuz)
        named = re.fullmatch(r"(torch)?(float8|fp8|f8)?(e4m3(fn)?)?", re.sub(r"[\W_]", "", str(fmt).lower()))
        if fmt is not None and not (named and (named[2] or named[3])):
            # (e4m3fnuz's exponent bias is one more: its codes read as e4m3fn are twice their values)
            raise ValueError(
                f"quantization_config['fmt']={fmt!r}: fp8fx reads fp8 weights in e4m3 (float8_e4m3fn), the format "
                "of vLLM's, DeepSeek's and compressed-tensors' checkpoints; load the model's bf16 checkpoint (with "
                "an online Fp8Config), or re-export this one in e4m3 (\"fmt\": \"e4m3\")"
            )
        warn_misspelt(config, _READ_KEYS, "quantization_config")
        key = "ignored_layers" if config.get("ignored_layers") else "modules_to_not_convert"
        ignored = config.get(key)
        if ignored is not None:
            check_name_list(ignored, f"quantization_config[{key!r}]")
        hf = config.get("modules_to_not_convert") if key == "modules_to_not_convert" or "weight_granularity" in config \
            else None  # ("weight_granularity": a dict to_dict wrote, which other tools' configs do not hold)
        if hf is not None:
            check_name_list(hf, "quantization_config['modules_to_not_convert']")
        block = config.get("weight_block_size")
        # vLLM's rule, unless the dict says (to_dict writes it: an online config reads back as online)
        given = config.get("is_checkpoint_fp8_serialized", "fp8" in str(quant_method).lower())  # (vLLM lowercases)
        if type(given) is not bool:
            raise ValueError(f"quantization_config: is_checkpoint_fp8_serialized={given!r}; true or false")
        out = cls(
            is_checkpoint_fp8_serialized=given,
            activation_scheme=config.get("activation_scheme", "dynamic"),
            ignored_layers=tuple(ignored) if ignored is not None else None,
            weight_block_size=block,  # checked there (a bare 128 is refused with its value)
            # transformers' entries read as it reads them too ("gate" of MiniMax-M2 names every router, no prefix):
            # where they are the list read (vLLM's rule), or beside ignored_layers in fp8fx's own to_dict
            modules_to_not_convert=tuple(hf) if hf else None,
        )
        # to_dict's resolved granularities: set where they differ from what the fields above imply
        weight = _granularity(config.get("weight_granularity"), "weight_granularity")
        if weight is not None and weight != out.weight:
            out = dataclasses.replace(out, weight_granularity=weight)
        act = _granularity(config.get("activation_granularity"), "activation_granularity")
        if act is not None and act != out.activation:
            out = dataclasses.replace(out, activation_granularity=act)
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "quant_method": "fp8",
            "activation_scheme": self.activation_scheme,
            "is_checkpoint_fp8_serialized": self.is_checkpoint_fp8_serialized,
            "weight_granularity": str(self.weight),
            "activation_granularity": str(self.activation),
        }
        if self.modules_to_not_convert is not None:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        if self.ignored_layers is not None and self.ignored_layers != self.modules_to_not_convert:  # (from_config
            out["ignored_layers"] = list(self.ignored_layers)  # set both from modules_to_not_convert)
        if self.weight_block_size is not None:
            out["weight_block_size"] = list(self.weight_block_size)
        return out

    def hash(self) -> str:
        """Stable across processes; feeds compile-cache keys."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @staticmethod
    def get_cache_scale(name: str) -> Optional[str]:
        """Map a checkpoint's attention output-scale name to the KV-cache scale's name, or None."""
        for suffix, target in (
            (".k_proj.output_scale", ".attn.k_scale"),
            (".v_proj.output_scale", ".attn.v_scale"),
            (".q_proj.output_scale", ".attn.q_scale"),
        ):
            if name.endswith(suffix):
                return name.replace(suffix, target)
        if name.endswith("self_attn.prob_output_scale"):
            return name.replace(".prob_output_scale", ".attn.prob_scale")
        return None


ONLINE_CALLERS = ("quantize_", "calibrate", "convert")  # what quantizes high-precision weights


def online_fix(config: str, **more: str) -> str:
    """How to quantize online with the scheme of ``config`` (a config's name in the message), one that describes an
    fp8 checkpoint: the same weight granularity (a serialized config's default is per-tensor, an online one's
    per-channel), ``more`` fields set too."""
    extra = "".join(f", {k}={v}" for k, v in more.items())
    return (f"dataclasses.replace({config}, is_checkpoint_fp8_serialized=False{extra}, "
            f"weight_granularity={config}.weight)")


def config_or(config: Any, default: Optional[Fp8Config], where: str, takes: str = "an Fp8Config or None"
              ) -> Optional[Fp8Config]:
    """``config``, an ``Fp8Config`` (``default`` for None), as ``where`` (e.g. "quantize_") takes it: a
    quantization_config dict, or the class itself, failed deep inside with an AttributeError or a TypeError."""
    if config is None:
        return default
    if isinstance(config, Fp8Config):
        return config
    if config is Fp8Config:
        raise ValueError(f"{where}(config=Fp8Config): the class; pass an instance, e.g. Fp8Config()")
    if callable(getattr(config, "named_modules", None)):  # quantize_(Fp8Config(), model): the two swapped
        raise ValueError(f"{where}(config=<a {type(config).__name__}>): a model where the config goes; the model "
                         f"comes first: {where}(model, Fp8Config(...))")
    fix = ""
    if isinstance(config, Mapping) or callable(getattr(config, "to_dict", None)):
        # (from_config describes an fp8 checkpoint: followed as it was, quantize_ refused that too, and its fix, a
        # plain Fp8Config(is_checkpoint_fp8_serialized=False), dropped the dict's blocks)
        fix = (f"; a quantization_config dict describes a checkpoint (Fp8Config.from_config(it), load_checkpoint's): "
               f"to quantize with its scheme pass {online_fix('c')} of c = Fp8Config.from_config(it)"
               if where in ONLINE_CALLERS else "; for a quantization_config dict pass Fp8Config.from_config(it)")
    raise ValueError(f"{where}(config={config!r:.80}): a {type(config).__name__}; it takes {takes}{fix}")
