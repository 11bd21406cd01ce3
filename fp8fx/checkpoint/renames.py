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
names back.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable, Mapping, Optional

from torch import nn

from fp8fx.checkpoint.files import CheckpointError, Entry
from fp8fx.config import Fp8Config

log = logging.getLogger("fp8fx")

Renamer = Callable[[str], str]


def resolve(model: nn.Module, key_mapping: Optional[Mapping[str, str]], where: str) -> Optional[Renamer]:
    """The renaming to apply to checkpoint names for ``model``: transformers' renames of the model and
    ``key_mapping`` (checked here: a dict of regex -> str), or None when there are none."""
    if key_mapping is not None:
        if not isinstance(key_mapping, Mapping):
            raise TypeError(f"{where}: key_mapping={key_mapping!r} is not a dict of regex pattern -> replacement")
        for pattern, replacement in key_mapping.items():
            if not isinstance(pattern, str) or not isinstance(replacement, str):
                raise TypeError(f"{where}: key_mapping entry {pattern!r}: {replacement!r} is not str -> str")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{where}: key_mapping pattern {pattern!r} is not a regex ({e})") from None
    renamer = transformers_renamer(model, key_mapping)
    if renamer is not None or not key_mapping:
        return renamer
    patterns = [(re.compile(p), r) for p, r in key_mapping.items()]

    def rename(name: str) -> str:
        for pattern, replacement in patterns:
            name = pattern.sub(replacement, name, count=1)
        return name

    return rename


def transformers_renamer(model: nn.Module, key_mapping: Optional[Mapping[str, str]]) -> Optional[Renamer]:
    """transformers' renaming of checkpoint keys for ``model`` (its conversion mapping's renames, for a
    transformers model, and ``key_mapping``), or None: no transformers, no renames, or an API it no longer
    has. ``conversion_mapping`` and ``core_model_loading`` are internal modules of transformers 5: if they
    change, the renames are left out with a warning, and ``key_mapping`` still applies (``resolve``)."""
    try:
        from transformers import PreTrainedModel, conversion_mapping, core_model_loading
    except ImportError:  # no transformers, or 4.x (which renames nothing by default)
        return None
    try:
        if isinstance(model, PreTrainedModel):
            mapping = dict(key_mapping) if key_mapping else None
            transforms = conversion_mapping.get_model_conversion_mapping(model, key_mapping=mapping, add_legacy=True)
        else:
            transforms = [core_model_loading.WeightRenaming(source_patterns=p, target_patterns=r)
                          for p, r in (key_mapping or {}).items()]
        renamings = [t for t in transforms if isinstance(t, core_model_loading.WeightRenaming)]
        rename_source_key = core_model_loading.rename_source_key  # 5.17 and 5.24: (key, renamings, converters)
    except Exception as e:  # an internal API of transformers: say so, go on without it
        log.warning(
            "fp8fx: could not read the checkpoint renames transformers applies to %s (%s: %s); checkpoint names "
            "are used as they are: pass key_mapping= if they differ from the model's",
            type(model).__name__, type(e).__name__, e,
        )
        return None
    if not renamings:
        return None
    return lambda name: rename_source_key(name, renamings, [])[0]


def apply(entries: Mapping[str, Entry], renamer: Optional[Renamer],
          where: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """(entries under the model's names, model module -> checkpoint module for each renamed one). Two
    checkpoint tensors renamed onto one name are an error; nothing is read."""
    if renamer is None:
        return dict(entries), {}
    new_names = {name: renamer(name) for name in sorted(entries)}  # in sorted order, as transformers renames
    out: dict[str, Entry] = {}
    modules: dict[str, str] = {}
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
                modules[".".join(a)] = ".".join(b)
                if a[-1] != b[-1]:
                    break
                a, b = a[:-1], b[:-1]
        out[new] = entry
    if modules:
        new, old = next(iter(modules.items()))
        log.info("fp8fx: %d checkpoint tensors renamed to the model's names (e.g. %s -> %s)",
                 sum(e.source is not None for e in out.values()), old, new)
    return out, modules


def with_stored_ignores(config: Fp8Config, sources: Mapping[str, str]) -> Fp8Config:
    """``config`` with its ``ignored_layers`` also naming, as the model names them, the renamed modules its
    entries name as the checkpoint stores them (``ignored_layers=["...block_sparse_moe.experts"]``)."""
    extra = [m for m, s in sources.items() if config.is_ignored(s) and not config.is_ignored(m)]
    return dataclasses.replace(config, ignored_layers=(*config.ignored_layers, *extra)) if extra else config


def stored(name: str, sources: Mapping[str, str]) -> str:
    """The checkpoint's name of module (or tensor owner) ``name``."""
    return sources.get(name, name)
