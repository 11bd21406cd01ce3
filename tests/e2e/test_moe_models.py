"""Tiny random HF MoE models (transformers 5) through Fp8Backend on CPU: every experts module rewritten into
fp8fx.fused_moe, one graph (fullgraph), logits close to the bf16 model's."""
import logging

import pytest
import safetensors
import torch

import fp8fx
import fp8fx.testing
from fp8fx.passes import MoePass, PassManager
from fp8fx.report import Report
from tests.conftest import rel_err

transformers = pytest.importorskip("transformers")

LAYERS = 2
COMMON = dict(vocab_size=512, hidden_size=256, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=512, moe_intermediate_size=128, head_dim=64, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    # MLA has no grouped KV heads: its k / v have num_attention_heads heads (as DeepSeek-V3's
                    # config says: 128 and 128); transformers repeats them by heads // kv_heads when the mask
                    # is materialized (5.17 under torch.compile), which a smaller num_key_value_heads breaks
                    dict(num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8,
                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1,
                         q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64)),
}


def tiny(name, impl):
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra})).to(torch.bfloat16).eval()
    model.set_experts_implementation(impl)
    with torch.no_grad():  # decisive routers: tiny random routers are near-ties that any rounding upstream flips
        for i in range(LAYERS):
            model.model.layers[i].mlp.gate.weight.mul_(10)
    return model


def run(model, backend):
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
        eager = model(ids).logits.float()  # fp8 weights, dequantized: the model's own code
        out = torch.compile(model, backend=backend, fullgraph=True)(ids).logits.float()  # fullgraph: no break
    return out, eager, ref


EXPERTS = {f"model.layers.{i}.mlp.experts" for i in range(LAYERS)}


def moe_only(report):
    """A torch.compile backend running the MoE pass alone (into ``report``), and no compiler."""
    def backend(gm, example_inputs):
        PassManager([MoePass()], {}).run(gm, example_inputs, report)
        return gm.forward

    return backend


@pytest.mark.parametrize("name,impl,compiler", [
    ("mixtral", "grouped_mm", "inductor"),
    ("qwen3_moe", "batched_mm", "eager"),
])
def test_tiny_moe_model(name, impl, compiler):
    model = tiny(name, impl)
    backend = fp8fx.Fp8Backend(compiler=compiler)
    out, eager, ref = run(model, backend)
    assert {s.fqn for s in backend.report.sites if s.kind == "moe"} == EXPERTS
    fp8fx.testing.assert_rewritten(backend, "model.layers.*.mlp.experts", "model.layers.*.self_attn.*")
    assert not [n for n, *_ in backend.report.unhandled_weights(model) if "experts" in n]
    # fp8 everywhere but lm_head and the routers, random weights: measured 0.05-0.06 (CPU, torch 2.13)
    assert rel_err(out, ref) < 0.1


def test_tiny_deepseek_v3_experts():
    """The MoE pass alone: the experts in fp8 against the same fp8 weights run by the model's own code,
    and against bf16 (the whole backend: the next test)."""
    model = tiny("deepseek_v3", "grouped_mm")
    report = Report()
    out, eager, ref = run(model, moe_only(report))
    assert {s.fqn for s in report.sites if s.rewritten} == EXPERTS and len(report.sites) == LAYERS
    assert rel_err(out, eager) < 0.05  # measured 0.031: activation quantization of the experts
    assert rel_err(out, ref) < 0.1  # measured 0.075


def test_tiny_deepseek_v3_whole_backend():
    """Every pass on DeepSeek-V3, whose graph holds in-place copy_ / scatter_ nodes nobody reads (a
    graph-wide dead-code elimination in the linear pass once dropped them: NaN logits)."""
    model = tiny("deepseek_v3", "grouped_mm")
    out, eager, ref = run(model, fp8fx.Fp8Backend(compiler="eager"))
    assert rel_err(out, ref) < 0.1


def test_every_experts_module_rewritten_after_a_shape_change():
    """The recompile after a new shape is symbolic: Dynamo computes the token count once, inside the first experts
    module, and every later layer reads it; counted as a second output of that module's region, it left layer 0's
    experts unrewritten in every recompiled graph (and with dynamic=True from the start)."""
    model = tiny("mixtral", "grouped_mm")
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    backend = fp8fx.Fp8Backend(compiler="eager")
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled(ids)
        out = compiled(ids[:1, :5]).logits.float()  # the second shape: a symbolic graph
        eager = model(ids[:1, :5]).logits.float()
    assert backend.report.graphs == 2
    moe = [s for s in backend.report.sites if s.kind == "moe" and s.graph == 1]
    assert {s.fqn for s in moe if s.rewritten} == EXPERTS, [(s.fqn, s.reason) for s in moe]
    assert rel_err(out, eager) < 0.08  # measured 0.051 against the fp8 weights run eagerly: activation quantization


def test_every_experts_module_rewritten_with_dynamic_shapes():
    """dynamic=True on Qwen3-MoE: Dynamo computes the token count in two steps (2 * s0, then * s1) inside layer 0's
    experts; the second step read the first, so only it was taken out of the region and layer 0 stayed bf16."""
    model = tiny("qwen3_moe", "grouped_mm")
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    backend = fp8fx.Fp8Backend(compiler="eager")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=True)(ids).logits.float()
        eager = model(ids).logits.float()
    moe = [s for s in backend.report.sites if s.kind == "moe"]
    assert moe and all(s.rewritten for s in moe), [(s.fqn, s.reason) for s in moe]
    assert rel_err(out, eager) < 0.08


