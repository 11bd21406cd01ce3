"""A tiny random HF Llama through Fp8Backend: every projection but lm_head rewritten, logits close."""
import pytest
import torch

import fp8fx
from tests.conftest import rel_err

transformers = pytest.importorskip("transformers")

PROJECTIONS = tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")) + tuple(
    f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
)


def tiny_llama(device="cpu", layers=2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # k/v_proj: 128 outputs, every linear divisible by 128
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()


def expected_sites(layers):
    return {f"model.layers.{i}.{p}" for i in range(layers) for p in PROJECTIONS}


def run_llama(config, device, input_scales=None, compiler="inductor", **backend_options):
    model = tiny_llama(device)
    ids = torch.randint(0, 512, (2, 16), device=device)
    with torch.no_grad():
        ref = model(ids).logits.float()
        if config.activation_scheme == "static" and input_scales is None:
            input_scales = fp8fx.calibrate(model, [ids], config)
        fp8fx.quantize_(model, config, input_scales=input_scales)
        backend = fp8fx.Fp8Backend(compiler=compiler, **backend_options)
        out = torch.compile(model, backend=backend)(ids).logits.float()
    return backend.report, out, ref


CPU_CONFIGS = {
    "per-channel": fp8fx.Fp8Config(ignored_layers=["lm_head"]),
    "block": fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_block_size=[128, 128]),
}


@pytest.mark.parametrize("name", list(CPU_CONFIGS))
def test_tiny_llama_cpu(name):
    report, out, ref = run_llama(CPU_CONFIGS[name], "cpu")
    rewritten = {s.fqn for s in report.rewritten}
    assert rewritten == expected_sites(2)
    skipped = {s.fqn: s.reason for s in report.skipped}
    assert skipped == {"lm_head": "not quantized: in ignored_layers"}
    assert rel_err(out, ref) < 0.1


GPU_CONFIGS = {
    "per-tensor": fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_granularity=fp8fx.PerTensor(),
                                  activation_granularity=fp8fx.PerTensor()),
    "per-channel": fp8fx.Fp8Config(ignored_layers=["lm_head"]),
    "block": fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_block_size=[128, 128]),
    "static": fp8fx.Fp8Config(ignored_layers=["lm_head"], activation_scheme="static"),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_tiny_llama_cuda(name):
    report, out, ref = run_llama(GPU_CONFIGS[name], "cuda")
    assert {s.fqn for s in report.rewritten} == expected_sites(2)
    assert rel_err(out, ref) < 0.1


@pytest.mark.cuda
def test_static_scales_set_by_the_test_are_used():
    """Static activations with scales the test picks: right scales stay close, scales 1000x too small
    saturate every activation and must visibly break the logits (so the input_scale is really used)."""
    model = tiny_llama("cuda")
    config = GPU_CONFIGS["static"]
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    with torch.no_grad():
        good = fp8fx.calibrate(model, [ids], config)
    bad = {k: v / 1000 for k, v in good.items()}
    _, out_good, ref = run_llama(config, "cuda", input_scales=good)
    torch._dynamo.reset()
    _, out_bad, _ = run_llama(config, "cuda", input_scales=bad)
    assert rel_err(out_good, ref) < 0.1
    assert rel_err(out_bad, ref) > 0.3


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["per-channel", "block"])
def test_tiny_llama_cuda_weight_only(name):
    """The weight-only fallback forced on the H200 (what a GPU without fp8 tensor cores runs)."""
    report, out, ref = run_llama(GPU_CONFIGS[name], "cuda", weight_only=True)
    assert {s.fqn for s in report.rewritten} == expected_sites(2)
    assert all(s.scheme.endswith("(weight-only)") for s in report.rewritten)
    assert rel_err(out, ref) < 0.1


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["per-tensor", "per-channel", "block"])
def test_tiny_llama_cuda_fused_qkv_gate_up(name):
    report, out, ref = run_llama(GPU_CONFIGS[name], "cuda", fuse_horizontal=True)
    assert {s.fqn for s in report.rewritten} == expected_sites(2)
    assert sum("fused(" in s.scheme for s in report.rewritten) == 10  # q/k/v + gate/up, 2 layers
    assert rel_err(out, ref) < 0.1


@pytest.mark.cuda
def test_tiny_llama_cuda_graphs_decode():
    """Fp8Backend(cudagraphs=True): decode-sized calls replay CUDA graphs and give what the plain
    compiled model gives (no host sync in the compiled path, or capture would fail)."""
    model = tiny_llama("cuda")
    fp8fx.quantize_(model, GPU_CONFIGS["per-channel"])
    ids = torch.randint(0, 512, (2, 1), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        plain = torch.compile(model, backend=fp8fx.Fp8Backend())(ids).logits.float()
        torch._dynamo.reset()
        graphed = torch.compile(model, backend=fp8fx.Fp8Backend(cudagraphs=True))
        for _ in range(3):  # warm-up, record, replay
            out = graphed(ids).logits.float()
    assert rel_err(out, plain) < 1e-2
