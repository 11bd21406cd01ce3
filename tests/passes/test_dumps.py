"""Fp8Backend(dump_dir=...): the files of each compiled graph, in the order things happened."""
import ast
import importlib.util
import json
import os
import re
import sys

import pytest
import torch
from torch import nn

import fp8fx
import fp8fx.testing
from fp8fx.lowerings import compat
from fp8fx.report import Report
from tests.passes.test_linear_pass import TwoLinear

# one file after each pass, in pass order
PASSES = [f"1_{i:02d}_after_{type(p).__name__}.py" for i, p in enumerate(fp8fx.Fp8Backend().pass_manager.passes, 1)]
# depyf is a test extra; without it the bytecode is a dis listing (see the last test)
BYTECODE = "4_dynamo_bytecode.py" if importlib.util.find_spec("depyf") else "4_dynamo_bytecode.txt"
PER_GRAPH = ["0_dynamo_graph.py", *PASSES, "2_inductor_output_code.py", "3_report.json", "3_report.txt", BYTECODE]
GRAPH0 = [f"graph000_{name}" for name in PER_GRAPH]
# an earlier fp8fx dump's reports, as it wrote them (a dump clears files fp8fx wrote, and refuses others of their names)
OLD_JSON, OLD_TABLE = Report().to_json(), str(Report()) + "\n"


TwoLayer = TwoLinear  # up (64 -> 128), relu, down (128 -> 32)


def compile_two_layer(tmp_path, x=None, **options):
    torch.manual_seed(0)
    model = TwoLayer().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(dump_dir=str(tmp_path), **options)
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16) if x is None else x)
    return backend


def test_two_layer_dump(tmp_path):
    backend = compile_two_layer(tmp_path)
    fp8fx.testing.assert_rewritten(backend, "up", "down")
    assert sorted(p.name for p in tmp_path.iterdir()) == GRAPH0 + ["report.json", "report.txt"]
    for name in GRAPH0:
        if name.endswith(".py"):
            ast.parse((tmp_path / name).read_text(), filename=name)  # each is valid Python

    before = (tmp_path / "graph000_0_dynamo_graph.py").read_text()
    after = (tmp_path / f"graph000_{next(p for p in PASSES if p.endswith('LinearPass.py'))}").read_text()
    assert "fp8fx.dequantize" in before and "fp8fx.scaled_mm" not in before
    assert after.count("torch.ops.fp8fx.scaled_mm.default(") == 2 and "fp8fx.dequantize" not in after
    assert "def forward(self" in before and "def forward(self" in after  # gm.code's form
    # each site's node (Dynamo's call) next to the op that replaced it: the name Inductor's code gives
    for site in backend.report.sites:
        op = re.search(rf"^#   (\w+) <- {site.node}$", after, re.M)[1]
        assert f"{op} = torch.ops.fp8fx.scaled_mm.default(" in after
        assert f"Source Nodes: [{op}]" in (tmp_path / "graph000_2_inductor_output_code.py").read_text()
    assert "= fp8fx_direct.scaled_mm(" in (tmp_path / "graph000_2_inductor_output_code.py").read_text()
    bytecode = (tmp_path / f"graph000_{BYTECODE}").read_text()
    assert "__compiled_fn_" in bytecode
    assert ("decompiled by depyf" in bytecode) == BYTECODE.endswith(".py")

    assert json.loads((tmp_path / "graph000_3_report.json").read_text()) == json.loads(backend.report.to_json(0))
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(backend.report.to_json())
    table = (tmp_path / "graph000_3_report.txt").read_text()
    assert "up" in table and "down" in table and "2 of 2 sites rewritten in graph 0" in table


