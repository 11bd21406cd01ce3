"""Issue 4's 75% of HBM at 2-64 rows: a decode GEMM written in Gluon (Triton's explicit-layout dialect, sm_90), the
weight's first pipeline stages copied in before the PDL wait.

Every Triton tile fp8fx has (runs 13-38) waits for the kernel before it and only then touches memory: a tile's
shared-memory ring and its TMA copies are the compiler's, so no weight byte can move before
``griddepcontrol.wait``. Here the ring is the kernel's own: each program issues the TMA copies of its weight's
first ``STAGES`` K steps (parameters: no kernel before writes them), then waits, then copies the activation. Its
ring is small (``STAGES`` x (BN + MT) x 128 bytes: 48-128 KB), so a program of the next launch fits on an SM
beside one of this launch and streams while this one drains. The product is transposed, as the ``SWAP_AB``
tiles: the weight's BN rows are wgmma's left operand (64-128), the activation's MT rows (8-64: wgmma's N, no
padding to 64) its right one; per-token x scales, per-channel weight scales, bf16 out; K split with the partials
summed by the tile's last split (``fp8_gemm``'s tickets, counted in periods).

    python benchmarks/gluon_decode.py --check           # outputs against float64 at 1, 3, 16, 33, 64 rows
    python benchmarks/gluon_decode.py --sweep --duel    # tiles as chains of launches, then the best against fp8fx

A study, not part of fp8fx: sm_90 only, no interpreter path, no bias, no other scheme.
"""
import argparse
import itertools
import json
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

PERIOD = gl.constexpr(1 << 16)  # a ticket's period (``fp8fx.kernels.fp8_gemm.TICKET_PERIOD``)


