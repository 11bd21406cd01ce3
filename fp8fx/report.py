"""What the compiler did: one ``Site`` per linear / MoE computation seen in a compiled graph."""
from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger("fp8fx")


@dataclasses.dataclass(frozen=True)
class Site:
    kind: str  # "linear" or "moe"
    fqn: str  # module path as in named_modules(), e.g. "model.layers.0.self_attn.q_proj"
    rewritten: bool
    reason: str  # why not rewritten; "" when rewritten
    scheme: str  # e.g. "w:per-channel a:per-token"; "" when the weight is not fp8
    graph: int  # index of the compiled graph (in compile order) the site was seen in


class Report:
    """Every site each compiled graph held; ``str(report)`` is a table."""

    def __init__(self):
        self.sites: list[Site] = []
        self.graphs = 0
        self._logged: set[tuple[str, str]] = set()

    def add(self, site: Site) -> None:
        self.sites.append(site)
        if not site.rewritten and (site.fqn, site.reason) not in self._logged:
            self._logged.add((site.fqn, site.reason))
            # a layer the user chose to ignore is expected: info; anything else deserves a look
            level = logging.INFO if site.reason.endswith("in ignored_layers") else logging.WARNING
            log.log(level, "fp8fx: %s %s not rewritten: %s", site.kind, site.fqn, site.reason)

    @property
    def rewritten(self) -> list[Site]:
        return [s for s in self.sites if s.rewritten]

    @property
    def skipped(self) -> list[Site]:
        return [s for s in self.sites if not s.rewritten]

    def __str__(self) -> str:
        rows = [("graph", "kind", "site", "rewritten", "scheme / reason")]
        for s in self.sites:
            rows.append((str(s.graph), s.kind, s.fqn, "yes" if s.rewritten else "no", s.scheme if s.rewritten else s.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"{len(self.rewritten)} of {len(self.sites)} sites rewritten in {self.graphs} graph(s)")
        return "\n".join(lines)

    __repr__ = __str__