def test_static_moe_from_calibrate(tmp_path):
    """activation_scheme='static' on a MoE model: calibrate measures each experts module's two inputs (the tokens
    routed to it; act(gate) * up of each expert), quantize_ gives them to the experts (they stayed bf16 before:
    'quantize_ cannot calibrate them'), the MoE pass runs them with static scales, and a checkpoint keeps them."""
    from fp8fx.checkpoint import load_checkpoint, meta_model, save_checkpoint
    from fp8fx.weights.moe import experts_scheme
    from tests.unit.test_checkpoint_save import assert_same_state

    cfg = fp8fx.Fp8Config(activation_scheme="static", ignored_layers=["lm_head"])
    batches = [torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(s))
               for s, shape in ((0, (2, 12)), (1, (1, 7)))]
    model = tiny("mixtral", "grouped_mm")
    seen = {f: [] for f in EXPERTS}  # what reaches each experts module, for a float64 check of the scales
    hooks = [model.get_submodule(f).register_forward_pre_hook(lambda m, a, f=f: seen[f].append(a[:2])) for f in EXPERTS]
    scales = fp8fx.calibrate(model, batches, cfg)
    for h in hooks:
        h.remove()
    for fqn in sorted(EXPERTS):
        experts = model.get_submodule(fqn)
        a13 = a2 = 0.0
        for x, ids in seen[fqn]:
            for e in ids.unique().tolist():
                xe = x[(ids == e).any(-1)].double()
                gate, up = (xe @ experts.gate_up_proj[e].double().t()).chunk(2, dim=-1)
                a13 = max(a13, xe.abs().max().item())
                a2 = max(a2, (torch.nn.functional.silu(gate) * up).abs().max().item())
        assert scales[f"{fqn}.gate_up_proj"] == pytest.approx(a13 / 448, rel=1e-6)
        assert scales[f"{fqn}.down_proj"] == pytest.approx(a2 / 448, rel=0.02)  # the model computes h in bf16
    with torch.no_grad():
        ref = model(batches[0]).logits.float()

    missing = {k: v for k, v in scales.items() if k != "model.layers.1.mlp.experts.down_proj"}
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.experts.down_proj'\]"):
        fp8fx.quantize_(model, cfg, input_scales=missing)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16  # nothing was quantized

    def logits(scales):
        m = tiny("mixtral", "grouped_mm")
        fp8fx.quantize_(m, cfg, input_scales=scales)
        backend = fp8fx.Fp8Backend(compiler="eager")
        with torch.no_grad():
            out = torch.compile(m, backend=backend, fullgraph=True)(batches[0]).logits.float()
        torch._dynamo.reset()
        return m, backend.report, out

    quantized, report, out = logits(scales)
    moe = [s for s in report.sites if s.kind == "moe"]
    assert {s.fqn for s in moe if s.rewritten} == EXPERTS and all("a:static per-tensor" in s.scheme for s in moe)
    assert rel_err(out, ref) < 0.1  # measured 0.067 (dynamic activations: 0.05-0.06)
    # down_proj's input scale 30x too small in one layer: h saturates, the bound breaks (measured 0.18)
    key = "model.layers.0.mlp.experts.down_proj"
    assert rel_err(logits({**scales, key: scales[key] / 30})[2], ref) > 0.1

    save_checkpoint(quantized, tmp_path / "fp8")
    again = meta_model(tmp_path / "fp8")
    load_checkpoint(again, tmp_path / "fp8", progress=False)
    assert_same_state(quantized, again)
    assert all(experts_scheme(again.get_submodule(f)).static_activation for f in EXPERTS)


@pytest.mark.cuda
def test_static_moe_from_calibrate_cuda():
    """The same on the GPU through Inductor: the experts run in fp8fx's fused MoE kernel with the calibrated
    static scales (a13 / a2), within the CPU run's bound of the bf16 model."""
    cfg = fp8fx.Fp8Config(activation_scheme="static", ignored_layers=["lm_head"])
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
    model = tiny("mixtral", "grouped_mm").cuda()
    with torch.no_grad():
        ref = model(ids).logits.float()
    fp8fx.quantize_(model, cfg, input_scales=fp8fx.calibrate(model, [ids], cfg))
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(ids).logits.float()
    moe = [s for s in backend.report.sites if s.kind == "moe"]
    assert {s.fqn for s in moe if s.rewritten} == EXPERTS and all("a:static per-tensor" in s.scheme for s in moe)
    assert rel_err(out, ref) < 0.1


def test_experts_of_a_layout_fp8fx_does_not_read_are_said_and_their_router_kept(caplog, tmp_path):
    """DBRX holds its experts as 2-D ``mlp.w1`` / ``v1`` / ``w2`` [E * I, H], which no fp8fx path reads: they stayed
    bf16 in silence (no log line, no load report row), and the router beside them, found only next to experts modules
    fp8fx reads, was quantized to fp8 (vLLM keeps routers in high precision: fp8 logits flip top-k choices)."""
    import logging

    config = transformers.DbrxConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_seq_len=64,
                                     attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                     ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 8, "moe_top_k": 2})
    torch.manual_seed(0)
    model = transformers.DbrxForCausalLM(config).to(torch.bfloat16).eval()
    routers = {f"transformer.blocks.{i}.ffn.router.layer" for i in range(2)}
    experts = {f"transformer.blocks.{i}.ffn.experts" for i in range(2)}
    assert set(fp8fx.weights.moe.routers(model)) == routers
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    assert all(model.get_submodule(r).weight.dtype == torch.bfloat16 for r in routers)
    assert ("quantize_ left 2 modules in high precision (['transformer.blocks.0.ffn.experts', "
            "'transformer.blocks.1.ffn.experts']): DbrxExperts holds its 8 experts as mlp.w1, mlp.v1, mlp.w2, a "
            "layout fp8fx does not read: left in high precision") in caplog.text
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randint(0, 256, (2, 10)))
    sites = {s.fqn: s for s in backend.report.sites}
    assert all(not sites[r].rewritten and "routes tokens to" in sites[r].reason for r in routers)
    # a bf16 checkpoint of it: the load report says so too
    transformers.DbrxForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    report = fp8fx.load_checkpoint(fp8fx.checkpoint.meta_model(tmp_path), tmp_path, progress=False)
    assert all(report.not_quantized[e].startswith("DbrxExperts holds its 8 experts as mlp.w1") for e in experts)
    assert all("routes tokens to" in report.not_quantized[r] for r in routers)


