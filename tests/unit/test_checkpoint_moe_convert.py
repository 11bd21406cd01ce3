"""convert and save_checkpoint on MoE experts of a tiny HF Mixtral / Qwen3-MoE: a bf16 checkpoint (experts per
expert, gate_proj/up_proj/down_proj or w1/w3/w2, or fused 3-D) -> convert -> load_checkpoint on meta gives the
experts quantize_ makes and logits near the bf16 model's; save writes per-expert names (or fused) that load back
to identical tensors and logits."""
import json
import logging

import pytest
import torch

import fp8fx
from fp8fx.checkpoint import convert, load_checkpoint, meta_model, save_checkpoint
from fp8fx.checkpoint.files import read_header, read_tensor
from fp8fx.weights import is_quantized_experts
from tests.conftest import rel_err
from tests.unit.test_checkpoint_moe import E, EXPERTS, FP8, NAMING, moe_checkpoint, moe_config, reference_model, write_moe
from tests.unit.test_checkpoint_save import assert_same_state

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
CONFIGS = {
    "per-channel": fp8fx.Fp8Config(ignored_layers=["lm_head"]),
    "per-tensor": fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor(), ignored_layers=["lm_head"]),
    "block": fp8fx.Fp8Config(weight_block_size=[32, 32], ignored_layers=["lm_head"]),
}
BOUND = 0.06  # measured 0.036 (fp8 weights and activations, bf16 compute); 1.5x down_proj scales: >0.1


def bf16_checkpoint(path, cfg, state, layout):
    """``state`` (the model's fused experts) written per expert (``layout`` a NAMING key) or fused."""
    tensors = dict(state)
    if layout != "fused":
        gate, up, down = NAMING[layout]
        for key in [k for k in state if k.endswith(".experts.gate_up_proj")]:
            fqn = key.rpartition(".")[0]
            w13, w2 = tensors.pop(key), tensors.pop(f"{fqn}.down_proj")
            for e in range(w13.shape[0]):
                g, u = w13[e].chunk(2)
                tensors.update({f"{fqn}.{e}.{gate}.weight": g.clone(), f"{fqn}.{e}.{up}.weight": u.clone(),
                                f"{fqn}.{e}.{down}.weight": w2[e].clone()})
    return write_moe(path, cfg, tensors, None, shards=2)


