"""Graph dumps: ``Fp8Backend(dump_dir=...)`` writes the story of every graph it compiles into one folder.

File names sort in the order things happened (``graph000`` is the first graph the backend compiled; past ``graph999``
the number takes four digits and sorts by number, not as text)::

    graph000_0_dynamo_graph.py           the graph Dynamo captured, before any fp8fx pass (as ``gm.code``)
    graph000_1_01_after_MoePass.py       the graph after each pass, in pass order (02: LinearPass, ...); its last
                                         lines name the call each fp8fx op replaced (the report's ``node``)
    graph000_2_inductor_output_code.py   what Inductor generated: the wrapper and its kernels (not with
                                         compiler="eager")
    graph000_3_report.json / .txt        the sites of this graph: rewritten or why not, kernel, bytes
    graph000_4_dynamo_bytecode.py        the bytecode Dynamo made of the traced frame, decompiled by depyf:
                                         the guards' inputs and the call of the compiled graph
                                         (``__compiled_fn_*``); a ``.txt`` listing when depyf is missing
    report.json / report.txt             every graph so far

A dump deletes and overwrites only files it wrote (``written_by_fp8fx``, by how each begins): a file of one of those
names that fp8fx did not write (the user's report.json) is refused, naming it, before anything is written
(``ForeignDumpFile``; ``Fp8Backend(dump_dir=...)`` raises ValueError).
"""
from __future__ import annotations

import copy
import dis
import logging
import os
import re
import types
from typing import Collection, Optional

try:
    import fcntl
except ImportError:  # (Windows: no advisory locks; a dump folder is shared with other processes as before)
    fcntl = None

from torch import fx

from fp8fx.lowerings import compat
from fp8fx.passes import Fp8Pass, PassContext, PassManager
from fp8fx.report import Report, Site

log = logging.getLogger("fp8fx")
# the files a dump writes (``GraphDump.clear`` removes these, where fp8fx wrote them, and no others: a user's
# graph001_loss.png stays, and so does a report.json of the user's: the dump refuses the folder); from
# the 1000th graph on, four digits (graph1000_: past graph999_ the names sort by their number, not as text)
DUMP_FILE = re.compile(r"graph\d{3,}_(0_dynamo_graph\.py|1_\d{2}_after_\w+\.py|2_inductor_output_code\.py"
                        r"|3_report\.(json|txt)|4_dynamo_bytecode\.(py|txt))|report\.(json|txt)")
NO_LOCK = -1  # ``lock_folder``'s answer where the platform has no advisory locks
# how the files a dump writes begin (GraphDump's writes), by the kind of name (the first that fits): a file named
# as a dump's that does not begin so (the user's report.json, another tool's report.txt) is not fp8fx's, and a dump
# deletes and overwrites none (a dump's clear took files by name alone, the user's with them)
GRAPH_HEAD = "# fp8fx graph "  # the .py files: "# fp8fx graph 0, after LinearPass ..." / "# fp8fx graph 0: ..."
NO_BYTECODE = "# no bytecode: the backend was not called by Dynamo"
NO_DEPYF = "depyf is not installed (pip install depyf) to decompile Dynamo's bytecode for "
DEPYF_FAILED = "depyf failed ("
_HEADS = (
    (re.compile(r"report\.json$"), re.compile(r'\{\s*"schema":\s*"fp8fx\.report/')),  # to_json: "schema" first
    (re.compile(r"report\.txt$"),  # Report.table's header and the dashes under it
     re.compile(r"graph +kind +site +weight +rewritten +kernel +scheme / reason\n-")),
    (re.compile(r"\.txt$"), re.compile("|".join(map(re.escape, (NO_BYTECODE, NO_DEPYF, DEPYF_FAILED))))),
    # Inductor's code: the fp8fx line, or Inductor's own first line where a dump made before that line was written
    (re.compile(r"2_inductor_output_code\.py$"), re.compile(re.escape(GRAPH_HEAD) + r"\d+: |\s*# AOT ID: ")),
    (re.compile(r"\.py$"), re.compile(re.escape(GRAPH_HEAD) + r"\d+[,:] ")),
)
_HEAD_CHARS = 256  # (what the heads take; a table's header line, as wide as its widest row, is read whole)


class ForeignDumpFile(FileExistsError):
    """A file named as a dump's, in the folder a dump goes to, that fp8fx did not write (``written_by_fp8fx``): the
    dump would delete or overwrite it."""


def written_by_fp8fx(path: str) -> bool:
    """Whether the file at ``path``, named as a dump's (``DUMP_FILE``), is one a dump wrote: it begins as a dump's
    file of its name does (``_HEADS``: the report JSON's ``schema``, the table's header, the graph files' ``# fp8fx
    graph N`` line). A link, a folder or a file that cannot be read is not (a dump writes none, and writing would
    follow the link)."""
    if os.path.islink(path):
        return False
    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.readline(1 << 16) + f.read(1) if name.endswith("report.txt") else f.read(_HEAD_CHARS)
    except OSError:
        return False
    head_of = next((pattern for kind, pattern in _HEADS if kind.search(name)), None)
    return head_of is not None and head_of.match(head) is not None


