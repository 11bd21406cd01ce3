"""load_checkpoint on a tiny model with HF names: every format, fused layers, KV-cache scales, ignore lists,
bad checkpoints (each an error naming the tensor, with the model unchanged).

Checkpoints are written here with safetensors and this file's own float64 quantization; the loaded
model's dequantized weights and outputs are compared with float64 dequantized references."""
import json
import logging
import math
import re

import pytest
import torch
from torch import nn

import fp8fx
from fp8fx.checkpoint import CheckpointError, load_checkpoint
from fp8fx.weights import is_quantized
from fp8fx.weights.linear import kept_by_the_model
from tests.conftest import rel_err

safetensors_torch = pytest.importorskip("safetensors.torch")

H, KV, INTER, VOCAB = 64, 32, 96, 128
FP8 = torch.float8_e4m3fn


# --- a tiny model with HF names, optionally holding q/k/v and gate/up fused --------------------
class TinyAttention(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.fused = fused
        if fused:
            self.qkv_proj = nn.Linear(H, H + 2 * KV, bias=True)
        else:
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(H, H), nn.Linear(H, KV), nn.Linear(H, KV)
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, x):
        if self.fused:
            q, k, v = self.qkv_proj(x).split([H, KV, KV], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(q * torch.sigmoid(torch.cat([k, v], dim=-1)))


class TinyMLP(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up_proj = nn.Linear(H, 2 * INTER, bias=False)
        else:
            self.gate_proj, self.up_proj = nn.Linear(H, INTER, bias=False), nn.Linear(H, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, H, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1) if self.fused else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(torch.nn.functional.silu(gate) * up)


class TinyLayer(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.self_attn, self.mlp, self.norm = TinyAttention(fused), TinyMLP(fused), nn.LayerNorm(H)

    def forward(self, x):
        x = x + self.self_attn(self.norm(x))
        return x + self.mlp(x)


class TinyInner(nn.Module):
    def __init__(self, fused, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(TinyLayer(fused) for _ in range(layers))
        self.register_buffer("position_ids", torch.arange(8))  # a persistent buffer

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return x


class Tiny(nn.Module):
    def __init__(self, fused=False, layers=2):
        super().__init__()
        self.model, self.lm_head = TinyInner(fused, layers), nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
LINEARS = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ]


def meta_tiny(fused=False, dtype=torch.bfloat16, layers=2):
    with torch.device("meta"):
        return Tiny(fused, layers).to(dtype)


def bf16_state(seed=0):
    """The unfused model's weights (bf16), with per-row magnitudes that differ a lot."""
    torch.manual_seed(seed)
    sd = Tiny().state_dict()
    for name, t in sd.items():
        if name.endswith("weight") and t.dim() == 2:
            sd[name] = t * torch.logspace(-1, 1, t.shape[0]).unsqueeze(1)
    return {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in sd.items()}


# --- this test's own fp8 quantization (float64) ------------------------------------------------
def ref_quantize(w, granularity, block=(32, 32)):
    """(q fp8, scale fp32) with scale = amax / 448 per tensor / row / block, computed in float64."""
    w = w.double()
    if granularity == "tensor":
        scale = w.abs().max() / 448
        expanded = scale
    elif granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        expanded = scale
    else:
        bn, bk = block
        n, k = w.shape
        scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float64)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448
        expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    scale = scale.float()
    q = (w / expanded.float().double()).clamp(-448, 448).to(FP8)
    return q, scale


def ref_dequantize(q, scale, granularity, block=(32, 32)):
    if granularity == "tensor":
        return q.double() * scale.double()
    if granularity == "channel":
        return q.double() * scale.double().reshape(-1, 1)
    n, k = q.shape
    bn, bk = block
    return q.double() * scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def fp8_checkpoint(state, granularity, *, static=False, ignore=("lm_head",), ct=False, block=(32, 32)):
    """(tensors, quantization_config) of an fp8 checkpoint of ``state``; also returns the dequantized
    float64 weights of the quantized layers."""
    tensors, deq = {}, {}
    for name, t in state.items():
        module = name.rpartition(".")[0]
        ignored = any(module == i or module.startswith(i + ".") for i in ignore)
        if name.endswith(".weight") and module in LINEARS + ["lm_head"] and not ignored:
            q, s = ref_quantize(t, granularity, block)
            scale_name = "weight_scale_inv" if granularity == "block" and not ct else "weight_scale"
            tensors[name], tensors[f"{module}.{scale_name}"] = q, (s.reshape(()) if granularity == "tensor" else s)
            deq[module] = ref_dequantize(q, s, granularity, block)
            if static:
                tensors[f"{module}.input_scale"] = torch.tensor([0.01 * (1 + len(deq) % 3)])
        else:
            tensors[name] = t
    return tensors, quantization_config(granularity, block, static, ct, ignore), deq


def quantization_config(granularity: str, block, static: bool, ct: bool, ignore) -> dict:
    """config.json's quantization_config for a checkpoint written with these settings: compressed-tensors
    (``ct``) or fp8."""
    if ct:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": granularity,
                   "block_structure": list(block) if granularity == "block" else None}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                "strategy": "tensor" if static else ("group" if granularity == "block" else "token"),
                "group_size": block[1] if granularity == "block" else None}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignore),
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}
    qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic", "ignored_layers": list(ignore)}
    if granularity == "block":
        qc["weight_block_size"] = list(block)
    return qc


def write_checkpoint(path, tensors, qc=None, shards=1, extra_config=None):
    """safetensors files (split round-robin into ``shards`` files with an index) + config.json."""
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        safetensors_torch.save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n].contiguous() for n in names[i::shards]}
            safetensors_torch.save_file(part, str(path / file))
            weight_map.update({n: file for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = dict(extra_config or {})
    if qc is not None:
        config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return path


def float_reference(state, deq, ids):
    """The unfused model in float64 with the dequantized weights: what the fp8 model approximates."""
    model = Tiny().double()
    sd = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    sd.update({f"{m}.weight": w for m, w in deq.items()})
    model.load_state_dict(sd)
    with torch.no_grad():
        return model(ids)


def snapshot(model):
    return {n: (id(p), p.device, p.dtype) for n, p in model.state_dict(keep_vars=True).items()}, [
        type(m) for m in model.modules()
    ]


def assert_unchanged(model, snap):
    """Same tensor objects (still on meta), same classes, no fp8fx attributes, no KV scales."""
    assert snapshot(model) == snap
    assert not any(is_quantized(m) for m in model.modules())
    assert not any(hasattr(m, "_fp8fx_partitions") or "k_scale" in m._buffers for m in model.modules())
    assert not hasattr(model, "_fp8fx_source")


IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


# --- formats -----------------------------------------------------------------------------------
FORMATS = {
    "fp8-per-tensor": dict(granularity="tensor"),
    "fp8-per-tensor-static": dict(granularity="tensor", static=True),
    "fp8-block": dict(granularity="block"),
    "ct-tensor": dict(granularity="tensor", ct=True),
    "ct-channel": dict(granularity="channel", ct=True),
    "ct-channel-static": dict(granularity="channel", ct=True, static=True),
    "ct-block": dict(granularity="block", ct=True),
}
SCHEMES = {
    "fp8-per-tensor": "w:per-tensor a:per-token",
    "fp8-per-tensor-static": "w:per-tensor a:static per-tensor",
    "fp8-block": "w:per-block(32x32) a:per-group(1x32)",
    "ct-tensor": "w:per-tensor a:per-token",
    "ct-channel": "w:per-channel a:per-token",
    "ct-channel-static": "w:per-channel a:static per-tensor",
    "ct-block": "w:per-block(32x32) a:per-group(1x32)",
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_format_loads_exact_weights_and_close_outputs(tmp_path, name):
    state = bf16_state()
    tensors, qc, deq = fp8_checkpoint(state, **FORMATS[name])
    path = write_checkpoint(tmp_path / "ckpt", tensors, qc, shards=2)
    model = meta_tiny()
    report = load_checkpoint(model, path, progress=False)
    assert report.quantized == {fqn: SCHEMES[name] for fqn in LINEARS}
    assert report.not_quantized == {"lm_head": "in ignored_layers"}
    for fqn in LINEARS:
        module = model.get_submodule(fqn)
        assert module._parameters["weight"].dtype == FP8
        # the dequantized view is the reference dequantization, rounded to the model's dtype
        assert torch.equal(module.weight, deq[fqn].to(torch.bfloat16)), fqn
    scale = "weight_scale_inv" if "block" in name else "weight_scale"
    assert set(model.model.layers[0].mlp.down_proj.state_dict()) == {"weight", scale} | (
        {"input_scale"} if "static" in name else set()
    )
    assert model.lm_head.weight.dtype == torch.bfloat16 and torch.equal(model.lm_head.weight, state["lm_head.weight"])
    for fqn in LINEARS:
        bias = model.get_submodule(fqn).bias
        assert bias is None if f"{fqn}.bias" not in state else torch.equal(bias, state[f"{fqn}.bias"]), fqn
    assert torch.equal(model.model.position_ids, torch.arange(8))
    assert not any(t.is_meta for t in model.state_dict().values())
    with torch.no_grad():
        out = model(IDS)
    assert rel_err(out, float_reference(state, deq, IDS)) < 0.03  # eager: bf16 compute on the dequantized weights (~1%)


def test_static_input_scales_are_the_checkpoints(tmp_path):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor", static=True)
    model = meta_tiny()
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    for fqn in LINEARS:
        assert torch.equal(model.get_submodule(fqn).input_scale, tensors[f"{fqn}.input_scale"].reshape(1))


def test_compressed_tensors_ignore_regex_and_two_groups(tmp_path):
    """Per-channel attention, block MLP, 're:' ignore of layer 1's MLP."""
    state = bf16_state()
    attn, mlp = [f for f in LINEARS if "self_attn" in f], [f for f in LINEARS if ".mlp." in f]
    t_attn, _, deq_a = fp8_checkpoint(state, "channel", ct=True, ignore=["lm_head"] + mlp)
    t_mlp, qc_mlp, deq_m = fp8_checkpoint(state, "block", ct=True, ignore=["lm_head"] + attn)
    tensors = {**t_attn, **{k: v for k, v in t_mlp.items() if ".mlp." in k}}
    for name in [n for n in tensors if n.startswith("model.layers.1.mlp.")]:
        del tensors[name]
    tensors.update({k: v for k, v in state.items() if k.startswith("model.layers.1.mlp.")})
    _, qc_attn, _ = fp8_checkpoint(state, "channel", ct=True)
    qc = qc_attn
    qc["config_groups"] = {
        "attn": dict(qc_attn["config_groups"]["group_0"], targets=["re:.*self_attn\\..*_proj$"]),
        "mlp": dict(qc_mlp["config_groups"]["group_0"], targets=["Linear"]),
    }
    qc["ignore"] = ["lm_head", "re:model\\.layers\\.1\\.mlp\\."]
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert report.quantized == {
        **{f: "w:per-channel a:per-token" for f in attn},
        **{f: "w:per-block(32x32) a:per-group(1x32)" for f in mlp if "layers.0" in f},
    }
    assert report.not_quantized == {
        "model.layers.1.mlp.gate_proj": "in ignored_layers",
        "model.layers.1.mlp.up_proj": "in ignored_layers",
        "model.layers.1.mlp.down_proj": "in ignored_layers",
        "lm_head": "in ignored_layers",
    }
    q_proj = model.model.layers[1].self_attn.q_proj
    assert torch.equal(q_proj.weight, deq_a["model.layers.1.self_attn.q_proj"].bfloat16())
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, deq_m["model.layers.0.mlp.up_proj"].bfloat16())
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, state["model.layers.1.mlp.up_proj.weight"])


def test_modules_to_not_convert_and_meta_model_in_float32(tmp_path):
    """HF's modules_to_not_convert works as ignored_layers; a float32 model gets float32 views."""
    state = bf16_state()
    tensors, qc, deq = fp8_checkpoint(state, "tensor", ignore=("lm_head", "model.layers.1"))
    qc["modules_to_not_convert"] = qc.pop("ignored_layers")
    model = meta_tiny(dtype=torch.float32)
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert set(report.quantized) == {f for f in LINEARS if "layers.0" in f}
    assert report.not_quantized["model.layers.1.mlp.up_proj"] == "in ignored_layers"
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, deq["model.layers.0.mlp.up_proj"].float())
    assert model.model.layers[1].mlp.up_proj.weight.dtype == torch.float32


def test_a_config_from_modules_to_not_convert_reads_them_as_transformers_does(tmp_path):
    """The README's recipe, load_checkpoint(model, path, Fp8Config.from_config(qc)), on a config whose
    modules_to_not_convert names modules by a suffix ("up_proj", as MiniMax-M2's "gate") was refused ("'up_proj' names
    no module ... no regex or suffix"), where load_checkpoint(model, path) loads it from the very same dict."""
    state = bf16_state()
    tensors, qc, deq = fp8_checkpoint(state, "tensor", ignore=("lm_head", "model.layers.0.mlp.up_proj",
                                                               "model.layers.1.mlp.up_proj"))
    qc.pop("ignored_layers")
    qc["modules_to_not_convert"] = ["lm_head", "up_proj"]
    path = write_checkpoint(tmp_path / "c", tensors, qc)
    config = fp8fx.Fp8Config.from_config(qc)
    assert config.is_ignored("model.layers.1.mlp.up_proj") and not config.is_ignored("model.layers.1.mlp.down_proj")
    assert fp8fx.Fp8Config.from_config(config.to_dict()) == config
    models = []
    for given in (None, config):
        models.append(meta_tiny())
        report = load_checkpoint(models[-1], path, config=given, progress=False)
        assert set(report.quantized) == {f for f in LINEARS if "up_proj" not in f}, report.quantized
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert torch.equal(models[1].model.layers[0].mlp.up_proj.weight, state["model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"modules_to_not_convert entry '\(' is not a regex"):
        fp8fx.Fp8Config(modules_to_not_convert=["("])


def test_user_config_overrides_checkpoint_config(tmp_path):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor", ignore=())
    model = meta_tiny()
    config = fp8fx.Fp8Config(is_checkpoint_fp8_serialized=True, ignored_layers=["lm_head"])
    match = (r"^lm_head\.weight \(float8_e4m3fn \[128, 64\] in model\.safetensors\): a float8 tensor for "
             r"lm_head\.weight, which is not quantized \(in ignored_layers\)")
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), config=config, progress=False)


