"""Checkpoint names -> the model's names, before ``load_checkpoint`` / ``convert`` plan anything.

A checkpoint on the hub need not name tensors as the model that loads it does: transformers 5 builds
Mixtral's experts under ``mlp.experts`` while every Mixtral checkpoint (bf16 and the FP8 ones) stores them
under ``block_sparse_moe.experts.<e>.w1`` ..., and transformers renames them as it loads. ``key_mapping``
is that renaming, with the meaning transformers gives ``from_pretrained(key_mapping=...)``: regex pattern
-> replacement, the first pattern that matches a name renames it. Without one, the renames transformers
itself applies to the model (its ``WeightRenaming`` transforms, read through ``transformers_renames``)
are used; merging per-expert tensors into 3-D experts is fp8fx's own (``fp8fx.checkpoint.experts``).

Renamed entries keep the checkpoint's name as ``Entry.source``, so errors name both, and the format
matches its ignore list and targets against both (``QuantFormat.sources``): an AutoFP8 Mixtral lists
``model.layers.0.block_sparse_moe.gate`` among its ignored layers.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Mapping, Optional

from torch import nn

from fp8fx.checkpoint.files import CheckpointError, Entry

log = logging.getLogger("fp8fx")


@dataclasses.dataclass(frozen=True)
class Rename:
    pattern: "re.Pattern[str]"
    replacement: str
    scope: str = ""  # only names under this module prefix (transformers scopes a sub-model's renames)

    def __call__(self, name: str) -> Optional[str]:
        if self.scope and not name.startswith(self.scope + "."):
            return None
        new, n = self.pattern.subn(self.replacement, name)
        return new if n else None


def resolve(model: nn.Module, key_mapping: Optional[Mapping[str, str]], where: str) -> list[Rename]:
    """The renames to apply: ``key_mapping`` as given ({} for none), or None for the model's own."""
    if key_mapping is None:
        return transformers_renames(model)
    if not isinstance(key_mapping, Mapping):
        raise TypeError(f"{where}: key_mapping={key_mapping!r} is not a dict of regex pattern -> replacement")
    renames = []
    for pattern, replacement in key_mapping.items():
        if not isinstance(pattern, str) or not isinstance(replacement, str):
            raise TypeError(f"{where}: key_mapping entry {pattern!r}: {replacement!r} is not str -> str")
        try:
            renames.append(Rename(re.compile(pattern), replacement))
        except re.error as e:
            raise ValueError(f"{where}: key_mapping pattern {pattern!r} is not a regex ({e})") from None
    return renames


def transformers_renames(model: nn.Module) -> list[Rename]:
    """The pure renames transformers applies when it loads a checkpoint into ``model`` (a transformers
    ``PreTrainedModel``; none for other models). Read from ``transformers.conversion_mapping`` (transformers
    5), an internal module: if it changes, the renames are left out with a warning, and ``key_mapping`` is
    the way to give them."""
    try:
        from transformers import PreTrainedModel
        from transformers import conversion_mapping
    except ImportError:  # no transformers, or one without conversion mappings (4.x renames nothing by default)
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    try:
        transforms = conversion_mapping.get_model_conversion_mapping(model, add_legacy=False)
        renames = []
        for t in transforms:
            if type(t).__name__ != "WeightRenaming":
                continue
            sources, targets = list(t.source_patterns), list(t.target_patterns)
            targets = targets * len(sources) if len(targets) == 1 else targets
            scope = getattr(t, "scope_prefix", None) or ""
            renames += [Rename(re.compile(s), r, scope) for s, r in zip(sources, targets, strict=True)]
    except Exception as e:  # an internal API of transformers: say so, load with the names as they are
        log.warning(
            "fp8fx: could not read the checkpoint renames transformers applies to %s (%s: %s); checkpoint names "
            "are used as they are: pass key_mapping= if they differ from the model's",
            type(model).__name__, type(e).__name__, e,
        )
        return []
    return renames


def apply(entries: Mapping[str, Entry], renames: list[Rename], where: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """(entries under the model's names, model module -> checkpoint module for each renamed one). Two
    checkpoint tensors renamed onto one name are an error; nothing is read."""
    if not renames:
        return dict(entries), {}
    out: dict[str, Entry] = {}
    modules: dict[str, str] = {}
    for name, entry in entries.items():
        new = next((n for n in (r(name) for r in renames) if n is not None), name)
        if new in out:
            raise CheckpointError(
                f"{where}: {entry.name} and {out[new].source or out[new].name} both load as {new} after "
                "key_mapping; fix the mapping (or the checkpoint)"
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