def check_own(folder: str, names: Optional[Collection[str]] = None) -> None:
    """``ForeignDumpFile`` naming the folder, the file and the fix where a file of ``folder`` a dump would delete or
    overwrite (those of ``names`` that exist, else every one named as a dump's) is not one fp8fx wrote; nothing is
    deleted or written here."""
    if names is None:
        names = [f for f in os.listdir(folder) if DUMP_FILE.fullmatch(f)]
    for f in sorted(names):
        path = os.path.join(folder, f)
        if os.path.lexists(path) and not written_by_fp8fx(path):
            raise ForeignDumpFile(
                f"{path} is not a file fp8fx wrote (it does not begin as a dump's {f} does), and a dump into {folder} "
                "would delete or overwrite it (a dump clears the graph and report files an earlier one left); pass "
                "another dump_dir, or move or remove that file")


def lock_folder(folder: str) -> Optional[int]:
    """A descriptor of ``folder`` holding an exclusive advisory lock (``flock``) on it, which says to other processes
    that a live backend writes its dump there (close it to let go); None where one holds it already (a descriptor
    of this process holding it counts too: ``flock`` locks an open file, not a process); ``NO_LOCK`` without
    ``fcntl`` or where the file system takes no lock (Lustre without flock: ENOSYS; some NFS mounts: ENOLCK). The
    folder itself is locked, not a file in it: a dump folder holds the dump's files and no other."""
    if fcntl is None:
        return NO_LOCK
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # held
        os.close(fd)
        return None
    except OSError as e:  # no locks here: shared with other processes, as without fcntl
        os.close(fd)
        log.debug("fp8fx: dump folder %s takes no lock (%s); it is not kept from other processes", folder, e)
        return NO_LOCK
    return fd


def unlock_folder(fd: Optional[int]) -> None:
    if fd is not None and fd != NO_LOCK:
        os.close(fd)  # (closing the descriptor lets go of its lock)


def locked_elsewhere(folder: str) -> bool:
    """Whether a live backend of another process (or one of this process: ``GraphDump.clear``'s ``live``) writes
    into ``folder``."""
    try:
        fd = lock_folder(folder)
    except OSError:
        return False
    unlock_folder(fd)
    return fd is None