# --- bf16 checkpoints, quantized online --------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [fp8fx.Fp8Config(ignored_layers=["lm_head"]), fp8fx.Fp8Config(weight_block_size=[32, 32]),
     fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor(), ignored_layers=["lm_head"])],
    ids=["per-channel", "block", "per-tensor"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_bf16_checkpoint_equals_quantize_(tmp_path, config, fused):
    """Loading a bf16 checkpoint with ``config`` gives bit for bit what quantize_ gives on the bf16 model
    (fused: what quantize_ gives on a model built fused from the same weights)."""
    state = bf16_state()
    path = write_checkpoint(tmp_path / "c", state)
    model = meta_tiny(fused)
    report = load_checkpoint(model, path, config, progress=False)
    ref = Tiny(fused).bfloat16()
    ref.load_state_dict(fuse(state) if fused else state)
    fp8fx.quantize_(ref, config)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a,
                                                  b.view(torch.uint8) if b.dtype == FP8 else b), k
    assert report.format.startswith("bf16/fp16, quantized online")
    with torch.no_grad():
        assert torch.equal(model(IDS), ref(IDS))


def fuse(state):
    out = {}
    for k, v in state.items():
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if any(f".{p}." in k for p in parts):
                if f".{parts[0]}." in k:
                    out[k.replace(parts[0], fused)] = torch.cat([state[k.replace(parts[0], p)] for p in parts])
                break
        else:
            out[k] = v
    return out


def test_bf16_checkpoint_without_config_uses_default_and_block_skip(tmp_path):
    """No quantization_config and no config: Fp8Config() (per-channel), every linear. With 64x64 blocks,
    the layers whose shape a block does not divide stay bf16, as with quantize_."""
    state = bf16_state()
    path = write_checkpoint(tmp_path / "c", state)
    model = meta_tiny()
    report = load_checkpoint(model, path, progress=False)
    assert set(report.quantized) == set(LINEARS) | {"lm_head"}
    model = meta_tiny()
    report = load_checkpoint(model, path, fp8fx.Fp8Config(weight_block_size=[64, 64]), progress=False)
    assert report.not_quantized["model.layers.0.self_attn.k_proj"].startswith("weight [32, 64] is not divisible")
    assert report.not_quantized["model.layers.0.mlp.down_proj"].startswith("weight [64, 96] is not divisible")
    assert "model.layers.0.self_attn.q_proj" in report.quantized
    assert torch.equal(model.model.layers[0].self_attn.k_proj.weight, state["model.layers.0.self_attn.k_proj.weight"])


# --- fused layers from separate checkpoint tensors ---------------------------------------------
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_fused_per_channel_and_block_are_exact(tmp_path, granularity):
    state = bf16_state()
    tensors, qc, deq = fp8_checkpoint(state, granularity, ct=True)
    model = meta_tiny(fused=True)
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert report.fused["model.layers.0.self_attn.qkv_proj"] == ("q_proj", "k_proj", "v_proj")
    assert report.fused["model.layers.1.mlp.gate_up_proj"] == ("gate_proj", "up_proj")
    for i in range(2):
        p = f"model.layers.{i}"
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        want = torch.cat([deq[f"{p}.self_attn.{x}_proj"] for x in "qkv"])
        assert torch.equal(attn.qkv_proj.weight, want.bfloat16())
        want = torch.cat([deq[f"{p}.mlp.{x}_proj"] for x in ("gate", "up")])
        assert torch.equal(mlp.gate_up_proj.weight, want.bfloat16())
        bias = torch.cat([state[f"{p}.self_attn.{x}_proj.bias"] for x in "qkv"])
        assert torch.equal(attn.qkv_proj.bias, bias) and not attn.qkv_proj.bias.requires_grad
    with torch.no_grad():
        assert rel_err(model(IDS), float_reference(state, deq, IDS)) < 0.03


def test_mla_fused_qkv_a_proj_loads_from_q_a_proj_and_kv_a_proj_with_mqa(tmp_path):
    """vLLM's DeepSeek-V2/V3 (Kimi, GLM) run MLA's q_a_proj and kv_a_proj_with_mqa as one fused_qkv_a_proj (FUSED): a
    model holding that layer loads it from the two, as it loads qkv_proj."""
    attn = "model.layers.0.self_attn"
    torch.manual_seed(0)
    tensors, deq = {}, []
    for proj, rows in (("q_a_proj", 64), ("kv_a_proj_with_mqa", 48)):  # DeepSeek-V3: 1536 and 512 + 64
        q, s = ref_quantize(torch.randn(rows, H, dtype=torch.bfloat16), "channel")
        tensors[f"{attn}.{proj}.weight"], tensors[f"{attn}.{proj}.weight_scale"] = q, s
        deq.append(ref_dequantize(q, s, "channel"))
    path = write_checkpoint(tmp_path / "c", tensors, quantization_config("channel", None, False, True, ()))
    with torch.device("meta"):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.fused_qkv_a_proj = nn.Linear(H, 112, bias=False, dtype=torch.bfloat16)
        model = nn.Module()
        model.model = nn.Module()
        model.model.layers = nn.ModuleList([layer])
    report = load_checkpoint(model, path, progress=False)
    assert report.fused == {f"{attn}.fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
    assert list(report.quantized) == [f"{attn}.fused_qkv_a_proj"]
    assert torch.equal(layer.self_attn.fused_qkv_a_proj.weight, torch.cat(deq).bfloat16())


def test_fused_per_tensor_shards_requantized_to_max_scale(tmp_path):
    """Per-tensor shards with their own scales and static input scales: one scale (the max), one input
    scale (the max); the shard that had the max scale is unchanged bit for bit."""
    state = bf16_state()
    tensors, qc, deq = fp8_checkpoint(state, "tensor", static=True)
    model = meta_tiny(fused=True)
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    p = "model.layers.0.self_attn"
    qkv = model.model.layers[0].self_attn.qkv_proj
    scales = [tensors[f"{p}.{x}_proj.weight_scale"] for x in "qkv"]
    assert qkv.weight_scale.shape == (1,) and qkv.weight_scale.item() == max(s.item() for s in scales)
    assert qkv.input_scale.item() == max(tensors[f"{p}.{x}_proj.input_scale"].item() for x in "qkv")
    biggest = max(range(3), key=lambda i: scales[i].item())
    rows = [(0, H), (H, H + KV), (H + KV, H + 2 * KV)][biggest]
    q = tensors[f"{p}.{'qkv'[biggest]}_proj.weight"]
    assert torch.equal(qkv._parameters["weight"][rows[0] : rows[1]].view(torch.uint8), q.view(torch.uint8))
    want = torch.cat([deq[f"{p}.{x}_proj"] for x in "qkv"])
    assert rel_err(qkv.weight, want) < 0.05  # requantizing the smaller shards costs fp8 rounding once more


def test_a_loaded_model_refuses_a_cast_to_an_8_bit_float_before_converting_anything(tmp_path):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor")
    model = meta_tiny()
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_proj: cast to torch\.float8_e5m2, .*"
                                         r"\(nothing was converted\)$"):
        model.to(torch.float8_e5m2)
    assert {k: v.dtype for k, v in model.state_dict().items()} == dtypes


def test_a_cast_to_float16_past_the_dequantized_range_is_refused_before_converting_anything(tmp_path):
    """load_checkpoint refuses an fp8 layer whose scale takes its dequantized weight past float16's 65504 for a
    float16 model; ``.half()`` of the loaded bf16 model made the same layer, with inf weights and NaN outputs, and
    no error. The cast is refused naming the layer, the model unchanged, the layer's own cast too; a scale whose
    fp8 values stay small enough casts."""
    state = bf16_state()
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    state[q_proj] = state[q_proj].clone()
    state[q_proj][3, 5] = 1e5  # per-channel: row 3's scale 99840 / 448 = 222.9 (1e5 in bf16), its fp8 code 448 at (3, 5)
    tensors, qc, _ = fp8_checkpoint(state, "channel", ct=True)
    model = meta_tiny()
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    snap = snapshot(model)
    match = (r"^model\.layers\.0\.self_attn\.q_proj: cast to torch\.float16, but a scale of 22\d\.\d+ times fp8 "
             r"values up to 448 is beyond torch\.float16's range \(at most 65504\): 1 values of its dequantized weight "
             r"would be inf \(outputs NaN\); keep the model in bfloat16 or float32 \(nothing was converted\)$")
    with pytest.raises(ValueError, match=match):
        model.half()
    assert snapshot(model) == snap  # the same tensors, of the same dtypes
    with pytest.raises(ValueError, match="beyond torch.float16's range"):
        model.model.layers[0].self_attn.q_proj.half()
    model.float()  # (float32 holds it)
    assert torch.isfinite(model.model.layers[0].self_attn.q_proj.weight).all()
    small = meta_tiny()
    load_checkpoint(small, write_checkpoint(tmp_path / "d", *fp8_checkpoint(bf16_state(), "channel", ct=True)[:2]),
                    progress=False)
    small.half()
    assert small.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16


