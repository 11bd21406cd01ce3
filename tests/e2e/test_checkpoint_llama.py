"""FP8 checkpoints of tiny HF models (Llama; DeepSeek-V3 with its 128x128 blocks) built in the test,
loaded into models that transformers builds from the checkpoint's config.json on the meta device, and
compared with float32 models holding the dequantized weights. Also: the loaded model under
torch.compile, and the streaming memory bounds of loading a bf16 checkpoint and of convert."""
import json
import logging

import pytest
import torch

import fp8fx
from fp8fx import quant
from fp8fx.checkpoint import convert, load_checkpoint, meta_model
from fp8fx.weights import chunked
from tests.conftest import rel_err
from tests.unit.test_checkpoint_load import FP8, LINEARS, fp8_checkpoint, ref_dequantize, ref_quantize, write_checkpoint

transformers = pytest.importorskip("transformers")
from torch._C._profiler import _EventType  # noqa: E402


def llama_config(hidden=256, inter=512, layers=2):
    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=2, max_position_embeddings=64,
    )


def deepseek_config():
    """MLA attention with q_lora; kv_a_proj_with_mqa has 128 + 64 = 192 rows: a ragged 128-row block,
    as in DeepSeek-V3 (576 rows). Dense MLPs only (experts: tests/e2e/test_checkpoint_moe.py)."""
    return transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=64,
    )


def reference_model(cfg, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def float_logits(cfg, state, deq, ids):
    """Logits of the model in float32 with the dequantized weights (float64 dequantization)."""
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    sd = {k: v.float() for k, v in state.items()}
    sd.update({f"{m}.weight": w.float() for m, w in deq.items()})
    model.load_state_dict(sd)
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "fmt",
    ["fp8-per-tensor-static", "compressed-tensors-channel", "fp8-block"],
)
def test_llama_checkpoint(tmp_path, fmt):
    cfg = llama_config()
    ref = reference_model(cfg)
    state = ref.state_dict()
    granularity = {"fp8-per-tensor-static": "tensor", "compressed-tensors-channel": "channel",
                   "fp8-block": "block"}[fmt]
    static = fmt.endswith("static")
    tensors, qc, deq = fp8_checkpoint(state, granularity, static=static, ct=fmt.startswith("compressed"),
                                      block=(128, 128))
    if static:  # real input scales: amax / 448 of each layer's input
        for fqn, scale in fp8fx.calibrate(ref, [IDS]).items():
            if f"{fqn}.input_scale" in tensors:
                tensors[f"{fqn}.input_scale"] = torch.tensor([scale])
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0625)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.125)
    path = write_checkpoint(tmp_path / "ckpt", tensors, qc, shards=3, extra_config=cfg.to_dict())

    model = meta_model(path)
    report = load_checkpoint(model, path, progress=False)
    assert set(report.quantized) == set(LINEARS)
    assert report.not_quantized == {"lm_head": "in ignored_layers"}
    assert report.kv_scales["model.layers.0.self_attn"] == {"k_scale": 0.0625, "v_scale": 0.125}
    # the fp8 format declares an fp8 KV cache by holding scales (every attention then has them); compressed-tensors
    # by its kv_cache_scheme, which this one lacks: the scales stay layer 0's
    defaults = [] if fmt.startswith("compressed") else ["model.layers.1.self_attn.k_scale",
                                                         "model.layers.1.self_attn.v_scale"]
    assert report.kv_defaults == defaults
    q_proj = model.model.layers[1].self_attn.q_proj
    assert q_proj._parameters["weight"].dtype == FP8
    assert torch.equal(q_proj.weight, deq["model.layers.1.self_attn.q_proj"].bfloat16())
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    with torch.no_grad():
        logits = model(IDS).logits.float()
    assert rel_err(logits, float_logits(cfg, state, deq, IDS)) < 0.02  # eager: bf16 compute (~0.7%)


