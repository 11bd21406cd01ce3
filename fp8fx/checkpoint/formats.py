"""``quantization_config`` of a checkpoint <-> the ``Fp8Config`` each linear layer is loaded with.

Formats read and written:

- ``none``: no ``quantization_config``: bf16/fp16 weights, quantized online with the given config.
- ``fp8`` (vLLM / HF): ``activation_scheme``, ``ignored_layers`` (or ``modules_to_not_convert``),
  optional ``weight_block_size``: per-tensor ``weight_scale`` or DeepSeek-V3 ``weight_scale_inv`` blocks.
- ``compressed-tensors``: ``config_groups`` (``targets``, ``weights`` / ``input_activations`` with
  ``strategy`` tensor / channel / block / token / group and ``dynamic``), ``ignore`` (names or ``re:``
  patterns), ``kv_cache_scheme``. Each layer gets the config of the first group that targets it.
- ``modelopt`` (NVIDIA ModelOpt, read as vLLM's ``ModelOptFp8Config`` reads it): ``quant_algo`` ``FP8`` (per-tensor
  weights, static per-tensor activations) or ``FP8_PER_CHANNEL_PER_TOKEN``; ``ignore`` (config.json) or
  ``quantization.exclude_modules`` (``hf_quant_config.json``, which ``files.read_config`` folds into config.json's
  ``quantization_config`` where it has none), wildcards; ``kv_cache_scheme`` or ``kv_cache_quant_algo``. Its layers
  load as the ``fp8`` format's.
"""
from __future__ import annotations

import dataclasses
import re
from fnmatch import fnmatchcase
from typing import Any, Mapping, Optional, Sequence

from fp8fx.checkpoint.files import CheckpointError
from fp8fx.config import OTHER_FP8_METHODS, Fp8Config, LayerScheme, PerBlock, PerGroup, PerRow, PerTensor
from fp8fx.config import check_name_list, warn_misspelt
from fp8fx.config import first_named, transformers_skips

FORMATS = ("fp8", "compressed-tensors", "modelopt")  # the formats read
WRITTEN_FORMATS = ("fp8", "compressed-tensors")  # and written (a ModelOpt checkpoint is saved as one of these)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint is quantized. ``groups``: compressed-tensors ``(targets, config)`` pairs."""

    name: str  # "none", "fp8" or "compressed-tensors"
    config: Fp8Config  # the config of every layer ("none", "fp8")
    groups: tuple[tuple[tuple[str, ...], Fp8Config], ...] = ()
    ignore: tuple[str, ...] = ()
    kv_cache: bool = False  # the checkpoint declares static KV-cache scales
    from_user: bool = False  # the config is the one passed to load_checkpoint, not config.json's
    # transformers' ``modules_to_not_convert`` (an fp8 config without ``ignored_layers``), read as transformers reads
    # it (``transformers_skips``): MiniMax-M2 lists "gate", every module named so; Fp8Config's prefixes miss them
    hf_ignore: tuple[str, ...] = ()
    # ModelOpt's exclude list (``modelopt_excludes``), where the checkpoint is ModelOpt's; None: it is not
    modelopt_exclude: Optional[tuple[str, ...]] = None
    # module -> the checkpoint's names for it where a rename changed them (fp8fx.checkpoint.renames): the
    # ignore list and targets were written against the checkpoint's names and match either
    sources: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False, compare=False)

    @property
    def declared_by(self) -> str:
        """Where the scheme the checkpoint is read with comes from, for messages that blame it."""
        return "the config= passed to load_checkpoint" if self.from_user else "its quantization_config"

    def names_of(self, fqn: str) -> tuple[str, ...]:
        """Module ``fqn``'s names: the model's, then the checkpoint's where a rename changed it."""
        return (fqn, *self.sources.get(fqn, ()))

    def is_ignored(self, fqn: str, classes: Sequence[str] = ()) -> bool:
        if self.name != "compressed-tensors":
            return any(self.config.is_ignored(n) for n in self.names_of(fqn)) or self.skips(fqn)
        return any(matches(n, classes, self.ignore) for n in self.names_of(fqn))

    def skips(self, fqn: str) -> bool:
        """An fp8 checkpoint's ignore list read as its producer reads it, where that is not ``ignored_layers``'
        names and prefixes: transformers' ``modules_to_not_convert``, ModelOpt's ``exclude_modules``."""
        names = self.names_of(fqn)
        if self.modelopt_exclude is not None and any(modelopt_excludes(n, self.modelopt_exclude) for n in names):
            return True
        return any(transformers_skips(n, self.hf_ignore) for n in names)

    def layer_config(self, fqn: str, classes: Sequence[str]) -> Optional[Fp8Config]:
        """The config layer ``fqn`` is quantized with, or None if it stays in high precision. ``classes``: the
        names of the layer's class and its bases (a ``"Linear"`` target covers subclasses of ``nn.Linear``)."""
        if self.is_ignored(fqn, classes):
            return None
        if self.name != "compressed-tensors":
            return self.config
        # a group that names the layer (exactly or by a 're:' pattern) wins over one that names its class,
        # whatever their order (as vLLM's compressed-tensors matching)
        for by_name in (True, False):
            for targets, config in self.groups:
                by = [t for t in targets if by_name != (t in classes)]
                if any(matches(n, () if by_name else classes, by) for n in self.names_of(fqn)):
                    return config
        return None

    def describe(self) -> str:
        if self.name == "none":
            return f"bf16/fp16, quantized online ({self.config.scheme()})"
        if self.name == "fp8":
            by = "ModelOpt " if self.modelopt_exclude is not None else ""
            return f"{by}fp8{', read with config=' if self.from_user else ''} ({self.config.scheme()})"
        schemes = sorted({str(c.scheme()) for _, c in self.groups})
        return f"compressed-tensors ({', '.join(schemes)})"