def test_every_block_of_a_reused_frame_is_reported_under_its_own_names():
    """HF's per-expert loop (experts_implementation='eager') breaks the graph inside the experts' forward; Dynamo
    runs the graphs of layer 0's blocks for layer 1. Layer 1's experts were in no site (their fp8 weights listed as
    unhandled: the resumed graphs inside the experts' forward were no frames of the report), and layer 1's router
    said it routes tokens to layer 0's experts (the first module's reason, copied). Each layer's router top-k is in
    the report's top-k list under its full name (it was once, as "gate": the frame's path)."""
    model = tiny("mixtral", "eager")
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    backend = fp8fx.Fp8Backend(compiler="eager")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids)
    sites = backend.report.sites
    moe_sites = [s for s in sites if s.kind == "moe"]
    assert {s.fqn for s in moe_sites} == EXPERTS and not any(s.rewritten for s in moe_sites)
    for i in range(LAYERS):
        [router] = {s.reason for s in sites if s.fqn == f"model.layers.{i}.mlp.gate"}
        assert f"routes tokens to model.layers.{i}.mlp.experts " in router
    assert not [w for w in backend.report.unhandled_weights(model) if ".experts." in w[0]]
    topk = [(s.fqn, s.scheme, s.graph) for s in backend.report.topk]
    graph = topk[0][2]
    assert topk == [(f"model.layers.{i}.mlp.gate", "k=2 of 8 with its softmax, renormalized, float32", graph)
                    for i in range(LAYERS)], topk


def tiny_llama4(top_k=1):
    config = transformers.Llama4TextConfig(
        **{**COMMON, "num_hidden_layers": LAYERS}, head_dim=64, intermediate_size=128, intermediate_size_mlp=256,
        num_local_experts=4, num_experts_per_tok=top_k, interleave_moe_layer_step=1, max_position_embeddings=64,
        attention_chunk_size=32, no_rope_layers=[1] * LAYERS)
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for i in range(LAYERS):  # decisive routers (as tiny() does)
            model.model.layers[i].feed_forward.router.weight.mul_(10)
    return model


LLAMA4_EXPERTS = {f"model.layers.{i}.feed_forward.experts" for i in range(LAYERS)}


@pytest.mark.parametrize("top_k", [1, 2])
def test_tiny_llama4_experts_in_fp8(top_k):
    """Llama-4's experts ([E, H, 2I] / [E, I, H], every expert run on every token with the router's weights on the
    rows) were left bf16: they are quantized, and its dense experts code becomes one fused_moe in every layer."""
    model = tiny_llama4(top_k)
    report = Report()
    out, eager, ref = run(model, moe_only(report))
    assert {s.fqn for s in report.sites if s.rewritten} == LLAMA4_EXPERTS and len(report.sites) == LAYERS
    assert all(s.scheme.endswith(fp8fx.passes.moe.ROUTED) for s in report.sites)
    assert rel_err(out, eager) < 0.05  # measured 0.010 / 0.011 (top 1 / 2): activation quantization of the experts
    assert rel_err(eager, ref) < 0.1  # measured 0.062 / 0.060: fp8 weights, run by the model's own code
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        whole = torch.compile(model, backend=backend, fullgraph=True)(
            torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))).logits.float()
    fp8fx.testing.assert_rewritten(backend, "model.layers.*.feed_forward.experts", "model.layers.*.self_attn.*")
    assert not [n for n, *_ in backend.report.unhandled_weights(model) if "experts" in n]
    assert rel_err(whole, ref) < 0.12  # measured 0.087 / 0.079 (CPU, torch 2.13): every linear and the experts in fp8


def test_tiny_llama4_checkpoints(tmp_path, caplog):
    """Llama-4's hub checkpoints hold its experts fused in its own layout ([E, H, 2I]): load_checkpoint quantizes them
    online, and convert offline, into what quantize_ makes; save_checkpoint writes fused_moe's layout, which loads
    back bit for bit."""
    model = tiny_llama4()
    model.save_pretrained(tmp_path / "bf16")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "bf16")
    report = fp8fx.load_checkpoint(loaded, tmp_path / "bf16", fp8fx.Fp8Config(ignored_layers=["lm_head"]),
                                   progress=False)
    assert not report.not_quantized.keys() & LLAMA4_EXPERTS
    fp8fx.checkpoint.save.convert(tmp_path / "bf16", tmp_path / "converted", progress=False)  # tensor by tensor
    # (as save_checkpoint says it: its docstring promised the source's layout, silently broken; a probe's catch)
    assert "convert writes the fp8 experts of ['model.layers.0.feed_forward.experts', " in caplog.text
    converted = fp8fx.checkpoint.meta_model(tmp_path / "converted")
    fp8fx.load_checkpoint(converted, tmp_path / "converted", progress=False)
    fp8fx.save_checkpoint(model, tmp_path / "fp8")
    assert "writes the fp8 experts of ['model.layers.0.feed_forward.experts', " in caplog.text
    assert "fused in fused_moe's layout, [E, 2I, H] / [E, H, I], not the model's transposed" in caplog.text
    again = fp8fx.checkpoint.meta_model(tmp_path / "fp8")
    fp8fx.load_checkpoint(again, tmp_path / "fp8", progress=False)
    for fqn in LLAMA4_EXPERTS:
        state = model.get_submodule(fqn).state_dict()
        assert state["gate_up_proj"].dtype == torch.float8_e4m3fn and state["gate_up_proj"].shape == (4, 256, 256)
        for other in (loaded, again, converted):
            for name, t in other.get_submodule(fqn).state_dict().items():
                assert torch.equal(t.view(torch.uint8), state[name].view(torch.uint8)), (fqn, name)
    with torch.no_grad():  # (the meta-built models' rotary tables are computed in bf16: not the built model's bits)
        out = loaded(ids).logits.float()
        assert torch.equal(again(ids).logits.float(), out)
    assert rel_err(out, ref) < 0.1


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["per-channel", "static"])
def test_tiny_llama4_experts_in_fp8_cuda(scheme):
    """Llama-4's dense experts on the GPU through Inductor: fp8fx's fused MoE kernels over E * T rows, most of them
    zero (the tokens the router sent elsewhere), within the CPU run's bound of the bf16 model and, per layer, of the
    fp8 weights run by the model's own code; static: calibrate measures the dense rows."""
    model = tiny_llama4(2).cuda()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
    cfg = fp8fx.Fp8Config(ignored_layers=["lm_head"], **({"activation_scheme": "static"} if scheme == "static" else {}))
    with torch.no_grad():
        ref = model(ids).logits.float()
        scales = fp8fx.calibrate(model, [ids], cfg) if scheme == "static" else None
        fp8fx.quantize_(model, cfg, input_scales=scales)
        eager = model(ids).logits.float()
        backend = fp8fx.Fp8Backend()
        out = torch.compile(model, backend=backend)(ids).logits.float()
    moe = [s for s in backend.report.sites if s.kind == "moe"]
    assert {s.fqn for s in moe if s.rewritten} == LLAMA4_EXPERTS, [(s.fqn, s.reason) for s in moe]
    assert all(s.kernel == "extern fp8fx.fused_moe" for s in moe), [s.kernel for s in moe]
    # the whole model's activation quantization: CPU 0.054 (both schemes), H200 0.052 (per-token)
    assert rel_err(out, eager) < 0.08
    assert rel_err(out, ref) < 0.1