def float_logits(cfg, state):
    model = reference_model(cfg, torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("name,layout,granularity", [
    ("mixtral", "mixtral", "per-channel"), ("mixtral", "hf", "per-tensor"), ("mixtral", "hf", "block"),
    ("mixtral", "fused", "per-tensor"), ("mixtral", "fused", "block"),
])
def test_convert_quantizes_experts(tmp_path, name, layout, granularity):
    config = CONFIGS[granularity]
    cfg = moe_config(name)
    ref = reference_model(cfg)
    state = ref.state_dict()
    src = bf16_checkpoint(tmp_path / "src", cfg, state, layout)
    report = convert(src, tmp_path / "dst", config, progress=False)
    assert list(report.experts) == [EXPERTS] and "lm_head" in report.not_quantized
    header = {}
    for f in (tmp_path / "dst").glob("*.safetensors"):
        header.update(read_header(str(f)))
    if layout == "fused":
        assert header[f"{EXPERTS}.gate_up_proj"].dtype == FP8
    else:
        assert header[f"{EXPERTS}.3.{NAMING[layout][2]}.weight"].dtype == FP8
    model = meta_model(tmp_path / "dst")
    loaded = load_checkpoint(model, tmp_path / "dst", progress=False)
    assert list(loaded.experts) == [EXPERTS] and is_quantized_experts(model.get_submodule(EXPERTS))

    if granularity == "per-tensor" and layout != "fused":  # an expert's gate and up: one scale, the max of theirs
        gate, up = NAMING[layout][:2]
        for e in range(E):
            g, u = (read_tensor(header[f"{EXPERTS}.{e}.{p}.weight_scale"]) for p in (gate, up))
            w13 = state[f"{EXPERTS}.gate_up_proj"][e].float()
            assert g.shape == u.shape == (1,) and torch.equal(g, u), (e, g, u)
            assert torch.equal(g, w13.abs().amax().reshape(1) / 448), e
    # the experts quantize_ makes, bit for bit (per-tensor: had gate and up their own scales, the load would
    # requantize one of them to the other's, a second rounding)
    fp8fx.quantize_(ref, config)
    assert_same_state(ref.get_submodule(EXPERTS), model.get_submodule(EXPERTS))

    with torch.no_grad():
        out = model(IDS).logits.float()
    bf16 = float_logits(cfg, state)
    err = rel_err(out, bf16)
    assert err < BOUND, err
    # the down_proj scales of the loaded experts 1.5x off (e.g. another expert's) break the bound
    experts = model.get_submodule(EXPERTS)
    scale = experts.down_proj_scale_inv if granularity == "block" else experts.down_proj_scale
    with torch.no_grad():
        scale.mul_(1.5)
        bad = rel_err(model(IDS).logits.float(), bf16)
    assert bad > BOUND


def test_convert_leaves_ignored_experts_bf16(tmp_path):
    cfg = moe_config("qwen3_moe")
    state = reference_model(cfg).state_dict()
    src = bf16_checkpoint(tmp_path / "src", cfg, state, "hf")
    config = fp8fx.Fp8Config(ignored_layers=["lm_head", EXPERTS])  # per-channel: compressed-tensors, exact names
    report = convert(src, tmp_path / "dst", config, progress=False)
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and not report.experts
    # the experts module by its own name too, as save_checkpoint writes it (vLLM skips its FusedMoE layer by that
    # name; fp8fx inspect read experts ignored one by one as fp8: a probe's catch)
    assert f"{EXPERTS}.{E - 1}.down_proj" in qc["ignore"] and sorted(qc["ignore"]) == sorted(
        [*report.not_quantized, EXPERTS])
    model = meta_model(tmp_path / "dst")
    loaded = load_checkpoint(model, tmp_path / "dst", progress=False)
    experts = model.get_submodule(EXPERTS)
    assert not is_quantized_experts(experts) and loaded.not_quantized[EXPERTS] == "in ignored_layers"
    for base in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(experts, base), state[f"{EXPERTS}.{base}"])
    with pytest.raises(ValueError, match="an experts module has one scheme"):
        convert(src, tmp_path / "dst2", fp8fx.Fp8Config(ignored_layers=[f"{EXPERTS}.1.up_proj"]), progress=False)


def test_convert_names_ignored_w1_w3_w2_experts_as_vllm_looks_them_up(tmp_path):
    """Experts stored as w1 / w3 / w2 (Mixtral's naming) and ignored: compressed-tensors' ignore list matches names
    exactly, and vLLM looks experts up as <experts>.0.gate_proj / up_proj / down_proj. convert named them w1 / w3 /
    w2 alone (save_checkpoint wrote both): vLLM would have built fp8 experts over the bf16 ones."""
    cfg = moe_config("mixtral")
    state = reference_model(cfg).state_dict()
    src = bf16_checkpoint(tmp_path / "src", cfg, state, "mixtral")
    convert(src, tmp_path / "dst", fp8fx.Fp8Config(ignored_layers=["lm_head", EXPERTS]), progress=False)
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    for e in (0, E - 1):
        assert {f"{EXPERTS}.{e}.{p}" for p in ("w1", "w3", "w2", "gate_proj", "up_proj", "down_proj")} <= \
            set(qc["ignore"])
    model = meta_model(tmp_path / "dst")
    load_checkpoint(model, tmp_path / "dst", progress=False)
    assert not is_quantized_experts(model.get_submodule(EXPERTS))


def _roundtrip(model, path, **kw):
    qc = save_checkpoint(model, path, **kw)
    header = read_header(str(path / "model.safetensors"))
    again = meta_model(path)
    assert list(load_checkpoint(again, path, progress=False).experts) == [EXPERTS]
    assert_same_state(model, again)
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)
    return qc, header