def test_deepseek_v3_block_checkpoint(tmp_path, caplog):
    """DeepSeek-V3's own format: quant_method fp8, weight_block_size [128, 128], no ignored layers,
    weight_scale_inv per block, lm_head stored in bf16."""
    cfg = deepseek_config()
    ref = reference_model(cfg)
    state = ref.state_dict()
    linears = [n.rpartition(".")[0] for n, t in state.items() if n.endswith("proj.weight") or n.endswith("mqa.weight")]
    tensors, deq = {}, {}
    for name, t in state.items():
        module = name.rpartition(".")[0]
        if module in linears and name.endswith(".weight"):
            q, s = ref_quantize(t, "block", (128, 128))
            tensors[name], tensors[f"{module}.weight_scale_inv"] = q, s
            deq[module] = ref_dequantize(q, s, "block", (128, 128))
        else:
            tensors[name] = t
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)  # 192 rows
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    path = write_checkpoint(tmp_path / "ckpt", tensors, qc, shards=2, extra_config=cfg.to_dict())
    model = meta_model(path)
    report = load_checkpoint(model, path, progress=False)
    assert set(report.quantized) == set(linears) and len(linears) == 16
    assert report.not_quantized == {"lm_head": "output embeddings stored in high precision"}
    assert set(report.quantized.values()) == {"w:per-block(128x128) a:per-group(1x128)"}
    with torch.no_grad():
        logits = model(IDS).logits.float()
    assert rel_err(logits, float_logits(cfg, state, deq, IDS)) < 0.02  # eager: bf16 compute (~0.7%)
    # the lm_head the checkpoint keeps in high precision is a choice, as vLLM makes it: no warning at compile
    backend = fp8fx.Fp8Backend(compiler="eager")
    with caplog.at_level(logging.INFO, logger="fp8fx"), torch.no_grad():
        torch.compile(model, backend=backend)(IDS)
    lm_head = [r for r in caplog.records if r.name == "fp8fx" and "lm_head not rewritten" in r.getMessage()]
    assert [r.levelno for r in lm_head] == [logging.INFO], [r.getMessage() for r in lm_head]


def test_deepseek_v3_mla_group_is_saved_in_one_precision(tmp_path, caplog):
    """vLLM fuses MLA's q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj (DeepSeek-V2/V3, Kimi, GLM) and refuses
    shards of two precisions. 128x128 blocks divide q_a_proj [128, 256] but not kv_a_proj_with_mqa [192, 256] (576
    rows in DeepSeek-V3): quantize_ leaves the latter bf16, and save_checkpoint wrote q_a_proj fp8 beside it. Now
    q_a_proj is written dequantized, both in the ignore list, with a warning, and loads back (the model's two layers
    are not fused: transformers keeps them apart); convert keeps q_a_proj bf16 as well."""
    import logging

    from safetensors import safe_open

    from fp8fx.checkpoint import save_checkpoint

    cfg = deepseek_config()
    model = reference_model(cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = fp8fx.Fp8Config(weight_block_size=[128, 128])
    fp8fx.quantize_(model, config)
    attn = [f"model.layers.{i}.self_attn" for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        qc = save_checkpoint(model, tmp_path / "saved")
    assert f"writes {attn[0]}.q_a_proj, {attn[1]}.q_a_proj in high precision" in caplog.text
    assert f"{attn[0]}.kv_a_proj_with_mqa: weight [192, 256] is not divisible by the 128x128 block" in caplog.text
    group = {f"{a}.{p}" for a in attn for p in ("q_a_proj", "kv_a_proj_with_mqa")}
    assert group <= set(qc["ignored_layers"]) and f"{attn[0]}.q_b_proj" not in qc["ignored_layers"]
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice(f"{attn[0]}.q_a_proj.weight").get_dtype() == "BF16"
    assert f"{attn[0]}.q_a_proj.weight_scale_inv" not in names and f"{attn[0]}.q_b_proj.weight_scale_inv" in names
    again = meta_model(tmp_path / "saved")
    report = load_checkpoint(again, tmp_path / "saved", progress=False)
    assert group <= set(report.not_quantized) and f"{attn[0]}.q_b_proj" in report.quantized and not report.fused
    for name, t in again.state_dict().items():
        owner = name.rpartition(".")[0]
        expected = model.get_submodule(owner).weight if owner in group else model.state_dict()[name]
        assert t.dtype == expected.dtype and torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), name

    src = write_checkpoint(tmp_path / "bf16", state, extra_config=cfg.to_dict())
    report = convert(src, tmp_path / "converted", config, progress=False)
    assert report.not_quantized[f"{attn[0]}.q_a_proj"] == (
        f"fused with {attn[0]}.kv_a_proj_with_mqa into one layer by engines, which stays bf16: weight [192, 256] is "
        "not divisible by the 128x128 block")
    assert f"{attn[0]}.q_b_proj" in report.quantized


def test_an_lm_head_quantized_on_its_own_is_saved_untied(tmp_path, caplog):
    """Quantizing a tied lm_head on its own unties it (README); the saved config.json still said
    tie_word_embeddings: true, so the model it describes tied lm_head again and load_checkpoint refused the
    checkpoint's fp8 lm_head (HF and vLLM tie it too). The config is written untied, with a warning; the model's own
    config is unchanged."""
    from fp8fx.checkpoint import save_checkpoint

    cfg = llama_config(layers=1)
    cfg.tie_word_embeddings = True
    model = reference_model(cfg)
    config = fp8fx.Fp8Config()
    fp8fx.quantize_(model.model.layers[0], config, prefix="model.layers.0")
    fp8fx.quantize_(model.lm_head, config, prefix="lm_head")
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        save_checkpoint(model, tmp_path / "saved")
    assert "writes tie_word_embeddings: false" in caplog.text and model.config.tie_word_embeddings
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["tie_word_embeddings"] is False
    again = meta_model(tmp_path / "saved")
    report = load_checkpoint(again, tmp_path / "saved", progress=False)
    assert "lm_head" in report.quantized
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


def test_loaded_checkpoint_compiles_with_fp8_backend(tmp_path):
    cfg = llama_config()
    state = reference_model(cfg).state_dict()
    tensors, qc, deq = fp8_checkpoint(state, "channel", ct=True)
    path = write_checkpoint(tmp_path / "ckpt", tensors, qc, extra_config=cfg.to_dict())
    model = meta_model(path)
    load_checkpoint(model, path, progress=False)
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)(IDS).logits.float()
    assert {s.fqn for s in backend.report.rewritten} == set(LINEARS)
    assert {s.fqn: s.reason for s in backend.report.skipped} == {"lm_head": "not quantized: in ignored_layers"}
    # compiled, activations are quantized too (per token): ~5% off the float reference (CPU, torch 2.13)
    assert rel_err(compiled, float_logits(cfg, state, deq, IDS)) < 0.1