def tiny_gpt_oss(impl="grouped_mm"):
    """A tiny random GPT-OSS: biases of a size that matters, decisive routers (as tiny() does)."""
    config = transformers.GptOssConfig(**COMMON, head_dim=64, intermediate_size=128, num_local_experts=8,
                                       num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16).eval()
    model.set_experts_implementation(impl)
    with torch.no_grad():
        for i in range(LAYERS):
            mlp = model.model.layers[i].mlp
            mlp.router.weight.mul_(10)
            mlp.experts.gate_up_proj.normal_(0, 0.1)  # (HF's init: 0.02, which hides the clamps)
            mlp.experts.down_proj.normal_(0, 0.1)
            mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            mlp.experts.down_proj_bias.normal_(0, 0.5)
    return model


def test_experts_whose_scales_alone_require_grad_stay_unfused():
    """Only the experts' scales require grad (set so by hand, or model.requires_grad_() with the embeddings frozen):
    the MoE pass looked at the hidden states and routing weights, rewrote the experts into fused_moe, and the
    backward failed ("no autograd formula" for fp8fx.fused_moe). They stay on the dequantized weights, reported, and
    the scales take their gradients."""
    model = tiny("qwen3_moe", "grouped_mm")
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    model.requires_grad_(False)
    scales = [p for n, p in model.named_parameters() if "experts" in n and n.endswith("_scale")]
    for p in scales:
        p.requires_grad_()
    backend = fp8fx.Fp8Backend(compiler="eager")
    torch.compile(model, backend=backend)(torch.randint(0, 512, (2, 6))).logits.float().square().sum().backward()
    experts = [s for s in backend.report.sites if s.kind == "moe"]
    assert experts and not any(s.rewritten for s in experts)
    assert all("expert scales require grad" in s.reason for s in experts), experts[0].reason
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in scales)


def gpt_oss_exact(mlp, x: torch.Tensor, activation: str = "swiglu_oai") -> torch.Tensor:
    """GPT-OSS's MLP block in float64 from its bf16 weights, written out (interleaved rows, biases, the clamped
    SwiGLU at alpha 1.702, limit 7; ``"silu_clamped"``: DeepSeek-V4's SiLU of the clamped gate instead): [T, H]."""
    e, x = mlp.experts, x.reshape(-1, x.shape[-1])
    _, scores, top = mlp.router(x)
    x, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(top.shape[1]):
            i = top[t, k]
            gu = x[t] @ e.gate_up_proj[i].double() + e.gate_up_proj_bias[i].double()
            gate, up = gu[0::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
            h = torch.nn.functional.silu(gate) * up if activation == "silu_clamped" else gate * torch.sigmoid(
                1.702 * gate) * (up + 1)
            out[t] += scores[t, k].double() * (h @ e.down_proj[i].double() + e.down_proj_bias[i].double())
    return out


GPT_OSS_FORM = " (biases, interleaved gate/up, clamped SwiGLU (alpha 1.702, limit 7))"


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_tiny_gpt_oss_experts_in_fp8(impl):
    """GPT-OSS's experts (biases, gate/up rows interleaved, a clamped SwiGLU) were left bf16: quantize_ takes them,
    and the MoE pass rewrites HF's code into one fused_moe with its biases, rows and activation, against the block
    written out in float64 (each of the three left out misses it by 0.24-1.3: tests/kernels/test_fused_moe.py)."""
    model = tiny_gpt_oss(impl)
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 7, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        truth = gpt_oss_exact(mlp, x)
        assert rel_err(mlp(x)[0].reshape(-1, 256), truth) < 0.01  # the bf16 model: measured 0.005
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
        report = Report()
        out = torch.compile(mlp, backend=moe_only(report), fullgraph=True)(x)[0].reshape(-1, 256)
    [site] = report.sites
    assert site.rewritten and site.scheme == "w:per-channel a:per-token" + GPT_OSS_FORM, (site.reason, site.scheme)
    assert rel_err(out, truth) < 0.08  # measured 0.057: three fp8 roundings (x, weights, the intermediate)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(torch.randint(0, 512, (2, 12)))
    fp8fx.testing.assert_rewritten(backend, "model.layers.*.mlp.experts", "model.layers.*.self_attn.*")
    assert not [n for n, *_ in backend.report.unhandled_weights(model) if "experts" in n]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_gpt_oss_experts_under_dynamic_true(compiler, caplog):
    """torch.compile(dynamic=True) makes GPT-OSS's alpha / limit graph inputs (0-d tensors read with .item()): the
    experts stayed on the dequantized weights, said why with compiler="eager", and with Inductor (which has Dynamo
    trace again with the floats as constants, -limit as a node neg(7.0)) said "neg is not part of an experts
    computation". Both rewrite them now. Dynamo does not guard an unspecialized float, so the eager graph checks
    alpha / limit at each call: a changed alpha runs the graph as traced, with a warning, as the model computes it;
    Inductor's constants are Dynamo's, guarded: a changed alpha compiles again."""
    model = tiny_gpt_oss()
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 6, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    backend = fp8fx.Fp8Backend(compiler=compiler)
    compiled = torch.compile(mlp, backend=backend, dynamic=True)
    with torch.no_grad():
        truth = gpt_oss_exact(mlp, x)
        out = compiled(x)[0].reshape(-1, 256)
        [site] = [s for s in backend.report.sites if s.kind == "moe"]
        assert site.rewritten and site.scheme.endswith(GPT_OSS_FORM), site.reason
        assert rel_err(out, truth) < 0.08  # measured 0.041
        mlp.experts.alpha = 1.25
        try:
            with caplog.at_level(logging.WARNING, logger="fp8fx"):
                out = compiled(x)[0].reshape(-1, 256)
            ref = mlp(x)[0].reshape(-1, 256)
        finally:
            mlp.experts.alpha = 1.702
    assert rel_err(ref, truth) > 0.01  # (the new alpha changes the output)
    moe = [s for s in backend.report.sites if s.kind == "moe"]
    if compiler == "eager":  # the graph as traced, the model's own numbers
        assert torch.equal(out, ref)
        assert "experts.alpha = 1.702 as a constant of its fp8 kernels, and is called with 1.25" in caplog.text
        assert len(moe) == 1
    else:  # compiled again for the new alpha, and rewritten
        assert rel_err(out, ref) < 0.08 and len(moe) == 2 and all(s.rewritten for s in moe)
        assert "(alpha 1.25, limit 7)" in moe[1].scheme


def _gate(gate_up, up_limit=7.0, alpha=1.702, one=1, act=None):
    """GPT-OSS's _apply_gate with one thing changed."""
    gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2]
    up = up if up_limit is None else up.clamp(-up_limit, up_limit)
    return (up if one is None else up + one) * (act(gate) if act else gate * torch.sigmoid(gate * alpha))


