"""``Fp8Backend(direct_calls=True)`` (the default): Inductor's code calls fp8fx's ops as plain functions
(``fp8fx.ops.direct``, ``compat.direct_op_calls``) instead of through the dispatcher - the same kernels on the same
arguments, so the same bits; the report still names the GEMMs; profiles still show the ops; ``direct_calls=False`` and
graphs compiled outside fp8fx's backend keep ``torch.ops.fp8fx.*`` calls."""
import copy
import pickle

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import fp8fx
from fp8fx import ops


class GatedMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.gate, self.up = nn.Linear(64, 128, bias=False), nn.Linear(64, 128, bias=False)
        self.down = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        x = self.proj(x)
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _compiled(direct_calls: bool, **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GatedMlp().to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config())
    backend = fp8fx.Fp8Backend(direct_calls=direct_calls, **options)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(model, backend=backend), x)
    return out, "\n".join(code), backend


@pytest.mark.parametrize("fuse_mlp", [False, True])
def test_direct_calls_run_the_ops_kernels_with_the_same_bits(fuse_mlp):
    out, code, backend = _compiled(True, fuse_mlp=fuse_mlp)
    ref, ref_code, ref_backend = _compiled(False, fuse_mlp=fuse_mlp)
    assert torch.equal(out, ref)
    gemms = ["scaled_mm", "gated_mlp"] if fuse_mlp else ["scaled_mm"] * 4
    assert "from fp8fx.ops import direct as fp8fx_direct" in code
    for op in set(gemms):
        assert code.count(f"= fp8fx_direct.{op}(") == gemms.count(op), code
        assert f"torch.ops.fp8fx.{op}.default(" not in code.replace(f"'torch.ops.fp8fx.{op}.default'", "")
        assert ref_code.count(f"= torch.ops.fp8fx.{op}.default(") == gemms.count(op) and "fp8fx_direct" not in ref_code
    # the report reads the GEMM each site runs from the code, either way
    kernels = {s.fqn: s.kernel for s in backend.report.sites}
    assert kernels == {s.fqn: s.kernel for s in ref_backend.report.sites}
    assert set(kernels.values()) == {f"extern fp8fx.{op}" for op in gemms}, kernels


def test_every_op_has_a_direct_call_with_its_name_in_profiles():
    assert set(vars(ops.direct)) == {"quantize", "quantize_static", "dequantize", "scaled_mm", "scaled_mm_fused",
                                     "gated_mlp", "weight_only_mm", "fused_moe", "topk", "softmax_topk",
                                     "grouped_topk", "small_mm"}
    assert all(hasattr(torch.ops.fp8fx, name) for name in vars(ops.direct))
    assert set(ops._CUDA_FNS) == {"scaled_mm", "gated_mlp", "weight_only_mm", "fused_moe", "topk", "softmax_topk",
                                  "grouped_topk", "small_mm"}
    x = torch.randn(4, 64)
    q, s = ops.direct.quantize(x, [1, -1])
    q2, s2 = torch.ops.fp8fx.quantize(x, [1, -1])
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.direct.quantize(x, [1, -1])
    assert "fp8fx::quantize" in {e.name for e in prof.events()}
    with pytest.raises(ValueError, match="block"):  # the op's own checks run
        ops.direct.quantize(x, [0, 128])


def test_other_compilers_keep_the_op_calls():
    """After fp8fx's backend has compiled with direct calls, a graph compiled by plain Inductor calls the ops
    through the dispatcher (the codegen entries are fp8fx's only while its backend compiles)."""
    _compiled(True)
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(lambda x: torch.ops.fp8fx.quantize(x * 2, [1, -1])), torch.randn(4, 64))
    assert "torch.ops.fp8fx.quantize.default(" in "\n".join(code) and "fp8fx_direct" not in "\n".join(code)


def test_the_option_is_checked_and_keys_the_cache():
    with pytest.raises(ValueError, match="direct_calls='no'"):
        fp8fx.Fp8Backend(direct_calls="no")
    with pytest.raises(ValueError, match="compiler='eager'.*direct_calls"):
        fp8fx.Fp8Backend(compiler="eager", direct_calls=False)
    assert fp8fx.Fp8Backend(direct_calls=False).cache_key() != fp8fx.Fp8Backend().cache_key()


