"""Launching a Triton kernel again without Triton's per-call binding (``Relaunch``).

``kernel[grid](*args, **kwargs)`` binds the arguments to the signature, specializes each one (its dtype, a pointer's
16-byte alignment, an int equal to 1 or a multiple of 16), formats the compile options into a string for the cache
key and looks the compiled kernel up, on every call. Prefill without CUDA graphs pays that in each of its calls, and
the fused MLP's op launched two such kernels a call (its host time above its GPU time at 2048 tokens on the H200,
benchmarks/RESULTS.md run 25). ``Relaunch(kernel)[grid](...)`` goes through Triton once per launch key and then
calls the compiled kernel directly: ``CompiledKernel[grid](*args)``, where Triton's own ``run`` ends (triton 3.6
and 3.9 alike), with the same stream, launch hooks and argument handling (host tensor descriptors included).

The launch key is at least as fine as Triton's own: the current device, every constexpr's value and every compile
option's (``num_warps``, ...), and for each other argument what Triton specializes on - a tensor's dtype and
alignment, an int's equality to 1, divisibility by 16 and width, a bool's value, a tensor descriptor's dtype, block
shape, padding and its shape's and strides' divisibility. A compiled kernel found under it is the one Triton would
have picked. What this skips: Triton's check that the kernel's globals did not change since it compiled (fp8fx's
kernels read module constants only), and a change of ``triton.knobs`` debug or instrumentation settings between
calls (they are part of Triton's key, not of this one). Under ``TRITON_INTERPRET=1`` nothing is compiled, so every
call takes Triton's path.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

_I32 = (-(2 ** 31), 2 ** 31)


# Host arithmetic of launches. ``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction``s in triton 3.6
# and 3.9: called from the host, each unwraps its arguments as constexprs, 4-6 us a call on CI's CPU against well
# under 1 us for the arithmetic itself, and a prefill MLP op called five of them.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of two ints (``triton.cdiv``'s value); SymInts too (``fp8fx.ops``' fake scale shapes)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of 2 >= n for n >= 1, and 0 for 0 (``triton.next_power_of_2``'s values)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _index(device: torch.device) -> int:
    """The CUDA ``device``'s index: its own, or the current device's for a bare "cuda"."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    """``torch.cuda.get_device_properties(index)``, looked up once a device (the lookup took 4 us a prefill op call
    on the H200's host, run 28's ``host_study.py``)."""
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device) -> int:
    """The SMs of the CUDA ``device`` (``_properties``)."""
    return _properties(_index(device)).multi_processor_count


def shared_memory(device: torch.device) -> int:
    """The bytes of shared memory one program of a kernel may take on the CUDA ``device`` (the opt-in maximum per
    block: 227 KiB on sm_90, 163 on sm_80, 99 on sm_86 and sm_89; ``_properties``)."""
    return _properties(_index(device)).shared_memory_per_block_optin


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether the CUDA ``device`` multiplies fp8 on its tensor cores: compute capability 8.9 (Ada, Hopper and later),
    also the first where Triton has the fp8e4nv type."""
    return capability(device) >= (8, 9)


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of the CUDA ``device``, looked up once a device (``torch.cuda.get_device_capability``
    reads the device's properties on every call: the prefill op asked it on every call)."""
    return _capability(_index(device))


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _spec(value: Any) -> Any:
    """What Triton's specialization of a non-constexpr argument depends on (a conservative superset)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    kind = type(value)
    if kind is int:
        return ("i", value == 1, value % 16 == 0, _I32[0] <= value < _I32[1], value < 2 ** 63)
    if kind is bool:
        return ("b", value)
    if kind is float:
        return "f"
    if value is None:
        return None
    if hasattr(value, "block_shape"):  # triton.tools.tensor_descriptor.TensorDescriptor
        return ("d", value.base.dtype, *value.block_shape, value.padding, getattr(value, "round_f32_to_tf32", False),
                value.base.data_ptr() % 16 == 0, *[s % 16 == 0 for s in value.shape],
                *[s % 16 == 0 for s in value.strides])
    return ("v", kind, value)  # anything else by value (must be hashable; Triton would key it by value too)


_DESCRIPTOR: Optional[tuple] = None  # (triton's TensorDescriptor, its fields' defaults), at the first unchecked one


def unchecked_descriptor(base: torch.Tensor, shape: list, strides: list, block_shape: list) -> Any:
    """``TensorDescriptor(base, shape, strides, block_shape)`` (triton.tools.tensor_descriptor) without the checks
    its ``__post_init__`` runs (base and strides 16-byte aligned, the block shape's powers of 2, ...: 2-3 us a
    descriptor on CI's CPU, three a prefill call): for arguments the caller knows to pass them, because a checked
    descriptor of the same shape, strides and block passed them before and it checked the base's alignment itself.
    The other fields (padding; triton 3.9's ``round_f32_to_tf32``) take their defaults."""
    global _DESCRIPTOR
    if _DESCRIPTOR is None:
        import dataclasses

        from triton.tools.tensor_descriptor import TensorDescriptor

        _DESCRIPTOR = (TensorDescriptor, {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                                          if f.default is not dataclasses.MISSING})
    cls, defaults = _DESCRIPTOR
    desc = cls.__new__(cls)
    desc.__dict__.update(defaults, base=base, shape=shape, strides=strides, block_shape=block_shape)
    return desc


class Relaunch:
    """``Relaunch(kernel)[grid](*args, **kwargs)``: launches like ``kernel[grid](*args, **kwargs)``; after a launch
    key's first call, straight through its compiled kernel (module docstring)."""

    def __init__(self, fn: Any):
        self.fn = fn
        self._compiled: dict = {}
        self._params = None  # from the signature, at the first compiled launch (_signature)

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _signature(self):
        if self._params is None:
            params = self.fn.params
            constexprs = [p.num for p in params if p.is_constexpr]
            self._params = (
                {p.name: p.is_constexpr for p in params},  # constexpr?
                [(p.name, p.default if p.has_default else None) for p in params],
                constexprs[0] if constexprs else len(params),  # how many leading arguments are not constexprs
                frozenset(p.name for p in params if not p.is_constexpr),
            )
        return self._params

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        constexpr, _, leading, runtime = self._signature()
        if len(args) <= leading:  # the usual call: runtime arguments by position, constexprs and options by name
            key = (torch.cuda.current_device(), *map(_spec, args))
        else:
            key = (torch.cuda.current_device(),
                   *[value if constexpr[name] else _spec(value) for name, value in zip(self.fn.arg_names, args)])
        if kwargs.keys().isdisjoint(runtime):
            return (*key, *kwargs.items())
        return (*key, *[(name, _spec(value) if name in runtime else value) for name, value in kwargs.items()])

    def bound(self, args: tuple, kwargs: dict) -> Optional["Bound"]:
        """The compiled kernel that a launch with these arguments went to, bound to its constexpr values
        (``Bound``); None where no launch compiled one for their launch key yet, and under the interpreter."""
        if self._params is None:
            return None
        kernel = self._compiled.get(self._key(args, kwargs))
        if kernel is None:
            return None
        defaults = self._params[1]
        return Bound(kernel, tuple(kwargs[name] if name in kwargs else default
                                   for name, default in defaults[len(args):]))

    def _launch(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        key = None if self._params is None else self._key(args, kwargs)
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            if hasattr(kernel, "packed_metadata") and hasattr(kernel, "function"):  # a CompiledKernel
                self._compiled[key if key is not None else self._key(args, kwargs)] = kernel
            return
        defaults = self._params[1]
        grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)  # the runner indexes all 3
        kernel[grid](*args, *(kwargs[name] if name in kwargs else default for name, default in defaults[len(args):]))


class Bound:
    """One compiled kernel of a ``Relaunch`` with the values of its constexprs and options fixed
    (``Relaunch.bound``). ``bound[grid](*args)`` launches it on ``args``, its leading arguments (as many as at the
    bind), with no launch key computed: for a caller that keeps every call's arguments to the launch key it was
    bound at (their dtypes, 16-byte alignments, the ints' and the tensor descriptors' properties), the device
    current at the bind included. ``grid`` has three entries."""

    __slots__ = ("kernel", "tail")

    def __init__(self, kernel: Any, tail: tuple):
        self.kernel, self.tail = kernel, tail

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        run = self.kernel[grid]
        return lambda *args: run(*args, *self.tail)