class Broken(nn.Module):
    """Two graphs: a graph break between the layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def test_files_of_each_graph_sort_after_the_previous_graph(tmp_path):
    model = Broken().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 64, dtype=torch.bfloat16))
    names = sorted(p.name for p in tmp_path.iterdir())
    per_graph = [n for n in PER_GRAPH if "inductor" not in n]  # eager: no output code
    assert names == [f"graph{g:03d}_{n}" for g in (0, 1) for n in per_graph] + ["report.json", "report.txt"]
    assert {s["fqn"] for s in json.loads((tmp_path / "graph000_3_report.json").read_text())["sites"]} == {"a"}
    assert {s["fqn"] for s in json.loads((tmp_path / "graph001_3_report.json").read_text())["sites"]} == {"b"}
    assert len(compat._bytecode_hooks) <= 1  # hooks of earlier graphs were removed


def test_a_new_backend_clears_what_an_earlier_dump_left(tmp_path):
    """A two-graph run then a one-graph run into one folder left graph001_* beside a report of one graph."""
    (tmp_path / "graph001_3_report.json").write_text(OLD_JSON)
    # (the 1001st graph's names: they were left)
    (tmp_path / "graph1000_0_dynamo_graph.py").write_text("# fp8fx graph 1000, as Dynamo captured it\n")
    (tmp_path / "report.txt").write_text(OLD_TABLE)
    # Inductor's code as dumps wrote it before its fp8fx line: Inductor's own first line tells it
    (tmp_path / "graph001_2_inductor_output_code.py").write_text("# AOT ID: ['0_inference']\nimport torch\n")
    (tmp_path / "notes.md").write_text("mine")  # not a dump file: kept
    (tmp_path / "graph001_loss.png").write_text("mine")  # named like one but never written by one: kept (it went)
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path)))(
            torch.randn(2, 64, dtype=torch.bfloat16))
    files = sorted(os.listdir(tmp_path))
    assert "notes.md" in files and [f for f in files if f.startswith("graph001")] == ["graph001_loss.png"]
    assert "graph1000_0_dynamo_graph.py" not in files
    assert (tmp_path / "report.txt").read_text() != OLD_TABLE


FOREIGN = [("report.json", '{"loss": 0.5}'), ("report.txt", "my notes"), ("graph000_3_report.json", "{}"),
           ("graph000_3_report.txt", ""), ("graph000_2_inductor_output_code.py", "print('mine')\n"),
           ("graph001_4_dynamo_bytecode.txt", "another tool's listing")]


@pytest.mark.parametrize("name, text", FOREIGN)
def test_a_file_fp8fx_did_not_write_is_refused_before_anything_is_written(tmp_path, name, text):
    """A file named as a dump's that fp8fx never wrote (the user's report.json, another tool's): the first graph's
    clear deleted it, by its name alone, with an INFO line. The backend is refused now, naming the folder, the file
    and the fix; the folder is left as it was (an earlier dump's files too)."""
    (tmp_path / "graph000_3_report.json").write_text(OLD_JSON)  # an earlier dump's: it would go, were the rest fp8fx's
    (tmp_path / name).write_text(text)
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=rf"dump_dir=.*: {re.escape(str(tmp_path / name))} is not a file fp8fx wrote"
                                         r".* pass another dump_dir, or move or remove that file"):
        fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before


