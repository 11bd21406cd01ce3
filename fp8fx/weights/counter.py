"""Counting the elements copied into a parameter, to know when its last shard has arrived."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CopyNumelCounter(TorchDispatchMode):
    """Counts the elements written by ``aten.copy_`` while active (like vLLM's counter of the same
    name): a weight loader that copies a shard with ``param.narrow(...).copy_(shard)`` inside this
    mode learns how many elements of ``param`` it has filled, whatever slicing the loader used."""

    def __init__(self):
        super().__init__()
        self.copied_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default:
            self.copied_numel += args[0].numel()
        return out