def test_kv_scales_stay_float32_through_a_cast(tmp_path):
    """KV-cache scales are float32 buffers of the attentions; ``model.to(torch.bfloat16)`` cast them (0.0123 became
    0.01233, which save_checkpoint then wrote), where the layers' scales stay float32. They follow device moves only."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0123)
    model = meta_tiny()
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    model.to(torch.float16)
    attn = model.model.layers[0].self_attn
    assert attn.k_scale.dtype == torch.float32 and attn.k_scale.item() == torch.tensor(0.0123).item()
    assert attn.q_proj.weight.dtype == torch.float16
    # an attention holding no fp8 layer (its projections kept, as fp8 checkpoints often keep them): its own .half()
    # rounded its scales to float16 (h154)
    kept = tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo")
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True, ignore=("lm_head", *kept))
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0123)
    model = meta_tiny()
    load_checkpoint(model, write_checkpoint(tmp_path / "kept", tensors, qc), progress=False)
    attn = model.model.layers[0].self_attn
    attn.half()
    assert attn.k_scale.dtype == torch.float32 and attn.k_scale.item() == torch.tensor(0.0123).item()
    assert attn.q_proj.weight.dtype == torch.float16


def test_fused_block_shard_not_on_block_rows(tmp_path):
    """A fused block-scaled layer whose first shard (k_proj: 32 rows here) is not a multiple of
    block_n=64: its scale blocks would span two shards."""
    state = bf16_state()
    tensors, qc, _ = fp8_checkpoint(state, "block", block=(64, 32))
    model = meta_tiny(fused=True)
    snap = snapshot(model)
    match = (r"model\.layers\.0\.self_attn\.qkv_proj: output partitions \[64, 32, 32\]"
             r".*multiple of block_n=64.*\(the layer fused from \[.*k_proj")
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert_unchanged(model, snap)


def test_checkpoint_holding_both_fused_and_separate_tensors(tmp_path):
    state = bf16_state()
    state["model.layers.0.mlp.gate_up_proj.weight"] = torch.zeros(2 * INTER, H, dtype=torch.bfloat16)
    model = meta_tiny(fused=True)
    match = r"model\.layers\.0\.mlp\.gate_up_proj: the checkpoint holds it both fused"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", state), progress=False)


@pytest.mark.parametrize("fmt", ["e4m3", "E5M2", "e4m3fnuz", "int8", "torch", "", "ignored"])
def test_e5m2_checkpoints_are_refused_as_such(tmp_path, fmt):
    """DeepSeek-V3's quantization_config key "fmt" was never read, and e5m2 codes were refused as "declared
    float8_e4m3fn" with the ignore list as the fix, which refuses them too - or, for a layer in the ignore list,
    with the fix "the ignore list" (a review's catch). The config's fmt and the codes' dtype are each refused as
    what they are, naming the fix; the model is untouched. A fmt of another format (e4m3fnuz, whose codes read as
    e4m3fn are twice their values; int8) is refused too."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "block", ignore=("lm_head", "model.layers.1.mlp.down_proj"))
    layer = "model.layers.1.mlp.down_proj"
    tensors[f"{layer}.weight"] = tensors[f"{layer}.weight"].float().to(torch.float8_e5m2)
    if fmt == "ignored":  # (the layer the e5m2 codes are for is in the ignore list, and fmt is not given)
        name = f"{layer}.weight"
    else:
        qc["fmt"], qc["ignored_layers"], name = fmt, ["lm_head"], layer
    model = meta_tiny()
    snap = snapshot(model)
    match = (rf"quantization_config\['fmt'\]='{fmt}': fp8fx reads fp8 weights in e4m3 \(float8_e4m3fn\).* load the "
             r"model's bf16 checkpoint" if fmt not in ("e4m3", "ignored") else
             rf"{layer}\.weight \(float8_e5m2 \[64, 96\] in model\.safetensors\): float8_e5m2 codes for {name}, "
             r"and fp8fx reads float8_e4m3fn ones .* re-export this one with e4m3 codes")
    with pytest.raises((CheckpointError, ValueError), match=match):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("fmt", ["e4m3", "E4M3", "float8_e4m3fn", "fp8_e4m3", "F8_E4M3", "torch.float8_e4m3fn", "fp8",
                                 "float8-e4m3fn", "e4m3_fn", None])
def test_fmt_spellings_of_e4m3_load(tmp_path, fmt):
    """Only a fmt naming e5m2 is refused: the other spellings of e4m3 (and null) load as before the key was read,
    as vLLM, which does not read it, loads them (a review's catch)."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "block")
    qc["fmt"] = fmt
    model = meta_tiny()
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert is_quantized(model.model.layers[0].mlp.down_proj)


# --- KV-cache scales ---------------------------------------------------------------------------
@pytest.mark.parametrize("naming", ["attn", "vllm", "output_scale"])
def test_kv_scales_from_either_naming(tmp_path, naming):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    names = {
        "attn": ("self_attn.k_scale", "self_attn.v_scale"),
        "vllm": ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
        "output_scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    }[naming]
    tensors["model.layers.0." + names[0]] = torch.tensor([0.5])
    tensors["model.layers.0." + names[1]] = torch.tensor(0.25, dtype=torch.bfloat16)
    tensors["model.layers.1." + names[0]] = torch.tensor(2.0)  # layer 1's v_scale is missing
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert attn0.k_scale.item() == 0.5 and attn0.v_scale.item() == 0.25 and attn0.k_scale.shape == ()
    assert attn1.k_scale.item() == 2.0 and attn1.v_scale.item() == 2.0  # vLLM: the one given serves both
    assert report.kv_scales == {
        "model.layers.0.self_attn": {"k_scale": 0.5, "v_scale": 0.25},
        "model.layers.1.self_attn": {"k_scale": 2.0, "v_scale": 2.0},
    }
    assert report.kv_defaults == ["model.layers.1.self_attn.v_scale=k_scale"]
    assert "v_scale=2 (= k_scale: not in the checkpoint)" in str(report)
    assert "model.layers.0.self_attn.k_scale" in model.state_dict()


def test_online_static_load_is_refused_before_reading(tmp_path, monkeypatch):
    """Weights quantized while loading have no input scales: refused at once, nothing read or changed - a bf16
    checkpoint with a static config given, or one whose config.json says fp8, not serialized, static (that one
    streamed every tensor, then failed on the first layer's input_scale)."""
    import fp8fx.checkpoint.load as load_mod

    path = write_checkpoint(tmp_path / "c", bf16_state())
    online_static = write_checkpoint(tmp_path / "d", bf16_state(), qc={
        "quant_method": "fp8", "is_checkpoint_fp8_serialized": False, "activation_scheme": "static"})
    model = meta_tiny()
    snap = snapshot(model)
    monkeypatch.setattr(load_mod, "read_tensor", lambda *a, **k: pytest.fail("a tensor was read"))
    message = r"quantized while loading \(not fp8-serialized\), which gives no static input scales.*'static'"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(model, path, fp8fx.Fp8Config(activation_scheme="static"), progress=False)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(model, online_static, progress=False)
    assert snapshot(model) == snap


def test_a_checkpoint_with_an_online_config_is_a_bf16_one(tmp_path):
    """config.json holding an online config (fp8fx's own to_dict, is_checkpoint_fp8_serialized false): the load was
    named "fp8", so save_checkpoint, keeping the format loaded, refused the per-channel model it had just loaded;
    and a misspelt ignored_layers entry quantized the layer it meant, where the same config as config= is refused."""
    qc = fp8fx.Fp8Config(ignored_layers=["lm_head"]).to_dict()
    path = write_checkpoint(tmp_path / "c", bf16_state(), qc=qc)
    model = meta_tiny()
    report = load_checkpoint(model, path, progress=False)
    assert report.format == "bf16/fp16, quantized online (w:per-channel a:per-token)"
    assert "lm_head" in report.not_quantized and "model.layers.0.mlp.down_proj" in report.quantized
    fp8fx.save_checkpoint(model, tmp_path / "out")
    assert load_checkpoint(meta_tiny(), tmp_path / "out", progress=False).quantized == report.quantized
    typo = write_checkpoint(tmp_path / "t", bf16_state(), qc={**qc, "ignored_layers": ["model.layers.0.mlp.down_prj"]})
    model = meta_tiny()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_prj' names no module of this Tiny or the "
                                         r"checkpoint .*did you mean 'model.layers.0.mlp.down_proj'"):
        load_checkpoint(model, typo, progress=False)
    assert snapshot(model) == snap


def test_legacy_kv_scale_serves_both(tmp_path):
    """The deprecated single ``kv_scale``: read as k_scale, and v_scale follows it (vLLM's rule)."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensors["model.layers.0.self_attn.kv_scale"] = torch.tensor(0.5)
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert report.kv_scales["model.layers.0.self_attn"] == {"k_scale": 0.5, "v_scale": 0.5}
    assert report.kv_scales["model.layers.1.self_attn"] == {"k_scale": 1.0, "v_scale": 1.0}


@pytest.mark.parametrize("strategy", ["attn_head", "channel"])
def test_a_kv_cache_scheme_of_more_scales_than_one_a_layer_is_refused(tmp_path, strategy):
    """A per-head scheme with no scale tensors loaded, every KV-cache scale defaulted to 1.0 with a warning."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False}
    model = meta_tiny()
    with pytest.raises(CheckpointError, match=rf"kv_cache_scheme strategy='{strategy}': fp8fx reads one KV-cache scale "
                                              r"per attention layer .*re-export"):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert all(p.is_meta for p in model.parameters())


def test_a_dynamic_per_head_kv_cache_scheme_loads_without_kv_scales(tmp_path):
    """A dynamic KV cache stores no scales, whatever its strategy: the per-head one was refused as if it held some."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": True}
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert not report.kv_scales and not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("leaf", ["k_proj.kv_scale", "v_proj.kv_scale", "k_proj.v_scale"])
def test_kv_scales_left_under_a_projection_are_refused(tmp_path, leaf):
    """The legacy kv_scale is the attention's (vLLM remaps <owner>.kv_scale to <owner>.attn.k_scale, so one under a
    projection finds no place there and is dropped), and fp8fx remaps only the projection's own scale
    (k_proj.k_scale, v_proj.v_scale, as ModelOpt writes them): v_proj.kv_scale was attached to the linear layer,
    k_proj.kv_scale became the attention's k_scale and v_scale. The error gives the KV-cache reason, as for a module no
    layer is (it blamed "a format mismatch" where the projection is a quantized linear: h154)."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensors[f"model.layers.0.self_attn.{leaf}"] = torch.tensor(0.5)
    model = meta_tiny()
    kv = "k_scale" if leaf.endswith("kv_scale") else leaf.rpartition(".")[2]
    with pytest.raises(CheckpointError, match=rf"self_attn\.{re.escape(leaf)} .* is a scale that no layer takes: a "
                                              rf"KV-cache scale \({kv}\) addressed to model\.layers\.0\.self_attn\."
                                              rf"{leaf[:6]}, a \w+: KV-cache scales belong to attention modules"):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert not any(n.endswith(("k_scale", "v_scale")) for n, _ in model.named_buffers())


def test_kv_scales_without_a_kv_cache_scheme_stay_their_layers(tmp_path):
    """Scales in a compressed-tensors checkpoint that declares no fp8 KV cache (no kv_cache_scheme): the layer that
    has them gets them (its missing v_scale from its k_scale), the others get none, and save_checkpoint declares no
    KV cache either (every attention got 1.0 defaults and the saved checkpoint declared a static fp8 KV cache).
    The fp8 format has no such field: there the scales are the declaration (test_checkpoint_llama)."""
    from fp8fx.checkpoint import save_checkpoint

    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert report.kv_scales == {"model.layers.0.self_attn": {"k_scale": 0.5, "v_scale": 0.5}}
    assert "k_scale" not in model.model.layers[1].self_attn._buffers
    save_checkpoint(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved.get("kv_cache_scheme") is None


def test_kv_scheme_without_scales_defaults_with_a_warning(tmp_path, caplog):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    model = meta_tiny()
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert len(report.kv_defaults) == 4
    assert "4 KV-cache scales the checkpoint does not hold: 1.0" in caplog.text
    assert model.model.layers[1].self_attn.v_scale.item() == 1.0
    assert "kv-cache scales" in str(report)


def _tiny_vlm(transformers, kind):
    """A tiny vision-language model of transformers, in bf16 on the CPU: LLaVA (CLIP vision tower, Llama decoder) or
    Mllama (its own vision tower; a decoder with a cross-attention layer, which has a KV cache)."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=256, pad_token_id=0)
    if kind == "llava":
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
        config = transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(**text),
                                          image_token_index=255)
        return transformers.LlavaForConditionalGeneration(config).bfloat16()
    config = transformers.MllamaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=2, image_size=32, patch_size=8, vision_output_dim=64,
                           intermediate_layers_indices=[0], max_num_tiles=2, supported_aspect_ratios=[[1, 1], [1, 2]]),
        text_config=dict(text, cross_attention_layers=[1]))
    return transformers.MllamaForConditionalGeneration(config).bfloat16()


@pytest.mark.parametrize("kind", ["llava", "mllama"])
def test_declared_kv_cache_gives_vision_tower_attentions_no_scales(tmp_path, kind):
    """A declared fp8 KV cache with no scales in the checkpoint, on a vision-language model: the decoder's attentions
    (self- and Mllama's cross-attention, which have a KV cache: transformers gives them a layer_idx) default to 1.0;
    the vision tower's (CLIPAttention, MllamaVisionAttention: no KV cache, no layer_idx) get none, as vLLM gives
    Fp8KVCacheMethod to its Attention layers only, not to the cacheless encoder attention of a vision tower. They got
    k_scale / v_scale = 1.0, and save_checkpoint wrote them, tensors vLLM has no place for."""
    from safetensors import safe_open

    from fp8fx.checkpoint import save_checkpoint

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    path = tmp_path / "c"
    _tiny_vlm(transformers, kind).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "is_checkpoint_fp8_serialized": False,
                                     "activation_scheme": "dynamic", "kv_cache_scheme": "static"}
    (path / "config.json").write_text(json.dumps(config))
    model = _tiny_vlm(transformers, kind)
    report = load_checkpoint(model, path, progress=False)
    decoder = {"llava": ["model.language_model.layers.0.self_attn", "model.language_model.layers.1.self_attn"],
               "mllama": ["model.language_model.layers.0.self_attn", "model.language_model.layers.1.cross_attn"]}[kind]
    assert sorted(report.kv_scales) == decoder
    assert all(s == {"k_scale": 1.0, "v_scale": 1.0} for s in report.kv_scales.values())
    tower = model.model.vision_tower if kind == "llava" else model.model.vision_model
    assert not any(n.endswith(("k_scale", "v_scale")) for n, _ in tower.named_buffers())
    save_checkpoint(model, tmp_path / "saved", format="compressed-tensors")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        saved = sorted(n for n in f.keys() if n.endswith(("k_scale", "v_scale")))
    assert saved == sorted(f"{a}.{s}" for a in decoder for s in ("k_scale", "v_scale"))
    saved_qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved_qc["kv_cache_scheme"] is not None


def test_a_vlm_and_falcon_h1_load_into_meta_models_with_what_transformers_computes(tmp_path):
    """Tensors no checkpoint holds, on a meta model, are computed as transformers initializes them: LLaVA's vision
    tower's position_ids by its CLIPVisionModel's initializer (the whole model's does not know them), Falcon-H1's
    mixers' mup_vector by its FalconH1Model's, called on that model (not on the mixer). Both failed to load; the
    checkpoint and config.json here are save_checkpoint's, of models built from their configs, which name no
    architectures (meta_model took AutoModelForCausalLM's class, which LLaVA has not)."""
    from fp8fx.checkpoint import meta_model, save_checkpoint

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    falcon = transformers.FalconH1Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64,
                                         mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                                         mamba_chunk_size=16)
    llava = _tiny_vlm(transformers, "llava")
    for name, cls, config in [("llava", type(llava), llava.config), ("falcon", transformers.FalconH1ForCausalLM, falcon)]:
        model = cls._from_config(config, dtype=torch.bfloat16).eval()  # (its rotary tables float32, as loaded)
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
        save_checkpoint(model, tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["architectures"] == [type(model).__name__]
        loaded = meta_model(tmp_path / name)
        assert type(loaded) is type(model)
        load_checkpoint(loaded, tmp_path / name, progress=False)
        want = dict(model.named_buffers())
        for key, buf in loaded.named_buffers():  # (the computed ones among them)
            assert torch.equal(buf, want[key]), key
        ids = torch.randint(1, 100, (1, 6))
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, model(ids).logits), name


def test_declared_kv_cache_attentions_are_the_decoders_even_where_towers_carry_a_layer_idx():
    """Gemma4's vision and audio towers' attentions carry a layer_idx (the mark of a decoder attention elsewhere): a
    declared fp8 KV cache gave them scales too (28 of 58 attentions at Gemma4's sizes). Those of the decoder
    get_decoder() returns are chosen."""
    from fp8fx.weights.kv_cache import kv_cache_attentions

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4Config"):
        pytest.skip("transformers without Gemma4")
    from transformers.models.gemma4 import configuration_gemma4 as c

    config = transformers.Gemma4Config(text_config=c.Gemma4TextConfig(num_hidden_layers=2),
                                       vision_config=c.Gemma4VisionConfig(num_hidden_layers=2),
                                       audio_config=c.Gemma4AudioConfig(num_hidden_layers=2))
    with torch.device("meta"):
        model = transformers.Gemma4ForConditionalGeneration(config)
    modules = dict(model.named_modules())
    assert any("_tower." in f for f in kv_cache_attentions(modules))  # layer_idx alone: the towers' too
    assert kv_cache_attentions(modules, model) == [f"model.language_model.layers.{i}.self_attn" for i in range(2)]


def test_declared_kv_cache_scales_go_to_the_attention_that_holds_the_cache_inside_a_wrapper(tmp_path):
    """T5 wraps each T5Attention (the one with a layer_idx: the KV cache's) in a T5LayerSelfAttention /
    T5LayerCrossAttention, whose names end in Attention too. The outermost were taken: a declared fp8 KV cache gave
    the wrappers scales of 1.0 beside the checkpoint's on the T5Attentions, warned of as missing and saved; and
    get_quant_method gave Fp8KVCacheMethod to the wrapper with model= and to the T5Attention without (h154)."""
    from safetensors.torch import load_file, save_file

    from fp8fx.checkpoint import save_checkpoint

    transformers = pytest.importorskip("transformers")

    def t5():
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2))

    model = t5()
    fp8fx.quantize_(model)
    save_checkpoint(model, tmp_path / "c")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False}
    (tmp_path / "c" / "config.json").write_text(json.dumps(config))
    self_attn, cross = "decoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.1.EncDecAttention"
    file = str(tmp_path / "c" / "model.safetensors")
    plain = load_file(file)
    report = load_checkpoint(t5(), tmp_path / "c", progress=False)  # none held: 1.0 for the decoder's two
    assert report.kv_scales == {a: {"k_scale": 1.0, "v_scale": 1.0} for a in (self_attn, cross)}, report.kv_scales
    save_file({**plain, f"{self_attn}.k_scale": torch.tensor(0.02)}, file)
    loaded = t5()
    report = load_checkpoint(loaded, tmp_path / "c", progress=False)
    assert report.kv_scales == {self_attn: {"k_scale": pytest.approx(0.02), "v_scale": pytest.approx(0.02)},
                                cross: {"k_scale": 1.0, "v_scale": 1.0}}, report.kv_scales
    assert report.kv_defaults == [f"{self_attn}.v_scale=k_scale", f"{cross}.k_scale", f"{cross}.v_scale"]
    modules = dict(loaded.named_modules())
    config = fp8fx.Fp8Config(is_checkpoint_fp8_serialized=True)
    for name in (self_attn, self_attn.rpartition(".")[0]):  # (with the model or without: the same module)
        picked = {type(config.get_quant_method(modules[name], name, **kw)).__name__ for kw in ({}, {"model": loaded})}
        assert picked == ({"Fp8KVCacheMethod"} if name == self_attn else {"NoneType"}), (name, picked)
    # a checkpoint holding the scale on the wrapper: the attention inside it gets none of its own
    save_file({**plain, "decoder.block.0.layer.0.k_scale": torch.tensor(0.02)}, file)
    report = load_checkpoint(t5(), tmp_path / "c", progress=False)
    assert set(report.kv_scales) == {"decoder.block.0.layer.0", cross}, report.kv_scales