def test_a_file_fp8fx_did_not_write_found_at_a_compile_is_left_alone(tmp_path, caplog):
    """The user's report.json put in the folder after the backend was made: every graph of the compile is left
    undumped, with a warning naming the file, and the file stays. In an earlier run's backend<k> folder, which no
    backend writes into now, such a file stays with its folder (the files fp8fx wrote there go)."""
    old = tmp_path / "backend2"
    old.mkdir()
    (old / "graph000_3_report.json").write_text(OLD_JSON)
    (old / "report.txt").write_text("another tool's")
    model = Broken().to(torch.bfloat16)  # two graphs
    fp8fx.quantize_(model)
    torch._dynamo.reset()
    backend = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
    (tmp_path / "report.json").write_text('{"loss": 0.5}')
    with caplog.at_level("WARNING", logger="fp8fx"), torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 64, dtype=torch.bfloat16))
    assert [s.rewritten for s in backend.report.sites] == [True, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backend2", "report.json"]
    assert (tmp_path / "report.json").read_text() == '{"loss": 0.5}'
    assert sorted(p.name for p in old.iterdir()) == ["graph000_3_report.json", "report.txt"]  # (refused first)
    warned = [r.getMessage() for r in caplog.records if "is not dumped" in r.getMessage()]
    assert len(warned) == 2 and all(f"{tmp_path / 'report.json'} is not a file fp8fx wrote" in w for w in warned)
    (tmp_path / "report.json").unlink()  # the next backend clears what fp8fx wrote of backend2/, and keeps the rest
    torch._dynamo.reset()
    compile_two_layer(tmp_path, compiler="eager")
    assert sorted(p.name for p in old.iterdir()) == ["report.txt"]


def test_a_new_run_clears_the_folders_an_earlier_runs_other_backends_left(tmp_path):
    """backend2/ of an earlier process (a notebook's two backends, then a script's one) stayed, read as this run's; a
    folder of a backend still alive stays; after Dynamo's reset a new backend takes the root folder, the live first
    backend's files moving out of its way (h131: its first graph cleared them)."""
    stale = tmp_path / "backend2"
    stale.mkdir()
    (stale / "graph000_3_report.json").write_text(OLD_JSON)
    (stale / "report.txt").write_text(OLD_TABLE)
    kept = tmp_path / "backend3"
    kept.mkdir()
    (kept / "notes.md").write_text("mine")  # not a dump file: kept, and its folder
    (tmp_path / "backend5").mkdir()  # a folder that holds no dump: the user's, kept
    elsewhere = tmp_path.parent / f"{tmp_path.name}_elsewhere"
    elsewhere.mkdir()
    (elsewhere / "report.txt").write_text("not this dump's")
    (tmp_path / "backend6").symlink_to(elsewhere)  # a link: nothing followed
    torch._dynamo.reset()
    first = compile_two_layer(tmp_path, compiler="eager")
    assert not stale.exists() and sorted(p.name for p in kept.iterdir()) == ["notes.md"]
    assert (tmp_path / "backend5").is_dir() and (elsewhere / "report.txt").read_text() == "not this dump's"
    second = compile_two_layer(tmp_path, compiler="eager")
    assert second.dump_dir == str(stale)
    first_graph = (tmp_path / "graph000_3_report.json").read_text()
    torch._dynamo.reset()  # both backends alive: a new one takes the root, the first's files move, backend2/ stays
    third = compile_two_layer(tmp_path, compiler="eager")
    moved = tmp_path / "backend4"  # (backend2/ is the second's; 3, 5 and 6 the user's: folders that exist)
    assert third.dump_dir == str(tmp_path) and first.dump_dir == str(moved)
    assert (stale / "report.json").exists() and (moved / "graph000_3_report.json").read_text() == first_graph
    assert sorted(p.name for p in kept.iterdir()) == ["notes.md"]


def test_sites_a_graph_adds_as_it_runs_for_other_blocks_are_dumped(tmp_path):
    """A block with a graph break: its two graphs run again for the next block, whose sites the report adds then
    (``Report.reused``); the dumped reports, written when each graph compiled, left them out."""
    model = nn.Sequential(Broken(), Broken()).to(torch.bfloat16)
    fp8fx.quantize_(model)
    torch._dynamo.reset()
    backend = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 64, dtype=torch.bfloat16))
    names = sorted(s.fqn for s in backend.report.sites)
    assert names == ["0.a", "0.b", "1.a", "1.b"]
    assert sorted(s["fqn"] for s in json.loads((tmp_path / "report.json").read_text())["sites"]) == names
    assert [s["fqn"] for s in json.loads((tmp_path / "graph000_3_report.json").read_text())["sites"]] == ["0.a", "1.a"]
    assert "1.b" in (tmp_path / "report.txt").read_text()


def test_a_dump_that_cannot_be_written_leaves_the_compile_alone(tmp_path, caplog):
    """The dump folder turned into a file after the backend was made: the compile failed (FileExistsError, naming
    no option). It runs, the report is whole, and a warning names dump_dir."""
    folder = tmp_path / "dump"
    backend = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(folder))
    folder.rmdir()
    folder.write_text("")
    model = TwoLayer().to(torch.bfloat16)
    fp8fx.quantize_(model)
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="fp8fx"), torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16))
    assert [s.rewritten for s in backend.report.sites] == [True, True]
    assert any("is not dumped" in r.getMessage() and "dump_dir" in r.getMessage() for r in caplog.records)


