"""Split-K tickets that CUDA graphs keep instead of zeroing them on every replay.

A split-K GEMM (``fp8fx.kernels.fp8_gemm``) counts the splits of each output tile that have finished on an int32
ticket per tile. Zeroed fresh in each call (``torch.zeros``), a captured launch carries a memset before it: on the
H200 that cost 1.1-1.2 us a launch of qkv, o and down at 2-64 tokens, 9-14% of qkv's and o's time (run 32,
``benchmarks/tune_gemm.py --tickets``). The kernel counts in periods (``_store_tile``), so a ticket left by
earlier launches at a multiple of the period serves the next one as it is; nothing has to zero it again.

Captured launches take their tickets here: ``for_capture`` hands every launch captured into a CUDA graph a slice
of its own, never handed out again, so two graphs replayed at once on two streams - or one graph's launches
overlapping - never count on the same ticket. A launch that is not being captured zeroes fresh tickets as before
(eager calls pay a host launch of ~20 us anyway). The slices come from reserves of ``CHUNK`` tickets per device,
allocated outside any CUDA-graph memory pool (a thread of their own: Inductor's cudagraph trees route every
allocation of the calling thread into their pool during warm-up, and restore that pool to checkpoints that would
not know a tensor kept here) and topped up before a capture can need them: at calls that are not captured (the
warm-up before each capture) whenever fewer than ``LOW`` are left. A capture that finds too few left (no warm-up
call on that device yet, or one graph of more than ``LOW`` split tiles) zeroes its tickets in the graph, as before;
the log says so once.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

log = logging.getLogger("fp8fx")

CHUNK = 1 << 18  # tickets a reserve allocates at a time (1 MiB of int32)
LOW = 1 << 16  # a reserve is topped up at a call outside capture when fewer tickets than this are left


class Reserve:
    """Slices of kept, zero-initialized int32 tickets on one device, each handed out once."""

    def __init__(self, device: torch.device, allocate=None):
        self.device = device
        self._allocate = allocate or _zeros_outside_pools
        self._buffers: list[torch.Tensor] = []  # every chunk, kept alive: captured graphs point into them
        self._next = 0  # the first free ticket of the last chunk
        self._warned = False
        self._lock = threading.Lock()  # (threads capturing graphs at once take disjoint slices)

    def left(self) -> int:
        return self._buffers[-1].numel() - self._next if self._buffers else 0

    def top_up(self) -> None:
        """A fresh chunk where fewer than ``LOW`` tickets are left (call outside capture only)."""
        with self._lock:
            if self.left() < LOW:
                self._buffers.append(self._allocate(CHUNK, self.device))
                self._next = 0

    def take(self, count: int) -> Optional[torch.Tensor]:
        """``count`` tickets no launch had before, or None where fewer are left."""
        with self._lock:
            if count <= self.left():
                out = self._buffers[-1][self._next:self._next + count]
                self._next += count
                return out
            warn, self._warned = not self._warned, True
        if warn:
            log.info("fp8fx: split-K tickets for CUDA graphs on %s are used up (a capture before any warm-up "
                     "call, or more than %d split tiles since the last one); captured split-K launches zero "
                     "their tickets in the graph until the next call outside capture", self.device, LOW)
        return None


_RESERVES: dict[torch.device, Reserve] = {}


def zeroed(device: torch.device, count: int) -> torch.Tensor:
    """``count`` int32 tickets at zero for a launch that leaves them at zero (or at a multiple of its period): a kept
    slice (``for_capture``) while a CUDA graph is captured, so the graph has no memset; else fresh zeros."""
    kept = for_capture(device, count) if device.type == "cuda" else None
    return kept if kept is not None else torch.zeros(count, device=device, dtype=torch.int32)


def for_capture(device: torch.device, count: int) -> Optional[torch.Tensor]:
    """Tickets for a split-K launch of ``count`` tiles on the CUDA ``device``: a slice of its own while a CUDA graph
    is being captured on the current stream (None where the reserve has too few left: zero fresh ones), None
    outside capture, where the device's reserve is topped up for the captures to come."""
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    reserve = _RESERVES.get(device)
    if not torch.cuda.is_current_stream_capturing():
        if reserve is None:
            reserve = _RESERVES.setdefault(device, Reserve(device))
        reserve.top_up()
        return None
    return None if reserve is None else reserve.take(count)


def _zeros_outside_pools(count: int, device: torch.device) -> torch.Tensor:
    """``torch.zeros(count, int32)`` on ``device``, allocated and zeroed by a thread of its own (outside the calling
    thread's CUDA-graph memory pool, if any) and complete when this returns."""
    out: list = []

    def allocate():
        try:
            with torch.cuda.device(device):
                out.append(torch.zeros(count, device=device, dtype=torch.int32))
                torch.cuda.current_stream(device).synchronize()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            out.append(err)

    worker = threading.Thread(target=allocate, name="fp8fx-tickets")
    worker.start()
    worker.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]