# names vLLM keeps unquantized in a ModelOpt checkpoint whatever its exclude list says (older exports left the vision
# towers of VLMs unlisted)
_MODELOPT_TOWERS = ("vision_tower", "vision_model", "visual")


def modelopt_excludes(fqn: str, patterns: Sequence[str]) -> bool:
    """ModelOpt's reading of ``exclude_modules`` / ``ignore`` (vLLM's ``ModelOptQuantConfigBase.is_layer_excluded``):
    an entry excludes ``fqn`` as the same name, a part of it ("lm_head", "mlp.gate"), or a wildcard
    ("model.layers.0*", "*.vision_tower.*"); a vision tower's layers are excluded whatever the list says."""
    if any(tower in fqn for tower in _MODELOPT_TOWERS):
        return True
    return any(p == fqn or p in fqn or fnmatchcase(fqn, p) for p in patterns)


def matches(fqn: str, classes: Sequence[str], patterns: Sequence[str]) -> bool:
    """compressed-tensors matching: an exact name, a ``re:`` pattern (``re.match``) or one of ``classes``."""
    for p in patterns:
        if p == fqn or p in classes or p.startswith("re:") and re.match(p[3:], fqn):
            return True
    return False


def parse(config_json: Mapping[str, Any], user: Optional[Fp8Config] = None) -> QuantFormat:
    """The format of a checkpoint from its ``config.json``; ``user`` overrides the layer config."""
    qc = config_json.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"config.json: quantization_config={qc!r} is not an object")
    kv = _kv_cache(qc or {})
    if user is not None:
        return QuantFormat("fp8" if user.is_checkpoint_fp8_serialized else "none", user, kv_cache=kv, from_user=True)
    if qc is None:
        return QuantFormat("none", Fp8Config())
    method = qc.get("quant_method")
    name = method.lower() if isinstance(method, str) else method  # (vLLM lowercases it: "FP8" is fp8)
    try:
        if name == "fp8":
            config = Fp8Config.from_config(qc)
            # (each entry a regex: Fp8Config.from_config checked them)
            hf = () if qc.get("ignored_layers") else tuple(qc.get("modules_to_not_convert") or ())
            # (an online config, fp8fx's to_dict: the weights are bf16/fp16, quantized as they load)
            return QuantFormat("fp8" if config.is_checkpoint_fp8_serialized else "none", config, kv_cache=kv,
                               hf_ignore=hf)
        if name == "compressed-tensors":
            return _compressed_tensors(qc, kv)
        if isinstance(name, str) and name.startswith("modelopt"):  # (vLLM's rule: "modelopt", "modelopt_fp4", ...)
            return _modelopt(qc, kv)
    except ValueError as e:
        raise CheckpointError(f"config.json quantization_config (quant_method={method!r}): {e}") from None
    other = OTHER_FP8_METHODS.get(name) if isinstance(name, str) else None
    if other:  # (Fp8Config.from_config's own words for it; the load gave the generic refusal below: h156)
        raise CheckpointError(f"config.json: quantization_config.quant_method={method!r}: {other}; pass that config "
                              "as load_checkpoint(..., config=...)")
    raise CheckpointError(
        f"config.json: quantization_config.quant_method={method!r} is not a format fp8fx loads; use a checkpoint "
        f"in one of {FORMATS} (float8), a bf16/fp16 one without quantization_config, or pass config=Fp8Config(...)"
    )