def test_gpt_oss_checkpoints_and_static_scales(tmp_path):
    """GPT-OSS's bf16 hub layout (fused, transposed, interleaved, with biases) loads online into what quantize_ makes,
    and an fp8fx fp8 checkpoint loads back bit for bit, biases included; both are fused. calibrate measures the
    experts' second input as the model computes it (HF's _apply_gate on the biased first GEMM), not SiLU(gate) * up of
    halves."""
    model = tiny_gpt_oss()
    model.save_pretrained(tmp_path / "bf16")
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    experts = {f"model.layers.{i}.mlp.experts" for i in range(LAYERS)}
    seen = {}  # the amax of each experts module's _apply_gate output, from the model's own forward
    cls = type(model.model.layers[0].mlp.experts)

    def watch(self, gate_up):
        h = cls._apply_gate(self, gate_up)
        seen[self] = max(seen.get(self, 0.0), h.abs().max().float().item())
        return h
    with torch.no_grad():
        for i in range(LAYERS):
            m = model.model.layers[i].mlp.experts
            m._apply_gate = watch.__get__(m)
        scales = fp8fx.calibrate(model, [ids])
        for i in range(LAYERS):
            m = model.model.layers[i].mlp.experts
            del m._apply_gate
            assert scales[f"model.layers.{i}.mlp.experts.down_proj"] == pytest.approx(seen[m] / 448, rel=0.02)
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "bf16")
    report = fp8fx.load_checkpoint(loaded, tmp_path / "bf16", fp8fx.Fp8Config(ignored_layers=["lm_head"]),
                                   progress=False)
    assert set(report.experts) == experts
    fp8fx.save_checkpoint(model, tmp_path / "fp8")
    again = fp8fx.checkpoint.meta_model(tmp_path / "fp8")
    fp8fx.load_checkpoint(again, tmp_path / "fp8", progress=False)
    for fqn in experts:
        state = model.get_submodule(fqn).state_dict()
        assert {"gate_up_proj_bias", "down_proj_bias"} <= state.keys()
        # (shards of rows that alternate are refused by the loader: tests/unit/test_moe_weights.py)
        assert all(fp8fx.weights.moe.is_interleaved(m.get_submodule(fqn)) for m in (model, loaded, again))
    for m in (loaded, again):  # fused as quantize_'s are: the loaded biases are tagged for the MoE pass (they were not)
        report = Report()
        with torch.no_grad():
            torch.compile(m, backend=moe_only(report), fullgraph=True)(ids)
        assert {s.fqn for s in report.sites if s.rewritten} == experts, [s.reason for s in report.sites]
        for other in (loaded, again):
            for name, t in other.get_submodule(fqn).state_dict().items():
                assert torch.equal(t.view(torch.uint8), state[name].view(torch.uint8)), (fqn, name)


@pytest.mark.cuda
@pytest.mark.parametrize("block", [None, [128, 128]])
def test_tiny_gpt_oss_experts_in_fp8_cuda(block):
    """GPT-OSS's experts on the GPU through Inductor: fp8fx's fused MoE kernels with biases, interleaved rows (128-row
    blocks holding 64 gate and 64 up rows) and the clamped SwiGLU, within the CPU run's bound of the float64 block."""
    model = tiny_gpt_oss().cuda()
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 7, 256, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        truth = gpt_oss_exact(mlp, x)
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_block_size=block))
        out = torch.compile(mlp, backend=backend, fullgraph=True)(x)[0].reshape(-1, 256)
    [site] = [s for s in backend.report.sites if s.kind == "moe"]
    assert site.rewritten and site.scheme.endswith(GPT_OSS_FORM), (site.reason, site.scheme)
    assert rel_err(out, truth) < 0.08


