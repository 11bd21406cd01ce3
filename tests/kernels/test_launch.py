"""``fp8fx.kernels.launch.Relaunch`` against a stand-in for a triton.jit function (CPU): which calls reach Triton's
own launch path, which go straight to the compiled kernel, and with what arguments. The GPU side (the prefill
kernels launched both ways give the same bits) is ``test_gated_mlp.py::test_relaunch_matches_triton_cuda``."""
import inspect
from types import SimpleNamespace

import pytest
import torch

from fp8fx.kernels.launch import Relaunch, cdiv, next_power_of_2

CONSTEXPR = "tl.constexpr"  # how the stand-in marks its constexpr parameters


class Compiled:
    """A CompiledKernel's launch surface: ``compiled[grid](*args)``."""

    def __init__(self, log):
        self.packed_metadata, self.function, self.log = (), object(), log

    def __getitem__(self, grid):
        assert len(grid) == 3, grid  # triton's runner reads grid[0], grid[1] and grid[2]
        return lambda *args: self.log.append(("direct", self, grid, args))


class Jit:
    """A triton.jit function's surface: ``params``, ``arg_names`` and ``fn[grid](*args, **kwargs)`` returning the
    compiled kernel (None under the interpreter)."""

    def __init__(self, interpreted=False):
        def kernel(x_ptr, n, scale, flag, FLAG: CONSTEXPR, BLOCK: CONSTEXPR = 8):
            pass
        self.params = [SimpleNamespace(name=p.name, num=i, is_constexpr="constexpr" in str(p.annotation),
                                       default=p.default, has_default=p.default is not inspect.Parameter.empty)
                       for i, p in enumerate(inspect.signature(kernel).parameters.values())]
        self.arg_names = [p.name for p in self.params]
        self.log, self.interpreted = [], interpreted

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            compiled = None if self.interpreted else Compiled(self.log)
            self.log.append(("triton", compiled, grid, args, kwargs))
            return compiled
        return run


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    device = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    return device


def test_second_call_goes_to_the_compiled_kernel_with_every_argument_in_order():
    fn = Jit()
    launch = Relaunch(fn)
    x = torch.zeros(64)
    launch[(4,)](x, 32, 0.5, True, FLAG=3, num_warps=4)
    launch[(5, 2)](x, 48, 0.25, True, FLAG=3, num_warps=4)
    (path1, compiled, grid1, args1, kwargs1), (path2, same, grid2, args2) = fn.log
    assert (path1, grid1, args1, kwargs1) == ("triton", (4,), (x, 32, 0.5, True), {"FLAG": 3, "num_warps": 4})
    # the same key (n a multiple of 16, not 1): no second compile; the constexprs by position, BLOCK's default too
    assert (path2, same, grid2, args2) == ("direct", compiled, (5, 2, 1), (x, 48, 0.25, True, 3, 8))


def _key_changes():
    x = torch.zeros(64)
    base = ((x, 32, 0.5, True), {"FLAG": 3, "num_warps": 4})
    yield "n equal to 1", ((x, 1, 0.5, True), base[1])
    yield "n not a multiple of 16", ((x, 33, 0.5, True), base[1])
    yield "n past int32", ((x, 2 ** 31 + 16, 0.5, True), base[1])
    yield "x not 16-byte aligned", ((x[1:], 32, 0.5, True), base[1])
    yield "x's dtype", ((x.double(), 32, 0.5, True), base[1])
    yield "a bool's value", ((x, 32, 0.5, False), base[1])
    yield "a constexpr's value", (base[0], {"FLAG": 4, "num_warps": 4})
    yield "a default constexpr given", (base[0], {**base[1], "BLOCK": 16})
    yield "a compile option", (base[0], {"FLAG": 3, "num_warps": 8})


@pytest.mark.parametrize("change", ["n equal to 1", "n not a multiple of 16", "n past int32", "x not 16-byte aligned",
                                    "x's dtype", "a bool's value", "a constexpr's value", "a default constexpr given",
                                    "a compile option", "the device"])
def test_what_triton_specializes_on_compiles_again(one_device, change):
    fn = Jit()
    launch = Relaunch(fn)
    x = torch.zeros(64)
    launch[(1,)](x, 32, 0.5, True, FLAG=3, num_warps=4)
    if change == "the device":
        one_device[0] = 1
        args, kwargs = (x, 32, 0.5, True), {"FLAG": 3, "num_warps": 4}
    else:
        args, kwargs = dict(_key_changes())[change]
    launch[(1,)](*args, **kwargs)
    assert [e[0] for e in fn.log] == ["triton", "triton"], change
    launch[(1,)](*args, **kwargs)  # and that key's kernel is kept
    assert fn.log[-1][0] == "direct" and fn.log[-1][1] is fn.log[1][1], change


def test_tensor_descriptors_key_on_dtype_block_and_divisibility():
    fn = Jit()
    launch = Relaunch(fn)

    def desc(t, shape, block):
        return SimpleNamespace(base=t, shape=shape, strides=[shape[1], 1], block_shape=block, padding="zero")
    a = torch.zeros(64, 64)
    launch[(1,)](desc(a, [64, 64], [16, 16]), 32, 0.5, True, FLAG=0)
    launch[(1,)](desc(a, [32, 64], [16, 16]), 32, 0.5, True, FLAG=0)  # another shape, same divisibility
    launch[(1,)](desc(a, [40, 64], [16, 16]), 32, 0.5, True, FLAG=0)  # a row count not a multiple of 16
    launch[(1,)](desc(a, [64, 64], [32, 16]), 32, 0.5, True, FLAG=0)  # another block
    launch[(1,)](desc(a.half(), [64, 64], [16, 16]), 32, 0.5, True, FLAG=0)  # another dtype
    assert [e[0] for e in fn.log] == ["triton", "direct", "triton", "triton", "triton"]