def _kv_cache(qc: Mapping[str, Any]) -> bool:
    """The checkpoint declares static KV-cache scales: compressed-tensors' scheme dict, or AutoFP8 / Quark's
    ``"kv_cache_scheme": "static"``."""
    scheme = qc.get("kv_cache_scheme")
    if scheme is not None and scheme != "static" and not isinstance(scheme, dict):  # "Static", true: no KV cache
        raise CheckpointError(f"config.json: kv_cache_scheme={scheme!r} is neither a compressed-tensors scheme (a "
                              "mapping: type float, num_bits 8, dynamic false) nor \"static\"; fix it, or remove it "
                              "for a checkpoint without KV-cache scales")
    if isinstance(scheme, dict) and (scheme.get("type", "float") != "float" or scheme.get("num_bits", 8) != 8):
        # an int8 (or other) KV cache read as fp8 scales would be wrong by its whole format
        raise CheckpointError(f"config.json: kv_cache_scheme={scheme!r} is not an fp8 (8-bit float) KV cache; fp8fx "
                              "reads fp8 KV-cache scales only")
    try:
        static = scheme == "static" or isinstance(scheme, dict) and not _flag(scheme, "dynamic", False,
                                                                              "kv_cache_scheme")
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None
    strategy = scheme.get("strategy", "tensor") if isinstance(scheme, dict) else "tensor"
    if static and strategy not in ("tensor", None):  # vLLM's per-head ("attn_head") scales: one per head, not per
        # layer (a dynamic KV cache stores none: nothing to read)
        raise CheckpointError(f"config.json: kv_cache_scheme strategy={strategy!r}: fp8fx reads one KV-cache scale per "
                              "attention layer (strategy 'tensor'); re-export the KV-cache scales per tensor, or "
                              "remove kv_cache_scheme to load the model without them")
    return static


# quant_algo -> the layers' config: per-tensor weights with static per-tensor activations (ModelOptFp8LinearMethod);
# per-channel weights with dynamic per-token activations (ModelOptFp8PcPtLinearMethod)
_MODELOPT_ALGOS = {
    "FP8": Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static"),
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=PerRow(),
                                           activation_granularity=PerRow()),
}


_MODELOPT_KEYS = frozenset({"quant_method", "quant_algo", "ignore", "exclude_modules", "kv_cache_scheme",
                            "kv_cache_quant_algo", "producer", "quantization"})  # (that fp8fx reads)