def _grouped_forward(b13_ids="sorted", b2_ids="sorted", alpha=None):
    """HF's grouped_mm experts code with GPT-OSS's biases, written out, one thing changeable: the ids each bias is
    gathered by (``"sorted"``, as HF: the rows' experts; ``"argsort"``: the same by ``ids[argsort(ids)]``;
    ``"routing"``: top_k_index's order, other experts' biases on rows sorted by expert; ``"descending"``: sorted the
    other way (the ascending ids reversed: a descending sort is refused as such); ``"per token"``: each token's k ids
    sorted) or the first bias added by ``torch.add(..., alpha=)``."""
    from transformers.integrations.moe import _grouped_mm

    def forward(self, x, top_k_index, top_k_weights):
        k, t, h = top_k_index.shape[-1], x.shape[0], x.shape[-1]
        weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)
        ids_sorted, perm = torch.sort(ids)
        offsets = torch.cumsum(torch.histc(ids_sorted.float(), bins=self.num_experts, min=0,
                                           max=self.num_experts - 1), dim=0, dtype=torch.int32)
        by = {"sorted": lambda: ids_sorted, "routing": lambda: ids, "argsort": lambda: ids[torch.argsort(ids)],
              "descending": lambda: ids_sorted[torch.arange(ids.shape[0] - 1, -1, -1)],
              "per token": lambda: torch.sort(top_k_index)[0].reshape(-1)}
        g1 = _grouped_mm(x[perm // k], self.gate_up_proj, offs=offsets)
        if alpha is None:
            g1.add_(self.gate_up_proj_bias[by[b13_ids]()])
        else:
            g1 = torch.add(g1, self.gate_up_proj_bias[by[b13_ids]()], alpha=alpha)
        y = _grouped_mm(self._apply_gate(g1), self.down_proj, offs=offsets)
        y.add_(self.down_proj_bias[by[b2_ids]()])
        y = y * weights[perm].unsqueeze(-1)
        unsort = torch.empty_like(perm)
        unsort[perm] = torch.arange(perm.shape[0], device=perm.device)
        return y[unsort].view(t, k, h).sum(dim=1).to(x.dtype)
    return forward


def _batched_forward(view_first=False, bias_perm=None):
    """HF's batched_mm experts code with GPT-OSS's biases; ``view_first``: the first GEMM's output read through one
    view of its bmm, the bias added in place through another (which the first sees too); ``bias_perm``: the pairs
    taken in their experts' sorted order (``sort(ids)[1]``), w13's bias gathered by that permutation (``"same"``) or
    by it reversed (``"other"``: a descending sort's permutation, which is refused as such)."""
    def forward(self, x, top_k_index, top_k_weights):
        k, t, h = top_k_index.shape[-1], x.shape[0], x.shape[-1]
        weights, ids = top_k_weights.reshape(-1), top_k_index.reshape(-1)
        rows = b13_rows = torch.arange(ids.shape[0])
        if bias_perm is not None:
            rows = torch.sort(ids)[1]
            b13_rows = rows if bias_perm == "same" else rows[torch.arange(ids.shape[0] - 1, -1, -1)]
        o = torch.bmm(x.repeat_interleave(k, dim=0)[rows].unsqueeze(1), self.gate_up_proj[ids[rows]])
        g1 = o.squeeze(1)
        if view_first:
            o.squeeze(1).add_(self.gate_up_proj_bias[ids[b13_rows]])
        else:
            g1.add_(self.gate_up_proj_bias[ids[b13_rows]])
        y = torch.bmm(self._apply_gate(g1).unsqueeze(1), self.down_proj[ids[rows]]).squeeze(1)
        y.add_(self.down_proj_bias[ids[rows]])
        y = y * weights[rows].unsqueeze(-1)
        unsort = torch.empty_like(rows)
        unsort[rows] = torch.arange(rows.shape[0])
        return y[unsort].view(t, k, h).sum(dim=1).to(x.dtype)
    return forward


def _keyword_gate(gate_up):
    """GPT-OSS's _apply_gate with every operand passed by keyword."""
    gate = torch.clamp(input=gate_up[..., ::2], max=7.0)
    up = torch.clamp(input=gate_up[..., 1::2], min=-7.0, max=7.0)
    glu = torch.mul(input=gate, other=torch.sigmoid(input=torch.mul(input=gate, other=1.702)))
    return torch.mul(input=torch.add(input=up, other=1), other=glu)


@pytest.mark.parametrize("what,forward,gate,reason", [
    # the same computation, the experts' code written out or its operands passed by keyword: rewritten
    ("grouped, written out", _grouped_forward(), None, None),
    ("batched, written out", _batched_forward(), None, None),
    ("w13 bias by ids[argsort(ids)]", _grouped_forward(b13_ids="argsort"), None, None),
    ("batched in sorted order, w13 bias by the same permutation", _batched_forward(bias_perm="same"), None, None),
    ("keyword operands", None, lambda gu: _keyword_gate(gu), None),
    # another computation: left as it is (each was rewritten wrongly, 0.28-0.60 off the model, before its check)
    ("w13 bias of the routing order on sorted rows", _grouped_forward(b13_ids="routing"), None,
     "adds a bias gathered in the routing order (top_k_index's) to GEMM rows in the experts' ascending order"),
    ("w2 bias of the routing order on sorted rows", _grouped_forward(b2_ids="routing"), None,
     "adds a bias gathered in the routing order (top_k_index's) to GEMM rows in the experts' ascending order"),
    ("w13 bias of the descending order on sorted rows", _grouped_forward(b13_ids="descending"), None,
     "adds a bias gathered in the order of the index 'arange' to GEMM rows in the experts' ascending order"),
    ("w13 bias of each token's sorted ids on sorted rows", _grouped_forward(b13_ids="per token"), None,
     "indexes an expert bias other than by expert or by the routing ids"),
    ("batched in sorted order, w13 bias by another permutation", _batched_forward(bias_perm="other"), None,
     "adds a bias gathered in the order of the index 'b13_rows' to GEMM rows in the experts' ascending order"),
    ("a bias added with alpha", _grouped_forward(alpha=2.0), None, "takes more than two operands ({'alpha': 2.0})"),
    ("up + 1 with alpha", None, lambda gu: torch.add(gu[..., 1::2].clamp(-7.0, 7.0), 1, alpha=3) * (
        gu[..., ::2].clamp(max=7.0) * torch.sigmoid(gu[..., ::2].clamp(max=7.0) * 1.702)),
     "takes more than two operands ({'alpha': 3})"),
    # activations that are not fused_moe's
    ("another limit for up", None, lambda gu: _gate(gu, up_limit=5.0),
     "multiplies values that fused_moe does not multiply (operands: up1, glu)"),
    ("up + 2", None, lambda gu: _gate(gu, one=2), "adds values other than weighted expert outputs (operands: up_c)"),
    ("up clamped unevenly", None, lambda gu: (gu[..., 1::2].clamp(-1.0, 7.0) + 1) * (
        gu[..., ::2].clamp(max=7.0) * torch.sigmoid(gu[..., ::2].clamp(max=7.0) * 1.702)),
     "clamps a half of w13's GEMM other than as GPT-OSS's SwiGLU does"),
    ("a sigmoid without alpha", None, lambda gu: _gate(gu, act=lambda g: g * torch.sigmoid(g)),
     "applies a sigmoid to something other than the clamped gate times alpha"),
    ("SiLU of the clamped gate times the unclamped up", None,
     lambda gu: _gate(gu, one=None, up_limit=None, act=torch.nn.functional.silu),
     "multiplies values that fused_moe does not multiply (operands: up, act)"),
    ("a bias added in place through another view", _batched_forward(view_first=True), None,
     "adds a bias in place to a view of o, which is read otherwise too"),
])
def test_gpt_oss_experts_code_variants(what, forward, gate, reason):
    """Variants of the experts' code around the biases and the activation: what computes fused_moe's form is
    rewritten (within fp8's error of the model's own code on the same fp8 weights), the rest left as it is, with the
    node that differs."""
    model = tiny_gpt_oss()
    mlp = model.model.layers[0].mlp
    if forward is not None:
        mlp.experts.forward = forward.__get__(mlp.experts)
    if gate is not None:
        mlp.experts._apply_gate = gate
    x = torch.randn(3, 7, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    report = Report()
    with torch.no_grad():
        eager = mlp(x)[0]
        out = torch.compile(mlp, backend=moe_only(report), fullgraph=True)(x)[0]
    [site] = report.sites
    if reason is None:
        assert site.rewritten and site.scheme.endswith(GPT_OSS_FORM), (what, site.reason)
        assert rel_err(out, eager) < 0.08, what  # measured 0.041
    else:
        assert not site.rewritten and reason in site.reason, (what, site.reason)
        assert torch.equal(out, eager)


def test_clamped_silu_experts_in_fp8():
    """DeepSeek-V4's (and HY-V4's) experts: SiLU of the gate clamped above times up clamped on both sides
    (``swiglu_limit``), here on GPT-OSS's interleaved rows and biases: fused_moe's ``silu_clamped``, against the block
    written out in float64."""
    model = tiny_gpt_oss()
    mlp = model.model.layers[0].mlp
    mlp.experts._apply_gate = lambda gu: _gate(gu, one=None, act=torch.nn.functional.silu)
    x = torch.randn(3, 7, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        truth = gpt_oss_exact(mlp, x, "silu_clamped")
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
        report = Report()
        out = torch.compile(mlp, backend=moe_only(report), fullgraph=True)(x)[0].reshape(-1, 256)
    [site] = report.sites
    assert site.rewritten and site.scheme.endswith("(biases, interleaved gate/up, clamped SiLU (limit 7))"), (
        site.reason, site.scheme)
    assert rel_err(out, truth) < 0.08


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("act,form", [("GELUTanh", "GELU (tanh)"), ("GELUActivation", "GELU"),
                                      ("ReLUSquaredActivation", "squared ReLU")])
def test_gelu_and_relu2_experts_in_fp8(impl, act, form):
    """Experts whose act_fn is GELU's tanh approximation (Gemma-4's: transformers' GELUTanh), the exact GELU or the
    squared ReLU were left bf16: quantized, and rewritten into fused_moe's ``gelu_tanh`` / ``gelu`` / ``relu2``, within
    fp8's error of the model's own code on the same fp8 weights; calibrate measures them (it refused them)."""
    import transformers.activations

    make = getattr(transformers.activations, act)
    model = tiny("mixtral", impl)
    for i in range(LAYERS):
        model.model.layers[i].mlp.experts.act_fn = make()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    report = Report()
    out, eager, ref = run(model, moe_only(report))
    assert {s.fqn for s in report.sites if s.rewritten} == EXPERTS, [s.reason for s in report.sites]
    assert all(s.scheme == f"w:per-channel a:per-token ({form})" for s in report.sites)
    assert rel_err(out, eager) < 0.05  # activation quantization of the experts
    assert set(fp8fx.calibrate(tiny("mixtral", impl).apply(
        lambda m: setattr(m, "act_fn", make()) if hasattr(m, "gate_up_proj") else None), [ids])) >= {
        f"{e}.{w}" for e in EXPERTS for w in ("gate_up_proj", "down_proj")}


def test_in_place_silu_act_fn_experts_in_fp8():
    """``nn.SiLU(inplace=True)`` as act_fn: SiLU of the gate half in place, which nothing else reads: rewritten (a
    first version of the in-place check refused every in-place SiLU, after quantize_ had stored the experts in fp8)."""
    model = tiny("mixtral", "grouped_mm")
    for i in range(LAYERS):
        model.model.layers[i].mlp.experts.act_fn = torch.nn.SiLU(inplace=True)
    report = Report()
    out, eager, ref = run(model, moe_only(report))
    assert {s.fqn for s in report.sites if s.rewritten} == EXPERTS, [s.reason for s in report.sites]
    assert rel_err(out, eager) < 0.05


def tiny_nemotron_h():
    """A tiny random Nemotron-H of MoE and attention layers (no Mamba): ungated experts of squared ReLU, a shared
    expert, decisive routers (as tiny() does)."""
    config = transformers.NemotronHConfig(
        vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layers_block_type=["moe", "attention", "moe"], moe_intermediate_size=128, moe_shared_expert_intermediate_size=128,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, intermediate_size=256)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for i in (0, 2):
            model.model.layers[i].mixer.gate.weight.mul_(10)
    return model


NEMOTRON_EXPERTS = {f"model.layers.{i}.mixer.experts" for i in (0, 2)}


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_tiny_nemotron_h_ungated_experts_in_fp8(impl):
    """Nemotron-H's ungated experts (down(relu(up(x))^2)) were left bf16: quantized and fused through Inductor, the
    logits within fp8's error of the bf16 model's (the experts alone: tests/passes/test_moe_pass.py)."""
    model = tiny_nemotron_h()
    model.set_experts_implementation(impl)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits.float()
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]), strict=True)
        out = torch.compile(model, backend=backend, fullgraph=True)(ids, use_cache=False).logits.float()
    sites = {s.fqn: s for s in backend.report.sites if s.kind == "moe"}
    assert set(sites) == NEMOTRON_EXPERTS and all(
        s.rewritten and s.scheme == "w:per-channel a:per-token (ungated, squared ReLU)" for s in sites.values())
    assert not [n for n, *_ in backend.report.unhandled_weights(model) if "experts" in n]
    assert rel_err(out, ref) < 0.15  # fp8 everywhere but lm_head and the routers: measured 0.098 (CPU, torch 2.13)


def test_nemotron_h_checkpoints(tmp_path):
    """Nemotron-H's hub layout (backbone., ungated experts per expert: experts.<e>.up_proj / down_proj) loads online
    into what quantize_ makes, bit for bit, and fused (load_checkpoint refused it: 32 tensors with no place); convert
    writes them per expert in fp8 (per channel, per tensor, blocks), which loads back bit for bit; an experts module
    in the ignore list loads as stored and says why; save_checkpoint writes them per expert (the hub's names) or fused,
    and both load back bit for bit."""
    from fp8fx.checkpoint.save import convert

    model = tiny_nemotron_h()
    model.save_pretrained(tmp_path / "bf16")
    config = fp8fx.Fp8Config(ignored_layers=["lm_head"])
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "bf16")
    report = fp8fx.load_checkpoint(loaded, tmp_path / "bf16", config, progress=False)
    assert set(report.experts) == NEMOTRON_EXPERTS and "model.layers.1.mixer.q_proj" in report.quantized
    fp8fx.quantize_(model, config)
    for fqn in NEMOTRON_EXPERTS:
        mine, theirs = (m.get_submodule(fqn).state_dict() for m in (model, loaded))
        assert mine.keys() == theirs.keys() == {"up_proj", "up_proj_scale", "down_proj", "down_proj_scale"}
        assert all(torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in mine), fqn
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    compiled = Report()
    with torch.no_grad():
        torch.compile(loaded, backend=moe_only(compiled), fullgraph=True)(ids, use_cache=False)
    assert {s.fqn for s in compiled.sites if s.rewritten} == NEMOTRON_EXPERTS, [s.reason for s in compiled.sites]
    for name, cfg in (("channel", config), ("tensor", fp8fx.Fp8Config(ignored_layers=["lm_head"],
                                                                      weight_granularity=fp8fx.PerTensor())),
                      ("blocks", fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_block_size=[64, 128]))):
        # convert writes them per expert in fp8 (it left them bf16: "no module of the model has this weight"), and
        # load_checkpoint reads those back as quantize_ makes them
        convert(tmp_path / "bf16", tmp_path / name, cfg, progress=False)
        fresh, again = tiny_nemotron_h(), fp8fx.checkpoint.meta_model(tmp_path / name)
        fp8fx.quantize_(fresh, cfg)
        report = fp8fx.load_checkpoint(again, tmp_path / name, progress=False)
        assert set(report.experts) == NEMOTRON_EXPERTS, name
        for fqn in NEMOTRON_EXPERTS:
            mine, theirs = (m.get_submodule(fqn).state_dict() for m in (fresh, again))
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in mine), (name, fqn)
    kept = fp8fx.checkpoint.meta_model(tmp_path / "bf16")
    ignoring = fp8fx.Fp8Config(ignored_layers=["lm_head", "model.layers.0.mixer.experts"])
    report = fp8fx.load_checkpoint(kept, tmp_path / "bf16", ignoring, progress=False)
    assert set(report.experts) == {"model.layers.2.mixer.experts"}
    assert report.not_quantized["model.layers.0.mixer.experts"] == "in ignored_layers"
    reference = tiny_nemotron_h().model.layers[0].mixer.experts
    assert all(torch.equal(getattr(kept.model.layers[0].mixer.experts, n), getattr(reference, n))
               for n in ("up_proj", "down_proj"))
    for experts in (None, "fused"):  # save_checkpoint: per expert in the hub's names (backbone.), or fused
        out = tmp_path / f"saved-{experts}"
        fp8fx.save_checkpoint(loaded, out, experts=experts)
        with safetensors.safe_open(out / "model.safetensors", "pt") as f:
            names = set(f.keys())
        # (per expert under the hub's backbone. where transformers' renames say so: 5.25's, not 5.17's)
        leaf = "layers.0.mixer.experts.7.up_proj.weight_scale" if experts is None else "mixer.experts.up_proj_scale"
        assert any(n.endswith(leaf) for n in names), sorted(names)[:8]
        back = fp8fx.checkpoint.meta_model(out)
        assert set(fp8fx.load_checkpoint(back, out, progress=False).experts) == NEMOTRON_EXPERTS
        for fqn in NEMOTRON_EXPERTS:
            mine, theirs = (m.get_submodule(fqn).state_dict() for m in (loaded, back))
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in mine), fqn


