"""Split-K tickets kept across launches (fp8fx.kernels.tickets, the period counting of fp8_gemm's ``_store_tile``).

On CPU (CI): the kernels under Triton's interpreter with tickets that no call re-zeroes, and the reserve's slices
with a CPU allocator. On the GPU: launches captured into CUDA graphs take slices of their own, and replays -
one after another, on two streams at once, under Inductor's cudagraph trees - give the eager bits.
"""
import logging
import textwrap

import pytest
import torch

import fp8fx
from fp8fx.kernels import tickets
from tests.conftest import run_under_triton_interpreter
from tests.kernels.test_fp8_gemm import operands

KEPT_CHECK = textwrap.dedent(
    """
    import torch
    from fp8fx.kernels.fp8_gemm import TICKET_PERIOD, fp8_gemm, gemv_config
    from tests.kernels.test_fp8_gemm import operands, reference

    period = TICKET_PERIOD.value
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    # the tensor-core kernel (3 rows, 3 N tiles) and the GEMV (one row, 16 tiles of 4 rows), K split in 2 and 4
    for m, n, k, cfg in [(3, 96, 1024, {**tile, "SPLIT_K": 4}), (3, 96, 1024, {**tile, "SPLIT_K": 2}),
                         (1, 64, 2048, {**gemv_config(64, 2048), "SPLIT_K": 4})]:
        xq, xs, wq, ws, _ = operands(m, n, k, [1, -1], [1, -1], "cpu")
        fresh = fp8_gemm(xq, wq, xs, ws, None, torch.float32, config=cfg)
        ref = reference(xq, xs, [1, -1], wq, ws, [1, -1], None, torch.float64)
        assert ((fresh.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, cfg
        tiles = -(-m // cfg.get("BLOCK_M", 1)) * -(-n // cfg["BLOCK_N"])
        # kept tickets, at zero, at 5 periods, and one period short of int32's wrap: three calls each, never re-zeroed
        for start in (0, 5 * period, 2**31 - period):
            kept = torch.full((tiles + 1,), start, dtype=torch.int32)
            for call in range(3):
                y = fp8_gemm(xq, wq, xs, ws, None, torch.float32, config=cfg, tickets=kept)
                assert torch.equal(y, fresh), (cfg, start, call)
            want = torch.tensor(start + 3 * period, dtype=torch.int64).to(torch.int32)  # (wrapped)
            assert torch.equal(kept[:tiles], want.expand(tiles)), (kept, want)
            assert int(kept[tiles]) == start  # past the tiles: untouched
    # a split that is not a power of 2 counts from zero, one a split
    xq, xs, wq, ws, _ = operands(3, 96, 1024, [1, -1], [1, -1], "cpu", seed=1)
    ref = reference(xq, xs, [1, -1], wq, ws, [1, -1], None, torch.float64)
    zeros = torch.zeros(3, dtype=torch.int32)
    y = fp8_gemm(xq, wq, xs, ws, None, torch.float32, config={**tile, "SPLIT_K": 3}, tickets=zeros)
    assert zeros.tolist() == [3, 3, 3] and ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    print("kept tickets ok")
    """
)


def test_kept_tickets_under_triton_interpreter():
    """Tickets counted in periods serve call after call without being zeroed, from any multiple of the period
    (int32's wrap included), in both kernels; a split that is not a power of 2 counts from zero."""
    assert "kept tickets ok" in run_under_triton_interpreter(["-c", KEPT_CHECK])


def _cpu_reserve():
    return tickets.Reserve(torch.device("cpu"), allocate=lambda n, device: torch.zeros(n, dtype=torch.int32))


def test_reserve_hands_each_ticket_out_once():
    reserve = _cpu_reserve()
    assert reserve.left() == 0 and reserve.take(1) is None  # nothing before the first top-up
    reserve.top_up()
    assert reserve.left() == tickets.CHUNK
    slices = [reserve.take(n) for n in (96, 1, 4000)]
    for s in slices:
        s.add_(1)
    assert all(int(s.max()) == 1 for s in slices)  # disjoint: each ticket in one slice
    assert reserve.left() == tickets.CHUNK - 4097
    first = reserve._buffers[0]
    reserve.top_up()  # enough left: no new chunk
    assert len(reserve._buffers) == 1
    assert reserve.take(tickets.CHUNK - tickets.LOW - 4097 + 1) is not None and reserve.left() < tickets.LOW
    reserve.top_up()  # a fresh chunk; the old one stays alive (graphs point into it)
    assert len(reserve._buffers) == 2 and reserve._buffers[0] is first and reserve.left() == tickets.CHUNK