def test_kv_scale_clashing_with_a_model_attribute_is_refused_unchanged(tmp_path):
    """An attention module whose ``k_scale`` is a plain float (not a buffer): ``register_buffer`` would refuse it
    after the linears were swapped in; the loader refuses the checkpoint before, naming the attribute."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    model = meta_tiny()
    model.model.layers[0].self_attn.k_scale = 1.0
    snap = snapshot(model)
    match = r"model\.layers\.0\.self_attn\.k_scale: TinyAttention already has an attribute 'k_scale' \(float\)"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert snapshot(model) == snap and not is_quantized(model.model.layers[0].self_attn.q_proj)


def test_kv_scales_running_out_of_memory_leave_the_model_unchanged(tmp_path, monkeypatch):
    """The KV-cache scales' tensors are new ones on the load's device (on a GPU, allocations). They were made in
    commit, after the linears were swapped in: one out of memory there left every layer fp8, layer 0 alone with its
    scales, and the model refused a load again ("already fp8-quantized"). They are made before anything is swapped
    in: the error leaves the model as it was, and it loads again."""
    from fp8fx.weights import kv_cache

    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.25)
    path = write_checkpoint(tmp_path / "c", tensors, qc)
    model = meta_tiny()
    snap = snapshot(model)
    made, real = [], kv_cache.kv_scale_tensor

    def out_of_memory_at_the_second(value, device=None):
        made.append(value)
        if len(made) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(value, device)

    monkeypatch.setattr(kv_cache, "kv_scale_tensor", out_of_memory_at_the_second)
    with pytest.raises(torch.OutOfMemoryError):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)
    monkeypatch.setattr(kv_cache, "kv_scale_tensor", real)
    report = load_checkpoint(model, path, progress=False)
    assert report.kv_scales == {"model.layers.0.self_attn": {"k_scale": 0.5, "v_scale": 0.5},
                                "model.layers.1.self_attn": {"k_scale": 0.25, "v_scale": 0.25}}
    assert model.model.layers[1].self_attn.v_scale.item() == 0.25 and is_quantized(model.model.layers[1].mlp.up_proj)


def test_kv_default_where_the_model_has_its_own_attribute_is_not_set(tmp_path, caplog):
    """A declared fp8 KV cache with no scales in the checkpoint, and an attention that uses ``v_scale`` for a float of
    its own (as transformers' MiMo-V2-Flash attention does): its default is not forced on it - the load goes on, the
    report and the log say which scale was not set - where it refused the checkpoint, naming tensors it does not
    hold. Its k_scale and the other layers' scales default as usual."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    model = meta_tiny()
    model.model.layers[0].self_attn.v_scale = 0.125
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    attn0 = model.model.layers[0].self_attn
    assert attn0.v_scale == 0.125 and "v_scale" not in attn0._buffers and attn0.k_scale.item() == 1.0
    assert report.kv_not_set == ["model.layers.0.self_attn.v_scale"]
    assert len(report.kv_defaults) == 3 and model.model.layers[1].self_attn.v_scale.item() == 1.0
    assert "not set: the model has an attribute of that name" in str(report)
    assert "1 KV-cache scales the checkpoint does not hold are not set" in caplog.text


def test_a_buffer_of_the_models_own_named_as_a_kv_scale_is_kept(tmp_path):
    """A buffer the model computes with under a KV-cache scale's name (Gemma3n's audio attention scales its queries
    by a non-persistent q_scale): a default does not replace it (listed as not set) and a checkpoint tensor for it is
    refused, naming it, the model unchanged. Before, both replaced it silently (0.125 became 1.0)."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    model = meta_tiny()
    attn0 = model.model.layers[0].self_attn
    attn0.register_buffer("v_scale", torch.tensor(0.125), persistent=False)
    report = load_checkpoint(model, write_checkpoint(tmp_path / "a", tensors, qc), progress=False)
    assert attn0.v_scale.item() == 0.125 and report.kv_not_set == ["model.layers.0.self_attn.v_scale"]
    assert attn0.k_scale.item() == 1.0 and model.model.layers[1].self_attn.v_scale.item() == 1.0

    tensors["model.layers.0.self_attn.q_scale"] = torch.tensor(0.02)
    model = meta_tiny()
    model.model.layers[0].self_attn.register_buffer("q_scale", torch.tensor(0.0883), persistent=False)
    snap = snapshot(model)
    match = (r"model\.layers\.0\.self_attn\.q_scale: TinyAttention already has a buffer 'q_scale' of its own \(not "
             r"in its state_dict\)")
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, write_checkpoint(tmp_path / "b", tensors, qc), progress=False)
    assert snapshot(model) == snap and model.model.layers[0].self_attn.q_scale.item() == pytest.approx(0.0883)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.k_scale", "model.layers.0.k_scale", "model.embed_tokens.kv_scale"])
def test_kv_scale_addressed_to_a_module_that_is_not_an_attention_is_refused(tmp_path, name):
    """vLLM drops a KV-cache scale whose module is no attention; fp8fx attached it to the MLP, the decoder layer or the
    embedding, where no attention reads it (and save_checkpoint wrote it back). Now a scale with no place: refused,
    naming the module's class, the model unchanged."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensors[name] = torch.tensor(0.5)
    model = meta_tiny()
    snap = snapshot(model)
    match = rf"{re.escape(name)} .* a KV-cache scale \(k_scale\) addressed to .*, a \w+: KV-cache scales belong to attention"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert snapshot(model) == snap


def test_per_head_kv_scales_are_refused_before_reading(tmp_path, monkeypatch):
    """A per-head k_scale ([4]) or an integer one: refused from the checkpoint's header, before any tensor is read (it
    was refused after streaming the tensors before it), the model unchanged."""
    import fp8fx.checkpoint.load as load_mod

    for value, match in [(torch.ones(4), r"self_attn\.k_scale: a KV-cache scale is one value, got shape \[4\]"),
                         (torch.ones((), dtype=torch.int32), r"self_attn\.k_scale: dtype torch\.int32 is not a float")]:
        tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
        qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
        tensors["model.layers.1.self_attn.k_scale"] = value
        path = write_checkpoint(tmp_path / str(value.dtype), tensors, qc)
        model = meta_tiny()
        snap = snapshot(model)
        with monkeypatch.context() as m:
            m.setattr(load_mod, "read_tensor", lambda *a, **k: pytest.fail("a tensor was read"))
            with pytest.raises(CheckpointError, match=match):
                load_checkpoint(model, path, progress=False)
        assert snapshot(model) == snap


def test_no_kv_scheme_no_kv_scales(tmp_path):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert report.kv_scales == {} and "k_scale" not in model.model.layers[0].self_attn._buffers


# --- bad checkpoints: an error naming the tensor, and the model unchanged -----------------------
def _case(mutate, granularity="tensor", **kw):
    def build():
        tensors, qc, _ = fp8_checkpoint(bf16_state(), granularity, **kw)
        mutate(tensors, qc)
        return tensors, qc
    return build


DOWN = "model.layers.1.mlp.down_proj"
BAD = {
    "missing scale": (
        _case(lambda t, qc: t.pop(f"{DOWN}.weight_scale")),
        rf"^{DOWN}\.weight_scale is missing from the checkpoint \(per-tensor\)",
    ),
    "missing weight": (
        _case(lambda t, qc: t.pop("model.layers.0.norm.weight")),
        r"^model\.layers\.0\.norm\.weight is missing from the checkpoint",
    ),
    "extra scale on an ignored layer": (
        _case(lambda t, qc: t.update({"lm_head.weight_scale": torch.tensor(1.0)})),
        r"^lm_head\.weight_scale \(float32 \[\] in model\.safetensors\) is a scale that no layer takes: "
        r"lm_head is not quantized \(in ignored_layers\)",
    ),
    # a module the model has, which no fp8fx layer is (it said "the model has no module 'model.layers.0.norm'" and
    # advised key_mapping=)
    "extra scale on a norm": (
        _case(lambda t, qc: t.update({"model.layers.0.norm.weight_scale": torch.tensor(1.0)})),
        r"^model\.layers\.0\.norm\.weight_scale \(float32 \[\] in model\.safetensors\) is a scale that no layer "
        r"takes: model\.layers\.0\.norm is a \w+, which takes no tensor named weight_scale \(fp8fx quantizes linear "
        r"layers and experts, and no other module\): drop the tensor from the checkpoint",
    ),
    "extra zero point": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight_zero_point": torch.zeros(64, 1)}), "channel", ct=True),
        rf"^{DOWN}\.weight_zero_point .* has no place in {DOWN} \(quantized: w:per-channel a:per-token",
    ),
    "input scale with dynamic activations": (
        _case(lambda t, qc: t.update({f"{DOWN}.input_scale": torch.tensor(1.0)})),
        rf"^{DOWN}\.input_scale .*: the checkpoint has static input scales but its quantization_config says dynamic",
    ),
    "scale of the wrong shape": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight_scale": torch.ones(64)})),
        rf"^{DOWN}\.weight_scale \(float32 \[64\] in model\.safetensors\): a per-tensor weight \[64, 96\] needs one "
        r"value, shape \[\] or \[1\]",
    ),
    "block scale of the wrong shape": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight_scale_inv": torch.ones(2, 2)}), "block"),
        rf"^{DOWN}\.weight_scale_inv \(float32 \[2, 2\] .*\): a per-block\(32x32\) weight \[64, 96\] needs shape "
        r"\[2, 3\] = ceil\(\[64, 96\] / \[32, 32\]\)",
    ),
    "scale of the wrong dtype": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight_scale": torch.tensor(1, dtype=torch.int32)})),
        rf"^{DOWN}\.weight_scale \(int32 \[\] .*\): scales are float32",
    ),
    "fp8 scale": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight_scale": torch.tensor(1.0).to(FP8)})),
        rf"^{DOWN}\.weight_scale \(float8_e4m3fn \[\] .*\): scales are float32",
    ),
    "bf16 weight in an fp8 checkpoint": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight": torch.zeros(64, 96, dtype=torch.bfloat16)})),
        rf"^{DOWN}\.weight \(bfloat16 \[64, 96\] .*\): {DOWN} is declared float8_e4m3fn",
    ),
    "e5m2 weight": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight": t[f"{DOWN}.weight"].float().to(torch.float8_e5m2)})),
        rf"^{DOWN}\.weight \(float8_e5m2 \[64, 96\] .*\): float8_e5m2 codes for {DOWN}, and fp8fx reads "
        r"float8_e4m3fn ones",
    ),
    "fp8 weight without quantization_config": (
        _case(lambda t, qc: qc.clear()),
        r"^model\.layers\.0\.self_attn\.q_proj\.weight \(float8_e4m3fn .*expected a bf16/fp16/fp32 weight; config\.json "
        r"has no quantization_config",
    ),
    "unknown quant_method": (
        _case(lambda t, qc: qc.update(quant_method="awq")),
        r"^config\.json: quantization_config\.quant_method='awq' is not a format fp8fx loads",
    ),
    "a misspelt ignore entry": (  # (the entry was not named: h156)
        _case(lambda t, qc: (t.update({f"{DOWN}.weight": t[f"{DOWN}.weight"].bfloat16()}),
                             qc.update(ignored_layers=["lm_head", DOWN[:-4] + "prj"]))),
        rf"^{DOWN}\.weight \(bfloat16 .* re-export the checkpoint; its ignore list's '{DOWN[:-4]}prj' names no "
        rf"module: a misspelling of '{DOWN}'\?$",
    ),
    "an fp8 method of another kind": (  # (its own words, as Fp8Config.from_config says them: h156)
        _case(lambda t, qc: qc.update(quant_method="fbgemm_fp8")),
        r"^config\.json: quantization_config\.quant_method='fbgemm_fp8': FBGEMM's fp8 checkpoints .* "
        r"weight_granularity=fp8fx\.PerRow\(\)\) and its ignore list; pass that config as "
        r"load_checkpoint\(\.\.\., config=\.\.\.\)$",
    ),
    "NaN scale": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight_scale": torch.tensor(float("nan"))})),
        rf"^{DOWN}\.weight_scale \(float32 \[\] in .*\): 1 scales are not positive finite floats \(nan at \[\]\)",
    ),
    "Inf scale": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight_scale": torch.tensor(float("inf"))})),
        rf"^{DOWN}\.weight_scale .*\(inf at \[\]\)",
    ),
    "zero scale": (
        _case(lambda t, qc: t[f"{DOWN}.weight_scale"].__setitem__((5, 0), 0.0), "channel", ct=True),
        rf"^{DOWN}\.weight_scale \(float32 \[64, 1\] .*\): 1 scales are not positive finite floats \(0\.0 at \[5, 0\]\)",
    ),
    "negative scale": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight_scale_inv": -t[f"{DOWN}.weight_scale_inv"]}), "block"),
        rf"^{DOWN}\.weight_scale_inv .*: 6 scales are not positive finite floats \(-",
    ),
    "NaN in an fp8 weight": (
        _case(lambda t, qc: t[f"{DOWN}.weight"].view(torch.uint8).__setitem__((3, 3), 0x7F)),
        rf"^{DOWN}\.weight \(float8_e4m3fn \[64, 96\] .*\) has 1 NaN/Inf values; fp8 codes hold no NaN in a sound "
        rf"checkpoint \(the ignore list cannot take them.*\): re-export {DOWN} from its high-precision weights$",
    ),
    "negative input scale": (
        _case(lambda t, qc: t.update({f"{DOWN}.input_scale": torch.tensor([-1.0])}), static=True),
        rf"^{DOWN}\.input_scale .*\(-1\.0 at \[0\]\)",
    ),
    "subnormal input scale": (  # positive, but static activations are divided by it (quantize_ refused it)
        _case(lambda t, qc: t.update({f"{DOWN}.input_scale": torch.tensor([1e-40])}), static=True),
        rf"^{DOWN}\.input_scale .*: 1 scales are not positive finite floats \(9\.99\d+e-41 at \[0\]\); a scale of 0, "
        r"<0, below float32's normal range \(1\.2e-38\)",
    ),
    "missing input scale": (
        _case(lambda t, qc: t.pop(f"{DOWN}.input_scale"), static=True),
        rf"^{DOWN}\.input_scale is missing from the checkpoint \(activation_scheme static\); its quantization_config "
        r"says static activations, .*: re-export the checkpoint with every layer's \(fp8fx\.calibrate gives them\), "
        r"or remove its input_scale tensors",
    ),
    "bad KV scale": (
        _case(lambda t, qc: t.update({"model.layers.1.self_attn.v_scale": torch.tensor(-2.0)})),
        r"^model\.layers\.1\.self_attn\.v_scale=-2\.0: a KV-cache scale must be a positive finite float",
    ),
    "subnormal KV scale": (  # positive, but 1 / scale, what the KV cache is quantized with, was inf
        _case(lambda t, qc: t.update({"model.layers.1.self_attn.v_scale": torch.tensor(1e-40)})),
        r"^model\.layers\.1\.self_attn\.v_scale=9\.9999\d+e-41: a KV-cache scale must be a positive finite float32 of "
        r"normal range \(at least 1\.17549e-38: 1 / scale is taken\)",
    ),
    "non-scalar KV scale": (
        _case(lambda t, qc: t.update({"model.layers.1.self_attn.k_proj.output_scale": torch.ones(4)})),
        r"^model\.layers\.1\.self_attn\.k_proj\.output_scale: a KV-cache scale is one value, got shape \[4\]",
    ),
    "weight of the wrong shape": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight": t[f"{DOWN}.weight"][:, :64].contiguous()})),
        rf"^{DOWN}\.weight \(float8_e4m3fn \[64, 64\] .*\): {DOWN} takes \[rows, 96\] weights",
    ),
    # it named the layer, not the tensor, its file or a fix
    "weight of too few rows": (
        _case(lambda t, qc: t.update({f"{DOWN}.weight": t[f"{DOWN}.weight"][:48].contiguous()})),
        rf"^{DOWN}\.weight \(float8_e4m3fn \[48, 96\] in model\.safetensors\): {DOWN} has out_features=64, its "
        r"checkpoint weights 48 rows; wrong model or checkpoint",
    ),
    # it said "weight_scale is missing from the checkpoint (per-tensor)", naming neither the block scales nor the fix
    "block scales under a config without weight_block_size": (
        _case(lambda t, qc: qc.pop("weight_block_size"), "block"),
        r"^model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv \(float32 \[2, 2\] .*\): block scales, where its "
        r"quantization_config says per-tensor weights .*; the checkpoint's config needs its weight_block_size",
    ),
    # a bias is copied into the layer's, which broadcasts: one of one value went into every output channel
    "bias of one value": (
        _case(lambda t, qc: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(1, dtype=torch.bfloat16)})),
        r"^model\.layers\.0\.self_attn\.q_proj\.bias \(bfloat16 \[1\] .*\): expected a bf16/fp16/fp32 bias of shape "
        r"\[64\]",
    ),
    "bias of one row too many": (
        _case(lambda t, qc: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(65, dtype=torch.bfloat16)})),
        r"^model\.layers\.0\.self_attn\.q_proj\.bias \(bfloat16 \[65\] .*\): expected a bf16/fp16/fp32 bias of shape",
    ),
    "unsupported compressed-tensors weights": (
        _case(lambda t, qc: qc["config_groups"]["group_0"]["weights"].update(type="int"), "channel", ct=True),
        r"^config\.json quantization_config \(quant_method='compressed-tensors'\): config_groups\.group_0\.weights: "
        r"type='int'",
    ),
    # each failed with a bare AttributeError, TypeError or re.error (the last two once a layer was matched)
    "compressed-tensors activations that are no mapping": (
        _case(lambda t, qc: qc["config_groups"]["group_0"].update(input_activations="dynamic"), "channel", ct=True),
        r"^config\.json quantization_config \(quant_method='compressed-tensors'\): config_groups\.group_0\."
        r"input_activations='dynamic' must be a mapping",
    ),
    "compressed-tensors targets that are no names": (
        _case(lambda t, qc: qc["config_groups"]["group_0"].update(targets=[5]), "channel", ct=True),
        r"^config\.json quantization_config \(quant_method='compressed-tensors'\): config_groups\.group_0\.targets="
        r"\[5\] must be a list of class names, module names or 're:' patterns",
    ),
    "compressed-tensors ignore pattern that does not compile": (
        _case(lambda t, qc: qc.update(ignore=["re:layers.(0"]), "channel", ct=True),
        r"^config\.json quantization_config \(quant_method='compressed-tensors'\): ignore: 're:layers\.\(0' is not a "
        r"regular expression \(missing \)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_raises_and_changes_nothing(tmp_path, case):
    build, match = BAD[case]
    tensors, qc = build()
    path = write_checkpoint(tmp_path / "c", tensors, qc or None)
    model = meta_tiny()
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)