def _modelopt(qc: Mapping[str, Any], kv: bool) -> QuantFormat:
    """ModelOpt's FP8 checkpoints: config.json's flat ``quantization_config`` (``quant_algo``, ``ignore``,
    ``kv_cache_scheme``) or ``hf_quant_config.json``'s ``quantization`` (``quant_algo``, ``exclude_modules``,
    ``kv_cache_quant_algo``)."""
    legacy = "quantization" in qc
    inner = qc["quantization"] if legacy else qc
    if not isinstance(inner, Mapping):
        raise ValueError(f"quantization={inner!r} must be an object holding quant_algo")
    algo = str(inner.get("quant_algo") or "").upper()  # (vLLM upper-cases it: ModelOpt may write it lowercase)
    if algo not in _MODELOPT_ALGOS:
        raise ValueError(f"quant_algo={inner.get('quant_algo')!r}: fp8fx loads ModelOpt's {sorted(_MODELOPT_ALGOS)} "
                         "checkpoints (NVFP4, MXFP8 and block weight-only ones are other formats)")
    # (the flat layout's list is "ignore", as vLLM reads it now; an older vLLM read "exclude_modules" there, which was
    # dropped silently, and the excluded bf16 layers refused as "not in the ignore list": h156)
    key = "exclude_modules" if legacy or "ignore" not in inner and "exclude_modules" in inner else "ignore"
    warn_misspelt(inner, _MODELOPT_KEYS, "ModelOpt quantization config")
    exclude = inner.get(key) or []
    if isinstance(exclude, str) or not isinstance(exclude, (list, tuple)):
        raise ValueError(f"{key}={exclude!r} must be a list of module names or wildcards")
    _check_patterns(exclude, key, "module names or wildcards")
    # (in either layout, as vLLM reads it: the flat one's was ignored, and an INT8 cache's scales loaded as fp8
    # ones, silently: h156)
    kv_algo = inner.get("kv_cache_quant_algo")
    if kv_algo is not None and str(kv_algo).upper() != "FP8":
        raise ValueError(f"kv_cache_quant_algo={kv_algo!r}: fp8fx reads FP8 KV-cache scales, and a checkpoint's "
                         "k_scale / v_scale tensors load as such; to load the model without them, remove both the "
                         "key and those tensors")
    return QuantFormat("fp8", _MODELOPT_ALGOS[algo], kv_cache=kv or kv_algo is not None,
                       modelopt_exclude=tuple(exclude))


_CT_KEYS = frozenset({"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme"})  # (that fp8fx reads)


def _compressed_tensors(qc: Mapping[str, Any], kv: bool) -> QuantFormat:
    groups = []
    config_groups = qc.get("config_groups") or {}
    if not isinstance(config_groups, Mapping):
        raise ValueError(f"config_groups={config_groups!r} must map group names to {{'targets': [...], ...}}")
    for name, group in config_groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, Mapping):
            raise ValueError(f"{where}={group!r} must be a mapping with 'targets', 'weights', 'input_activations'")
        targets = group.get("targets") or []
        if isinstance(targets, str) or not targets:
            raise ValueError(f"{where}.targets={targets!r} must be a non-empty list, e.g. ['Linear']")
        _check_patterns(targets, f"{where}.targets", "class names, module names or 're:' patterns")
        groups.append((tuple(targets), _ct_config(where, group)))
    if not groups:
        raise ValueError("no config_groups: nothing says how the layers are quantized")
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"format={fmt!r} is not an fp8 storage format; fp8fx loads 'float-quantized' checkpoints")
    warn_misspelt(qc, _CT_KEYS, "compressed-tensors quantization_config")
    _refuse_unapplied(qc, config_groups)
    ignore = qc.get("ignore") or []
    _check_patterns(ignore, "ignore", "module names or 're:' patterns")
    return QuantFormat("compressed-tensors", groups[0][1], tuple(groups), tuple(ignore), kv)


