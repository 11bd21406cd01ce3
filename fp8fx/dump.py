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
# the files a dump writes (``GraphDump.clear`` removes these and no others: a user's graph001_loss.png stays); from
# the 1000th graph on, four digits (graph1000_: past graph999_ the names sort by their number, not as text)
DUMP_FILE = re.compile(r"graph\d{3,}_(0_dynamo_graph\.py|1_\d{2}_after_\w+\.py|2_inductor_output_code\.py"
                        r"|3_report\.(json|txt)|4_dynamo_bytecode\.(py|txt))|report\.(json|txt)")
NO_LOCK = -1  # ``lock_folder``'s answer where the platform has no advisory locks


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


def _locked_elsewhere(folder: str) -> bool:
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
        self.dir = dump_dir
        self.graph = graph
        self.failed = False  # a file could not be written: said once, and the compile goes on

    @staticmethod
    def clear(dump_dir: str, live: Collection[str] = ()) -> None:
        """Remove the files an earlier dump left in ``dump_dir`` (``graphNNN_*``, ``report.*``), and so the
        ``backend<k>`` folders of earlier runs' other backends (removed where they held dump files and nothing else),
        but those of ``live`` (real paths of folders live backends write into), those a live backend of another
        process writes into (``lock_folder``) and links; nothing else."""
        if not os.path.isdir(dump_dir):
            return
        names = os.listdir(dump_dir)
        stale = [f for f in names if DUMP_FILE.fullmatch(f)]
        for f in stale:
            os.remove(os.path.join(dump_dir, f))
        if stale:
            log.info("fp8fx: removed %d files of an earlier dump from %s", len(stale), dump_dir)
        for f in names:  # (an earlier run's second backend's folder read as this run's)
            sub = os.path.join(dump_dir, f)
            if (not re.fullmatch(r"backend\d+", f) or os.path.islink(sub) or not os.path.isdir(sub)
                    or os.path.realpath(sub) in live or not any(DUMP_FILE.fullmatch(n) for n in os.listdir(sub))
                    or _locked_elsewhere(sub)):
                continue
            GraphDump.clear(sub, live)
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
            self.write("4_dynamo_bytecode.txt", "# no bytecode: the backend was not called by Dynamo\n")

    def write_graph(self, gm: fx.GraphModule, name: str, what: str) -> None:
        gm.recompile()  # gm.code of the graph as it is now
        self.write(name, f"# fp8fx graph {self.graph}, {what}\n" + gm.code.lstrip("\n") + _origins(gm))

    def passes(self, manager: PassManager) -> PassManager:
        """A copy of ``manager`` whose passes each write the graph after they ran."""
        dumping = copy.copy(manager)
        dumping.passes = [_DumpAfter(p, self, i) for i, p in enumerate(manager.passes, 1)]
        return dumping

    def finish(self, report: Report, output_code: list[str]) -> None:
        if output_code:
            self.write("2_inductor_output_code.py", "\n\n".join(output_code))
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
            self.write("4_dynamo_bytecode.txt", f"depyf is not installed (pip install depyf) to decompile Dynamo's "
                       f"bytecode for {where}; here it is as dis lists it:\n\n{dis.Bytecode(new_code).dis()}")
            return
        try:
            source = depyf.decompile(new_code)
        except Exception as e:  # noqa: BLE001 - a debugging aid must not break the user's compile
            log.warning("fp8fx: depyf could not decompile Dynamo's bytecode for %s: %s: %s", where, type(e).__name__, e)
            self.write("4_dynamo_bytecode.txt", f"depyf failed ({type(e).__name__}: {e}); the bytecode for {where} "
                       f"as dis lists it:\n\n{dis.Bytecode(new_code).dis()}")
            return
        header = (f"# fp8fx graph {self.graph}: the bytecode Dynamo made of {where}, decompiled by depyf "
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