@pytest.mark.parametrize("name, value", [("direct_calls", False), ("one_pass_rows", 1024), ("lowering", "op"),
                                         ("compiler", "eager"), ("inductor_config", {"cpp_wrapper": True}),
                                         # the passes' options (h164: taken, and the passes never saw them)
                                         ("fuse_horizontal", True), ("fuse_mlp", True), ("use_fast_accum", False),
                                         ("weight_only", True), ("mlp_h_group", 32), ("fast_topk", False),
                                         ("fast_router", False), ("fuse_routing", False), ("cudagraphs", True)])
def test_options_read_at_compile_are_fixed(name, value):
    """The options the backend reads at each compile key Inductor's caches from the constructor's values: one set
    afterwards (``backend.direct_calls = False``) compiled otherwise under the old key, and a default backend of
    another process sharing the cache dir was served that code (a review's catch). They are read-only now, as is the
    Inductor config's mapping, and the refusal names the fix."""
    backend = fp8fx.Fp8Backend()
    before, key = getattr(backend, name), backend.cache_key()
    with pytest.raises(AttributeError, match=rf"Fp8Backend.{name} is fixed .* Fp8Backend\({name}="):
        setattr(backend, name, value)
    for change in (lambda c: c.__setitem__("cpp_wrapper", True), lambda c: c.update(cpp_wrapper=True)):
        with pytest.raises(TypeError, match=r"inductor_config is fixed .* Fp8Backend\(inductor_config="):
            change(backend.inductor_config)
    assert getattr(backend, name) == before and backend.inductor_config == {} and backend.cache_key() == key


def test_fixed_options_copy_pickle_and_answer_getattr():
    """The read-only options kept what a backend did before: pickle and copy of one with an Inductor config (pickle
    rebuilt the mapping item by item and was refused), and getattr with a default / hasattr on one whose __init__
    has not set them yet (a subclass's, which raised KeyError) - both a review's catch."""
    backend = fp8fx.Fp8Backend(cudagraphs=True, inductor_config={"max_autotune": False})
    for copied in (pickle.loads(pickle.dumps(backend)), copy.copy(backend.inductor_config),
                   copy.deepcopy(backend.inductor_config)):
        config = getattr(copied, "inductor_config", copied)
        assert config == {"max_autotune": False, "triton.cudagraphs": True}
        with pytest.raises(TypeError, match="inductor_config is fixed"):
            config["max_autotune"] = True
    bare = fp8fx.Fp8Backend.__new__(fp8fx.Fp8Backend)
    assert getattr(bare, "compiler", "unset") == "unset" and not hasattr(bare, "inductor_config")


def test_cpp_wrapper_code_calls_the_ops_as_before():
    """Inductor's C++ wrapper (``cpp_wrapper=True``) has no Python call to make: the ops run through the dispatcher
    there, with the same bits."""
    out, code, _ = _compiled(True, inductor_config={"cpp_wrapper": True})
    ref, _, _ = _compiled(False)
    assert torch.equal(out, ref) and "fp8fx_direct" not in code


def test_cuda_kernels_check_their_arguments_where_direct_calls_leave_that_to_the_trace():
    """The registered CUDA kernels of scaled_mm and gated_mlp check their arguments before anything else (here on
    CPU tensors, so the check is all that can run); ``direct`` calls the kernel function without them, for arguments
    whose dtypes and shapes the op's fake impl checked when the graph was traced (the same checks, same errors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(4, 64, dtype=torch.bfloat16)  # 16-bit where the fp8 codes belong
    w = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    s, row, bf16 = torch.ones(32, 1), [1, -1], torch.bfloat16
    cases = {"scaled_mm": (x, torch.ones(4, 1), w, s, None, row, row, bf16),
             "gated_mlp": (x, torch.ones(4, 1), w, s, w, s, w.t().contiguous(), torch.ones(64, 1), None, row, row,
                           row, row, None, "silu", bf16, bf16)}
    for name, args in cases.items():
        kernel = ops._OPS[name]._backend_fns["cuda"]
        with pytest.raises(ValueError, match=f"fp8fx.{name}: xq is torch.bfloat16"):
            kernel(*args)
        try:  # the function direct calls: past the checks (here it fails further on, at the CUDA launch)
            ops._CUDA_FNS[name](*args)
        except Exception as e:  # noqa: BLE001 - whatever it is, it is not the check's error
            assert f"fp8fx.{name}: xq is" not in str(e), e
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, \
                pytest.raises(ValueError, match=f"fp8fx.{name}: xq is torch.bfloat16"):
            getattr(torch.ops.fp8fx, name)(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
