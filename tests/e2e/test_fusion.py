"""Generated code on the GPU: activation quantization fused into its producer (issue: fused lowerings)."""
import os
import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import fp8fx
from benchmarks.bench_linear import MLP  # the block the benchmark times


class NormLinear(nn.Module):
    def __init__(self, dim=256, out=512):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.proj = nn.Linear(dim, out, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def triton_kernels(code: str) -> list[str]:
    """Source of each Triton kernel in Inductor's output code."""
    return re.findall(r"@triton\.jit\ndef (.*?)(?=\n'''|\n\"\"\")", code, flags=re.S)


def compiled_code(model, x, **options):
    fp8fx.quantize_(model)
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(model, backend=fp8fx.Fp8Backend(**options)), x)
    dump = os.environ.get("FP8FX_TEST_DUMP")  # where the device run collects generated code
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{type(model).__name__}.py"), "w") as f:
            f.write("\n# ----\n".join(code))
    return out, "\n".join(code)


@pytest.mark.cuda
def test_rmsnorm_and_quant_in_one_kernel():
    model = NormLinear().cuda().to(torch.bfloat16)
    _, code = compiled_code(model, torch.randn(64, 256, device="cuda", dtype=torch.bfloat16))
    kernels = triton_kernels(code)
    # one Triton kernel computes rsqrt (RMSNorm) and the fp8 cast (quantization), then the fp8 GEMM op
    fused = [k for k in kernels if "rsqrt" in k and "float8" in k]
    assert len(fused) == 1, f"{len(kernels)} kernels:\n" + "\n----\n".join(kernels)
    assert len(kernels) == 1
    assert code.count("= fp8fx_direct.scaled_mm(") == 1  # the op, called without the dispatcher (direct_calls)


@pytest.mark.cuda
def test_llama_mlp_kernel_count():
    model = MLP(256, 512).cuda().to(torch.bfloat16)
    _, code = compiled_code(model, torch.randn(64, 256, device="cuda", dtype=torch.bfloat16))
    kernels = triton_kernels(code)
    # x quantized once (shared by gate and up), silu*mul fused with the quantization of down's input
    # (Inductor writes silu as x / (1 + exp(-x)))
    assert len(kernels) == 2, f"{len(kernels)} kernels:\n" + "\n----\n".join(kernels)
    assert sum("exp(" in k and "float8" in k for k in kernels) == 1
    assert code.count("= fp8fx_direct.scaled_mm(") == 3


def kernels_inductor_vs_one_pass(m: int, hidden: int) -> tuple[list[str], list[str]]:
    """Names of the Triton kernels of the fp8fx MLP(1024, hidden) at M=m with Inductor's reduction
    heuristics (``one_pass_rows=None``) and with the default; asserts their outputs are equal."""
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    results = []
    for options in ({"one_pass_rows": None}, {}):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MLP(1024, hidden).cuda().to(torch.bfloat16)
        out, code = compiled_code(model, x, **options)
        results.append((out, [k.split("(")[0] for k in triton_kernels(code)]))
    (ref, inductor), (out, one_pass) = results
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the same arithmetic (a max is exact in any order)
    return inductor, one_pass


@pytest.mark.cuda
def test_llama_mlp_one_pass_quantization():
    """Fp8Backend(one_pass_rows=...) (default 16384): both activation quantizations (rows of 1024 and 4096)
    are one-pass (persistent) reductions; with Inductor's heuristic (None) the 4096-wide one is looped.
    Same kernel count, same output."""
    inductor, one_pass = kernels_inductor_vs_one_pass(64, 4096)
    assert sum(n.startswith("triton_red_") for n in inductor) == 1, inductor  # SiLU*mul + quant over 4096
    assert len(one_pass) == 2 and all(n.startswith("triton_per_") for n in one_pass), one_pass


@pytest.mark.cuda
def test_decode_row_quantization_is_not_split():
    """A decode step (M=1): Inductor splits the 14336-wide SiLU*mul + quantization of down's input into
    two reductions and a pointwise kernel (a row of over 8192 elements, fewer rows than SMs); with the
    default ``one_pass_rows`` it is one kernel. The same output."""
    inductor, one_pass = kernels_inductor_vs_one_pass(1, 14336)
    assert len(inductor) >= 3, inductor
    assert len(one_pass) == 2 and all(n.startswith("triton_per_") for n in one_pass), one_pass


class NormMLP(nn.Module):
    """RMSNorm -> Llama MLP: the decode step's MLP half."""

    def __init__(self, dim=256, hidden=512):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        return self.mlp(self.norm(x))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16])
def test_fused_mlp_decode_kernel_count(m):
    """Fp8Backend(fuse_mlp=True) at decode sizes (up to GATED_MAX_M tokens): RMSNorm and the quantization of x in
    one Triton kernel, then the gated MLP op (its two kernels) - no act * mul, no quantization of the
    intermediate, no unfused GEMM."""
    model = NormMLP().cuda().to(torch.bfloat16)
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x).float()
    out, code = compiled_code(model, x, fuse_mlp=True)
    kernels = triton_kernels(code)
    assert len(kernels) == 1 and "rsqrt" in kernels[0] and "float8" in kernels[0], "\n----\n".join(kernels)
    assert code.count("= fp8fx_direct.gated_mlp(") == 1 and "scaled_mm" not in code
    assert ((out.float() - want).norm() / want.norm()).item() < 0.08


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16])
def test_fused_mlp_of_static_gate_and_up_scales(m):
    """Written without a GPU (run 56): gate and up with static input scales of their own quantize x once, with the
    larger, in the gated MLP op (they were left unfused); against the unfused graph at that scale."""
    torch.manual_seed(0)
    model = NormMLP().cuda().to(torch.bfloat16)
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    scales = fp8fx.calibrate(model, [x])
    names = [n for n in scales if n.endswith(("gate_proj", "up_proj"))]
    scales[names[1]] *= 2
    same = {**scales, names[0]: scales[names[1]]}
    plain = NormMLP().cuda().to(torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    config = fp8fx.Fp8Config(activation_scheme="static")
    fp8fx.quantize_(plain, config, input_scales=same)
    fp8fx.quantize_(model, config, input_scales=scales)
    with torch.no_grad():
        want = torch.compile(plain, backend=fp8fx.Fp8Backend())(x).float()
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(fuse_mlp=True, mlp_h_group=None)  # (h per token, as the unfused graph's)
        out, code = run_and_get_code(torch.compile(model, backend=backend), x)
    assert "\n".join(code).count("= fp8fx_direct.gated_mlp(") == 1, "\n".join(code)
    assert all("gated MLP" in s.scheme and "not fused" not in s.scheme for s in backend.report.sites), backend.report
    assert ((out.float() - want).norm() / want.norm()).item() < 0.02