# --- streaming memory ------------------------------------------------------------------------------
def peak_allocated(fn):
    """(fn(), peak bytes above the start) of torch's CPU allocator while ``fn`` runs.

    Every CPU tensor torch allocates is reported to the profiler (``profile_memory=True``) with the
    allocator's running total; the peak of that total minus its value at the start is the most memory
    the call ever held in tensors: file data read (fp8fx reads into ``torch.empty`` tensors, no mmap),
    quantization temporaries, parameters. Memory outside torch's allocator (Python objects, the page
    cache) is not counted; the loader keeps no tensor data there."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
    events.sort()
    start = events[0][2] - events[0][1]
    return out, max(total for _, _, total in events) - start


def unique_bytes(tensors):
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_streaming_bf16_load_peak_is_fp8_model_plus_one_bf16_tensor(tmp_path):
    """A 57 MiB bf16 Llama checkpoint in ONE file, loaded into a meta model with online quantization:
    the peak is at most the loaded model + the largest bf16 tensor (8 MiB) + the quantization workspace
    (16 * CHUNK_NUMEL bytes = 4 MiB). Reading the file first, all bf16 weights before quantizing, a second
    bf16 copy of a weight, or quantizing a whole weight at once (~12 bytes per element of float32
    temporaries) would not fit."""
    cfg = llama_config(hidden=1024, inter=4096, layers=2)
    state = reference_model(cfg).state_dict()
    path = write_checkpoint(tmp_path / "ckpt", state, extra_config=cfg.to_dict())
    model = meta_model(path)
    report, peak = peak_allocated(lambda: load_checkpoint(model, path, fp8fx.Fp8Config(ignored_layers=["lm_head"]),
                                                          progress=False))
    assert len(report.quantized) == 14
    final = unique_bytes(list(model.parameters()) + list(model.buffers()))
    largest = max(t.numel() * t.element_size() for t in state.values())  # gate/up/down: 4M elements, 8 MiB
    workspace = 16 * chunked.CHUNK_NUMEL
    bound = final + largest + workspace
    bf16_linears = sum(t.numel() * 2 for n, t in state.items() if "proj" in n)
    assert final + bf16_linears > 1.5 * bound  # a non-streaming loader would be far above the bound
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB (final {final / 2**20:.1f})"
    assert peak >= final  # the measurement sees the loaded model


def meta_gate_up_mlp(h, i):
    """A model whose gate_up_proj fuses a checkpoint's gate_proj and up_proj, on the meta device, in bf16."""
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj, self.down_proj = nn.Linear(h, 2 * i, bias=False), nn.Linear(i, h, bias=False)

    with torch.device("meta"):
        return MLP().bfloat16()