class GraphDump:
    """Writes the files of graph ``graph`` into ``dump_dir`` (created if missing)."""

    def __init__(self, dump_dir: str, graph: int):
        os.makedirs(dump_dir, exist_ok=True)
        # (``ForeignDumpFile`` where a file this graph would overwrite is not fp8fx's: one made since the clear)
        prefix = f"graph{graph:03d}_"
        check_own(dump_dir, [f for f in os.listdir(dump_dir) if f in ("report.json", "report.txt")
                             or f.startswith(prefix) and DUMP_FILE.fullmatch(f)])
        self.dir = dump_dir
        self.graph = graph
        self.failed = False  # a file could not be written: said once, and the compile goes on

    @staticmethod
    def clear(dump_dir: str, live: Collection[str] = (), strict: bool = True) -> None:
        """Remove the files an earlier dump left in ``dump_dir`` (``graphNNN_*``, ``report.*`` that fp8fx wrote:
        ``written_by_fp8fx``), and so the ``backend<k>`` folders of earlier runs' other backends (removed where they
        held dump files and nothing else), but those of ``live`` (real paths of folders live backends write into),
        those a live backend of another process writes into (``lock_folder``) and links; nothing else. A file of
        ``dump_dir`` named as a dump's that fp8fx did not write: ``ForeignDumpFile`` (``check_own``), before anything
        is removed (``strict``; in a ``backend<k>`` folder, which no dump writes into now, it stays, and so does the
        folder)."""
        if not os.path.isdir(dump_dir):
            return
        if strict:
            check_own(dump_dir)
        names = os.listdir(dump_dir)
        stale = [f for f in names if DUMP_FILE.fullmatch(f) and written_by_fp8fx(os.path.join(dump_dir, f))]
        for f in stale:
            os.remove(os.path.join(dump_dir, f))
        if stale:
            log.info("fp8fx: removed %d files of an earlier dump from %s", len(stale), dump_dir)
        for f in names:  # (an earlier run's second backend's folder read as this run's)
            sub = os.path.join(dump_dir, f)
            if (not re.fullmatch(r"backend\d+", f) or os.path.islink(sub) or not os.path.isdir(sub)
                    or os.path.realpath(sub) in live or not any(DUMP_FILE.fullmatch(n) for n in os.listdir(sub))
                    or locked_elsewhere(sub)):
                continue
            GraphDump.clear(sub, live, strict=False)
            if not os.listdir(sub):
                os.rmdir(sub)

    def write(self, name: str, text: str, prefix: bool = True) -> str:
        path = os.path.join(self.dir, f"graph{self.graph:03d}_{name}" if prefix else name)
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as e:  # a debugging aid must not break the user's compile (a full disk, a folder taken away)
            if not self.failed:
                self.failed = True
                log.warning("fp8fx: graph %d: could not write the dump file %s (%s: %s); the compile goes on, its dump "
                            "is incomplete: fix Fp8Backend(dump_dir=%r)", self.graph, path, type(e).__name__, e,
                            self.dir)
            return path
        log.debug("fp8fx: wrote %s", path)
        return path

    def start(self, gm: fx.GraphModule) -> None:
        """The graph as Dynamo captured it; the bytecode follows once Dynamo has made it."""
        self.write_graph(gm, "0_dynamo_graph.py", "as Dynamo captured it, before the fp8fx passes")
        if not compat.after_dynamo_bytecode(self._bytecode):
            self.write("4_dynamo_bytecode.txt", NO_BYTECODE + "\n")

    def write_graph(self, gm: fx.GraphModule, name: str, what: str) -> None:
        gm.recompile()  # gm.code of the graph as it is now
        self.write(name, f"{GRAPH_HEAD}{self.graph}, {what}\n" + gm.code.lstrip("\n") + _origins(gm))

    def passes(self, manager: PassManager) -> PassManager:
        """A copy of ``manager`` whose passes each write the graph after they ran."""
        dumping = copy.copy(manager)
        dumping.passes = [_DumpAfter(p, self, i) for i, p in enumerate(manager.passes, 1)]
        return dumping

    def finish(self, report: Report, output_code: list[str]) -> None:
        if output_code:
            self.write("2_inductor_output_code.py", f"{GRAPH_HEAD}{self.graph}: the code Inductor generated for it "
                       "(its kernels and the wrapper that calls them)\n" + "\n\n".join(output_code))
        self.write_reports(report)
        log.info("fp8fx: graph %d dumped to %s", self.graph, self.dir)

    def write_reports(self, report: Report) -> None:
        """This graph's report and the whole report so far; again when the graph adds sites as it runs for another
        module (``Report.reused``: the blocks after the first that run its frame), which the files left out."""
        self.write("3_report.json", report.to_json(self.graph))
        self.write("3_report.txt", report.table(self.graph) + "\n")
        self.write("report.json", report.to_json(), prefix=False)
        self.write("report.txt", str(report) + "\n", prefix=False)

    def _bytecode(self, code: types.CodeType, new_code: types.CodeType) -> None:
        where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
        try:
            import depyf
        except ImportError:
            self.write("4_dynamo_bytecode.txt", f"{NO_DEPYF}{where}; here it is as dis lists it:\n\n"
                       f"{dis.Bytecode(new_code).dis()}")
            return
        try:
            source = depyf.decompile(new_code)
        except Exception as e:  # noqa: BLE001 - a debugging aid must not break the user's compile
            log.warning("fp8fx: depyf could not decompile Dynamo's bytecode for %s: %s: %s", where, type(e).__name__, e)
            self.write("4_dynamo_bytecode.txt", f"{DEPYF_FAILED}{type(e).__name__}: {e}); the bytecode for {where} "
                       f"as dis lists it:\n\n{dis.Bytecode(new_code).dis()}")
            return
        header = (f"{GRAPH_HEAD}{self.graph}: the bytecode Dynamo made of {where}, decompiled by depyf "
                  f"{depyf.__version__}.\n# __compiled_fn_* is the compiled graph; the code before it reads the "
                  "graph's inputs.\n")
        self.write("4_dynamo_bytecode.py", header + source)


def _origins(gm: fx.GraphModule) -> str:
    """Comment lines naming the call Dynamo captured that each fp8fx op of ``gm`` replaced (``Site.node``, the
    report's ``node``, is that call's name: ``linear_1``, where this graph and Inductor's code name the op's node
    ``scaled_mm_default_1``); "" where no node is an fp8fx op that replaced one."""
    lines = [f"#   {n.name} <- {Site.origin_of(n)}" for n in gm.graph.nodes
             if n.op == "call_function" and str(n.target).startswith("fp8fx.") and Site.origin_of(n) != n.name]
    if not lines:
        return ""
    head = "\n# fp8fx ops <- the call Dynamo captured each in place of (a report site's node):\n"
    return head + "\n".join(lines) + "\n"


class _DumpAfter(Fp8Pass):
    """Runs ``inner`` and writes the graph it left."""

    def __init__(self, inner: Fp8Pass, dump: GraphDump, position: int):
        self.inner, self.dump, self.position = inner, dump, position

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        n = self.inner(gm, ctx)
        name = type(self.inner).__name__
        # (a count of the pass's rewrites: RouterPass's small_mm routers are rewrites and no fp8 sites of the report)
        what = f"after {name} ({n} rewrites)" if n else f"after {name}: nothing rewritten (off, or nothing it matches)"
        self.dump.write_graph(gm, f"1_{self.position:02d}_after_{name}.py", what)
        return n

    def uuid(self) -> str:
        return self.inner.uuid()