def test_backends_sharing_a_dump_dir_write_apart(tmp_path, caplog):
    """Two live backends, one dump_dir: the second's first graph cleared the first's files and both wrote
    graph000_*. Now the second (and a third) write into backend2/, backend3/ with a warning; once the backends are
    collected (after torch._dynamo.reset(), which releases Dynamo's hold on them) the folder is taken again."""
    first = compile_two_layer(tmp_path)
    with caplog.at_level("WARNING", logger="fp8fx"):
        second = compile_two_layer(tmp_path)
        third = compile_two_layer(tmp_path)
    assert first.dump_dir == str(tmp_path)
    assert (second.dump_dir, third.dump_dir) == (str(tmp_path / "backend2"), str(tmp_path / "backend3"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        GRAPH0 + ["report.json", "report.txt", "backend2", "backend3"])
    for sub in ("backend2", "backend3"):
        assert sorted(p.name for p in (tmp_path / sub).iterdir()) == GRAPH0 + ["report.json", "report.txt"]
    assert sum("is another live backend's dump folder" in r.getMessage() for r in caplog.records) == 2
    again = compile_two_layer(tmp_path)  # Dynamo holds every backend until its reset: the first is still live
    assert again.dump_dir == str(tmp_path / "backend4")
    torch._dynamo.reset()  # calls each backend's reset: the folders are free (the first's files move out of the way)
    assert compile_two_layer(tmp_path).dump_dir == str(tmp_path)
    assert first.dump_dir == str(tmp_path / "backend5") and (tmp_path / "backend5" / "report.json").exists()


def test_a_backend_keeps_its_dump_folder_after_a_reset(tmp_path):
    """After torch._dynamo.reset() a backend that wrote into backend2/ compiles again: it took the root folder,
    whose report.json then listed its sites next to the first backend's graph files."""
    model_a, model_b = TwoLayer().to(torch.bfloat16), TwoLayer().to(torch.bfloat16)
    fp8fx.quantize_(model_a), fp8fx.quantize_(model_b)
    a = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
    b = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
    with torch.no_grad():
        torch.compile(model_a, backend=a)(torch.randn(4, 64, dtype=torch.bfloat16))
        compiled_b = torch.compile(model_b, backend=b)
        compiled_b(torch.randn(4, 64, dtype=torch.bfloat16))
        assert b.dump_dir == str(tmp_path / "backend2")
        torch._dynamo.reset()
        compiled_b(torch.randn(4, 64, dtype=torch.bfloat16))
    assert b.dump_dir == str(tmp_path / "backend2")
    assert len(json.loads((tmp_path / "report.json").read_text())["sites"]) == 2  # a's only
    assert len(json.loads((tmp_path / "backend2" / "report.json").read_text())["sites"]) == 4  # b's two graphs


def test_a_graph_that_failed_before_any_site_is_in_the_report(monkeypatch):
    """A pass that raises before it records a site (here the first one, under Dynamo's suppress_errors): the report
    read "0 of 0 sites rewritten in 1 graph(s)", with no word of the failure; now the graph says why."""
    from fp8fx.passes.moe import MoePass

    def broken(self, gm, ctx):
        raise RuntimeError("a pass broke")
    monkeypatch.setattr(MoePass, "__call__", broken)
    torch._dynamo.reset()
    model = TwoLayer().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad(), torch._dynamo.config.patch(suppress_errors=True):
        torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16))
    torch._dynamo.reset()
    # (Dynamo tries the frame again after the failure: each graph it built failed the same way)
    assert 0 in backend.report.failed
    assert set(backend.report.failed.values()) == {"the graph failed to compile (RuntimeError: a pass broke)"}
    assert "graph 0 failed to compile, nothing in it rewritten: the graph failed to compile (RuntimeError: a pass " \
           "broke)" in backend.report.table()
    assert backend.report.to_dict()["graphs"][0]["failed"].endswith("a pass broke)")
    assert "failed to compile" in backend.report.graph_summary(0)