@pytest.mark.parametrize("granularity", ["per-channel", "per-tensor", "block"])
def test_save_writes_per_expert_names_that_load_identically(tmp_path, granularity):
    cfg = moe_config("qwen3_moe")
    ref = reference_model(cfg)
    fp8fx.quantize_(ref, CONFIGS[granularity])
    qc, header = _roundtrip(ref, tmp_path / "saved")
    scale = "weight_scale_inv" if granularity == "block" and qc["quant_method"] == "fp8" else "weight_scale"
    assert not any(k.startswith(f"{EXPERTS}.gate_up_proj") or k.startswith(f"{EXPERTS}.down_proj") for k in header)
    for e in range(E):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert header[f"{EXPERTS}.{e}.{proj}.weight"].dtype == FP8
            assert f"{EXPERTS}.{e}.{proj}.{scale}" in header
    if granularity == "per-tensor":  # w13's one scale per expert, for gate and up
        for proj in ("gate_proj", "up_proj"):
            assert header[f"{EXPERTS}.1.{proj}.weight_scale"].shape == (1,)
    _, fused = _roundtrip(ref, tmp_path / "fused", experts="fused")
    assert f"{EXPERTS}.gate_up_proj" in fused and f"{EXPERTS}.0.gate_proj.weight" not in fused


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_block_experts_written_as_compressed_tensors_warn_that_transformers_refuses_them(tmp_path, caplog, fmt):
    """Block-scaled experts written as compressed-tensors: transformers' loader multiplies their codes by the block
    scales unexpanded and fails ("The size of tensor a (64) must match the size of tensor b (2)"); nothing said so
    (h138). save_checkpoint and convert warn, naming the experts and format fp8; in fp8 they stay quiet."""
    cfg = moe_config("qwen3_moe")
    ref = reference_model(cfg)
    src = bf16_checkpoint(tmp_path / "src", cfg, ref.state_dict(), "hf")
    fp8fx.quantize_(ref, CONFIGS["block"])
    said = f"writes the block-scaled experts {EXPERTS} as compressed-tensors, which fp8fx loads but transformers'"
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        save_checkpoint(ref, tmp_path / "saved", format=fmt)
        convert(src, tmp_path / "dst", CONFIGS["block"], format=fmt, progress=False)
    warned = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    if fmt == "fp8":
        assert not warned, warned
    else:
        assert [w.split(":")[1].split()[0] for w in warned] == ["save_checkpoint", "convert"], warned
        assert warned[0].endswith("use format='fp8'") and warned[1].endswith("use --format fp8 (format='fp8')")


def test_save_per_expert_static_input_scales(tmp_path):
    """An fp8 checkpoint with static input scales (w1/w3/w2) -> load -> save per expert -> load: identical."""
    cfg = moe_config("mixtral")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), "tensor", naming="mixtral", static=True)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    load_checkpoint(model, path, progress=False)
    _, header = _roundtrip(model, tmp_path / "saved")
    experts = model.get_submodule(EXPERTS)
    # Mixtral's hub leaves (save_checkpoint writes them); the block's own name follows the installed transformers'
    # renames (5.24: block_sparse_moe; 5.17 keeps mlp), which test_checkpoint_moe's hub-layout test pins
    up = [k for k in header if k.endswith(".experts.2.w3.input_scale")]
    assert up in (["model.layers.0.block_sparse_moe.experts.2.w3.input_scale"],
                  ["model.layers.0.mlp.experts.2.w3.input_scale"]), up
    assert experts._parameters["gate_up_proj"].dtype == FP8
    assert experts.gate_up_proj_input_scale.shape == (1,)


def test_convert_quantizes_shards_of_fused_expert_linears(tmp_path):
    """A ModuleList of expert MLPs with a fused gate_up_proj, a checkpoint with gate_proj / up_proj per expert: the
    shards are the fused linear's, quantized as before (the stray-expert rule above must not claim them)."""
    from torch import nn

    from fp8fx.checkpoint.files import read_checkpoint, write_file

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj, self.down_proj = nn.Linear(64, 256, bias=False), nn.Linear(128, 64, bias=False)

    model = nn.Module()
    model.experts = nn.ModuleList([Expert() for _ in range(2)])
    g = torch.Generator().manual_seed(0)
    tensors = {f"experts.{e}.{p}.weight": torch.randn(*shape, generator=g).bfloat16() for e in range(2)
               for p, shape in (("gate_proj", (128, 64)), ("up_proj", (128, 64)), ("down_proj", (64, 128)))}
    (tmp_path / "src").mkdir()
    write_file(str(tmp_path / "src" / "model.safetensors"), tensors)
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "x"}))
    report = convert(tmp_path / "src", tmp_path / "dst", model=model, progress=False)
    assert not report.not_quantized
    written = read_checkpoint(str(tmp_path / "dst"))[1]
    assert all(written[name].dtype == FP8 for name in tensors)
