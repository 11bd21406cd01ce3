"""MoE experts for ``load_checkpoint``: checkpoint tensors -> the 3-D expert tensors of an experts module
(``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], ``fp8fx.weights.moe``), through ``Fp8MoEMethod``.

A checkpoint stores the experts of module ``<fqn>`` (e.g. ``model.layers.0.mlp.experts``) either

- per expert: ``<fqn>.<e>.gate_proj.weight`` / ``up_proj`` / ``down_proj`` (or Mixtral's ``w1`` / ``w3``
  / ``w2``), each a linear layer with its own ``weight_scale`` / ``weight_scale_inv`` / ``input_scale``;
  quantization configs name them (ignore lists, compressed-tensors targets ``Linear``); or
- fused, under the module's own names: ``<fqn>.gate_up_proj`` + ``gate_up_proj_scale`` (per-tensor
  ``[E]`` or ``[E, 2]``, per-channel ``[E, 2I, 1]``), ``gate_up_proj_scale_inv`` (blocks),
  ``gate_up_proj_input_scale`` (``[1]`` or ``[E]``), the same for ``down_proj`` (vLLM's ``w13_weight``
  ... too); configs name the experts module itself (as a ``Linear`` for compressed-tensors targets).

``save_checkpoint`` writes the first (in the hub's naming where transformers knows it: Mixtral's ``w1`` ...), or
the second with ``experts="fused"`` and, in the hub's naming, for a model transformers loads from fused experts
only (GraniteMoE's ``input_linear`` / ``output_linear``).

Everything is checked from the headers (``plan``) before any data is read; tensors stream into a
stand-in module (``stage``) that ``commit`` swaps in. bf16 experts are quantized online, each expert as
soon as its tensors arrived; an experts module left in high precision is assembled as it is.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import torch
from torch import nn

from fp8fx import quant
from fp8fx.checkpoint.files import STATIC_SCALE_MISSING, CheckpointError, Entry, check_fp8_codes, missing_name
from fp8fx.config import Fp8Config, PerBlock, PerRow, PerTensor, first_named
from fp8fx.weights import chunked, moe
from fp8fx.weights.linear import RANGE_CHECKED, remember_trainable
from fp8fx.weights.moe import UP, W13, W2, Fp8MoEMethod

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ONE_VALUE = ((), (1,), (1, 1))

# checkpoint projection -> Fp8MoEMethod shard; the two namings of per-expert checkpoints
SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
LEAF = {"weight": "", "weight_scale": "_scale", "weight_scale_inv": "_scale_inv", "input_scale": "_input_scale"}
_PER_EXPERT = re.compile(r"^(.+)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.([a-z_]+)$")
FUSED_NAMES = {b + s: b + s for b in (W13, UP, W2) for s in LEAF.values()}
FUSED_NAMES.update({f"{v}_{leaf}": b + s for v, b in (("w13", W13), ("w2", W2)) for leaf, s in LEAF.items()})


def check_scale_dtype(s: Entry) -> None:
    if s.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"{s}: scales are float32 (or bf16/fp16); re-export the checkpoint")


def check_weight_values(entry: Entry, t: torch.Tensor, dtype: torch.dtype, owner: str, into: str) -> None:
    """Refuses a checkpoint weight quantized online with NaN/Inf values, or with values the model's ``dtype`` cannot
    hold (``into``: what they would become inf in), in one pass (``chunked.count_unloadable``)."""
    bad, overflow, largest = chunked.count_unloadable(t, dtype)
    if bad:
        raise CheckpointError(f"{entry} has {bad} NaN/Inf values; {_nonfinite_fix(t, owner)}")
    if overflow:
        raise beyond_range_error(entry, t.dtype, dtype, overflow, largest, f", quantized online {into}")


def beyond_range_error(entry: Entry | str, stored: torch.dtype, dtype: torch.dtype, overflow: int, largest: float,
                       how: str = "") -> CheckpointError:
    """The error of a checkpoint tensor (its entry, or the parameter it loads into, of ``stored`` dtype) with
    ``overflow`` finite values, up to ``largest``, that a cast to the model's ``dtype`` makes inf (``how``: where
    that cast happens)."""
    return CheckpointError(
        f"{entry}: {overflow} of its {stored} values are beyond {dtype}'s range (at most {torch.finfo(dtype).max:g}; "
        f"the largest is {largest:g}) and would load as inf{how}; build the model in bfloat16 or float32"
    )


def dequantized_range_error(entry: Entry, largest: float, dtype: torch.dtype, count: int,
                            weight: str) -> CheckpointError:
    """The error of an fp8 ``weight`` (a layer, or an experts module's tensor) whose scale, up to ``largest`` (from
    ``entry``), makes ``count`` values of its dequantized view (fp8 * scale in the model's ``dtype``) inf."""
    return CheckpointError(
        f"{entry}: a scale of {largest:g} times fp8 values up to {quant.FP8_MAX:g} is beyond {dtype}'s range (at most "
        f"{torch.finfo(dtype).max:g}): {count} values of {weight}'s dequantized weight would be inf (outputs NaN); "
        "build the model in bfloat16 or float32"
    )


def beyond_dequantized_range(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Which of ``scales`` (float32) take a dequantized view (fp8 * scale, in the model's ``dtype``) to inf at the
    largest fp8 value (float16: a scale above 65504 / 448 = 146.2); the loaders then count the values that would be
    (``chunked.dequantized_overflow``)."""
    return torch.isinf((scales.float() * quant.FP8_MAX).to(dtype))


def check_scale_values(entry: Entry, t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32 if every value is a positive finite float, else a ``CheckpointError``."""
    t = t.float()
    why = quant.bad_scales(t)
    if why:
        raise CheckpointError(f"{entry}: {why}: re-export the checkpoint")
    return t


def check_finite(entry: Entry, t: torch.Tensor, fqn: str) -> None:
    bad = chunked.count_nonfinite(t)
    if bad:
        raise CheckpointError(f"{entry} has {bad} NaN/Inf values; {_nonfinite_fix(t, fqn)}")


def _nonfinite_fix(t: torch.Tensor, owner: str) -> str:
    """What to do about a checkpoint tensor with NaN / Inf values: high-precision weights may be kept so by the ignore
    list; fp8 codes may not (an ignored layer takes high-precision weights, and refuses fp8 ones)."""
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        return ("fp8 codes hold no NaN in a sound checkpoint (the ignore list cannot take them: an ignored layer "
                f"loads high-precision weights): re-export {owner} from its high-precision weights")
    return f"fix the checkpoint or add {owner!r} to the ignore list"


@dataclasses.dataclass
class Experts:
    """One experts module being loaded."""

    fqn: str
    module: nn.Module
    per_expert: dict[tuple[int, str, str], Entry] = dataclasses.field(default_factory=dict)  # (e, shard, leaf)
    fused: dict[str, Entry] = dataclasses.field(default_factory=dict)  # HF name (gate_up_proj_scale ...)
    naming: Optional[tuple[str, str, str]] = None  # per-expert projection names the checkpoint uses
    config: Optional[Fp8Config] = None
    method: Optional[Fp8MoEMethod] = None
    stage: Optional[nn.Module] = None  # stand-in that Fp8MoEMethod loads into
    plain: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # high precision, assembled
    # (base, expert) -> [(largest scale, its entry)] of weight scales whose 448 * scale the model's dtype cannot
    # hold (float16): finish() counts the inf values of those experts' dequantized weights
    wide_scales: dict[tuple[str, int], list[tuple[float, Entry]]] = dataclasses.field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, H, I)"""
        return moe.sizes(self.module)

    @property
    def gated(self) -> bool:
        """False for ungated experts (Nemotron-H's ``up_proj`` [E, I, H] in gate_up_proj's place: per expert, up_proj
        alone, shard w3, which is the whole of each expert's w13)."""
        return moe.is_experts(self.module)

    @property
    def w13(self) -> str:
        return moe.w13_name(self.module)

    def base(self, shard: str) -> str:
        """The module tensor a per-expert shard (w1 / w3 / w2) goes into."""
        return W2 if shard == "w2" else self.w13

    def loader_shard(self, shard: Optional[str]) -> Optional[str]:
        """``Fp8MoEMethod.weight_loader``'s shard id of a per-expert shard: an ungated expert's up_proj is its whole w13."""
        return None if shard == "w3" and not self.gated else shard

    @property
    def transposed(self) -> bool:
        """The model's experts are [E, H, 2I] / [E, I, H] (``moe.is_transposed``); which checkpoint tensors come in
        that layout: ``in_model_layout``."""
        return moe.is_transposed(self.module)

    def rows_cols(self, shard: str) -> tuple[int, int]:
        _, h, i = self.shape
        return (h, i) if shard == "w2" else (i, h)

    def name(self, e: int, shard: str, leaf: str) -> str:
        proj = (self.naming or NAMINGS[0])[("w1", "w3", "w2").index(shard)]
        return f"{self.fqn}.{e}.{proj}.{leaf}"

    @property
    def serialized(self) -> bool:
        return self.config is not None and self.config.is_checkpoint_fp8_serialized


class ExpertsLoader:
    """The experts part of ``load.py``'s ``_Loader``: find, route, plan, finish, commit."""

    def __init__(self, modules: dict[str, nn.Module], fmt, device: torch.device, items: list):
        self.fmt, self.device, self.items = fmt, device, items
        self.experts = {f: Experts(f, m) for f, m in modules.items() if moe.is_any_experts(m)}
        self.not_quantized: dict[str, str] = {}  # experts fqn -> why it stays in high precision
        # what a "missing from the checkpoint" error says to do (the loader's: names to map where tensors are unplaced)
        self.missing_fix: Callable[[], str] = lambda: "wrong checkpoint for this model, or a shard is missing"

    # --- 1. plan ---------------------------------------------------------------------------
    def find(self, names) -> None:
        """Each experts module's config; experts stored fused and left in high precision drop out
        (their tensors load as plain parameters)."""
        shards: dict[str, set[str]] = {f: set() for f in self.experts}
        for n in names:
            m = _PER_EXPERT.match(n)
            if m and m[1] in shards:
                shards[m[1]].add(n.rpartition(".")[0])
        for fqn, ex in list(self.experts.items()):
            ex.config, reason = self._config(ex, sorted(shards[fqn]))
            if ex.config is None:
                self.not_quantized[fqn] = reason
                if not shards[fqn]:
                    del self.experts[fqn]

    def _config(self, ex: Experts, shards: list[str]):
        if shards and self.fmt.is_ignored(ex.fqn):  # the experts module itself in the ignore list (vLLM's FusedMoE
            # prefix, or the model's name): a compressed-tensors entry names one module exactly, not its experts
            return None, "in ignored_layers"
        modules = shards or [ex.fqn]  # per-expert checkpoint modules are Linear layers
        configs = {self.fmt.layer_config(m, ("Linear",)) for m in modules}
        if len(configs) > 1:
            raise CheckpointError(
                f"{ex.fqn}: its experts are quantized differently in the checkpoint "
                f"({sorted(str(c.scheme()) if c else 'not quantized' for c in configs)}); an experts module has one "
                "scheme: fix the ignore list / targets of quantization_config"
            )
        config = configs.pop()
        if config is None:
            ignored = any(self.fmt.is_ignored(m) for m in [ex.fqn] + modules)
            return None, "in ignored_layers" if ignored else "not targeted by quantization_config"
        if not config.is_checkpoint_fp8_serialized:
            reason = moe.skip_reason(ex.module, ex.fqn, config)
            if reason is not None:
                return None, reason
        elif (reason := moe.layout_reason(ex.module)) is not None:  # its fp8 experts cannot be kept high precision
            raise CheckpointError(
                f"{ex.fqn}: the checkpoint's fp8 experts would load into a {type(ex.module).__name__} whose {reason}; "
                "fp8fx's experts take [E, 2I, H] / [E, H, I] weights (or, transposed, [E, H, 2I] / [E, I, H]): load a "
                "bf16 checkpoint (quantized online, these experts stay bf16), or add the module to ignored_layers of a "
                "bf16 load"
            )
        return config, ""

    def route(self, name: str, entry: Entry) -> bool:
        """Claim checkpoint tensor ``name`` if it is an expert tensor; False otherwise."""
        m = _PER_EXPERT.match(name)
        if m and m[1] in self.experts:
            ex, e, proj, leaf = self.experts[m[1]], int(m[2]), m[3], m[4]
            experts = ex.shape[0]
            if e >= experts:
                raise CheckpointError(
                    f"{entry}: expert index {e} is out of range: {ex.fqn} has {experts} experts (num_experts / "
                    "num_local_experts in config.json); wrong checkpoint for this model"
                )
            naming = next(n for n in NAMINGS if proj in n)
            if not ex.gated and SHARD[proj] == "w1":
                raise CheckpointError(f"{entry}: {ex.fqn} holds ungated experts (up_proj and down_proj, no gate: "
                                      f"{type(ex.module).__name__}); wrong checkpoint for this model")
            if ex.naming not in (None, naming):
                raise CheckpointError(
                    f"{entry}: {ex.fqn} mixes {'/'.join(ex.naming)} and {'/'.join(naming)} expert names; "
                    "keep one naming"
                )
            ex.naming = naming
            if leaf not in LEAF and leaf != "activation_scale":  # (transformers' input_scale: _plan_scales)
                raise CheckpointError(f"{entry}: an expert takes {sorted(LEAF)}, not {leaf!r}; wrong checkpoint")
            key = (e, SHARD[proj], leaf)
            if key in ex.per_expert:  # experts.1. and experts.01.: one would be read, the other dropped silently
                raise CheckpointError(
                    f"{entry}: expert {e}'s {proj}.{leaf} of {ex.fqn} is also given as {ex.per_expert[key].name}; "
                    "keep one"
                )
            ex.per_expert[key] = entry
            return True
        owner, _, leaf = name.rpartition(".")
        if owner in self.experts and leaf in FUSED_NAMES:
            ex = self.experts[owner]
            hf = FUSED_NAMES[leaf]
            if hf.startswith(W13) and not ex.gated:  # vLLM's w13_ names: up_proj's here
                hf = UP + hf[len(W13):]
            elif hf.startswith(UP) and ex.gated:  # (a gated module's own state has no up_proj)
                return False
            if hf in ex.fused:
                raise CheckpointError(f"{entry}: {ex.fqn}.{hf} is also given as {ex.fused[hf].name}; keep one")
            ex.fused[hf] = entry
            return True
        return False

    def handled(self) -> set[str]:
        """State keys this loader fills."""
        return {f"{f}.{b}" for f, ex in self.experts.items() for b in (ex.w13, W2)}

    def plan(self) -> None:
        for ex in self.experts.values():
            if ex.per_expert and ex.fused:
                raise CheckpointError(
                    f"{ex.fqn}: the checkpoint holds its experts both per expert ({ex.name(0, 'w1', 'weight')} ...) "
                    f"and fused ({next(iter(ex.fused.values()))}); keep one"
                )
            e, h, i = ex.shape
            if ex.config is not None:
                ex.method = Fp8MoEMethod(ex.config)
                ex.stage = nn.Module()
                try:
                    ex.method.create_weights(ex.stage, e, h, i, ex.module._parameters[ex.w13].dtype,
                                             device=self.device, prefix=ex.fqn, transposed=ex.transposed,
                                             interleaved=moe.is_interleaved(ex.module), gated=ex.gated)
                    setattr(ex.stage, RANGE_CHECKED, True)  # (_check_dequantized_range, naming the entry)
                except ValueError as err:  # e.g. a block that does not divide intermediate_size
                    raise CheckpointError(f"{err} ({self.fmt.describe()})") from None
            if ex.fused:
                self._plan_fused(ex)
            else:
                self._plan_per_expert(ex)

    def _plan_per_expert(self, ex: Experts) -> None:
        todo = dict(ex.per_expert)
        experts = ex.shape[0]

        def need(key: tuple[int, str, str], why: str = "") -> Entry:
            if key not in todo:
                fix = (STATIC_SCALE_MISSING.format(self.fmt.declared_by) if key[2] == "input_scale"  # (h147)
                       else self.missing_fix())
                raise CheckpointError(
                    f"{missing_name(ex.name(*key), ex.per_expert.values())} is missing from the checkpoint{why}; "
                    f"{ex.fqn} has {experts} experts, each needs {'/'.join((ex.naming or NAMINGS[0])[0 if ex.gated else 1:])}: {fix}"
                )
            return todo.pop(key)

        for e in range(experts):
            for shard in ("w1", "w3", "w2") if ex.gated else ("w3", "w2"):
                rows, cols = ex.rows_cols(shard)
                w = need((e, shard, "weight"))
                self._check_weight_dtype(ex, w)
                if tuple(w.shape) != (rows, cols):
                    raise CheckpointError(
                        f"{w}: an expert's {shard} weight of {ex.fqn} is [{rows}, {cols}] "
                        f"(E, H, I = {list(ex.shape)}); wrong checkpoint for this model"
                    )
                self._add(w, ex, ex.base(shard), shard, e)
                if ex.serialized:
                    self._plan_scales(ex, (rows, cols), shard, e, todo, need, lambda leaf, e=e, s=shard: (e, s, leaf))
        self._reject_leftovers(ex, todo)

    def _reject_leftovers(self, ex: Experts, todo: dict) -> None:
        """Checkpoint tensors of ``ex`` that no parameter takes: a format mismatch."""
        if todo:
            raise CheckpointError(
                f"{first_named(todo.values())} has no place in {ex.fqn} "
                f"({'quantized: ' + str(ex.config.scheme()) if ex.config else 'not quantized'}); a format mismatch: "
                f"the checkpoint is read as {self.fmt.describe()}"
            )

    def _plan_fused(self, ex: Experts) -> None:
        todo = dict(ex.fused)
        experts = ex.shape[0]

        def need(name: str, why: str = "") -> Entry:
            if name not in todo:  # (an input scale's said no fix: h147)
                fix = (STATIC_SCALE_MISSING.format(self.fmt.declared_by) if name.endswith("input_scale")
                       else self.missing_fix())
                raise CheckpointError(f"{missing_name(f'{ex.fqn}.{name}', ex.fused.values())} is missing from the "
                                      f"checkpoint{why}; {fix}")
            return todo.pop(name)

        _, h, i = ex.shape
        for base, (rows, cols) in ((ex.w13, (2 * i if ex.gated else i, h)), (W2, (h, i))):
            w = need(base)
            self._check_weight_dtype(ex, w)
            stored = (cols, rows) if in_model_layout(ex.module, w.dtype) else (rows, cols)
            if tuple(w.shape) != (experts, *stored):
                layout = " (the model's layout, is_transposed)" if stored != (rows, cols) else ""
                raise CheckpointError(
                    f"{w}: {ex.fqn}.{base} is {[experts, *stored]}{layout} (E, H, I = {list(ex.shape)}); wrong "
                    "checkpoint for this model"
                )
            self._add(w, ex, base, None, None)
            if ex.serialized:
                self._plan_scales(ex, (rows, cols), base, None, todo, need, lambda leaf, b=base: b + LEAF[leaf])
        self._reject_leftovers(ex, todo)

    def _check_weight_dtype(self, ex: Experts, w: Entry) -> None:
        check_fp8_codes(w, f"the experts of {ex.fqn}")
        fp8 = w.dtype == quant.FP8_DTYPE
        if ex.serialized and not fp8:
            raise CheckpointError(
                f"{w}: the experts of {ex.fqn} are declared float8_e4m3fn ({self.fmt.describe()}); fix "
                "quantization_config (e.g. add the experts to its ignore list) or re-export the checkpoint"
            )
        if not ex.serialized and w.dtype not in quant.HIGH_PRECISION:
            state = "not quantized" if ex.config is None else "quantized online"
            raise CheckpointError(
                f"{w}: expected a bf16/fp16/fp32 expert weight; {ex.fqn} is {state} here ({self.fmt.describe()}): "
                "fix quantization_config or pass config=Fp8Config(is_checkpoint_fp8_serialized=True, ...)"
            )

    def _plan_scales(self, ex: Experts, shape, where, e, todo, need, key) -> None:
        """Scales of one expert's shard (``e`` an index, ``where`` w1/w3/w2) or of a fused tensor
        (``e`` None, ``where`` gate_up_proj / down_proj): shapes checked, loads queued. ``key``: checkpoint
        leaf (weight_scale ...) -> its key in ``todo``; ``need(key, why)`` pops it or raises."""
        scheme = ex.config.scheme()

        def has(leaf: str) -> bool:
            return key(leaf) in todo

        w, (rows, cols) = scheme.weight, shape
        # transformers' names for scales that are not blocks' (as load.py's _plan_scales reads them for linears): a
        # per-tensor weight_scale_inv, multiplied as a weight_scale is, and the static activation_scale
        renames = [("weight_scale_inv", "weight_scale")] if isinstance(w, PerTensor) else []
        if e is not None:  # (an expert's own tensors: a fused tensor's names have no activation_scale)
            renames.append(("activation_scale", "input_scale"))
        for theirs, ours in renames:
            if has(theirs) and not has(ours):
                todo[key(ours)] = todo.pop(key(theirs))
        fused = e is None
        base, shard = (where, None) if fused else (ex.base(where), where)
        lead = (ex.shape[0],) if fused else ()
        if isinstance(w, PerBlock):
            names = [leaf for leaf in ("weight_scale_inv", "weight_scale") if has(leaf)]
            if len(names) > 1:
                raise CheckpointError(f"{need(key(names[0]))}: also given as {need(key(names[1]))}; keep one")
            s = need(key(names[0] if names else "weight_scale_inv"), f" (blocks {w.block_n}x{w.block_k})")
            expect = [lead + quant.scale_shape((rows, cols), w.block)]
            text = f"shape {list(expect[0])} = ceil([{rows}, {cols}] / {list(w.block)}) per expert"
            target = "_scale_inv"
        elif isinstance(w, PerRow):
            s = need(key("weight_scale"), " (per-channel)")
            expect = [lead + (rows, 1), lead + (rows,)]
            text = f"shape {list(expect[0])} (one per output channel)"
            target = "_scale"
        else:
            s = need(key("weight_scale"), " (per-tensor)")
            experts = ex.shape[0]
            expect = [(experts,), (experts, 1)] + ([(experts, 2)] if base == W13 else []) if fused else ONE_VALUE
            text = f"shape {list(expect[0])} (one per expert)" if fused else "one value, shape [] or [1]"
            target = "_scale"
        if tuple(s.shape) not in expect:
            raise CheckpointError(
                f"{s}: a {w} expert weight [{rows}, {cols}] of {ex.fqn} needs {text}; the checkpoint does not match "
                f"{self.fmt.declared_by} ({self.fmt.describe()})"
            )
        check_scale_dtype(s)
        self._add(s, ex, base + target, shard, e, scale=True)
        if scheme.static_activation:
            a = need(key("input_scale"), " (activation_scheme static)")
            if tuple(a.shape) not in ONE_VALUE + (((lead[0],),) if fused else ()):  # (fused [E]: vLLM's, one an expert)
                raise CheckpointError(f"{a}: an input_scale is one value, shape [] or [1] (fused: [1] or [E])")
            check_scale_dtype(a)
            self._add(a, ex, base + "_input_scale", shard, e, scale=True)
        elif has("input_scale"):
            raise CheckpointError(
                f"{need(key('input_scale'))}: the checkpoint has static input scales but {self.fmt.declared_by} says "
                "dynamic activations; set activation_scheme 'static' (input_activations dynamic false) or drop the "
                "input_scale tensors"
            )

    def _add(self, entry: Entry, ex: Experts, name: str, shard, e, scale: bool = False) -> None:
        load: Callable[[torch.Tensor], None] = lambda t: self._load(ex, entry, name, shard, e, t, scale)
        self.items.append((entry, load))

    # --- 2. stream -------------------------------------------------------------------------
    def _load(self, ex: Experts, entry: Entry, name: str, shard, e, t: torch.Tensor, scale: bool) -> None:
        if ex.config is None:  # high precision: assemble [E, rows, cols]
            param = ex.module._parameters[name]
            # as load.py's _cast: a finite value the model's dtype cannot hold (1e5 in a float16 model) would be inf
            _, overflow, largest = chunked.count_unloadable(t, param.dtype)
            if overflow:
                raise beyond_range_error(entry, t.dtype, param.dtype, overflow, largest)
            if name not in ex.plain:
                ex.plain[name] = torch.empty(param.shape, dtype=param.dtype, device=self.device)
            dest = ex.plain[name][e]
            if shard is not None and ex.transposed:  # an expert's [rows, cols], as a linear layer's
                dest = dest.t()
            if ex.loader_shard(shard) in ("w1", "w3"):
                dest = dest[Fp8MoEMethod._rows(shard, dest.shape[0])]
            dest.copy_(t)
            return
        dtype = ex.module._parameters[ex.w13].dtype  # the stage's, and the dequantized views'
        if scale:
            t = check_scale_values(entry, t)
            if not name.endswith("_input_scale"):
                self._note_wide_scales(ex, entry, name, e, t, dtype)
            # (one value per expert or per module: Fp8MoEMethod.weight_loader gives it every slot it stands for)
        else:  # bf16 experts before quantizing, fp8 ones as stored (0x7F / 0xFF are fp8 NaN), as linear weights
            # the pass that looks for NaN/Inf also counts the values the model's dtype cannot hold: quantized online,
            # an expert's gate/up is assembled in a buffer of that dtype (1e5 becomes inf in a float16 model, its
            # scale inf) and every expert's dequantized view is in that dtype (inf again): outputs NaN. Raised while
            # streaming: nothing was swapped into the model yet (commit), so the model stays as it was.
            check_weight_values(entry, t, dtype, ex.fqn,
                                f"into {dtype} experts (scale or dequantized weight inf, outputs NaN)")
            if e is None and in_model_layout(ex.module, t.dtype):  # -> fused_moe's
                t = t.transpose(1, 2)
        # a weight's NaN/Inf were refused just above, in the pass that checks its range: not scanned again there
        ex.method.weight_loader(ex.stage, name, t, ex.loader_shard(shard), e, values_checked=not scale)

    @staticmethod
    def _note_wide_scales(ex: Experts, entry: Entry, name: str, e, t: torch.Tensor, dtype: torch.dtype) -> None:
        """The experts whose dequantized views (fp8 * scale, in the model's dtype) reach 448 * a scale beyond the
        dtype's range (float16: a scale above 65504 / 448 = 146.2): finish() counts the values that would be inf."""
        base = ex.w13 if name.startswith(ex.w13) else W2
        top = t.reshape(t.shape[0], -1).amax(dim=1) if e is None else t.max().reshape(1)  # fused: [E, ...]
        wide = beyond_dequantized_range(top, dtype).nonzero().flatten().tolist()
        for i in wide:
            ex.wide_scales.setdefault((base, i if e is None else e), []).append((float(top[i]), entry))

    # --- 3. finish, 4. commit ----------------------------------------------------------------
    def finish(self) -> None:
        for ex in self.experts.values():
            if ex.method is not None:
                try:
                    ex.method.process_weights_after_loading(ex.stage)
                except (RuntimeError, ValueError) as err:
                    raise CheckpointError(str(err)) from None
                self._check_dequantized_range(ex)

    @staticmethod
    def _check_dequantized_range(ex: Experts) -> None:
        """fp8 experts whose dequantized views would hold inf in the model's dtype (a float16 model, a scale above
        65504 / 448 = 146.2) are refused, before commit: the model is unchanged. Only experts with such a scale are
        counted (a second pass over their fp8 weights); experts whose fp8 values stay small enough load."""
        if not ex.wide_scales:
            return
        stage, dtype = ex.stage, ex.module._parameters[ex.w13].dtype
        for base in (ex.w13, W2):
            q = stage._parameters[base].data
            scales = stage._parameters[base + ("_scale_inv" if stage._fp8fx_block_scales else "_scale")].data
            count, named = 0, []
            for (b, e), wide in sorted(ex.wide_scales.items(), key=lambda item: item[0][1]):
                if b != base:
                    continue
                n = chunked.dequantized_overflow(q[e], scales[e], stage._fp8fx_w_block, dtype)
                if n:
                    count += n
                    named += wide
            if count:
                largest, entry = max(named, key=lambda p: p[0])
                raise dequantized_range_error(entry, largest, dtype, count, f"{ex.fqn}.{base}")

    def commit(self, report) -> None:
        """Swap the new expert tensors in (nothing here can fail)."""
        for ex in self.experts.values():
            module = ex.module
            if ex.config is not None:
                remember_trainable(module)
            for name, t in ex.plain.items():
                module._parameters[name] = nn.Parameter(t, requires_grad=False)
            if ex.config is None:
                continue
            module._parameters.update({n: p for n, p in ex.stage._parameters.items() if p is not None})
            for attr, value in vars(ex.stage).items():
                if attr.startswith("_fp8fx_"):
                    setattr(module, attr, value)
            module.__class__ = moe.fp8_experts_class(type(module), ex.w13)
            for base in (ex.w13, W2):
                module._parameters[base]._fp8fx_fqn = ex.fqn
            moe.tag_biases(module)  # (loaded as plain tensors, into the module itself)
            report.experts[ex.fqn] = str(ex.config.scheme())
        for fqn, reason in self.not_quantized.items():
            report.not_quantized[fqn] = reason

    def tag_skipped(self, modules: dict[str, nn.Module]) -> None:
        """After the swap: the report of a compiled model reads why these experts stayed bf16."""
        for fqn, reason in self.not_quantized.items():
            moe.tag_skipped(modules[fqn], fqn, reason)


# --- convert: bf16 experts -> fp8, tensor by tensor ------------------------------------------------
def convert_plan(modules: dict[str, nn.Module], entries: dict[str, Entry], config: Fp8Config):
    """``convert``'s view of the expert weights in ``entries`` (per expert or fused, see the module
    docstring): ``(plan, tensors, experts)`` with ``plan``: checkpoint module (``<fqn>.<e>.gate_proj`` ...,
    or ``<fqn>`` when fused) -> "" to quantize it, else why it stays bf16 (all of one experts module alike);
    ``tensors``: weight name -> its experts fqn, for the weights to quantize; ``experts``: fqn -> reason."""
    experts = {f: m for f, m in modules.items() if moe.is_any_experts(m)}
    found: dict[str, list[tuple[str, str]]] = {}  # fqn -> [(tensor name, checkpoint module)]
    # per-expert weights under a container the model does not have, even after the renames
    # (fp8fx.checkpoint.renames; hub Mixtral's block_sparse_moe.experts.E.w1 are renamed to mlp.experts): they stay
    # bf16, said so, and in the ignore list - not passed through as if the config covered them. Under a container
    # the model has (a ModuleList of expert MLPs), they are linears or shards of fused ones: the linear plan's
    stray: dict[str, str] = {}
    for name in entries:
        m = _PER_EXPERT.match(name)
        if m and m[1] in experts and m[4] == "weight":
            found.setdefault(m[1], []).append((name, name.rpartition(".")[0]))
            continue
        if m and m[4] == "weight" and m[1] not in modules:  # no container of that name at all (else: linears')
            stray[name.rpartition(".")[0]] = m[1]
            continue
        owner, _, leaf = name.rpartition(".")
        if owner in experts and leaf in (moe.w13_name(experts[owner]), W2):
            found.setdefault(owner, []).append((name, owner))
    plan: dict[str, str] = {}
    tensors: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for fqn, items in found.items():
        ex = Experts(fqn, experts[fqn])
        mods = sorted({mod for _, mod in items})
        ignored = [mod for mod in mods if config.is_ignored(mod)]
        if ignored and len(ignored) < len(mods):
            raise ValueError(
                f"convert: ignored_layers names {ignored[0]} but not all of {fqn}'s experts; an experts module has "
                f"one scheme: ignore {fqn} as a whole"
            )
        bad = [entries[n] for n, _ in items if entries[n].dtype not in quant.HIGH_PRECISION]
        if ignored or config.is_ignored(fqn):
            reason = "in ignored_layers"
        elif bad:
            reason = f"{bad[0]} is not a bf16/fp16/fp32 expert weight"
        else:
            reason = moe.skip_reason(ex.module, fqn, config) or ""
        if not reason:
            e, h, i = ex.shape
            for name, _ in items:
                m = _PER_EXPERT.match(name)
                rows13 = 2 * i if ex.gated else i
                expect = ex.rows_cols(SHARD[m[3]]) if m else (e,) + ((rows13, h) if name.endswith(ex.w13) else (h, i))
                if not m and in_model_layout(ex.module, entries[name].dtype):  # (convert writes fused_moe's)
                    expect = (e, expect[2], expect[1])
                if tuple(entries[name].shape) != expect:
                    raise CheckpointError(
                        f"{entries[name]}: expected {list(expect)} for {fqn} (E, H, I = {list(ex.shape)}); wrong "
                        "checkpoint for this model"
                    )
            tensors.update({name: fqn for name, _ in items})
        plan.update({mod: reason for mod in mods})
        reasons[fqn] = reason
    why = ("an expert weight under {}, where the model has no experts module (a layout that neither transformers' "
           "renames of this model nor key_mapping map to it); kept bf16")
    plan.update({mod: why.format(prefix) for mod, prefix in stray.items()})
    return plan, tensors, reasons


def w13_partners(names) -> dict[str, str]:
    """Per-expert gate and up weight names (``<experts>.<e>.gate_proj.weight`` / ``w1``, and up's) -> each other's.
    Under a per-tensor scheme ``convert`` gives the two one scale, the larger of their own: fused_moe runs an expert's
    gate and up as one GEMM of one scale, so a load would requantize the one of the smaller scale to the other's, a
    second fp8 rounding (what ``save_checkpoint`` writes: the one scale of ``gate_up_proj``, under both names)."""
    by_expert: dict[tuple[str, str], dict[str, str]] = {}
    for name in names:
        m = _PER_EXPERT.match(name)
        if m and m[4] == "weight" and SHARD[m[3]] in ("w1", "w3"):
            by_expert.setdefault((m[1], m[2]), {})[SHARD[m[3]]] = name
    return {a: b for pair in by_expert.values() if len(pair) == 2
            for a, b in ((pair["w1"], pair["w3"]), (pair["w3"], pair["w1"]))}


def in_model_layout(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a fused checkpoint tensor (``gate_up_proj`` / ``down_proj``) of ``dtype`` for the experts ``module``
    holds the model's transposed layout, [E, H, 2I] / [E, I, H]: a high-precision one of experts stored transposed
    (``moe.is_transposed``: Llama-4's hub tensors). An fp8 one holds fused_moe's [E, 2I, H] / [E, H, I], as fp8fx
    writes them; per-expert tensors are [rows, cols], as a linear layer's."""
    return dtype != quant.FP8_DTYPE and moe.is_transposed(module)


def quantize_fused(t: torch.Tensor, config: Fp8Config) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused bf16 experts tensor ``[E, rows, cols]`` -> fp8 and its per-expert scales (``[E]``
    per-tensor, ``[E, rows, 1]`` per-channel, ``[E, rows/bn, cols/bk]`` blocks), one expert at a time."""
    block = config.weight.block
    q = torch.empty(t.shape, dtype=quant.FP8_DTYPE, device=t.device)
    scales = []
    for e in range(t.shape[0]):
        q[e], s = chunked.quantize(t[e], block)
        scales.append(s.reshape(()) if isinstance(config.weight, PerTensor) else s)
    return q, torch.stack(scales)


# --- save: fused expert tensors -> per-expert names ------------------------------------------------
PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def naming(leaves: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
    """Shard -> projection name for ``per_expert_tensors`` from a model's hub leaf names (``renames.hub_expert_leaves``:
    Mixtral's ``{"gate_proj": "w1", ...}``): ``{"w1": "w1", "w3": "w3", "w2": "w2"}``; ``PROJ`` without them; None when
    they are a naming the loader does not read (``NAMINGS``), which ``load_checkpoint`` could not read back."""
    names = {shard: (leaves or {}).get(proj, proj) for shard, proj in PROJ.items()}
    return names if tuple(names[s] for s in ("w1", "w3", "w2")) in NAMINGS else None


def split_reason(module: nn.Module) -> Optional[str]:
    """Why the experts of ``module`` (high precision) cannot be written per expert, or None: per-expert tensors are
    row halves of ``gate_up_proj`` [E, 2I, H] and slices of ``down_proj`` [E, H, I], and nothing else of them (the
    flags of HF's @use_experts_implementation say where a model's experts are laid out otherwise)."""
    for flag, value, what in (("is_transposed", True, "transposed expert weights"),
                              ("is_concatenated", False, "interleaved gate/up rows"),
                              ("has_bias", True, "expert biases"),
                              ("has_post_expert_norm", True, "a norm after each expert")):  # as moe.skip_reason
        if getattr(module, flag, not value) == value:
            return what
    return moe.shape_reason(module, transposed=False)  # (the stored layout: Llama-4's, transposed with no flag, too)


def per_expert_tensors(fqn: str, module: nn.Module, block_leaf: str = "weight_scale_inv",
                       names: dict[str, str] = PROJ) -> dict[str, torch.Tensor]:
    """The tensors of an experts module under per-expert names (``<fqn>.<e>.gate_proj.weight``, ``.weight_scale`` /
    ``block_leaf`` for blocks, ``.input_scale``; ``up_proj``, ``down_proj``; ``names``: shard -> projection, Mixtral's
    ``w1`` / ``w3`` / ``w2``), views of the module's tensors: w13 rows split into gate and up (its per-tensor scale
    given to both; ungated experts: up_proj whole), static input scales given to every expert; a module in high
    precision has weights only. ``load_checkpoint`` reads them back into the same tensors."""
    p = module._parameters
    quantized = moe.is_quantized_experts(module)
    block = quantized and module._fp8fx_block_scales
    out: dict[str, torch.Tensor] = {}
    first = (W13, ("w1", "w3")) if moe.is_experts(module) else (UP, ("w3",))
    for base, shards in (first, (W2, ("w2",))):
        q = p[base].detach()
        scale = p[base + ("_scale_inv" if block else "_scale")].detach() if quantized else None
        act = p.get(base + "_input_scale")
        for e in range(q.shape[0]):
            for shard in shards:
                rows = Fp8MoEMethod._rows(shard, q.shape[1]) if base == W13 else slice(None)
                prefix = f"{fqn}.{e}.{names[shard]}"
                out[f"{prefix}.weight"] = q[e, rows]
                if scale is None:
                    continue
                if scale.dim() == 1:  # per-tensor: one per expert, for gate and up alike
                    out[f"{prefix}.weight_scale"] = scale[e : e + 1]
                else:
                    srows = Fp8MoEMethod._rows(shard, scale.shape[1]) if base == W13 else slice(None)
                    out[f"{prefix}.{block_leaf if block else 'weight_scale'}"] = scale[e, srows]
                if act is not None:
                    out[f"{prefix}.input_scale"] = act.detach().reshape(1)
    return out


def per_expert_modules(fqn: str, module: nn.Module, names: dict[str, str] = PROJ) -> list[str]:
    """The checkpoint module names ``per_expert_tensors`` writes for ``module``."""
    shards = ("w1", "w3", "w2") if moe.is_experts(module) else ("w3", "w2")
    return [f"{fqn}.{e}.{names[s]}" for e in range(module._parameters[W2].shape[0]) for s in shards]