def test_a_relative_dump_dir_is_where_it_was_made(tmp_path, monkeypatch):
    """A relative dump_dir is the folder the backend made when it was built: a chdir before the first compile
    wrote the dump into a folder of that name under the new working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    model = TwoLayer().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager", dump_dir="dumps")
    monkeypatch.chdir(tmp_path / "elsewhere")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16))
    assert backend.dump_dir == str(tmp_path / "dumps") and (tmp_path / "dumps" / "report.txt").exists()
    assert not (tmp_path / "elsewhere" / "dumps").exists()


def test_nothing_is_written_without_dump_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = TwoLayer().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16))
    assert len(backend.report.rewritten) == 2
    assert list(tmp_path.iterdir()) == []


def test_without_depyf_the_bytecode_is_listed_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf raises ImportError
    compile_two_layer(tmp_path, compiler="eager")
    assert not (tmp_path / "graph000_4_dynamo_bytecode.py").exists()
    text = (tmp_path / "graph000_4_dynamo_bytecode.txt").read_text()
    assert text.startswith("depyf is not installed (pip install depyf)")
    assert "__compiled_fn_" in text  # the dis listing of the call of the compiled graph


def test_a_folder_another_process_dumps_into_is_not_shared(tmp_path, caplog):
    """Two processes (two training scripts, a test run beside a notebook) with one dump_dir: each one's first graph
    cleared the other's files, and both wrote graph000_*. A backend holds a lock on its folder (``lock_folder``, as
    another process's backend does); a backend finding it held writes into backend2/, and the next run's clear
    leaves a backend<k> folder another process writes into alone."""
    from fp8fx.dump import lock_folder, unlock_folder

    torch._dynamo.reset()
    other = lock_folder(str(tmp_path))  # (a lock held by another open descriptor: what another process holds)
    (tmp_path / "graph000_3_report.json").write_text(OLD_JSON)  # (the other process's)
    try:
        with caplog.at_level("WARNING", logger="fp8fx"):
            backend = compile_two_layer(tmp_path, compiler="eager")
        assert backend.dump_dir == str(tmp_path / "backend2")
        assert (tmp_path / "graph000_3_report.json").read_text() == OLD_JSON
        assert sorted(p.name for p in (tmp_path / "backend2").iterdir()) == sorted(
            [f for f in GRAPH0 if "inductor" not in f] + ["report.json", "report.txt"])
        assert "(of this process or another)" in caplog.text
    finally:
        unlock_folder(other)
    del backend
    torch._dynamo.reset()  # the backend lets go of backend2/: the other process takes it, a new run here the root
    other = lock_folder(str(tmp_path / "backend2"))
    try:
        assert other is not None
        assert compile_two_layer(tmp_path, compiler="eager").dump_dir == str(tmp_path)
        assert (tmp_path / "backend2" / "report.json").exists()  # (held by the other process: not cleared)
    finally:
        unlock_folder(other)


def test_a_file_system_without_locks_shares_the_folder(tmp_path, monkeypatch):
    """flock failing otherwise than "held" (ENOLCK on some NFS mounts, ENOSYS on Lustre without flock) was read as
    another process's lock: the backend made backend2/, backend3/, ... without end and the compile never finished."""
    import errno

    from fp8fx import dump

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(dump.fcntl, "flock", no_locks)
    torch._dynamo.reset()
    assert compile_two_layer(tmp_path, compiler="eager").dump_dir == str(tmp_path)
    assert compile_two_layer(tmp_path, compiler="eager").dump_dir == str(tmp_path / "backend2")  # (this process's)