def _refuse_unapplied(qc: Mapping[str, Any], config_groups: Mapping[str, Any]) -> None:
    """What a compressed-tensors config asks of its reader beyond loading the stored tensors, which fp8fx does not do,
    refused naming the key: a ``transform_config`` with rotations applied at run time (llm-compressor's SpinQuant /
    QuIP Hadamard transforms on the layers' inputs: its tensors are none, so nothing else gives it away: loaded
    without the rotation, logits 41% off, silently; those folded into the stored weights alone load as they are);
    a ``sparsity_config`` whose weights are stored compressed (2:4 bitmask, not ``dense``); a group's
    ``output_activations`` (quantized outputs)."""
    online = _online_transforms(qc.get("transform_config"))
    if online:
        raise ValueError(
            f"transform_config: {online[0]} is applied at run time (SpinQuant / QuIP Hadamard rotations: the stored "
            "weights are rotated, and the layers' inputs or outputs are to be rotated as the model runs), which fp8fx "
            "does not do: its outputs would be far off. Load it with vLLM or compressed-tensors, or export the model "
            "with the rotations folded into the weights only (locations weight_input / weight_output)")
    sparsity = qc.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, Mapping) or sparsity.get("format", "dense") != "dense"):
        fmt = sparsity.get("format") if isinstance(sparsity, Mapping) else sparsity
        raise ValueError(
            f"sparsity_config.format={fmt!r}: the weights are stored compressed for sparsity, which fp8fx does not "
            "decompress; export the checkpoint with dense weights (sparsity_config format 'dense', or none)")
    for name, group in config_groups.items():
        if group.get("output_activations") is not None:
            raise ValueError(
                f"config_groups.{name}.output_activations={group['output_activations']!r:.80}: the layers' outputs are "
                "quantized too, which fp8fx does not do (it quantizes weights and inputs); export the checkpoint "
                "without output_activations")


_FOLDED = ("weight_input", "weight_output")  # transform locations applied to the stored weights only


def _online_transforms(transform: Any) -> list[str]:
    """The transforms of a compressed-tensors ``transform_config`` applied at run time, each as
    ``config_groups.<name>.apply[i] (location '<loc>')``: those of a location other than ``weight_input`` /
    ``weight_output``, which are folded into the stored weights (vLLM applies the others, ``is_online()``). A config
    fp8fx cannot read counts as one."""
    if not transform:
        return []
    groups = transform.get("config_groups") if isinstance(transform, Mapping) else None
    if not isinstance(groups, Mapping):
        return [f"{transform!r:.80} (no config_groups fp8fx can read)"]
    online = []
    for name, scheme in groups.items():
        applies = scheme.get("apply") if isinstance(scheme, Mapping) else None
        if not isinstance(applies, (list, tuple)):
            online.append(f"config_groups.{name} (no apply list fp8fx can read)")
            continue
        for i, arg in enumerate(applies):
            location = arg.get("location") if isinstance(arg, Mapping) else None
            if location not in _FOLDED:
                online.append(f"config_groups.{name}.apply[{i}] (location {location!r})")
    return online


def _check_patterns(names: Any, where: str, what: str) -> None:
    """A list of strings whose ``re:`` patterns compile (a bad one raised re.error once a layer was matched)."""
    check_name_list(names, where, what)
    for name in names:
        if name.startswith("re:"):
            try:
                re.compile(name[3:])
            except re.error as e:
                raise ValueError(f"{where}: {name!r} is not a regular expression ({e}); fix the pattern") from None


def _ct_args(where: str, args: Optional[Mapping[str, Any]]) -> Mapping[str, Any]:
    if args is None:
        raise ValueError(
            f"{where} is null (weight-only fp8); fp8fx runs W8A8 GEMMs: quantize activations too "
            "(e.g. input_activations strategy 'token', dynamic true)"
        )
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}={args!r:.80} must be a mapping, e.g. {{'type': 'float', 'num_bits': 8, ...}}")
    if args.get("type") != "float" or args.get("num_bits") != 8 or args.get("symmetric", True) is not True:
        raise ValueError(
            f"{where}: type={args.get('type')!r} num_bits={args.get('num_bits')!r} "
            f"symmetric={args.get('symmetric', True)!r} is not symmetric float8; fp8fx loads FP8 (float, 8 bits)"
        )
    return args