def test_truncated_shard_found_before_anything_loads(tmp_path):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor")
    path = write_checkpoint(tmp_path / "c", tensors, qc, shards=3)
    file = path / "model-00003-of-00003.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    model = meta_tiny()
    snap = snapshot(model)
    match = r"in .*model-00003-of-00003\.safetensors: its data ends at byte \d+ but the file has"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)


def test_error_while_streaming_leaves_a_materialized_model_unchanged(tmp_path):
    """A model with real weights: a NaN scale in the last file is found while streaming, after other
    layers were read; the model's parameters are still the old ones, with the old values."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()
    last = sorted(n for n in tensors if n.endswith("weight_scale"))[-1]
    tensors[last] = torch.tensor(float("nan"))
    path = write_checkpoint(tmp_path / "c", tensors, qc, shards=4)
    model = Tiny().bfloat16()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match="not positive finite"):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_already_quantized_model_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "c", bf16_state())
    model = Tiny().bfloat16()
    fp8fx.quantize_(model)
    match = r"model\.layers\.0\.self_attn\.q_proj \(and 14 more\) is already fp8-quantized"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)


def test_parametrized_layer_is_refused_naming_the_parametrization(tmp_path):
    """A layer parametrized before loading (weight_norm) has no ``.weight`` to load into: the error said only that
    ``parametrizations.weight.original0`` was missing; it names the layer, why, and the fix. Nothing changes."""
    path = write_checkpoint(tmp_path / "c", bf16_state())
    model = Tiny().bfloat16()
    layer = model.model.layers[0].self_attn.o_proj
    torch.nn.utils.parametrizations.weight_norm(layer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    match = r"model\.layers\.0\.self_attn\.o_proj is parametrized.*remove_parametrizations"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)
    assert not any(is_quantized(m) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unexpected_plain_tensors_are_reported_not_loaded(tmp_path, caplog):
    state = bf16_state()
    state["model.layers.0.rotary_emb.inv_freq"] = torch.ones(4)
    model = meta_tiny()
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        report = load_checkpoint(model, write_checkpoint(tmp_path / "c", state), progress=False)
    assert report.unexpected == ["model.layers.0.rotary_emb.inv_freq"]
    assert "1 checkpoint tensors have no place in the model" in caplog.text


def test_a_bias_for_a_layer_without_one_is_refused(tmp_path):
    """A checkpoint bias for a bias=False layer the model has (lm_head, not quantized): it was dropped with a warning
    and the layer ran without it, silently wrong; refused before anything is loaded, naming the tensor and the fix."""
    state = bf16_state()
    state["lm_head.bias"] = torch.ones(state["lm_head.weight"].shape[0], dtype=torch.bfloat16)
    model = meta_tiny()
    with pytest.raises(CheckpointError, match=r"lm_head.bias \(bfloat16 \[\d+\] in model.safetensors\) has no place in "
                                              r"lm_head, a Linear without a bias: it would run"):
        load_checkpoint(model, write_checkpoint(tmp_path / "c", state), fp8fx.Fp8Config(ignored_layers=["lm_head"]),
                        progress=False)
    assert model.lm_head.weight.is_meta and model.lm_head.bias is None  # nothing loaded


def test_a_load_leaves_no_cycle_that_holds_the_model_or_its_tensors(tmp_path):
    """The loader's bound method in its experts loader and its planned closures made a cycle holding the model, its
    tensors from before the load and the staged ones: a model built with real weights kept every old bf16 weight
    after the load returned, a loaded model outlived ``del model``, and a load that failed late kept its staged fp8
    tensors, each until Python's cyclic collector ran (disabled here, so that only references count)."""
    import gc
    import weakref

    state = bf16_state()
    path = write_checkpoint(tmp_path / "c", state)
    bad = dict(state, **{"model.layers.1.mlp.down_proj.weight": torch.full_like(
        state["model.layers.1.mlp.down_proj.weight"], float("nan"))})
    bad_path = write_checkpoint(tmp_path / "bad", bad)

    def fp8_tensors() -> int:
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float8_e4m3fn)

    gc.collect()
    gc.disable()
    try:
        model = Tiny().bfloat16()
        old = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
        load_checkpoint(model, path, progress=False)
        assert is_quantized(model.model.layers[0].mlp.up_proj) and old() is None
        loaded = weakref.ref(model)
        del model
        assert loaded() is None
        before = fp8_tensors()
        with pytest.raises(CheckpointError, match="NaN"):
            load_checkpoint(meta_tiny(), bad_path, progress=False)
        assert fp8_tensors() == before
    finally:
        gc.enable()


