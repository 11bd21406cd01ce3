"""Time and energy per call under the H200's power cap: the prefill MLP block and its gate/up GEMMs (issue 3).

``bench_linear.py`` times prefill by plain calls through ``do_bench``: ~100 ms of calls back to back, during which
the H200 draws up to its power limit and lowers its SM clock (run 29 call 2: 1470-1545 MHz in most samples
flagged with nvidia-smi's throttle reason 0x4, software power cap, while a CUDA-graph replay of the same block,
timed replay by replay, matched the profiler's kernel sum). Under the cap a variant's speed follows its energy
per call as much as its time at full clock. This script measures both, for each case in turn over ``--rounds``
rounds (each round in another order):

- ``capped``: calls back to back for ``--seconds`` after ``--warm`` seconds of the same (the power controller at
  its steady state): ms a call, mJ a call from NVML's energy counter, mean W and the SM clock NVML reported
  after each batch of calls (MHz, median), and the share of those samples with the software power cap active.
  The host keeps a batch queued ahead of the GPU (it waits for the batch before last, not the last one). In run
  29's calls it synchronized after each batch of 10, so the GPU idled while the next batch's first launch was
  queued, and those runs' ms and W count it: each variant's own host latency to its first kernel, an estimated
  0.1 ms a batch of 12 ms at 4096 tokens (not measured);
- ``clocked``: the median of single calls each after an idle ``--gap`` ms (CUDA events; the GPU cools between,
  and a spin kernel holds it while the host queues the call): the time at the clock the GPU holds when not capped.

Cases at each M of ``--ms``: the compiled blocks (fp8fx with the fused MLP, torchao float8 row-wise when
installed, optionally bf16 Inductor: ``--bf16``) and the gate/up GEMMs alone (``gated_prefill`` against cuBLAS's
gate and up GEMMs, as ``prefill_study.py --rounding`` times them). Needs pynvml (``nvidia-ml-py``, in the device
image; not a dependency of fp8fx).

    python benchmarks/power_study.py --ms 4096 --rounds 3 [--seconds 2] [--warm 1] [--gap 5] [--bf16] [--no-blocks]
        [--tiles GROUP_M:STAGES,...] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_linear import DIM, fp8fx_module, mlp_factory  # noqa: E402
from benchmarks.prefill_study import Operands, _add_torchao  # noqa: E402
from fp8fx.kernels import gated_mlp as gm  # noqa: E402

BATCH = 10  # calls between clock samples; the host runs up to two batches ahead of the GPU
SPIN_MS, SPIN_HZ = 3.0, 1.98e9  # ``clocked``'s hold before each call: over a compiled block's host time (~0.5 ms)


class Nvml:
    """NVML's energy counter (mJ since the driver loaded), SM clock and throttle reasons of one GPU."""

    def __init__(self, index: int):
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        # NVML numbers GPUs by PCI bus; CUDA_VISIBLE_DEVICES may reorder them: find torch's by its UUID
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handles = [h for h in (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount()))
                   if uuid in str(pynvml.nvmlDeviceGetUUID(h))]
        if len(handles) != 1:  # (another GPU's counter would time nothing of ours)
            raise RuntimeError(f"power_study.py: NVML lists {len(handles)} GPUs of UUID {uuid} (torch's cuda:{index})")
        self.handle = handles[0]
        self.power_cap = pynvml.nvmlDeviceGetPowerManagementLimit(self.handle) / 1000  # W
        self.sw_cap = getattr(pynvml, "nvmlClocksThrottleReasonSwPowerCap", 0x4)

    def energy_mj(self) -> int:
        return self.nv.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def clock_mhz(self) -> int:
        return self.nv.nvmlDeviceGetClockInfo(self.handle, self.nv.NVML_CLOCK_SM)

    def capped(self) -> bool:
        return bool(self.nv.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle) & self.sw_cap)


def capped(fn, nvml: Nvml, seconds: float, warm: float) -> dict:
    """``fn`` called back to back: ``warm`` seconds, then ``seconds`` measured (time, energy, clock samples)."""
    def run_for(duration: float, samples: list | None):
        calls, end, queued = 0, time.perf_counter() + duration, []
        while time.perf_counter() < end:
            for _ in range(BATCH):
                fn()
            calls += BATCH
            queued.append(torch.cuda.Event())
            queued[-1].record()
            if len(queued) > 2:  # the GPU keeps the last batch to run while the host queues the next one
                queued.pop(0).synchronize()
            if samples is not None:  # (the GPU is within two batches of the host here)
                samples.append((nvml.clock_mhz(), nvml.capped()))
        return calls

    run_for(warm, None)
    samples = []
    torch.cuda.synchronize()
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    calls = run_for(seconds, samples)
    torch.cuda.synchronize()
    t1, e1 = time.perf_counter(), nvml.energy_mj()
    wall = t1 - t0
    return {"ms": 1e3 * wall / calls, "mJ": (e1 - e0) / calls, "W": (e1 - e0) / 1e3 / wall, "calls": calls,
            "sm_mhz": statistics.median(c for c, _ in samples),
            "capped_share": sum(c for _, c in samples) / len(samples)}