def test_the_interpreter_always_takes_tritons_path():
    fn = Jit(interpreted=True)
    launch = Relaunch(fn)
    for _ in range(3):
        launch[(2,)](torch.zeros(4), 32, 0.5, True, FLAG=1)
    assert [e[0] for e in fn.log] == ["triton"] * 3


def test_arguments_by_position_or_by_name_key_as_triton_binds_them():
    """A constexpr given by position keys on its value; a runtime argument given by name on its specialization."""
    fn = Jit()
    launch = Relaunch(fn)
    x = torch.zeros(64)
    launch[(1,)](x, 32, 0.5, True, 3)  # FLAG by position
    launch[(1,)](x, 32, 0.5, True, 4)  # another FLAG: compiled anew
    launch[(1,)](x, 48, 0.5, True, 4)  # n by position, same specialization: reused
    launch[(1,)](x, 32, 0.5, flag=True, FLAG=4)  # flag by name
    launch[(1,)](x, 32, 0.5, flag=True, FLAG=4)
    launch[(1,)](x, 32, 0.25, flag=True, FLAG=4)  # a float's value is not specialized on
    assert [e[0] for e in fn.log] == ["triton", "triton", "direct", "triton", "direct", "direct"]
    assert fn.log[2][3] == (x, 48, 0.5, True, 4, 8) and fn.log[5][3] == (x, 32, 0.25, True, 4, 8)


def test_host_arithmetic_is_tritons():
    """``cdiv`` and ``next_power_of_2`` (plain ints, for the host) give ``triton.cdiv``'s and
    ``triton.next_power_of_2``'s values."""
    import triton

    values = [0, 1, 2, 3, 15, 16, 17, 127, 128, 129, 4095, 4096, 14336, 2 ** 31 - 1, 2 ** 31, 2 ** 40 + 3]
    for a in values:
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 7, 16, 128, 512):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_sm_count_is_looked_up_once_a_device(monkeypatch):
    """``sm_count`` asks ``torch.cuda.get_device_properties`` once per device index (the device's own index, or the
    current device's for a bare "cuda"), then answers from its cache."""
    from types import SimpleNamespace

    from fp8fx.kernels import launch

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: asked.append(index) or SimpleNamespace(multi_processor_count=100 + index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    launch._properties.cache_clear()
    try:
        counts = [launch.sm_count(torch.device(d)) for d in ("cuda:0", "cuda:1", "cuda:0", "cuda", "cuda:1")]
        assert counts == [100, 101, 100, 101, 101] and asked == [0, 1]
    finally:
        launch._properties.cache_clear()  # (the fake counts must not outlive the test)


def test_capability_is_looked_up_once_a_device(monkeypatch):
    """``capability`` asks ``torch.cuda.get_device_capability`` once per device index, as ``sm_count`` does."""
    from fp8fx.kernels import launch

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    launch._capability.cache_clear()
    try:
        got = [launch.capability(torch.device(d)) for d in ("cuda:0", "cuda", "cuda:0", "cuda:1")]
        assert got == [(9, 0), (9, 1), (9, 0), (9, 1)] and asked == [0, 1]
    finally:
        launch._capability.cache_clear()


def test_bound_launches_the_keys_compiled_kernel_with_its_constexprs():
    """``Relaunch.bound``: None before a launch compiled the key's kernel and for another key; after, that kernel,
    launched on the leading arguments with the constexprs' values of the bind (defaults included) appended, as
    ``Relaunch`` launches it."""
    fn = Jit()
    launch = Relaunch(fn)
    x = torch.zeros(64)
    args, kwargs = (x, 32, 0.5, True), {"FLAG": 3, "num_warps": 4}
    assert launch.bound(args, kwargs) is None
    launch[(4,)](*args, **kwargs)
    assert launch.bound((x, 33, 0.5, True), kwargs) is None  # n not a multiple of 16: another key
    assert launch.bound(args, {"FLAG": 4, "num_warps": 4}) is None
    bound = launch.bound(args, kwargs)
    compiled = fn.log[0][1]
    assert bound.kernel is compiled and bound.tail == (3, 8)
    y = torch.zeros(64)
    bound[(2, 3, 1)](y, 48, 0.25, False)
    assert fn.log[-1] == ("direct", compiled, (2, 3, 1), (y, 48, 0.25, False, 3, 8))
    assert Relaunch(Jit(interpreted=True)).bound(args, kwargs) is None


def test_unchecked_descriptor_is_tritons_descriptor():
    """``unchecked_descriptor`` builds the ``TensorDescriptor`` Triton's constructor builds from the same arguments
    (every field, the defaults of the ones it is not given included), without its checks."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp8fx.kernels.launch import unchecked_descriptor

    t = torch.zeros(64, 48, dtype=torch.bfloat16)
    for shape, strides, block in (([64, 48], [48, 1], [16, 16]), ([2, 16, 48], [768, 48, 1], [2, 16, 32])):
        checked, unchecked = TensorDescriptor(t, shape, strides, block), unchecked_descriptor(t, shape, strides, block)
        assert type(unchecked) is TensorDescriptor and vars(unchecked) == vars(checked)
    with pytest.raises(AssertionError):
        TensorDescriptor(t[:, 1:], [64, 47], [48, 1], [16, 16])  # (what the checks would have said)
    assert unchecked_descriptor(t[:, 1:], [64, 47], [48, 1], [16, 16]).shape == [64, 47]