def test_tied_weights(tmp_path):
    """lm_head tied to embed_tokens: the checkpoint holds one of them; lm_head is not quantized
    (its weight is the embedding) and both names keep sharing one tensor."""
    state = bf16_state()
    del state["lm_head.weight"]
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:, :H].contiguous()
    with torch.device("meta"):
        model = Tiny().bfloat16()
    model.lm_head.weight = model.model.embed_tokens.weight
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", state), progress=False)
    assert report.not_quantized == {"lm_head": "weight tied to model.embed_tokens.weight"}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


def test_a_transformers_model_built_untied_is_tied_as_its_config_says(tmp_path):
    """A tie_word_embeddings model built with accelerate's init_empty_weights() is not tied yet (from_pretrained ties
    it after loading): lm_head.weight, on meta, was "missing from the checkpoint", which holds the embeddings alone.
    It loads tied, as from_pretrained would; one that is not to be tied (tie_word_embeddings=False) still misses it,
    and an untied lm_head that holds values of its own is not tied over."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(config).bfloat16()
    source.save_pretrained(tmp_path / "bf16")  # (tied: the embeddings alone)
    fp8fx.quantize_(source, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    fp8fx.save_checkpoint(source, tmp_path / "c")

    def untied(real=False):
        with torch.device("cpu" if real else "meta"):
            model = transformers.LlamaForCausalLM(config).bfloat16()
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))  # (init_empty_weights' state)
        return model

    model = untied()
    load_checkpoint(model, tmp_path / "c", progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, source(ids).logits)
    model = untied()  # quantized as it loads (the lm_head's plan looked up its untied weight: a KeyError)
    report = load_checkpoint(model, tmp_path / "bf16", fp8fx.Fp8Config(), progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report.not_quantized == {"lm_head": "weight tied to model.embed_tokens.weight"}
    # a checkpoint that holds its own lm_head (saved untied) loads it as its own, as transformers does
    untied_state = dict(safetensors_torch.load_file(tmp_path / "bf16" / "model.safetensors"))
    untied_state["lm_head.weight"] = torch.randn_like(untied_state["model.embed_tokens.weight"])
    model = untied()
    load_checkpoint(model, write_checkpoint(tmp_path / "own", untied_state),
                    fp8fx.Fp8Config(ignored_layers=["lm_head"]), progress=False)
    assert torch.equal(model.lm_head.weight, untied_state["lm_head.weight"])
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    config.tie_word_embeddings = False
    with pytest.raises(CheckpointError, match="lm_head.weight is missing from the checkpoint"):
        load_checkpoint(untied(), tmp_path / "c", progress=False)
    config.tie_word_embeddings = True
    model = untied(real=True)
    with pytest.raises(CheckpointError, match="lm_head.weight is missing from the checkpoint"):
        load_checkpoint(model, tmp_path / "c", progress=False)


def test_lm_head_left_in_high_precision_by_an_fp8_checkpoint(tmp_path):
    """DeepSeek-V3's config lists no ignored layers but stores lm_head in bf16: it loads unquantized.
    Stored in fp8 with its scale, it is quantized."""
    state = bf16_state()
    tensors, qc, _ = fp8_checkpoint(state, "block", ignore=("lm_head",))
    del qc["ignored_layers"]
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "a", tensors, qc), progress=False)
    assert report.not_quantized == {"lm_head": "output embeddings stored in high precision"}
    tensors, qc, deq = fp8_checkpoint(state, "block", ignore=())
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "b", tensors, qc), progress=False)
    assert "lm_head" in report.quantized and torch.equal(model.lm_head.weight, deq["lm_head"].bfloat16())


class WithBuffer(Tiny):
    """A non-persistent buffer that no checkpoint holds (like rotary inv_freq, or Llama-4's complex freqs_cis)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0).to(dtype), persistent=False)


class WithInit(WithBuffer):
    """... and an initializer that computes it, as HF's PreTrainedModel._init_weights does (or not)."""

    def __init__(self, init, dtype=torch.float32):
        super().__init__(dtype)
        self.init = init

    def _init_weights(self, module):
        self.init(module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=["float", "complex"])
def test_meta_buffers_are_computed_or_refused(tmp_path, dtype):
    path = write_checkpoint(tmp_path / "c", bf16_state())
    with torch.device("meta"):  # no initializer: refused before anything loads
        model = WithBuffer(dtype)
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=r"^inv_freq: a non-persistent buffer on the meta device"):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)
    with torch.device("meta"):  # an initializer that does not write it: refused after streaming
        model = WithInit(lambda m: None, dtype)
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=r"^inv_freq: .* WithInit\._init_weights does not compute it"):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)
    want = torch.tensor([1.0, 0.5, 0.25, 0.125]).to(dtype) * (1 + 1j if dtype.is_complex else 1)
    with torch.device("meta"):  # one that does: computed on the load device
        model = WithInit(lambda m: m.inv_freq.copy_(want), dtype)
    load_checkpoint(model, path, progress=False)
    assert torch.equal(model.inv_freq, want)


class RotaryOwnInit(nn.Module):
    """A plain module with an ``_init_weights(self)`` of its own (no transformers model: not the initializer)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)

    def _init_weights(self):
        raise AssertionError("called as transformers' _init_weights(module)")


def test_a_submodules_own_init_weights_is_not_taken_for_transformers(tmp_path):
    """The model's initializer computes a buffer of a child whose own ``_init_weights`` takes no module (a plain
    PyTorch idiom): it was called as transformers' and raised a TypeError; only transformers models' initializers
    (a VLM's vision tower) stand in for the model's."""
    path = write_checkpoint(tmp_path / "c", bf16_state())
    want = torch.tensor([1.0, 0.1, 0.01, 0.001])
    with torch.device("meta"):
        model = WithInit(lambda m: m.inv_freq.copy_(want) if "inv_freq" in m._buffers else None)
        model.rotary = RotaryOwnInit()
    load_checkpoint(model, path, progress=False)
    assert torch.equal(model.rotary.inv_freq, want) and torch.equal(model.inv_freq, want)


@pytest.mark.parametrize("damage", ["truncated", "corrupt header", "missing shard"])
def test_damaged_files_are_found_before_the_model_changes(tmp_path, damage):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "block")
    path = write_checkpoint(tmp_path / "c", tensors, qc, shards=3)
    file = path / "model-00002-of-00003.safetensors"
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:-1])
    elif damage == "corrupt header":
        file.write_bytes(file.read_bytes()[:8] + b"\xff" + file.read_bytes()[9:])
    else:
        file.unlink()
    match = {"truncated": "the file is truncated", "corrupt header": "corrupt safetensors header",
             "missing shard": "names shard 'model-00002-of-00003.safetensors'"}[damage]
    model = meta_tiny()
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)


def test_progress_bar_over_files(tmp_path, monkeypatch):
    """progress=True shows a tqdm bar over the checkpoint's files (on terminals: disable=None)."""
    tqdm = pytest.importorskip("tqdm")
    seen = []

    class Bar(tqdm.tqdm):
        def __init__(self, iterable, **kw):
            seen.append((len(iterable), kw))
            super().__init__(iterable, **kw)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    path = write_checkpoint(tmp_path / "c", bf16_state(), shards=3)
    load_checkpoint(meta_tiny(), path)
    load_checkpoint(meta_tiny(), path, progress=False)
    assert [(n, kw["disable"], kw["unit"]) for n, kw in seen] == [(3, None, "file"), (3, True, "file")]


def test_a_kv_cache_scheme_that_is_not_fp8_is_refused(tmp_path):
    """An int8 KV-cache scheme was taken for fp8 KV-cache scales (scales of another format)."""
    from fp8fx.checkpoint import formats

    qc = {"quant_method": "fp8", "kv_cache_scheme": {"type": "int", "num_bits": 8, "strategy": "tensor"}}
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme=.*'type': 'int'.* is not an fp8 \(8-bit float\) KV"):
        formats.parse({"quantization_config": qc})
    assert formats.parse({"quantization_config": {**qc, "kv_cache_scheme": {"type": "float", "num_bits": 8}}}).kv_cache


@pytest.mark.parametrize("where,value", [("weights", "false"), ("input_activations", "false"), ("kv", "false"),
                                         ("kv", "Static"), ("kv", True)])
def test_compressed_tensors_flags_must_be_json_booleans(where, value, caplog):
    """"dynamic": "false" (a string) is true to Python: static input activations were read as dynamic, a weights
    flag was refused as "dynamic=true", a KV-cache scheme (or "Static", true) declared no KV cache. Each is refused,
    naming the field; and a misspelt top-level key ("ignores") is warned about."""
    import logging

    from fp8fx.checkpoint import formats

    args = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignores": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "weights": dict(args), "input_activations": dict(args)}}}
    if where == "kv":
        qc["kv_cache_scheme"] = {**args, "dynamic": value} if value == "false" else value
        match = (r"kv_cache_scheme.dynamic='false' is not a JSON boolean" if value == "false" else
                 rf"kv_cache_scheme={value!r} is neither a compressed-tensors scheme")
    else:
        qc["config_groups"]["g"][where]["dynamic"] = value
        match = rf"config_groups\.g\.{where}\.dynamic='false' is not a JSON boolean: write true or false, unquoted"
    with pytest.raises(CheckpointError, match=match):
        formats.parse({"quantization_config": qc})
    qc = {**qc, "kv_cache_scheme": None}
    qc["config_groups"]["g"] = {"targets": ["Linear"], "weights": dict(args), "input_activations": dict(args)}
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        assert formats.parse({"quantization_config": qc}).config.activation_scheme == "static"
    assert "quantization_config['ignores']=['lm_head'] is not a key fp8fx reads (did you mean 'ignore'?)" in caplog.text


@pytest.mark.parametrize("key", ["compression_config", "text_config"])
def test_a_quantization_config_where_vllm_also_looks_for_it(tmp_path, key):
    """Older compressed-tensors exports hold their config as ``compression_config``, VLMs under ``text_config``: vLLM
    reads both; fp8fx read such checkpoints as bf16 and refused their fp8 codes (h156). convert refuses them as
    quantized, naming the key."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    path = write_checkpoint(tmp_path / "c", tensors, None, extra_config={
        "quantization_config": None, **({key: qc} if key == "compression_config" else
                                        {key: {"quantization_config": qc}})})
    report = load_checkpoint(meta_tiny(), path, progress=False)
    assert set(report.quantized) == set(LINEARS) and report.format.startswith("compressed-tensors"), report.format
    where = "compression_config" if key == "compression_config" else "text_config.quantization_config"
    with pytest.raises(CheckpointError, match=rf"config\.json already has a {re.escape(where)}; convert takes a "
                                              r"bf16/fp16 checkpoint"):
        fp8fx.checkpoint.convert(path, tmp_path / "dst", model=meta_tiny(), progress=False)


def test_compressed_tensors_fields_left_out_take_its_defaults():
    """compressed-tensors' QuantizationArgs: ``dynamic`` false, and a null ``strategy`` 'tensor' (or 'group' with a
    group_size). fp8fx read an absent ``dynamic`` as dynamic (refusing a static scheme as "says dynamic activations")
    and refused a null weights strategy (h156)."""
    from fp8fx.checkpoint import formats

    def scheme(weights, acts):
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"g": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}
        return str(formats.parse({"quantization_config": qc}).config.scheme())

    fp8 = {"num_bits": 8, "type": "float"}
    assert scheme({**fp8, "strategy": None}, dict(fp8)) == "w:per-tensor a:static per-tensor"
    assert scheme({**fp8, "strategy": "channel"}, {**fp8, "dynamic": True}) == "w:per-channel a:per-tensor"
    assert scheme({**fp8, "strategy": "block", "block_structure": [64, 64]},
                  {**fp8, "dynamic": True, "group_size": 64}) == "w:per-block(64x64) a:per-group(1x64)"
    with pytest.raises(CheckpointError, match=r"weights\.strategy='group' is not one of 'tensor', 'channel', 'block'"):
        scheme({**fp8, "group_size": 128}, dict(fp8))


def test_load_arguments_are_checked_before_reading(tmp_path, monkeypatch):
    """config as a dict, device 'meta' or an unusable 'cuda', a fused entry given as a string: each failed deep in
    the load (AttributeError, Tensor.item() on meta, 'Torch not compiled with CUDA', a checkpoint module name split
    into characters), or read every tensor first; now each is refused naming it, nothing read."""
    import fp8fx.checkpoint.load as load_mod

    path = write_checkpoint(tmp_path / "c", bf16_state())
    model = meta_tiny()
    snap = snapshot(model)
    monkeypatch.setattr(load_mod, "read_tensor", lambda *a, **k: pytest.fail("a tensor was read"))
    cases = [(dict(config={"quant_method": "fp8"}), r"config=\{'quant_method': 'fp8'\}\): a dict; it takes an "
                                                      r"Fp8Config or None; for a quantization_config dict pass "
                                                      r"Fp8Config.from_config"),
             (dict(device="meta"), r"device='meta'\): the tensors need a real device"),
             (dict(fused={"qkv_proj": "q_proj"}), r"fused=\{'qkv_proj': 'q_proj'\}\): the checkpoint module names"),
             # a list of pairs (AttributeError: 'list' object has no attribute 'items'), a shard named twice (its
             # second read was reported missing from the checkpoint, with key_mapping= as the fix)
             (dict(fused=[("qkv_proj", ["q_proj", "k_proj", "v_proj"])]), r"fused=\[\('qkv_proj', .*\): a list; it "
                                                                          r"takes a dict of model module name"),
             (dict(fused={"qkv_proj": ["q_proj", "q_proj", "v_proj"]}), r"'q_proj' is named twice; each checkpoint "
                                                                         r"module is one shard of the fused one")]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), r"device='cuda'\): this torch has no usable CUDA device"))
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            load_checkpoint(model, path, progress=False, **kwargs)
    assert snapshot(model) == snap


class Projection(nn.Module):
    """A linear of a library's own class (a weight [in, out], as transformers' Conv1D's): no nn.Linear, no Conv1D."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.empty(nx, nf)), nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