def test_fp8_shards_of_a_fused_layer_are_requantized_within_the_bound(tmp_path):
    """Per-tensor gate and up shards (8 MiB each in bf16) loaded into a fused gate_up_proj are requantized to their
    max scale a few rows at a time: the peak stays under the loaded model + one bf16 tensor + the workspace. The
    whole fused weight's float32 temporaries peaked at 72 MiB here, 3x the bound."""
    h, i = 1024, 4096
    torch.manual_seed(0)
    tensors = {}
    for name, w in (("gate_proj", torch.randn(i, h)), ("up_proj", torch.randn(i, h) * 4), ("down_proj",
                                                                                          torch.randn(h, i))):
        q, scale = ref_quantize(w.bfloat16(), "tensor")
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, scale.reshape(())
    path = write_checkpoint(tmp_path, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    model = meta_gate_up_mlp(h, i)
    report, peak = peak_allocated(lambda: load_checkpoint(model, path, progress=False))
    assert report.fused == {"gate_up_proj": ("gate_proj", "up_proj")}
    bound = unique_bytes(list(model.parameters())) + i * h * 2 + 16 * chunked.CHUNK_NUMEL
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_bf16_shards_of_a_fused_layer_are_quantized_as_they_arrive(tmp_path, granularity):
    """bf16 gate and up shards (8 MiB each) loaded online into a fused gate_up_proj with per-channel or 128x128 block
    scales: each shard is quantized as it arrives, its rows' scales being its own, so the peak stays under the loaded
    model + one bf16 tensor + the workspace, and the weight is the whole one's quantization bit for bit. The layer
    held its whole bf16 weight (16 MiB) until the last shard arrived: the peak was above this bound."""
    h, i = 1024, 4096
    torch.manual_seed(0)
    tensors = {"gate_proj.weight": torch.randn(i, h).bfloat16(), "up_proj.weight": torch.randn(i, h).bfloat16() * 4,
               "down_proj.weight": torch.randn(h, i).bfloat16()}
    path = write_checkpoint(tmp_path, tensors)
    model = meta_gate_up_mlp(h, i)
    config = fp8fx.Fp8Config(weight_block_size=[128, 128] if granularity == "block" else None)
    report, peak = peak_allocated(lambda: load_checkpoint(model, path, config, progress=False))
    assert report.fused == {"gate_up_proj": ("gate_proj", "up_proj")}
    bound = unique_bytes(list(model.parameters())) + i * h * 2 + 16 * chunked.CHUNK_NUMEL
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
    block = [128, 128] if granularity == "block" else [1, -1]
    q, scale = quant.quantize(torch.cat([tensors["gate_proj.weight"], tensors["up_proj.weight"]]), block)
    layer = model.gate_up_proj
    assert torch.equal(layer._parameters["weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv if granularity == "block" else layer.weight_scale, scale)


def test_convert_peak_is_one_output_file_plus_one_bf16_tensor(tmp_path):
    """convert holds one output file at a time: peak <= largest output file + largest bf16 tensor +
    workspace, well below the fp8 model."""
    cfg = llama_config(hidden=512, inter=2048, layers=4)
    state = reference_model(cfg).state_dict()
    src = write_checkpoint(tmp_path / "src", state, shards=4, extra_config=cfg.to_dict())
    report, peak = peak_allocated(lambda: convert(src, tmp_path / "dst", progress=False))
    assert len(report.quantized) == 28 and list(report.not_quantized) == ["lm_head"]  # bf16 by default
    files = sorted((tmp_path / "dst").glob("*.safetensors"))
    assert len(files) == 4
    largest_file = max(f.stat().st_size for f in files)
    bound = largest_file + max(t.numel() * t.element_size() for t in state.values()) + 16 * chunked.CHUNK_NUMEL
    total = sum(f.stat().st_size for f in files)
    assert total > 1.5 * bound
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]


# --- on the GPU ------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_block_checkpoint_loads_and_compiles(tmp_path):
    cfg = llama_config()
    state = reference_model(cfg).state_dict()
    tensors, qc, deq = fp8_checkpoint(state, "block", block=(128, 128))
    path = write_checkpoint(tmp_path / "ckpt", tensors, qc, shards=2, extra_config=cfg.to_dict())
    model = meta_model(path)
    load_checkpoint(model, path, device="cuda", progress=False)
    assert all(t.is_cuda for t in list(model.parameters()) + list(model.buffers()))
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)(IDS.cuda()).logits.float().cpu()
    assert {s.fqn for s in backend.report.rewritten} == set(LINEARS)
    assert rel_err(compiled, float_logits(cfg, state, deq, IDS)) < 0.1


@pytest.mark.cuda
def test_cuda_streaming_bf16_load_peak(tmp_path):
    """As the CPU test, measured by the CUDA caching allocator: tensors are read on the CPU, moved to
    the GPU one at a time and quantized there."""
    cfg = llama_config(hidden=512, inter=2048, layers=4)
    state = reference_model(cfg).state_dict()
    path = write_checkpoint(tmp_path / "ckpt", state, extra_config=cfg.to_dict())
    model = meta_model(path)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    load_checkpoint(model, path, fp8fx.Fp8Config(ignored_layers=["lm_head"]), device="cuda", progress=False)
    peak = torch.cuda.max_memory_allocated() - start
    final = unique_bytes(list(model.parameters()) + list(model.buffers()))
    bound = final + max(t.numel() * t.element_size() for t in state.values()) + 16 * chunked.CHUNK_NUMEL
    assert final <= peak <= bound, f"peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"