def test_reserve_used_up_returns_none_and_logs_once(caplog):
    reserve = _cpu_reserve()
    reserve.top_up()
    assert reserve.take(tickets.CHUNK) is not None
    with caplog.at_level(logging.INFO, logger="fp8fx"):
        assert reserve.take(1) is None and reserve.take(5) is None
    assert sum("used up" in r.getMessage() for r in caplog.records) == 1


def test_for_capture_takes_slices_only_while_capturing(monkeypatch):
    """Outside capture: None (the caller zeroes fresh tickets) and the device's reserve topped up; while capturing:
    a slice of its own per launch; while capturing before any top-up: None."""
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(tickets, "_zeros_outside_pools", lambda n, device: torch.zeros(n, dtype=torch.int32))
    monkeypatch.setattr(tickets, "_RESERVES", {})
    dev = torch.device("cuda", 0)
    capturing[0] = True
    assert tickets.for_capture(dev, 8) is None and not tickets._RESERVES  # no warm-up call yet
    capturing[0] = False
    assert tickets.for_capture(dev, 8) is None and tickets._RESERVES[dev].left() == tickets.CHUNK
    capturing[0] = True
    a, b = tickets.for_capture(dev, 8), tickets.for_capture(dev, 3)
    assert a.shape == (8,) and b.shape == (3,) and a.data_ptr() + 8 * 4 == b.data_ptr()
    assert tickets._RESERVES[dev].left() == tickets.CHUNK - 11


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 40])
def test_captured_split_k_keeps_tickets_of_its_own(m):
    """A split-K GEMM captured into a CUDA graph (the GEMV with K split, the 2- and 40-row tiles) takes a slice of
    the reserve - no memset in the graph - and gives the eager bits in 20 replays; a second capture takes another."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm, gemv_config, tile_config

    n, k = (256, 14336) if m == 1 else (4096, 14336)
    cfg = {**gemv_config(n, k), "SPLIT_K": 4} if m == 1 else tile_config(m, n, k)
    assert cfg["SPLIT_K"] > 1
    xq, xs, wq, ws, _ = operands(m, n, k, [1, -1], [1, -1], "cuda")
    want = fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg)  # (outside capture: tops the reserve up)
    reserve = tickets._RESERVES[xq.device]
    graphs, outs = [], []
    for _ in range(2):
        before = reserve.left()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg))
        assert reserve.left() < before  # its tickets came from the reserve
        graphs.append(graph)
    for _ in range(20):
        for graph, y in zip(graphs, outs):
            y.zero_()
            graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(y, want) for y in outs)


@pytest.mark.cuda
def test_graphs_replayed_on_two_streams_at_once():
    """Two graphs of the same split-K GEMM captured on one stream, replayed together on two streams 50 times
    (their launches free to overlap): each keeps its own tickets, so each gives its eager bits."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm

    ops = [operands(16, 4096, 14336, [1, -1], [1, -1], "cuda", seed=s) for s in (0, 1)]
    wants = [fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16) for xq, xs, wq, ws, _ in ops]
    graphs, outs = [], []
    for xq, xs, wq, ws, _ in ops:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16))
        graphs.append(graph)
    streams = [torch.cuda.Stream() for _ in graphs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(50):
        for graph, s in zip(graphs, streams):
            with torch.cuda.stream(s):
                graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(y, want) for y, want in zip(outs, wants))


@pytest.mark.cuda
def test_kept_tickets_under_inductor_cudagraph_trees():
    """Fp8Backend(cudagraphs=True) at 2 and then 40 tokens (a second graph recorded after the first, the trees'
    pool restored to a checkpoint between): the reserve, allocated during the first warm-up, lies outside the
    trees' pool and serves both recordings; every call matches the plain compiled model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 14336, bias=False), torch.nn.Linear(14336, 4096, bias=False))
    model = model.cuda().to(torch.bfloat16)
    fp8fx.quantize_(model)
    xs = [torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for m in (2, 40)]
    with torch.no_grad():
        plain = torch.compile(model, backend=fp8fx.Fp8Backend(), dynamic=False)
        wants = [plain(x).clone() for x in xs]
        reserve = tickets._RESERVES[torch.device("cuda", torch.cuda.current_device())]  # (the plain split-K calls)
        chunks, before = len(reserve._buffers), reserve.left()
        torch._dynamo.reset()
        graphed = torch.compile(model, backend=fp8fx.Fp8Backend(cudagraphs=True), dynamic=False)
        for _ in range(4):
            for x, want in zip(xs, wants):
                torch.testing.assert_close(graphed(x).clone(), want, rtol=0, atol=0)
    assert len(reserve._buffers) > chunks or reserve.left() < before  # the recordings took kept tickets