def test_layers_that_are_no_linear_are_reported(tmp_path):
    """GPT-2's Conv1D layers were loaded bf16 and the report said '0 not' quantized about them. They are quantized
    now (tests/e2e/test_gpt2.py); a linear-like layer of another class is reported."""
    transformers = pytest.importorskip("transformers")
    from fp8fx.checkpoint import meta_model

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100))
    model.save_pretrained(tmp_path / "gpt2")
    model = meta_model(tmp_path / "gpt2")
    with torch.device("meta"):
        model.transformer.h[0].mlp.c_fc = Projection(64, 256)
    report = load_checkpoint(model, tmp_path / "gpt2", progress=False)
    assert report.not_quantized["transformer.h.0.mlp.c_fc"].startswith("Projection is no nn.Linear")
    assert sorted(report.quantized) == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                                        "transformer.h.0.mlp.c_proj"]


def test_errors_blame_the_config_that_was_passed(tmp_path):
    """With config= given, a mismatch blamed the checkpoint's quantization_config (or said config.json had none,
    'restore it'): the message names the config that was passed."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor")
    path = write_checkpoint(tmp_path / "fp8", tensors, qc)
    with pytest.raises(CheckpointError, match=r"the config= passed to load_checkpoint quantizes online .* drop it"):
        load_checkpoint(meta_tiny(), path, fp8fx.Fp8Config(), progress=False)
    blocks = fp8fx.Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[32, 32])
    with pytest.raises(CheckpointError, match=r"does not match the config= passed to load_checkpoint"):
        load_checkpoint(meta_tiny(), path, blocks, progress=False)


def test_values_a_float16_model_cannot_hold_are_refused(tmp_path):
    """A bf16 checkpoint whose embedding holds 1e5 loaded into a float16 model: the value became inf, silently."""
    state = bf16_state()
    key = next(k for k, v in state.items() if v.dim() == 2 and "embed" in k)
    state[key][0, 0] = 1e5
    path = write_checkpoint(tmp_path / "c", state)
    model = meta_tiny().to(torch.float16)
    with pytest.raises(CheckpointError, match=rf"{key}: 1 of its torch.bfloat16 values are beyond torch.float16's "
                                              r"range \(at most 65504; the largest is 99840\) and would load as inf"):
        load_checkpoint(model, path, fp8fx.Fp8Config(ignored_layers=list(LINEARS)), progress=False)


@pytest.mark.parametrize("fused", [False, True])
def test_a_float64_model_is_refused_naming_the_dtypes_and_the_cast_after(tmp_path, fused):
    """A float64 model (a reference) loading an fp8 checkpoint was refused with "create_weights(params_dtype=
    torch.float64)", a call the caller never made, and "the layer fused from [...]" of a layer of one shard. The
    refusal says which dtypes an fp8 layer loads in and how to have the float64 reference; nothing is loaded."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    path = write_checkpoint(tmp_path / "c", tensors, qc)
    model = meta_tiny(fused, dtype=torch.float64)
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=r"^model\.layers\.0\.\S+: the model's layer is torch\.float64, and an "
                                              r"fp8 layer is loaded to compute in torch\.bfloat16, torch\.float16, "
                                              r"torch\.float32: .*model\.double\(\).*\(nothing was loaded\)$"):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)
    model = meta_tiny(fused, dtype=torch.float32)  # the fix it names
    load_checkpoint(model, path, progress=False)
    assert model.double()(IDS).dtype == torch.float64


@pytest.mark.parametrize("fused", [False, True])
def test_float16_model_refuses_online_weights_beyond_its_range(tmp_path, fused):
    """A bf16 checkpoint quantized online into a float16 model: a weight of 1e5 was copied into a float16 buffer as
    inf, its scale became inf and every output NaN, silently. Refused while streaming, the model unchanged."""
    state = bf16_state()
    state[f"{DOWN}.weight"][3, 5] = 1e5
    state["model.layers.0.self_attn.k_proj.weight"][2, 1] = -1e5
    path = write_checkpoint(tmp_path / "c", state)
    model = meta_tiny(fused, dtype=torch.float16)
    snap = snapshot(model)
    match = (r" \(bfloat16 \[\d+, \d+\] in model\.safetensors\): 1 of its torch\.bfloat16 values are beyond "
             r"torch\.float16's range \(at most 65504; the largest is 99840\) and would load as inf.*build the model "
             r"in bfloat16 or float32")
    with pytest.raises(CheckpointError, match=r"^model\.layers\.\d\.(mlp\.down_proj|self_attn\.k_proj)\.weight" + match):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)
    model = meta_tiny(fused, dtype=torch.bfloat16)  # bfloat16 holds it
    load_checkpoint(model, path, progress=False)
    assert torch.isfinite(model(IDS)).all()


@pytest.mark.parametrize("granularity,ct", [("tensor", False), ("channel", True), ("block", False)])
def test_float16_model_refuses_fp8_scales_beyond_its_range(tmp_path, granularity, ct):
    """An fp8 checkpoint whose down_proj reaches 1e5 (scale 1e5 / 448) loaded into a float16 model: the dequantized
    float16 .weight view held inf and the outputs were NaN, silently. Refused, the model unchanged; a scale that
    large over fp8 values small enough to stay finite loads."""
    state = bf16_state()
    state[f"{DOWN}.weight"][3, 5] = 1e5
    tensors, qc, _ = fp8_checkpoint(state, granularity, ct=ct)
    scale = f"{DOWN}.weight_scale_inv" if granularity == "block" else f"{DOWN}.weight_scale"
    path = write_checkpoint(tmp_path / "c", tensors, qc)
    model = meta_tiny(dtype=torch.float16)
    snap = snapshot(model)
    match = (rf"^{re.escape(scale)} \(float32 .*\): a scale of 222\.857 times fp8 values up to 448 is beyond "
             rf"torch\.float16's range \(at most 65504\): 1 values of {DOWN}'s dequantized weight would be inf "
             r"\(outputs NaN\); build the model in bfloat16 or float32")
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)
    model = meta_tiny(dtype=torch.bfloat16)
    load_checkpoint(model, path, progress=False)
    assert torch.isfinite(model.get_submodule(DOWN).weight).all()
    # a large scale whose fp8 values stay below 65504 / scale: no value is inf, it loads
    tensors[f"{DOWN}.weight"] = tensors[f"{DOWN}.weight"].float().clamp(-64, 64).to(FP8)
    model = meta_tiny(dtype=torch.float16)
    load_checkpoint(model, write_checkpoint(tmp_path / "d", tensors, qc), progress=False)
    assert torch.isfinite(model.get_submodule(DOWN).weight).all()


def test_tied_weight_given_under_both_names(tmp_path):
    """lm_head tied to embed_tokens and the checkpoint holding both names: the file's first one (lm_head: safetensors
    sorts names) loaded into the embedding. Now model.embed_tokens.weight loads (as vLLM and HF transformers keep
    it) and lm_head.weight is reported unused; two different values are refused, the model unchanged."""
    def tied_model():
        with torch.device("meta"):
            model = Tiny().bfloat16()
        model.lm_head.weight = model.model.embed_tokens.weight
        return model

    state = bf16_state()
    embed = state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:, :H].contiguous()
    state["lm_head.weight"] = embed.clone()
    model = tied_model()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "same", state), progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert report.unexpected == ["lm_head.weight"]

    state["lm_head.weight"] = torch.full_like(embed, 7.0)
    model = tied_model()
    snap = snapshot(model)
    match = (r"^model\.embed_tokens\.weight \(bfloat16 \[128, 64\] in model\.safetensors\) and lm_head\.weight "
             r"\(bfloat16 \[128, 64\] in model\.safetensors\): the model ties lm_head\.weight to "
             r"model\.embed_tokens\.weight \(one tensor\), but the checkpoint holds different values for them")
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, write_checkpoint(tmp_path / "differ", state), progress=False)
    assert_unchanged(model, snap)


def test_tensors_the_models_class_skips_are_not_loaded_and_reported(tmp_path):
    """DeepSeek-V3's fp8 checkpoints hold its multi-token-prediction layer (model.layers.61), which the HF model does
    not build and transformers skips by the class's _keys_to_ignore_on_load_unexpected (vLLM skips it too): its
    weight_scale_inv tensors made the checkpoint refused as scales no layer takes. They are skipped, and reported."""
    torch.manual_seed(0)
    extra = {k.replace("layers.1.", "layers.2."): v for k, v in bf16_state().items() if ".layers.1." in k}
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "block")
    tensors.update(extra)
    tensors["model.layers.2.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 3)
    path = write_checkpoint(tmp_path / "c", tensors, qc)
    model = meta_tiny()
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.down_proj\.weight_scale_inv .* no layer takes"):
        load_checkpoint(model, path, progress=False)
    model._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    report = load_checkpoint(model, path, progress=False)
    assert len(report.skipped) == len(extra) + 1 and not report.unexpected
    assert "not loaded: the model's class skips them (_keys_to_ignore_on_load_unexpected)" in str(report)
    assert is_quantized(model.model.layers[1].mlp.down_proj)


@pytest.mark.parametrize("method", ["FP8", "Fp8", "Compressed-Tensors"])
def test_quant_method_is_read_as_vllm_reads_it_whatever_its_case(method):
    """vLLM lowercases quant_method ("FP8" is its fp8): load_checkpoint refused "FP8" as a format it does not load,
    while Fp8Config.from_config took it."""
    from fp8fx.checkpoint import formats

    args = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    qc = ({"quant_method": method, "activation_scheme": "static"} if "fp8" in method.lower() else
          {"quant_method": method, "format": "float-quantized",
           "config_groups": {"g": {"targets": ["Linear"], "weights": dict(args), "input_activations": dict(args)}}})
    parsed = formats.parse({"quantization_config": qc})
    assert parsed.config.is_checkpoint_fp8_serialized and parsed.config.activation_scheme == "static"
    with pytest.raises(CheckpointError, match=r"quant_method='FP4' is not a format fp8fx loads"):
        formats.parse({"quantization_config": {"quant_method": "FP4"}})


class KeepsDown(Tiny):
    """A transformers model's ``_keep_in_fp32_modules`` (DeepSeek-V3.2's "indexer.weights_proj", T5's "wo"), read
    as a suffix of the layers' names."""

    _keep_in_fp32_modules = ["mlp.down_proj"]


def test_layers_the_model_keeps_in_high_precision_load_as_stored_and_stay_bf16_online(tmp_path):
    """DeepSeek-V3.2's fp8 checkpoints store indexer.weights_proj in bf16 and list it nowhere but in the model class
    (_keep_in_fp32_modules; vLLM builds it with quant_config=None): the load refused it as "declared float8", and a
    bf16 checkpoint (or quantize_) quantized it, so that the fp8 checkpoint saved from it had a weight_scale vLLM has
    no parameter for."""
    state = bf16_state()
    downs = [f for f in LINEARS if f.endswith("down_proj")]
    tensors, qc, deq = fp8_checkpoint(state, "tensor", ignore=("lm_head", *downs))
    qc["ignored_layers"] = ["lm_head"]  # (the official layout: the bf16 layers are not in the list)
    with torch.device("meta"):
        model = KeepsDown().to(torch.bfloat16)
    report = load_checkpoint(model, write_checkpoint(tmp_path / "fp8", tensors, qc), progress=False)
    assert set(report.quantized) == set(LINEARS) - set(downs)
    why = report.not_quantized[downs[0]]
    assert why.startswith("kept in high precision by KeepsDown._keep_in_fp32_modules ('mlp.down_proj')"), why
    assert not is_quantized(model.model.layers[0].mlp.down_proj)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, state[f"{downs[0]}.weight"])

    # stored in fp8 all the same: the checkpoint decides, as for the output embeddings
    tensors, qc, deq = fp8_checkpoint(state, "tensor")
    with torch.device("meta"):
        model = KeepsDown().to(torch.bfloat16)
    report = load_checkpoint(model, write_checkpoint(tmp_path / "all_fp8", tensors, qc), progress=False)
    assert set(report.quantized) == set(LINEARS)
    assert is_quantized(model.model.layers[0].mlp.down_proj)

    # online: a bf16 checkpoint, and quantize_ (strict too: kept on purpose)
    with torch.device("meta"):
        model = KeepsDown().to(torch.bfloat16)
    report = load_checkpoint(model, write_checkpoint(tmp_path / "bf16", dict(state)), progress=False)
    assert set(report.quantized) == set(LINEARS + ["lm_head"]) - set(downs)
    assert report.not_quantized[downs[1]].startswith("kept in high precision by KeepsDown._keep_in_fp32_modules")
    saved = fp8fx.save_checkpoint(model, tmp_path / "saved")
    assert set(downs) <= set(saved.get("ignored_layers") or saved.get("ignore")), saved
    with torch.device("meta"):  # (convert, file by file: the same plan)
        model = KeepsDown().to(torch.bfloat16)
    converted = fp8fx.checkpoint.convert(tmp_path / "bf16", tmp_path / "converted", model=model, progress=False)
    assert set(converted.quantized) == set(LINEARS) - set(downs), converted
    assert converted.not_quantized[downs[0]].startswith("kept in high precision by KeepsDown._keep_in_fp32_modules")
    eager = KeepsDown().to(torch.bfloat16)
    eager.load_state_dict(state)
    fp8fx.quantize_(eager, strict=True)
    assert [f for f in LINEARS if not is_quantized(eager.get_submodule(f))] == downs
    kept = KeepsDown()
    kept._keep_in_fp32_modules = ["mlp.down_proj", "model.layers.1", "bad["]  # (one entry no regex: the others as
    # transformers reads them, a name covering its layers too)
    assert set(kept_by_the_model(kept)) == set(downs + [f for f in LINEARS if "layers.1" in f])
    plain = Tiny().to(torch.bfloat16)  # (a model without the list: every layer, as before)
    plain.load_state_dict(state)
    fp8fx.quantize_(plain)
    assert all(is_quantized(plain.get_submodule(f)) for f in LINEARS)