@gluon.constexpr_function
def _store_layout(bn, mt):
    """A blocked layout of a [bn, mt] tile whose 8-element runs go along the weight rows (the output's contiguous
    dimension): 16-byte bf16 stores."""
    lanes_n = min(32, bn // 8)
    return gl.BlockedLayout([8, 1], [lanes_n, 32 // lanes_n], [1, 4], [0, 1])


# the CTA-wide barrier: ``thread_barrier`` in triton 3.6, ``barrier`` in 3.8
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _pdl_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pdl_trigger():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _issue(desc, row, k0, bar, ring, slot, KSUB: gl.constexpr, ok):
    """TMA copies of one stage: KSUB boxes of [rows, 128] along K from (row, k0) into ring[slot * KSUB + j]."""
    mbarrier.expect(bar, KSUB * desc.block_type.nbytes, pred=ok)
    for j in gl.static_range(KSUB):
        tma.async_copy_global_to_shared(desc, [row, k0 + j * 128], bar, ring.index(slot * KSUB + j), pred=ok)


@gluon.jit
def decode_kernel(w_desc, x_desc, xs_ptr, ws_ptr, y_ptr, out_ptr, ticket_ptr, M, N, K,
                  BN: gl.constexpr, MT: gl.constexpr, KSUB: gl.constexpr, STAGES: gl.constexpr,
                  SPLIT: gl.constexpr, PDL: gl.constexpr, TRIGGER: gl.constexpr, FAST: gl.constexpr):
    # a K step is KSUB boxes of 128 (TMA's 128-byte swizzle takes boxes of at most 128 bytes a row)
    BK: gl.constexpr = 128 * KSUB
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    off_n = pid_n * BN
    steps = gl.cdiv(K, BK)
    per = gl.cdiv(steps, SPLIT)
    first = split * per
    n_steps = gl.minimum(per, steps - first)

    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES * KSUB, BN, 128], w_desc.layout)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES * KSUB, MT, 128], x_desc.layout)
    w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(w_bar.index(s), count=1)
        mbarrier.init(x_bar.index(s), count=1)
    fence_async_shared()

    # the weight's first steps: before the wait (a parameter: the kernel before does not write it)
    for s in gl.static_range(STAGES):
        _issue(w_desc, off_n, (first + s) * BK, w_bar.index(s), w_ring, s, KSUB, s < n_steps)
    if PDL:
        _pdl_wait()
    if TRIGGER:
        _pdl_trigger()
    for s in gl.static_range(STAGES):
        _issue(x_desc, 0, (first + s) * BK, x_bar.index(s), x_ring, s, KSUB, s < n_steps)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, MT, 32])
    acc = gl.zeros([BN, MT], gl.float32, mma)
    total = gl.zeros([BN, MT], gl.float32, mma)
    for i in range(n_steps):
        st = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(w_bar.index(st), phase)
        mbarrier.wait(x_bar.index(st), phase)
        if FAST:
            # one accumulator over the whole K (the tensor cores' own accumulation, cuBLAS's fast-accumulation
            # mode), this step's dots left in flight while the step before's stage is refilled
            for j in gl.static_range(KSUB):
                acc = warpgroup_mma(w_ring.index(st * KSUB + j), x_ring.index(st * KSUB + j).permute((1, 0)), acc,
                                    is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=KSUB, deps=(acc, ))
            back = i - 1 + STAGES
            prev = (i + STAGES - 1) % STAGES
            ok = (i > 0) & (back < n_steps)
            _issue(w_desc, off_n, (first + back) * BK, w_bar.index(prev), w_ring, prev, KSUB, ok)
            _issue(x_desc, 0, (first + back) * BK, x_bar.index(prev), x_ring, prev, KSUB, ok)
        else:
            # each step's product promoted into fp32 (fp8fx's default: cuBLAS without fast accumulation)
            for j in gl.static_range(KSUB):
                acc = warpgroup_mma(w_ring.index(st * KSUB + j), x_ring.index(st * KSUB + j).permute((1, 0)), acc,
                                    use_acc=j > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            total += acc
            nxt = i + STAGES
            _issue(w_desc, off_n, (first + nxt) * BK, w_bar.index(st), w_ring, st, KSUB, nxt < n_steps)
            _issue(x_desc, 0, (first + nxt) * BK, x_bar.index(st), x_ring, st, KSUB, nxt < n_steps)
    if FAST:
        total = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(w_bar.index(s))
        mbarrier.invalidate(x_bar.index(s))

    store: gl.constexpr = _store_layout(BN, MT)
    total = gl.convert_layout(total, store)
    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, store))
    offs_m = gl.arange(0, MT, layout=gl.SliceLayout(0, store))
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    at = offs_m[None, :] * N + offs_n[:, None]
    if SPLIT > 1:
        gl.store(y_ptr + split * M * N + at, total, mask=mask)
        _cta_barrier()
        ticket = gl.atomic_add(ticket_ptr + pid_n, PERIOD // SPLIT, sem="acq_rel")
        if ((ticket + PERIOD // SPLIT) & (PERIOD - 1)) == 0:
            total = gl.zeros([BN, MT], gl.float32, store)
            for p in range(SPLIT):
                total += gl.load(y_ptr + p * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
            ws = gl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
            xs = gl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
            gl.store(out_ptr + at, (total * ws[:, None] * xs[None, :]).to(gl.bfloat16), mask=mask)
    else:
        ws = gl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
        xs = gl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
        gl.store(out_ptr + at, (total * ws[:, None] * xs[None, :]).to(gl.bfloat16), mask=mask)


def rows_tile(m: int) -> int:
    """The activation tile's rows (wgmma's N): the least of 8, 16, 32, 64 that holds m."""
    for mt in (8, 16, 32, 64):
        if m <= mt:
            return mt
    raise ValueError(f"gluon_decode: {m} rows; it takes 1-64")


class Launcher:
    """One decode GEMM's launch on fixed operands (descriptors, partials and tickets made once): ``out = (xq @ wq.T)
    * xs * ws.T`` in bf16, ``xq`` [m, k] fp8 per token, ``wq`` [n, k] fp8 per channel."""

    def __init__(self, xq, xs, wq, ws, bn=64, stages=4, split=1, pdl=False, trigger=False, ksub=1, fast=False):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        m, k = xq.shape
        n = wq.shape[0]
        mt = rows_tile(m)
        w_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
        x_layout = gl.NVMMASharedLayout.get_default_for([mt, 128], gl.float8e4nv)
        self.w_desc = TensorDescriptor(wq, list(wq.shape), [wq.stride(0), 1], [bn, 128], w_layout)
        self.x_desc = TensorDescriptor(xq, list(xq.shape), [xq.stride(0), 1], [mt, 128], x_layout)
        self.xs, self.ws = xs.reshape(-1).contiguous(), ws.reshape(-1).contiguous()
        self.out = torch.empty(m, n, device=xq.device, dtype=torch.bfloat16)
        self.y = torch.empty(split, m, n, device=xq.device, dtype=torch.float32) if split > 1 else self.out
        self.tickets = torch.zeros(triton.cdiv(n, bn), device=xq.device, dtype=torch.int32)
        self.m, self.n, self.k = m, n, k
        self.grid = (triton.cdiv(n, bn), split)
        self.consts = dict(BN=bn, MT=mt, KSUB=ksub, STAGES=stages, SPLIT=split, PDL=pdl, TRIGGER=trigger,
                           FAST=fast, num_warps=4, launch_pdl=pdl)

    def __call__(self):
        decode_kernel[self.grid](self.w_desc, self.x_desc, self.xs, self.ws, self.y, self.out, self.tickets,
                                 self.m, self.n, self.k, **self.consts)
        return self.out


def reference(xq, xs, wq, ws):
    return (xq.double() @ wq.double().T) * xs.double().reshape(-1, 1) * ws.double().reshape(1, -1)


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}


def check(ms=(1, 3, 16, 33, 64)):
    """Each tile family against float64 and against fp8fx's default at ``ms`` rows: the relative error of the worst
    element (on the output's largest value)."""
    from tune_gemm import _operands

    from fp8fx.kernels.fp8_gemm import fp8_gemm
    bad = 0
    for name, m in itertools.product(("o", "down"), ms):
        n, k = SHAPES[name]
        torch.manual_seed(m)
        xq, xs, wq, ws = _operands(m, n, k)
        ref = reference(xq, xs, wq, ws)
        scale = ref.abs().max().item()
        fx = (fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16).double() - ref).abs().max().item() / scale
        for bn, ksub, stages, split, pdl, fast in [(64, 1, 4, 1, False, False), (128, 2, 4, 2, True, True),
                                                   (64, 4, 2, 4, True, False), (128, 1, 6, 8, False, True)]:
            run = Launcher(xq, xs, wq, ws, bn=bn, ksub=ksub, stages=stages, split=split, pdl=pdl, trigger=pdl,
                           fast=fast)
            errs = []
            for _ in range(3):  # the tickets' periods: three calls on the same buffers
                errs.append((run().double() - ref).abs().max().item() / scale)
            ok = max(errs) <= max(2 * fx, 1e-2)
            bad += not ok
            print(f"check {name} M={m} BN={bn} ksub={ksub} stages={stages} split={split} pdl={pdl} fast={fast}: "
                  f"error {max(errs):.2e} "
                  f"(fp8fx {fx:.2e}) {'ok' if ok else 'FAILED'}", flush=True)
    return bad


def _chain(name, m, chain_bytes, **tile):
    """Launchers of one tile on each operand set of a chain (``tune_gemm._chain_operands``) and the chain's run."""
    from tune_gemm import _chain_operands
    n, k = SHAPES[name]
    launchers = [Launcher(xq, xs, wq, ws, **tile) for xq, xs, wq, ws in _chain_operands(m, n, k, chain_bytes)]
    return launchers, lambda: [run() for run in launchers]


def _fp8fx_chain(name, m, chain_bytes, pdl=False, trigger=False):
    from tune_gemm import _decode_chain
    chain, reps, n, k, default = _decode_chain(name, m, chain_bytes)
    cfg = {**default, **({"pdl": True} if pdl else {}), **({"PDL_TRIGGER": True} if trigger else {})}
    return reps, lambda: chain(cfg)


def tiles(name: str, m: int):
    """The sweep's tiles at m rows: 64 weight rows, K steps of 128-512 (KSUB boxes of 128) with 64-128 KB of the
    weight in the ring, K split so the grid holds 64-528 programs, each step's product promoted or not (``fast``)."""
    n, k = SHAPES[name]
    rings = [(1, 8), (2, 4), (2, 6), (4, 2), (4, 3)]
    out = []
    for (ksub, stages), split, fast in itertools.product(rings, (1, 2, 4, 8), (False, True)):
        programs = triton.cdiv(n, 64) * split
        if 64 <= programs <= 528 and k // (128 * ksub * split) >= 2 * stages:
            out.append(dict(bn=64, ksub=ksub, stages=stages, split=split, fast=fast))
    return out


def sweep(names=("o", "qkv", "down"), ms=(16, 64), chain_bytes=256 << 20, top=3):
    """Every tile of ``tiles`` with PDL and the early trigger, as chains (each timed once); returns the best
    ``top`` per (name, m)."""
    from tune_gemm import _read_speed, time_ms
    print(f"read speed (sum of 2 GiB): {_read_speed():.2f} TB/s", flush=True)
    best = {}
    for name, m in itertools.product(names, ms):
        n, k = SHAPES[name]
        reps, fx = _fp8fx_chain(name, m, chain_bytes, pdl=True, trigger=True)
        ref = fx()
        results = []
        for tile in tiles(name, m):
            try:
                launchers, run = _chain(name, m, chain_bytes, pdl=True, trigger=True, **tile)
                outs = run()
                worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                            for a, b in zip(outs, ref))
                assert worst <= 2e-2, f"{worst:.3e} apart from fp8fx"
                results.append((time_ms(run, True) / reps, tile))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit is not a candidate
                print(f"  {name} M={m} {tile}: {type(e).__name__} {str(e)[:160]}", flush=True)
        results.sort(key=lambda r: r[0])
        t_fx = time_ms(fx, True) / reps
        print(f"{name} M={m}: fp8fx (pdl, trigger) {t_fx:.4f} ms ({n * k / t_fx / 1e9:.2f} TB/s) | "
              + " ; ".join(f"{t:.4f} ({n * k / t / 1e9:.2f}) {c}" for t, c in results[:6]), flush=True)
        best[(name, m)] = [c for _, c in results[:top]]
    return best


def duel(best: dict, names=("o", "qkv", "down"), ms=(1, 16, 32, 64), rounds=5, chain_bytes=256 << 20):
    """fp8fx's default (plain; PDL with the trigger) against the sweep's best Gluon tiles (plain; PDL and the
    trigger) as chains, ``rounds`` interleaved rounds; ms per launch, TB/s and % of the read speed."""
    from tune_gemm import _medians, _read_speed
    speed = _read_speed()
    print(f"read speed (sum of 2 GiB): {speed:.2f} TB/s", flush=True)
    for name, m in itertools.product(names, ms):
        n, k = SHAPES[name]
        near = min(best, key=lambda key: (key[0] != name, abs(key[1] - m)))
        runs = {}
        reps, runs["fp8fx"] = _fp8fx_chain(name, m, chain_bytes)
        _, runs["fp8fx pdl+trigger"] = _fp8fx_chain(name, m, chain_bytes, pdl=True, trigger=True)
        keep = []
        for i, tile in enumerate(best[near][:2]):
            for pdl in (False, True):
                launchers, run = _chain(name, m, chain_bytes, pdl=pdl, trigger=pdl, **tile)
                keep.append(launchers)
                runs[f"gluon#{i + 1}{' pdl+trigger' if pdl else ''} {tile}"] = run
        ref = runs["fp8fx"]()
        for label, run in runs.items():
            worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                        for a, b in zip(run(), ref))
            assert worst <= 2e-2, f"{label}: {worst:.3e} apart from fp8fx"
        med = _medians(runs, rounds)
        print(f"{name} M={m} (chains of {reps}), ms per launch: " + ", ".join(
            f"{label} {t / reps:.4f} ({reps * n * k / t / 1e9:.2f} TB/s, {100 * reps * n * k / t / 1e9 / speed:.0f}%)"
            for label, t in med.items()), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--duel", action="store_true")
    p.add_argument("--names", default="o,qkv,down")
    p.add_argument("--ms", default="16,64", help="the sweep's row counts")
    p.add_argument("--best", help="a JSON file: the sweep writes its best tiles there (--sweep), or the duel reads them")
    args = p.parse_args(argv)
    names = tuple(args.names.split(","))
    if args.check and check():
        sys.exit(1)
    if args.sweep:
        best = sweep(names, tuple(int(m) for m in args.ms.split(",")))
        if args.best:
            with open(args.best, "w") as f:
                json.dump([[name, m, tiles_] for (name, m), tiles_ in best.items()], f)
    elif args.best:
        with open(args.best) as f:
            best = {(name, m): tiles_ for name, m, tiles_ in json.load(f)}
    else:
        best = {(name, 16): [dict(bn=64, stages=4, split=2)] for name in names}
    if args.duel:
        duel(best, names)


if __name__ == "__main__":
    main()