def _flag(args: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """A JSON boolean: the string "false" is true to Python, and was read so."""
    value = args.get(key, default)
    if type(value) is not bool:
        raise ValueError(f"{where}.{key}={value!r} is not a JSON boolean: write true or false, unquoted")
    return value


def _ct_strategy(args: Mapping[str, Any]) -> Any:
    """A compressed-tensors ``strategy`` as its ``QuantizationArgs`` reads it: absent or null, 'group' where a
    group_size is given, else 'tensor' (fp8fx read null as no strategy and refused what vLLM loads, and read an absent
    ``dynamic`` as dynamic where it is static: h156)."""
    strategy = args.get("strategy")
    if strategy is None:
        return "tensor" if args.get("group_size") is None else "group"
    return strategy


def _ct_config(where: str, group: Mapping[str, Any]) -> Fp8Config:
    w = _ct_args(f"{where}.weights", group.get("weights"))
    a = _ct_args(f"{where}.input_activations", group.get("input_activations"))
    if _flag(w, "dynamic", False, f"{where}.weights"):
        raise ValueError(f"{where}.weights.dynamic=true: weights need stored scales (dynamic false)")
    strategy = _ct_strategy(w)
    if strategy == "tensor":
        weight = PerTensor()
    elif strategy == "channel":
        weight = PerRow()
    elif strategy == "block":
        block = w.get("block_structure")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"{where}.weights.block_structure={block!r} must be [block_n, block_k] of positive ints, "
                             "e.g. [128, 128]")
        weight = PerBlock(*block)
    else:
        raise ValueError(f"{where}.weights.strategy={strategy!r} is not one of 'tensor', 'channel', 'block'")
    static = not _flag(a, "dynamic", False, f"{where}.input_activations")  # (QuantizationArgs' default: static)
    act_strategy = _ct_strategy(a)
    # what Fp8Config would refuse, refused here in config.json's terms (its own messages name Fp8Config / PerGroup
    # fields, which a checkpoint's config does not have)
    if static and isinstance(weight, PerBlock):
        raise ValueError(
            f"{where}.input_activations.dynamic=false (static scales) with {where}.weights.strategy='block': "
            "block-scaled weights take dynamic activations; set input_activations dynamic true, strategy 'group', "
            f"group_size {weight.block_k}"
        )
    if static:
        if act_strategy != "tensor":
            raise ValueError(
                f"{where}.input_activations: static (dynamic false) scales must have strategy 'tensor', got "
                f"{act_strategy!r}"
            )
        act = None
    elif act_strategy == "token":
        act = PerRow()
    elif act_strategy == "tensor":
        act = PerTensor()
    elif act_strategy == "group":
        size = a.get("group_size")
        if not isinstance(weight, PerBlock):
            raise ValueError(
                f"{where}.input_activations.strategy='group' needs block-scaled weights ({where}.weights.strategy="
                f"'block'), not {strategy!r}; use strategy 'token' (per-token scales) for these weights"
            )
        if not (type(size) is int and size == weight.block_k):  # one activation scale per weight block along K
            blocks = f"{where}.weights.block_structure={list(block)}"
            if size is None:
                raise ValueError(f"{where}.input_activations.group_size=None: strategy 'group' needs the weights' "
                                 f"block_k, {weight.block_k} ({blocks}); set it to {weight.block_k}")
            if type(size) is not int:  # 64.0, "64", true
                raise ValueError(f"{where}.input_activations.group_size={size!r}: not an int; it must be the "
                                 f"weights' block_k ({blocks}): set it to {weight.block_k}")
            raise ValueError(f"{where}.input_activations.group_size={size!r} must match the weights' block_k "
                             f"({blocks}): set it to {weight.block_k}")
        act = PerGroup(size)
    else:
        raise ValueError(
            f"{where}.input_activations.strategy={act_strategy!r} is not one of 'token', 'tensor', 'group'"
        )
    return Fp8Config(
        is_checkpoint_fp8_serialized=True,
        activation_scheme="static" if static else "dynamic",
        weight_granularity=weight,
        activation_granularity=act,
    )