def test_transformers_per_tensor_layout_reads_as_vllms(tmp_path):
    """transformers' FP8Linear without blocks (FineGrainedFP8Config(weight_block_size=None)) names its one scale
    weight_scale_inv (multiplied, as a weight_scale) and its static activation scale activation_scale: the load
    took them for block scales and told the user to add a weight_block_size, which failed too."""
    state = bf16_state()
    tensors, qc, deq = fp8_checkpoint(state, "tensor", static=True)
    theirs = {k.replace(".weight_scale", ".weight_scale_inv").replace(".input_scale", ".activation_scale"): v
              for k, v in tensors.items()}
    hf_qc = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None,
             "modules_to_not_convert": ["lm_head"]}
    models = {}
    for name, t, q in (("vllm", tensors, qc), ("hf", theirs, hf_qc)):
        models[name] = meta_tiny()
        load_checkpoint(models[name], write_checkpoint(tmp_path / name, t, q), progress=False)
    ours, hf = (dict(m.state_dict()) for m in models.values())
    assert ours.keys() == hf.keys() and all(torch.equal(ours[k].float(), hf[k].float()) for k in ours)
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert rel_err(models["hf"](ids), float_reference(state, deq, ids)) < 0.08
    # transformers 5.25's save_pretrained writes the one scale [1, 1] (one block over the whole weight): the same
    # per-tensor scale, which was refused as block scales, with a weight_block_size to add as the fix
    square = {k: (v.reshape(1, 1) if k.endswith("weight_scale_inv") else v) for k, v in theirs.items()}
    models["hf [1, 1]"] = meta_tiny()
    load_checkpoint(models["hf [1, 1]"], write_checkpoint(tmp_path / "square", square, hf_qc), progress=False)
    assert all(torch.equal(ours[k].float(), v.float()) for k, v in models["hf [1, 1]"].state_dict().items())
    blocks = {k: (v.reshape(1, 1).expand(2, 2).contiguous() if k.endswith("weight_scale_inv") else v)
              for k, v in theirs.items()}
    with pytest.raises(CheckpointError, match="block scales, where its quantization_config says per-tensor"):
        load_checkpoint(meta_tiny(), write_checkpoint(tmp_path / "blocks", blocks, hf_qc), progress=False)


@pytest.mark.parametrize("spelling", ["config.json", "config.json's kv_cache_quant_algo", "config.json's exclude_modules",
                                      "hf_quant_config.json"])
def test_modelopt_fp8_checkpoints_load_as_vllm_reads_them(tmp_path, spelling):
    """NVIDIA ModelOpt's FP8 checkpoints (quant_method "modelopt", quant_algo "FP8": per-tensor weights, static
    input scales; older exports carry it in hf_quant_config.json only) were refused, or read as bf16. Their exclude
    list is read as vLLM reads it: a name, a part of one, or a wildcard."""
    state = bf16_state()
    tensors, qc, deq = fp8_checkpoint(state, "tensor", static=True, ignore=("lm_head", "model.layers.1"))
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(0.5)
    exclude = ["lm_head", "model.layers.1*"]
    path = tmp_path / "modelopt"
    if spelling.startswith("config.json"):  # (the flat layout's kv_cache_quant_algo was not read: h156)
        kv = ({"kv_cache_quant_algo": "FP8"} if "algo" in spelling else
              {"kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}})
        # (an older vLLM's flat exclude_modules was dropped, and the excluded layers refused: h156)
        excluded = {"exclude_modules" if "exclude" in spelling else "ignore": exclude}
        write_checkpoint(path, tensors, {"quant_method": "modelopt", "quant_algo": "FP8", **excluded, **kv})
    else:
        write_checkpoint(path, tensors)
        (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "fp8", "kv_cache_quant_algo": "FP8", "exclude_modules": exclude}}))
    model = meta_tiny()
    report = load_checkpoint(model, path, progress=False)
    assert set(report.quantized) == {f for f in LINEARS if "layers.0" in f}, report
    assert report.format.startswith("ModelOpt fp8 (w:per-tensor a:static per-tensor)"), report.format
    assert report.not_quantized["model.layers.1.mlp.up_proj"] == "in ignored_layers"
    assert report.kv_scales == {"model.layers.0.self_attn": {"k_scale": 0.25, "v_scale": 0.5},
                                "model.layers.1.self_attn": {"k_scale": 1.0, "v_scale": 1.0}}  # (declared: defaulted)
    twin = meta_tiny()  # the same tensors, read as vLLM's fp8 format: the same model
    load_checkpoint(twin, write_checkpoint(tmp_path / "fp8", tensors, qc), progress=False)
    ours, theirs = model.state_dict(), twin.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k].float(), theirs[k].float()) for k in ours)
    assert model.model.layers[0].self_attn.k_proj.weight_scale.item() == tensors[
        "model.layers.0.self_attn.k_proj.weight_scale"].item()
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert rel_err(model(ids), float_reference(state, deq, ids)) < 0.08


def test_modelopt_per_channel_per_token_and_other_algorithms(tmp_path, caplog):
    state = bf16_state()
    tensors, _, deq = fp8_checkpoint(state, "channel", ignore=("lm_head",))
    qc = {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "ignore": ["lm_head"]}
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "pcpt", tensors, qc), progress=False)
    assert set(report.quantized) == set(LINEARS)
    assert model.model.layers[0].mlp.up_proj.weight_scale.shape == (INTER, 1)
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert rel_err(model(ids), float_reference(state, deq, ids)) < 0.08
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json holds ModelOpt's quantization config; convert "
                                              r"takes a bf16/fp16 checkpoint"):
        src = write_checkpoint(tmp_path / "src", dict(state), extra_config={"quantization_config": None})
        (src / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
        fp8fx.checkpoint.convert(src, tmp_path / "dst", model=meta_tiny(), progress=False)
    with caplog.at_level(logging.WARNING, logger="fp8fx"):  # a misspelt key: said (h156)
        load_checkpoint(meta_tiny(), write_checkpoint(tmp_path / "typo", tensors, {
            "quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "ignroe": ["lm_head"]}),
            progress=False)
    assert "ModelOpt quantization config['ignroe']=['lm_head'] is not a key fp8fx reads (did you mean 'ignore'?)" \
        in caplog.text
    # an INT8 KV cache's scales, declared in the flat layout too (they loaded as fp8 ones there: h156)
    kv = dict(tensors, **{"model.layers.0.self_attn.k_scale": torch.tensor(0.25)})
    with pytest.raises(CheckpointError, match=r"kv_cache_quant_algo='INT8': fp8fx reads FP8 KV-cache scales"):
        load_checkpoint(meta_tiny(), write_checkpoint(tmp_path / "int8kv", kv, dict(qc, kv_cache_quant_algo="INT8")),
                        progress=False)
    with pytest.raises(CheckpointError, match=r"quant_algo='NVFP4': fp8fx loads ModelOpt's \['FP8', "):
        load_checkpoint(meta_tiny(), write_checkpoint(tmp_path / "fp4", tensors, dict(qc, quant_algo="NVFP4")),
                        progress=False)


def test_a_load_report_reads_as_data_and_json(tmp_path):
    """Report has to_dict() / to_json(); LoadReport, which load_checkpoint and convert return, had neither."""
    state = bf16_state()
    tensors, qc, _ = fp8_checkpoint(state, "tensor", ignore=("lm_head", "model.layers.1"))
    model = meta_tiny(fused=True)
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    data = report.to_dict()
    assert data["quantized"] == report.quantized and data["not_quantized"] == report.not_quantized
    assert data["fused"]["model.layers.0.self_attn.qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
    assert data["format"] == report.format and data["tensors"] == report.tensors > 0
    assert json.loads(report.to_json()) == data and report.to_json(indent=None).count("\n") == 0


def test_loaded_parameters_keep_their_requires_grad(tmp_path):
    """A LayerNorm's or an embedding's weight is swapped in as a new nn.Parameter: it keeps the flag it had (the
    model's own choice, for a fine-tuned head say), not a fixed one."""
    state = bf16_state()
    tensors, qc, _ = fp8_checkpoint(state, "tensor")
    model = meta_tiny()
    model.model.embed_tokens.weight.requires_grad_(False)
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert model.model.layers[0].norm.weight.requires_grad and model.model.layers[0].norm.weight.device.type == "cpu"
    assert not model.model.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("extra,match", [
    ({"transform_config": {"config_groups": {"u": {"type": "hadamard", "apply": [
        {"targets": ["re:.*down_proj$"], "location": "weight_input", "inverse": True},
        {"targets": ["re:.*down_proj$"], "location": "input"}]}}}},
     r"transform_config: config_groups\.u\.apply\[1\] \(location 'input'\) is applied at run time .*which fp8fx does "
     r"not do"),
    ({"sparsity_config": {"format": "sparse-24-bitmask", "targets": ["Linear"]}},
     r"sparsity_config\.format='sparse-24-bitmask': the weights are stored compressed"),
    ({"group": {"output_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}}},
     r"config_groups\.g\.output_activations=.*the layers' outputs are quantized too"),
])
def test_compressed_tensors_features_fp8fx_does_not_apply_are_refused(extra, match):
    """A transform_config (SpinQuant / QuIP rotations: the stored weights rotated, the inputs to be rotated at run
    time; no tensor of its own gives it away) was dropped without a word: the loaded model's logits 41% off. So were a
    compressed sparsity format and quantized outputs. Each is refused naming the key; a dense sparsity_config is
    read as before."""
    from fp8fx.checkpoint import formats

    args = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    group = {"targets": ["Linear"], "weights": dict(args), "input_activations": dict(args), **extra.pop("group", {})}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": group}, **extra}
    with pytest.raises(CheckpointError, match=match):
        formats.parse({"quantization_config": qc})
    folded = {"config_groups": {"r1": {"type": "hadamard", "apply": [  # (SpinQuant's R1 / R2: in the weights alone)
        {"targets": ["re:.*down_proj$"], "location": "weight_input", "inverse": True},
        {"targets": ["re:.*up_proj$"], "location": "weight_output"}]}}}
    dense = {**qc, "config_groups": {"g": {**group, "output_activations": None}}, "transform_config": folded,
             "sparsity_config": {"format": "dense", "global_sparsity": 0.0}}
    assert formats.parse({"quantization_config": dense}).config.activation_scheme == "static"


def test_a_load_that_quantizes_nothing_warns_with_the_reasons(tmp_path, caplog):
    """load_checkpoint of a bf16 checkpoint with a config whose blocks divide no layer returned an all-bf16 model and
    said nothing (quantize_ warns, for the same model and config); it warns now, naming the layers and why."""
    import logging

    path = write_checkpoint(tmp_path / "c", bf16_state())
    block = 80  # (divides none of 32, 64, 96, 128)
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        report = load_checkpoint(meta_tiny(), path, fp8fx.Fp8Config(weight_block_size=[block, block]),
                                 progress=False)
    assert not report.quantized
    assert re.search(rf"load_checkpoint: nothing in this Tiny is quantized: \d+ layers \(model\.layers\.0\.self_attn\."
                     rf"q_proj, \.\.\.\): weight \[{H}, {H}\] is not divisible by the {block}x{block} block", caplog.text)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        assert load_checkpoint(meta_tiny(), path, progress=False).quantized
    assert "nothing in this" not in caplog.text


def test_a_lazy_module_not_yet_initialized_is_refused(tmp_path):
    """load_checkpoint into a model holding an nn.LazyLinear before its first forward failed in torch's "Attempted to
    use an uninitialized parameter", naming no module; it is refused as quantize_ refuses it."""
    torch.manual_seed(0)
    fp8fx.save_checkpoint(fp8fx.quantize_(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).bfloat16()),
                          tmp_path)
    lazy = nn.Sequential(nn.LazyLinear(32, dtype=torch.bfloat16), nn.ReLU(), nn.Linear(32, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^load_checkpoint: 0 \(LazyLinear\) is a lazy module whose weights are not "
                                         r"initialized yet; run a forward with a batch first.*\(nothing was loaded\)$"):
        load_checkpoint(lazy, tmp_path, progress=False)
    assert not is_quantized(lazy[2])
