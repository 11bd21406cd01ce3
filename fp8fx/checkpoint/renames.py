"""Checkpoint names -> the model's names, before ``load_checkpoint`` / ``convert`` plan anything.

A checkpoint on the hub need not name tensors as the model that loads it does: transformers 5 builds
Mixtral's experts under ``mlp.experts`` while every Mixtral checkpoint (bf16 and the FP8 ones) stores them
under ``block_sparse_moe.experts.<e>.w1`` ..., and transformers renames them as it loads. fp8fx applies
the same renames, through transformers' own code (``transformers_renamer``): the pure renames of the
model's conversion mapping (``WeightRenaming`` and its subclasses, scoped to sub-models, the legacy ones
too), every one that matches a name, in turn; plus a user's ``key_mapping`` as ``from_pretrained``
takes it (regex -> replacement, added to the model's). Merging per-expert tensors into 3-D experts is
fp8fx's own (``fp8fx.checkpoint.experts``), so transformers' ``WeightConverter`` s are not applied.
Without transformers (or for a model it did not build) a ``key_mapping`` still applies: each pattern,
in turn, replaces its first match (``re.sub(count=1)``).

Renamed entries keep the checkpoint's name as ``Entry.source``: errors name both, the format matches
its ignore list and targets against both (``QuantFormat.sources``: an AutoFP8 Mixtral lists
``model.layers.0.block_sparse_moe.gate`` among its ignored layers), and ``convert`` writes the stored
names back. ``save_checkpoint`` writes experts per expert in the hub's layout: the renames reversed
(``hub_names``), as transformers' ``save_pretrained`` reverses them.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
from typing import Callable, Iterable, Mapping, Optional

from torch import nn

from fp8fx.checkpoint.files import CheckpointError, Entry
from fp8fx.config import Fp8Config

log = logging.getLogger("fp8fx")

Renamer = Callable[[str], str]


def resolve(model: nn.Module, key_mapping: Optional[Mapping[str, str]], where: str,
            names: Iterable[str] = ()) -> Optional[Renamer]:
    """The renaming to apply to checkpoint names for ``model``: ``key_mapping`` (checked here: a dict of regex ->
    str, each pattern found in one of the checkpoint's ``names`` at least) then transformers' renames of the model,
    or None when there are none. ``key_mapping`` applies to every name, as ``from_pretrained(key_mapping=)`` does
    (``q_proj.kernel`` -> ``q_proj.weight`` renames a tensor of a module the model has). The model's own renames
    skip a name that already has its place in the model (a parameter or buffer, or a tensor of one of its modules):
    a checkpoint in the model's own layout (``save_checkpoint(experts="fused")`` writes one) loads as it is,
    whatever renames the hub layout needs."""
    user = _user_renames(key_mapping, where)
    names = list(names)
    for pattern, replacement in user if names else ():
        if not any(re.search(pattern, n) for n in names):  # a mistake: it was asked for
            raise ValueError(f"{where}: key_mapping pattern {pattern!r} (-> {replacement!r}) is in no tensor name of "
                             f"the checkpoint (e.g. {sorted(names)[:2]}); correct or drop it")
    by_user = transformers_renamer(model, user, model_renames=False) if user else None
    if by_user is None and user:
        def by_user(name: str) -> str:  # no transformers: each pattern replaces its first match, in turn
            for pattern, replacement in user:
                name = re.sub(pattern, replacement, name, count=1)
            return name
    by_model = transformers_renamer(model, [])
    state = set(model.state_dict(keep_vars=True))
    placed = state | {f for f, _ in model.named_modules() if f}

    def renames(name: str) -> str:
        # transformers applies the user's renames, then the model's, each to what the one before left (in one
        # rename_source_key call): the same, in two steps, with the model's skipped for a name in place
        name = by_user(name) if by_user is not None else name
        if by_model is None or name in placed:
            return name
        new, owner = by_model(name), name.rpartition(".")[0]
        # a tensor of a module the model has (a scale, no parameter yet) stays with it; a rename of the leaf alone
        # goes through (transformers' legacy LayerNorm.gamma / .beta -> .weight / .bias)
        return name if owner in placed and new.rpartition(".")[0] != owner else new

    # then the base model's prefix, added or stripped as from_pretrained does it, name by name, after the renames
    base = _base_prefix(model, placed, [renames(n) for n in names])
    if by_user is None and by_model is None and base is None:
        return None
    return renames if base is None else lambda name: base(renames(name))


def _base_prefix(model: nn.Module, placed: set[str], names: Iterable[str]) -> Optional[Renamer]:
    """The base model's prefix added to or stripped from each checkpoint name where that puts the name in the model
    and it is not in it as it is, as ``from_pretrained`` does name by name: a checkpoint of the base model (GPT-2's
    own on the hub, saved from ``GPT2Model``: ``h.0.attn.c_attn.weight``, ``wte.weight``) loaded into a model with a
    head (``transformer.h.0...``), one of a model with a head loaded into its base model, a VLM's base checkpoint whose
    vision tower transformers' renames already moved under the prefix. A name is in the model where it or a module
    above it is (``placed``: the model's tensors and modules; a scale has no tensor yet, per-expert tensors no module
    of their own). None where no name changes (or the model has no ``base_model_prefix``)."""
    prefix = getattr(model, "base_model_prefix", None)
    if not isinstance(prefix, str) or not prefix:
        return None
    start = f"{prefix}."

    def placed_in(name: str) -> bool:
        while name:
            if name in placed and name != prefix:  # (the base model itself places nothing)
                return True
            name = name.rpartition(".")[0]
        return False

    def fixed(name: str) -> str:
        if placed_in(name):
            return name
        if name.startswith(start) and placed_in(name[len(start):]):
            return name[len(start):]
        return start + name if placed_in(start + name) else name

    return fixed if any(fixed(n) != n for n in names) else None


def _user_renames(key_mapping: Optional[Mapping[str, str]], where: str) -> list[tuple[str, str]]:
    if key_mapping is None:
        return []
    if not isinstance(key_mapping, Mapping):
        raise TypeError(f"{where}: key_mapping={key_mapping!r} is not a dict of regex pattern -> replacement")
    for pattern, replacement in key_mapping.items():
        if not isinstance(pattern, str) or not isinstance(replacement, str):
            raise TypeError(f"{where}: key_mapping entry {pattern!r}: {replacement!r} is not str -> str")
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: key_mapping pattern {pattern!r} is not a regex ({e})") from None
        # every group reference (\N, \g<N>, \g<name>), not \1 alone: one the pattern lacks failed later, as tensors
        # missing from the checkpoint
        for text, ref in _group_refs(replacement):
            if not (ref <= compiled.groups if isinstance(ref, int) else ref in compiled.groupindex):
                named = f", named {', '.join(compiled.groupindex)}" if compiled.groupindex else ""
                shown = ref if text[1:].isdigit() else text  # \2 as "group 2", \g<x> as it is written
                raise ValueError(
                    f"{where}: key_mapping entry {pattern!r}: {replacement!r} refers to group {shown}, which the "
                    f"pattern does not have (it has {compiled.groups} group{'s' * (compiled.groups != 1)}{named}); "
                    "refer to one of its groups or add the group to the pattern"
                )
        try:  # re's own reading of the replacement (a bad escape such as \q): nothing is replaced in ""
            compiled.sub(replacement, "")
        except (re.error, IndexError) as e:  # IndexError: python 3.11's unknown group name
            raise ValueError(f"{where}: key_mapping entry {pattern!r}: {replacement!r} is not a replacement for that "
                             f"pattern ({e})") from None
    return list(key_mapping.items())


def _group_refs(replacement: str) -> list[tuple[str, int | str]]:
    r"""The group references of a ``re.sub`` replacement: (their text, the group number or name). ``\\`` is an
    escaped backslash; ``\0`` and three-digit ``\NNN`` are octal escapes, not references (as ``re`` reads them)."""
    refs: list[tuple[str, int | str]] = []
    for m in re.finditer(r"\\(?:g<([^>]*)>|([0-7]{3}|0[0-7]{0,2}|\d\d?)|.)", replacement, re.S):
        name, digits = m[1], m[2]
        if name is not None:
            refs.append((m[0], int(name) if name.isdigit() else name))
        elif digits is not None and not (digits[0] == "0" or len(digits) == 3):
            refs.append((m[0], int(digits)))
    return refs


def transformers_renamer(model: nn.Module, user: list[tuple[str, str]], model_renames: bool = True
                         ) -> Optional[Renamer]:
    """transformers' renaming of checkpoint keys: ``user`` (regex, replacement) pairs, as ``from_pretrained(
    key_mapping=...)`` takes them, then (``model_renames``) the renames of ``model``'s conversion mapping (a
    transformers model), or None: no transformers, no renames, or an API it no longer has. ``conversion_mapping`` and
    ``core_model_loading`` are internal modules of transformers 5: if they change, the model's renames are left out
    with a warning and ``resolve`` applies ``user`` itself."""
    try:
        from transformers import PreTrainedModel, conversion_mapping, core_model_loading

        rename_source_key = core_model_loading.rename_source_key  # 5.17 and 5.24: (key, renamings, converters)
        weight_renaming = core_model_loading.WeightRenaming
    except (ImportError, AttributeError):  # no transformers, or 4.x (which renames nothing by default)
        return None
    renamings = []
    for pattern, replacement in user:
        # transformers substitutes the text \1 alone (WeightRenaming.rename_source_key): any other reference would
        # stay in the names as it is, and the load fail later on missing tensors
        other = [text for text, ref in _group_refs(replacement) if text != "\\1"]
        if other:
            raise ValueError(
                f"key_mapping entry {pattern!r}: {replacement!r}: transformers' key renaming (which fp8fx applies, as "
                f"from_pretrained(key_mapping=) does) substitutes only \\1 and would leave {other[0]} in the names as "
                "text; capture the part to keep in one group and write \\1, or split the entry in several"
            )
        try:
            renamings.append(weight_renaming(source_patterns=pattern, target_patterns=replacement))
        except Exception as e:  # transformers' own checks of a pattern: the user's to fix
            raise ValueError(f"key_mapping entry {pattern!r}: {replacement!r}: {type(e).__name__}: {e}") from None
    if model_renames and isinstance(model, PreTrainedModel):
        try:
            transforms = conversion_mapping.get_model_conversion_mapping(model, add_legacy=True)
        except Exception as e:  # an internal API of transformers: say so, go on without it
            log.warning(
                "fp8fx: could not read the checkpoint renames transformers applies to %s (%s: %s); checkpoint names "
                "are used as they are: pass key_mapping= if they differ from the model's",
                type(model).__name__, type(e).__name__, e,
            )
            transforms = []
        renamings += [t for t in transforms if isinstance(t, weight_renaming)]
    if not renamings:
        return None
    return lambda name: rename_source_key(name, renamings, [])[0]


# what a linear's weight carries along when a rename moves the weight alone (Phimoe's .gate.weight ->
# .router.weight): ``.weight`` -> ``<leaf>`` takes ``.weight_scale`` -> ``<leaf>_scale`` (the 3-D experts' names)
_SIBLINGS = {"weight_scale": "_scale", "weight_scale_inv": "_scale_inv", "input_scale": "_input_scale",
             "output_scale": "_output_scale"}


def apply(entries: Mapping[str, Entry], renamer: Optional[Renamer],
          where: str) -> tuple[dict[str, Entry], dict[str, tuple[str, ...]]]:
    """(entries under the model's names, model module -> the checkpoint modules renamed onto it). Two checkpoint
    tensors renamed onto one name are an error; nothing is read."""
    if renamer is None:
        return dict(entries), {}
    new_names = renamed(entries, renamer)
    out: dict[str, Entry] = {}
    modules: dict[str, list[str]] = {}
    for name, entry in entries.items():
        new = new_names[name]
        if new in out:
            raise CheckpointError(
                f"{where}: {entry.name} and {out[new].source or out[new].name} both load as {new} after the "
                "checkpoint renames (transformers' for this model, and key_mapping); fix key_mapping or the "
                "checkpoint"
            )
        if new != name:
            entry = dataclasses.replace(entry, name=new, source=name)
            # the owner and its ancestors down to where the names differ: a.mlp.experts.0.w1 and
            # a.mlp.experts are a.block_sparse_moe.experts.0.w1 and a.block_sparse_moe.experts
            a, b = new.split(".")[:-1], name.split(".")[:-1]
            while a and b and a != b:
                stored = modules.setdefault(".".join(a), [])
                if ".".join(b) not in stored:
                    stored.append(".".join(b))
                if a[-1] != b[-1]:
                    break
                a, b = a[:-1], b[:-1]
        out[new] = entry
    if modules:
        new, old = next(iter(modules.items()))
        log.info("fp8fx: %d checkpoint tensors renamed to the model's names (e.g. %s -> %s)",
                 sum(e.source is not None for e in out.values()), old[0], new)
    return out, {m: tuple(s) for m, s in modules.items()}


def cut(entries: Mapping[str, Entry], model: nn.Module, where: str,
        block_rows: Callable[[str], Optional[int]] = lambda owner: None
        ) -> tuple[dict[str, Entry], dict[str, tuple[str, ...]]]:
    """(``entries`` with each tensor that transformers cuts into several of ``model``'s as it loads replaced by its
    parts, the model's modules -> the checkpoint modules cut into them). The cuts are the model's conversion mapping's
    ``WeightConverter`` s of one source and a single ``Chunk`` / ``Split`` along rows (Dinov2's SwiGLU
    ``mlp.weights_in`` -> ``gate_proj``, ``up_proj``; GTE's ``qkv_proj`` -> q/k/v). A part of a row-major tensor is a
    range of its bytes, so a part is an ``Entry`` of those bytes, read and checked as any other. The weight's scales
    follow its rows: a per-tensor scale (one value) serves every part, per-channel scales and block scales are cut
    with the rows (``block_rows(stored module)``: its config's block height; a cut inside a block is refused).
    Converters of other operations (``PermuteForRope``, ``Interleave``) are not applied: their tensors stay as
    stored and the load names them."""
    converters = _row_cutters(model)
    if not converters:
        return dict(entries), {}
    params = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    placed = set(model.state_dict(keep_vars=True))
    parts: dict[str, list[tuple[str, Entry]]] = {}  # stored name -> (model name, entry)
    owners: dict[str, tuple[list[str], list[int], int]] = {}  # stored owner -> (model owners, rows, total)
    leftover: dict[str, list[str]] = {}  # stored name -> targets whose rows come from the owner's weight
    for name, entry in entries.items():
        if name in placed:
            continue
        conv = next((c for c in converters if c.rename_source_key(name)[1] is not None), None)
        if conv is None:
            continue
        targets = [_retargeted(conv, t).rename_source_key(name)[0] for t in conv.target_patterns]
        if not all(t in params for t in targets):  # a scale matched by a pattern without ".weight" (attn.qkv)
            leftover[name] = targets
            continue
        rows = [params[t][0] if params[t] else 1 for t in targets]
        if not entry.shape or sum(rows) != entry.shape[0]:
            raise CheckpointError(
                f"{where}: {entry} is cut by transformers into {', '.join(targets)} of {rows} rows (the model's "
                f"sizes), {sum(rows)} in all: wrong checkpoint or config for this model"
            )
        parts[name] = [(t, _rows(entry, t, r0, r)) for t, r0, r in zip(targets, _starts(rows), rows)]
        if name.endswith(".weight"):
            owners[name[:-len(".weight")]] = ([t.rpartition(".")[0] for t in targets], rows, entry.shape[0])
    for owner, (new_owners, rows, total) in owners.items():  # the weight's scales, cut as its rows
        for leaf in ("weight_scale", "weight_scale_inv", "input_scale"):
            name = f"{owner}.{leaf}"
            if name in entries and name not in parts:
                targets = leftover.pop(name, None) or [f"{o}.{leaf}" for o in new_owners]
                parts[name] = _cut_scale(entries[name], targets, rows, total, block_rows(owner), where)
    for name, targets in leftover.items():
        raise CheckpointError(
            f"{where}: {entries[name]} is cut by transformers into {', '.join(targets)}, but no weight of those "
            "rows is in the checkpoint: wrong checkpoint for this model"
        )
    out = {name: entry for name, entry in entries.items() if name not in parts}
    sources: dict[str, list[str]] = {}
    for name, cut_into in parts.items():
        for new, entry in cut_into:
            if new in out:
                raise CheckpointError(
                    f"{where}: {entry.source} and {out[new].source or out[new].name} both load as {new} (transformers"
                    " cuts the first into it): keep one"
                )
            out[new] = entry
            stored_owner, new_owner = name.rpartition(".")[0], new.rpartition(".")[0]
            if stored_owner != new_owner and stored_owner not in sources.setdefault(new_owner, []):
                sources[new_owner].append(stored_owner)
    if parts:
        log.info("fp8fx: %d checkpoint tensors cut into the model's as transformers cuts them (e.g. %s -> %s)",
                 len(parts), next(iter(parts)), ", ".join(n for n, _ in next(iter(parts.values()))))
    return out, {m: tuple(s) for m, s in sources.items()}


def _row_cutters(model: nn.Module) -> list:
    """The model's ``WeightConverter`` s that ``cut`` applies (none without transformers, for a model it did not
    build, or where its internal ``conversion_mapping`` / ``core_model_loading`` moved)."""
    try:
        from transformers import PreTrainedModel, conversion_mapping, core_model_loading

        if not isinstance(model, PreTrainedModel):
            return []
        converter, chunk = core_model_loading.WeightConverter, core_model_loading.Chunk
        split = getattr(core_model_loading, "Split", None)  # (5.24 has it, 5.17 not)
        transforms = conversion_mapping.get_model_conversion_mapping(model, add_legacy=True)
    except Exception:  # noqa: BLE001 - no transformers, or its internals moved: nothing is cut
        return []
    out = []
    for t in transforms:
        ops = getattr(t, "operations", None) or []
        if not isinstance(t, converter) or len(t.source_patterns) != 1 or len(t.target_patterns) < 2 or len(ops) != 1:
            continue
        op = ops[0]
        if op.dim == 0 and (type(op) is split or (type(op) is chunk and op.num_shards_attribute is None)):
            out.append(t)
    return out


def _retargeted(converter, target: str):
    """``converter`` renaming to ``target`` (transformers renames a key it cuts to the first target only). Its
    sources, which the targets' group references (``\\1``) refer to, are the same: its guard against a new pattern
    is for sources and targets changed apart."""
    one = copy.copy(converter)
    object.__setattr__(one, "target_patterns", [target])
    return one


def _starts(rows: list[int]) -> list[int]:
    return [sum(rows[:i]) for i in range(len(rows))]


def _rows(entry: Entry, name: str, start: int, count: int) -> Entry:
    """Rows ``[start, start + count)`` of ``entry`` (row-major: one range of its bytes) as the model's ``name``."""
    row = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    return dataclasses.replace(entry, name=name, shape=(count, *entry.shape[1:]), start=entry.start + start * row,
                               end=entry.start + (start + count) * row, source=entry.source or entry.name)


def _cut_scale(entry: Entry, targets: list[str], rows: list[int], total: int, block: Optional[int],
               where: str) -> list[tuple[str, Entry]]:
    """A weight's scale cut as its ``rows`` (of ``total``): one value for every part, one value a part (a per-tensor
    scale a shard, as vLLM's fused layers keep them), one scale a row (per-channel), or one a ``block`` of rows, cut
    where the parts start (each at a block edge; the last block may be ragged)."""
    if math.prod(entry.shape) == 1:
        return [(t, dataclasses.replace(entry, name=t, source=entry.source or entry.name)) for t in targets]
    if block is None and tuple(entry.shape) == (len(targets),) and len(targets) != total:  # ([n, 1]: rows of blocks)
        return [(t, _rows(entry, t, i, 1)) for i, t in enumerate(targets)]
    per = 1 if entry.shape and entry.shape[0] == total else block
    starts = _starts(rows)
    if not per or not entry.shape or entry.shape[0] != -(-total // per) or any(r0 % per for r0 in starts):
        blocks = f"{per}-row blocks" if per else "no block size in the config"
        raise CheckpointError(
            f"{where}: {entry} is the scale of a weight transformers cuts into parts of {rows} rows, and its "
            f"{entry.shape[0] if entry.shape else 0} rows of scales ({blocks}, of {total} weight rows) cannot be cut "
            "there (a block of rows across two parts); quantize the parts apart, or load the bf16 checkpoint"
        )
    return [(t, _rows(entry, t, r0 // per, -(-r // per))) for t, r0, r in zip(targets, starts, rows)]


def renamed(names: Iterable[str], renamer: Renamer) -> dict[str, str]:
    """Checkpoint name -> the model's name for it: ``renamer``, with a weight's scales following the weight where a
    rename moved the weight alone."""
    new_names = {name: renamer(name) for name in sorted(names)}  # in sorted order, as transformers renames
    for name, new in list(new_names.items()):
        owner, _, leaf = name.rpartition(".")
        new_owner, _, new_leaf = new.rpartition(".")
        if leaf != "weight" or new == name:
            continue
        for sibling, suffix in _SIBLINGS.items():
            old = f"{owner}.{sibling}"
            if old in new_names and new_names[old].rpartition(".")[0] == owner:
                new_names[old] = f"{new_owner}.{sibling}" if new_leaf == "weight" else f"{new_owner}.{new_leaf}{suffix}"
    return new_names


def with_stored_ignores(config: Fp8Config, sources: Mapping[str, tuple[str, ...]]) -> Fp8Config:
    """``config`` with its ``ignored_layers`` also naming, as the model names them, the renamed modules its
    entries name as the checkpoint stores them (``ignored_layers=["...block_sparse_moe.experts"]``)."""
    extra = [m for m, stored in sources.items() if any(config.is_ignored(s) for s in stored)
             and not config.is_ignored(m)]
    return dataclasses.replace(config, ignored_layers=(*(config.ignored_layers or ()), *extra)) if extra else config


def stored(name: str, sources: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The checkpoint's names of module (or tensor owner) ``name``: one, or several a rename merged."""
    return sources.get(name, (name,))


def hub_expert_leaves(model: nn.Module) -> Optional[dict[str, str]]:
    """The per-expert leaf names of ``model``'s hub checkpoints where transformers' conversion mapping fuses them
    into its experts (Mixtral: ``{"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}``), or None (no such
    converters, no transformers, or an API it no longer has: the internal ``conversion_mapping`` /
    ``core_model_loading`` of transformers 5)."""
    return _expert_leaves(model) or None


def per_expert_loadable(model: nn.Module) -> Optional[bool]:
    """Whether transformers loads ``model``'s experts from per-expert tensors: True where its conversion mapping merges
    them into the experts modules (gate, up and down: Mixtral, Qwen3-MoE, DeepSeek-V3; up and down of ungated experts:
    Nemotron-H), False for another transformers model, whose checkpoints hold its experts fused (GraniteMoE's
    ``input_linear`` / ``output_linear``, renamed; GPT-OSS as the model names them) and which loads per-expert tensors
    nowhere (random experts, with no error), None where unknown (not a transformers model, no transformers, an API it
    no longer has)."""
    from fp8fx.weights import moe  # (the experts' kind: gated ones need a gate converter too)

    leaves = _expert_leaves(model)
    if leaves is None:
        return None
    gated = any(moe.is_experts(m) for m in model.modules())
    return ({"gate_proj"} if gated else set()) | {"up_proj", "down_proj"} <= set(leaves)


def _expert_leaves(model: nn.Module) -> Optional[dict[str, str]]:
    """``hub_expert_leaves``, ``{}`` for a transformers model with no such converters, None where unknown."""
    try:
        from transformers import PreTrainedModel, conversion_mapping, core_model_loading

        converter = core_model_loading.WeightConverter
        if not isinstance(model, PreTrainedModel):
            return None
        transforms = conversion_mapping.get_model_conversion_mapping(model, add_legacy=True)
    except Exception:  # noqa: BLE001 - no transformers, or its internals moved: no names to compare
        return None
    leaves: dict[str, str] = {}
    for t in transforms:
        if not isinstance(t, converter) or not t.target_patterns:
            continue
        found = [re.search(r"experts\.\*\.(\w+)\.weight", str(src)) for src in t.source_patterns]
        names = [m.group(1) for m in found if m]
        target = str(t.target_patterns[0])
        if target.endswith("experts.gate_up_proj") and len(names) == 2:
            leaves["gate_proj"], leaves["up_proj"] = names
        elif target.endswith("experts.up_proj") and len(names) == 1:  # ungated experts' (Nemotron-H's)
            leaves["up_proj"] = names[0]
        elif target.endswith("experts.down_proj") and len(names) == 1:
            leaves["down_proj"] = names[0]
    return leaves


def hub_names(model: nn.Module, names: Iterable[str], blocks: Iterable[str], say: logging.Logger = log
              ) -> Optional[dict[str, str]]:
    """``names`` (tensors under the model's names) -> as the model's hub checkpoints name them: transformers' renames
    of the model reversed, as its ``save_pretrained`` writes them (Mixtral's ``.mlp.`` -> ``.block_sparse_moe.``), a
    weight's scales following the weight, for names inside the MoE blocks ``blocks`` (the modules holding experts
    modules: their routers and shared experts too); other names are kept. Reversed, a rename is not one to one:
    Kimi-Linear's hub names its MoE blocks ``block_sparse_moe`` and its dense MLPs ``mlp``, both ``mlp`` in the model,
    and vLLM reads a dense MLP only as ``mlp``. None where there are none to reverse (no transformers, no renames, an
    API it no longer has) or where the reversed names would not load back as ``names`` through ``resolve`` (which
    ``load_checkpoint`` applies): a warning says which, and the model's names are kept."""
    try:
        from transformers import PreTrainedModel, conversion_mapping, core_model_loading

        if not isinstance(model, PreTrainedModel):
            return None
        weight_renaming, apply_renamings = core_model_loading.WeightRenaming, core_model_loading.apply_renamings
        prefix_change = getattr(core_model_loading, "PrefixChange", ())
        # as save_pretrained: no legacy renames, no prefix changes (a model built from a config has no prefix to undo)
        transforms = conversion_mapping.get_model_conversion_mapping(model, add_legacy=False)
        reverse = [t.reverse_transform() for t in transforms[::-1]
                   if isinstance(t, weight_renaming) and not isinstance(t, prefix_change)]
    except Exception:  # noqa: BLE001 - no transformers, or its internals moved: the model's names
        return None
    if not reverse:
        return None

    blocks = set(blocks)
    everywhere = "" in blocks  # experts at the top level: the model is one MoE block

    def hub(name: str) -> str:
        parts = name.split(".")
        if not everywhere and not any(".".join(parts[:i]) in blocks for i in range(1, len(parts))):
            return name
        owner, _, leaf = name.rpartition(".")
        if leaf in _SIBLINGS:  # where the weight goes (a rename of ".gate.weight" moves the weight alone)
            return f"{apply_renamings(owner + '.weight', reverse).rpartition('.')[0]}.{leaf}"
        return apply_renamings(name, reverse)

    out = {name: hub(name) for name in sorted(names)}
    back = renamed(out.values(), resolve(model, None, "save_checkpoint") or (lambda n: n))
    wrong = next((n for n, h in out.items() if back[h] != n), None)  # two names onto one fail here too
    if wrong is not None:
        say.warning(
            "fp8fx: save_checkpoint keeps %s's own tensor names: transformers' renames of it, reversed, write %s as "
            "%s, which loads back as %s; transformers and vLLM may not find the tensors it renames",
            type(model).__name__, wrong, out[wrong], back.get(out[wrong]),
        )
        return None
    return out