# --- writing ---------------------------------------------------------------------------------
def _fp8_dict(scheme: LayerScheme, ignored: Sequence[str]) -> Optional[dict[str, Any]]:
    """The ``fp8`` quantization_config for ``scheme``, or None if the ``fp8`` format cannot express it
    (it is read back with ``Fp8Config.from_config``: exactly that scheme or nothing)."""
    qc: dict[str, Any] = {
        "quant_method": "fp8",
        "activation_scheme": "static" if scheme.static_activation else "dynamic",
        "ignored_layers": list(ignored),
        "modules_to_not_convert": list(ignored),
    }
    if isinstance(scheme.weight, PerBlock):
        qc["weight_block_size"] = [scheme.weight.block_n, scheme.weight.block_k]
    try:
        return qc if Fp8Config.from_config(qc).scheme() == scheme else None
    except ValueError:
        return None


def _ct_group(scheme: LayerScheme, targets: Sequence[str]) -> dict[str, Any]:
    w = scheme.weight
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None}
    if isinstance(w, PerBlock):
        weights.update(strategy="block", block_structure=[w.block_n, w.block_k])
    else:
        weights.update(strategy="channel" if isinstance(w, PerRow) else "tensor", block_structure=None)
    a = scheme.activation
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not scheme.static_activation}
    if scheme.static_activation or isinstance(a, PerTensor):
        acts.update(strategy="tensor", group_size=None)
    elif isinstance(a, PerGroup):
        acts.update(strategy="group", group_size=a.group_size)
    else:
        acts.update(strategy="token", group_size=None)
    return {"targets": list(targets), "weights": weights, "input_activations": acts, "output_activations": None}


KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def quantization_config(
    schemes: Mapping[str, LayerScheme], ignored: Sequence[str], kv_cache: bool, fmt: Optional[str] = None
) -> dict[str, Any]:
    """The ``quantization_config`` for layers quantized with ``schemes`` (``{fqn: scheme}``), linear
    layers ``ignored`` in high precision, and KV-cache scales if ``kv_cache``. ``fmt``: ``"fp8"``,
    ``"compressed-tensors"`` or None (``fp8`` when it can express every layer, else compressed-tensors)."""
    if fmt not in (None,) + WRITTEN_FORMATS:  # ('modelopt' wrote an fp8 or compressed-tensors config, unsaid)
        read = " (fp8fx reads ModelOpt checkpoints, and writes none)" if fmt == "modelopt" else ""
        raise ValueError(f"format={fmt!r} is not one of the formats fp8fx writes, {WRITTEN_FORMATS}{read}: pass one "
                         "of them, or None for fp8 where it stores every layer's scheme, else compressed-tensors")
    distinct = sorted(set(schemes.values()), key=str)
    fp8 = _fp8_dict(distinct[0], ignored) if len(distinct) == 1 else None
    if fmt == "fp8" and fp8 is None:
        layers = [f"{first_named([f for f, t in schemes.items() if t == s])}: {s}" for s in distinct]
        raise ValueError(
            "format='fp8' stores one scheme for all layers: per-tensor weights with per-token (dynamic) or static "
            "per-tensor activations, or block weights with 1 x block_k groups of activations (dynamic, "
            f"activation_granularity=PerGroup(block_k)); this model has {layers}; "
            "use format='compressed-tensors' (--format compressed-tensors), which stores any mix"
        )
    if fmt != "compressed-tensors" and fp8 is not None:
        if kv_cache:
            fp8["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
        return fp8
    if len(distinct) == 1:
        groups = {"group_0": _ct_group(distinct[0], ["Linear"])}
    else:
        groups = {}
        for i, scheme in enumerate(distinct):
            groups[f"group_{i}"] = _ct_group(scheme, sorted(f for f, s in schemes.items() if s == scheme))
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(ignored),
        "kv_cache_scheme": dict(KV_CACHE_SCHEME) if kv_cache else None,
    }