def clocked(fn, gap_ms: float, reps: int = 30) -> float:
    """Median ms of single calls, each after ``gap_ms`` of idle GPU. A spin kernel of ``SPIN_MS`` holds the GPU
    before each call's start event, so the host has queued the call's kernels by the time the GPU reaches them:
    the events time the GPU, not the host's launches (without it, run 29 call 3 timed the fused block at 0.95 ms
    at 2048 tokens, its host time, against 0.63 back to back)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        time.sleep(gap_ms / 1e3)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        torch.cuda._sleep(int(SPIN_MS * 1e-3 * SPIN_HZ))
        ev[0].record()
        fn()
        ev[1].record()
        ev[1].synchronize()
        times.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(times)


def cases_at(m: int, blocks: dict, ops: Operands, tiles: list[tuple[int, int]]) -> dict:
    x = torch.randn(m, DIM, device="cuda", dtype=torch.bfloat16)
    xq, xs = ops.x_quant(x)
    cases = {f"block {name}": (lambda f=f: f(x)) for name, f in blocks.items()}
    cases["gate/up: gated_prefill"] = lambda: ops.gate_up(xq, xs, None)
    cases["gate/up: cuBLAS gate + up"] = lambda: ops.cublas_g_u(xq, xs)
    default = gm.prefill_tile_config(m, ops.w1.shape[0], DIM)
    for group, stages in tiles:  # the default tile with other row tiles a sweep / pipeline depths
        tile = {**default, "GROUP_M": group, "num_stages": stages}
        cases[f"gate/up: gated_prefill GROUP_M={group}, {stages} stages"] = lambda t=tile: ops.gate_up(xq, xs, t)
    return cases


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="4096")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--warm", type=float, default=1.0)
    p.add_argument("--gap", type=float, default=5.0)
    p.add_argument("--bf16", action="store_true", help="also the bf16 Inductor block")
    p.add_argument("--no-blocks", action="store_true", help="the gate/up GEMMs only")
    p.add_argument("--tiles", default="", metavar="GROUP_M:STAGES,...",
                   help="also the gate/up kernel's default tile with these row tiles a sweep and pipeline depths")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("power_study.py measures a GPU's energy counter: no CUDA device here")
    nvml = Nvml(torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name()}, power limit {nvml.power_cap:.0f} W, torch {torch.__version__}", flush=True)
    tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",") if t]
    fresh = mlp_factory("cuda")
    blocks = {}
    if not args.no_blocks:
        blocks["fp8fx_fused_mlp"] = fp8fx_module(fresh(), {"fuse_mlp": True}, dynamic=False)[0]
        _add_torchao(blocks, fresh)
        if args.bf16:
            blocks["bf16_inductor"] = torch.compile(fresh(), dynamic=False)
    ops = Operands(fresh())
    out = []
    with torch.no_grad():
        for m in (int(v) for v in args.ms.split(",")):
            cases = cases_at(m, blocks, ops, tiles)
            for fn in cases.values():  # compile and warm every case first
                fn()
            names = list(cases)
            results = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    row = {**capped(cases[name], nvml, args.seconds, args.warm),
                           "clocked_ms": clocked(cases[name], args.gap)}
                    results[name].append(row)
                    print(f"M={m} round {r} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
            for name in names:
                rows = results[name]
                med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
                out.append({"M": m, "case": name, **med, "rounds": rows})
                print(f"M={m} {name}: capped {med['ms']:.4f} ms, {med['mJ']:.1f} mJ, {med['W']:.0f} W, "
                      f"{med['sm_mhz']:.0f} MHz (cap active in {med['capped_share']:.0%} of samples); "
                      f"clocked {med['clocked_ms']:.4f} ms", flush=True)
            pairs = [("block torchao_rowwise", "block fp8fx_fused_mlp"), *[
                ("gate/up: gated_prefill", name) for name in names if name.startswith("gate/up: gated_prefill ")],
                *[("gate/up: cuBLAS gate + up", name) for name in names if name.startswith("gate/up: gated")]]
            for a, b in pairs:
                if a in results and b in results:
                    ratio = {k: statistics.median(ra[k] / rb[k] for ra, rb in zip(results[a], results[b]))
                             for k in ("ms", "mJ", "clocked_ms")}
                    print(f"M={m} {b} vs {a} (medians of per-round ratios): capped time {ratio['ms']:.3f}x, energy "
                          f"{ratio['mJ']:.3f}x, clocked time {ratio['clocked_ms']:.3f}x", flush=True)
                    out.append({"M": m, "ratio": f"{b} vs {a}", **ratio})
    with open(os.path.join(args.out, "power_study.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "power_limit_w": nvml.power_cap, "torch": torch.__version__,
                   "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