def test_a_forked_child_does_not_hold_the_parents_dump_folder(tmp_path):
    """A child forked while a backend held its folder (a DataLoader worker) kept a copy of the locked descriptor:
    after torch._dynamo.reset() freed the folder, this process's next backend was sent to backend2/."""
    import time

    torch._dynamo.reset()
    compile_two_layer(tmp_path, compiler="eager")
    pid = os.fork()
    if pid == 0:  # a worker doing nothing with fp8fx
        time.sleep(20)
        os._exit(0)
    try:
        torch._dynamo.reset()
        assert compile_two_layer(tmp_path, compiler="eager").dump_dir == str(tmp_path)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_live_backend_keeps_its_dump_after_a_reset(tmp_path, caplog):
    """h131: after torch._dynamo.reset() (which fp8fx.testing.assert_compiles_once calls itself) a new backend with
    the same dump_dir took the folder of a backend still held and compiling, its first graph deleting that backend's
    graph000_* files; the live one was sent to backend2/, with graph001_* alone under a report of both graphs. Its
    files move to backend2/ now, where it writes on. (h132: a backend Dynamo leaks after a compile that raised, kept
    past the reset, held its folder: the next backend went to backend2/.)"""
    torch.manual_seed(0)
    model = TwoLayer().to(torch.bfloat16)
    fp8fx.quantize_(model)
    a = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
    compiled = torch.compile(model, backend=a)
    with torch.no_grad():
        compiled(torch.randn(4, 64, dtype=torch.bfloat16))
    graph0 = (tmp_path / "graph000_0_dynamo_graph.py").read_text()
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="fp8fx"):
        b = compile_two_layer(tmp_path, compiler="eager")
    assert (a.dump_dir, b.dump_dir) == (str(tmp_path / "backend2"), str(tmp_path))
    assert (tmp_path / "backend2" / "graph000_0_dynamo_graph.py").read_text() == graph0
    assert "the dump of the backend that wrote there before, still alive (held by you" in caplog.text
    with torch.no_grad():  # a compiles on, into its folder
        compiled(torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert (tmp_path / "backend2" / "graph001_0_dynamo_graph.py").exists()
    assert not (tmp_path / "graph001_0_dynamo_graph.py").exists()


def test_a_reset_frees_a_held_backends_folder_for_this_process_alone(tmp_path):
    """h133: the reset let go of the folder's lock too, so another process's backend took the folder of a backend
    still held and its first graph cleared that backend's files (_evict moves them in this process only). The lock
    stays until the backend is collected."""
    from fp8fx.dump import lock_folder, unlock_folder

    a = compile_two_layer(tmp_path, compiler="eager")
    torch._dynamo.reset()
    assert lock_folder(str(tmp_path)) is None  # (another descriptor: what another process would try)
    del a
    other = lock_folder(str(tmp_path))
    assert other is not None
    unlock_folder(other)


def test_a_folder_is_free_after_a_reset_though_a_compile_raised(tmp_path):
    """h132: a backend whose compiled call raised (a wrong-shaped input: Dynamo leaks the backend then, past its
    reset and the garbage collector) held its folder while its claim went with the collection alone: every later
    backend of the folder wrote into backend2/. Dynamo's reset frees it, as before h131's change."""
    import gc

    torch.manual_seed(0)
    model = TwoLayer().to(torch.bfloat16)
    fp8fx.quantize_(model)

    def session(bad_call):
        backend = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            compiled(torch.randn(4, 64, dtype=torch.bfloat16))
            if bad_call:
                with pytest.raises(Exception):
                    compiled(torch.randn(4, 65, dtype=torch.bfloat16))
        return backend.dump_dir

    assert session(True) == str(tmp_path)
    torch._dynamo.reset()
    gc.collect()
    assert session(False) == str(tmp_path)


def test_a_forked_child_moves_none_of_the_parents_dump(tmp_path):
    """h133: a forked child kept the parent's backends among the dumpers it evicts: after a reset in the parent, a
    worker dumping into the same folder moved the parent's live backend's files to backend2/, the parent's dump_dir
    left naming the folder the child then filled."""
    torch._dynamo.reset()
    a = compile_two_layer(tmp_path, compiler="eager")
    graph0 = (tmp_path / "graph000_0_dynamo_graph.py").read_text()
    torch._dynamo.reset()
    pid = os.fork()
    if pid == 0:  # a worker compiling a model of its own (the backend called directly: no Dynamo in the fork)
        code = 1
        try:
            model = TwoLayer().to(torch.bfloat16)
            fp8fx.quantize_(model)
            worker = fp8fx.Fp8Backend(compiler="eager", dump_dir=str(tmp_path))
            worker(torch.fx.symbolic_trace(model), [torch.randn(4, 64, dtype=torch.bfloat16)])
            code = 0 if worker.dump_dir != str(tmp_path) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # (the worker wrote beside the parent's folder)
    assert a.dump_dir == str(tmp_path) and (tmp_path / "graph000_0_dynamo_graph.py").read_text() == graph0