@pytest.mark.cuda
@pytest.mark.parametrize("block", [None, [128, 128]])
def test_tiny_nemotron_h_ungated_experts_in_fp8_cuda(block):
    """Nemotron-H's ungated experts on the GPU through Inductor (fp8fx's fused MoE kernels with GATED off and the
    squared ReLU), within fp8's error of the bf16 experts written out in float64."""
    from tests.passes.test_moe_pass import nemotron_h_exact

    model = tiny_nemotron_h().cuda()
    mixer = model.model.layers[0].mixer
    x = torch.randn(3, 7, 256, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        flat = x.reshape(-1, 256)
        _, weights, ids = mixer.gate(flat)  # the routing the experts get
        truth = nemotron_h_exact(mixer.experts, flat, ids, weights) - flat.double()
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_block_size=block))
        out = torch.compile(mixer.experts, backend=backend, fullgraph=True)(flat, ids, weights)
    [site] = [s for s in backend.report.sites if s.kind == "moe"]
    assert site.rewritten and site.scheme.endswith("(ungated, squared ReLU)"), (site.reason, site.scheme)
    assert rel_err(out, truth) < 0.06  # the CPU run of the same experts: 0.020-0.035 with the residual x


def test_a_frame_that_gave_no_graph_reaching_the_recompile_limit_is_in_the_report():
    """DBRX's block, attention and norm forwards share transformers' deprecate_kwarg wrapper, one code object that
    Dynamo compiles again for each method and shape and that breaks before its first op: it reached
    torch._dynamo.config.recompile_limit without giving fp8fx a graph, and from then on the whole forward ran
    uncompiled (the dequantized model's bits) while the report listed every layer rewritten and said nothing (found by
    a probe)."""
    import copy

    torch.manual_seed(0)
    config = transformers.DbrxConfig(vocab_size=128, d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                                     pad_token_id=0, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                     ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    fp8fx.quantize_(model)
    plain = copy.deepcopy(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    forward = torch.compile(model.forward, backend=backend)
    with torch.no_grad():
        for shape in [(2, 5), (1, 1), (1, 3)]:
            ids = torch.randint(1, 128, shape)
            out, ref = forward(input_ids=ids).logits, plain(ids).logits
    report = backend.report
    if not torch.equal(out, ref):  # (a transformers whose wrapper Dynamo traces through: nothing ran uncompiled)
        assert report.recompile_limit_hits == 0, report
        return
    assert not report.limits and report.rewritten, report  # (no graph of the frame came to fp8fx)
    assert report.recompile_limit_hits >= 1 and report.to_dict()["totals"]["recompile_limit_hits"] >= 1
    assert "Dynamo hit torch._dynamo.config.recompile_limit" in report.table(), report
