"""Checkpoint tensors that transformers cuts into several of the model's as it loads (a conversion mapping's
``Chunk`` / ``Split`` converters): HRM-Text stores ``attn.gqkv_proj`` (gate, q, k, v) and ``mlp.gate_up_proj``, its
model has the four projections and gate / up apart. load_checkpoint reads each part as a range of the stored
tensor's bytes, the weight's scales cut with its rows."""
import json

import pytest
import torch

import fp8fx
from fp8fx.checkpoint import CheckpointError, load_checkpoint
from tests.unit.test_checkpoint_load import FP8, assert_unchanged, quantization_config, ref_quantize, snapshot

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
HrmTextConfig = getattr(transformers, "HrmTextConfig", None)
pytestmark = pytest.mark.skipif(HrmTextConfig is None, reason="transformers without HRM-Text (before 5.17)")

INTER = 96  # gate_up_proj: 192 rows cut at 96 (3 blocks of 32 each side; inside the second block of 64)


def hub_checkpoint(path):
    """A tiny HRM-Text saved by transformers: the hub's fused names (save_pretrained reverses the cuts)."""
    config = HrmTextConfig(vocab_size=128, hidden_size=64, intermediate_size=INTER, num_hidden_layers=2,
                           num_attention_heads=2, head_dim=32, H_cycles=1, L_cycles=1, num_layers_per_stack=1,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.HrmTextForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):  # rows of very different sizes: a part given another's scale shows
                p.mul_(torch.logspace(-1, 1, p.shape[0]).unsqueeze(1))
    model.to(torch.bfloat16).save_pretrained(path)
    return safetensors_torch.load_file(str(path / "model.safetensors"))


def cut_names(stored):
    """The model's names of a stored fused tensor's parts, in order."""
    if ".attn.gqkv_proj." in stored:
        owner = stored.replace(".attn.gqkv_proj.weight", ".self_attn.")
        return [owner + p + ".weight" for p in ("gate_proj", "q_proj", "k_proj", "v_proj")]
    if ".mlp.gate_up_proj." in stored:
        owner = stored.replace(".gate_up_proj.weight", ".")
        return [owner + p + ".weight" for p in ("gate_proj", "up_proj")]
    return [stored.replace(".attn.o_proj.", ".self_attn.o_proj.")]


def test_a_bf16_checkpoint_loads_as_transformers_cuts_it(tmp_path):
    """Quantized while loading, the parts are what quantize_ gives the model transformers loads."""
    hub_checkpoint(tmp_path)
    model = fp8fx.checkpoint.meta_model(tmp_path)
    report = load_checkpoint(model, tmp_path, progress=False)
    ref = transformers.HrmTextForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    fp8fx.quantize_(ref, fp8fx.Fp8Config())  # (a checkpoint without a quantization_config: the default config)
    assert len(report.quantized) == 17 and "model.L_module.layers.0.self_attn.k_proj" in report.quantized
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        a, b = got[name], t
        if a.dtype == FP8:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), name


@pytest.mark.parametrize("granularity,ct", [("tensor", False), ("channel", True), ("block", False), ("shard", False)])
def test_an_fp8_checkpoint_quantized_fused_loads_its_parts_exactly(tmp_path, granularity, ct):
    """Each part holds the stored codes of its rows and the scales of them: one per-tensor scale for every part,
    per-channel and 32x32-block scales cut with the rows, a per-tensor scale a part (``shard``: a vector of one value
    a part, as vLLM keeps the scales of a fused layer) to its part."""
    stored = hub_checkpoint(tmp_path / "bf16")
    tensors, parts = {}, {}
    for name, t in stored.items():
        if not name.endswith("proj.weight"):
            tensors[name] = t
            continue
        if granularity == "shard" and len(cut_names(name)) > 1:
            codes = [ref_quantize(c, "tensor") for c in t.chunk(len(cut_names(name)))]
            tensors[name] = torch.cat([q for q, _ in codes])
            tensors[name.replace(".weight", ".weight_scale")] = torch.stack([s.reshape(()) for _, s in codes])
            for part, (q, s) in zip(cut_names(name), codes):
                parts[part] = (q, s.reshape(()))
            continue
        q, s = ref_quantize(t, "tensor" if granularity == "shard" else granularity)
        if granularity == "shard":
            tensors[name], tensors[name.replace(".weight", ".weight_scale")] = q, s.reshape(())
            parts[cut_names(name)[0]] = (q, s.reshape(()))
            continue
        leaf = "weight_scale_inv" if granularity == "block" else "weight_scale"
        tensors[name], tensors[name.replace(".weight", f".{leaf}")] = q, (s.reshape(()) if granularity == "tensor"
                                                                           else s)
        rows, row0 = t.shape[0] // len(cut_names(name)), 0
        for part in cut_names(name):
            scale = s if granularity == "tensor" else s[row0 // (32 if granularity == "block" else 1):][
                : rows // (32 if granularity == "block" else 1)]
            parts[part] = (q[row0:row0 + rows], scale)
            row0 += rows
    path = tmp_path / "fp8"
    path.mkdir()
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = quantization_config("tensor" if granularity == "shard" else granularity,
                                                        (32, 32), False, ct, ["lm_head"])
    (path / "config.json").write_text(json.dumps(config))

    model = fp8fx.checkpoint.meta_model(path)
    report = load_checkpoint(model, path, progress=False)
    assert len(report.quantized) == 16  # 8 a layer, lm_head in the ignore list
    sd = model.state_dict()
    leaf = "weight_scale_inv" if granularity == "block" else "weight_scale"
    for name, (q, scale) in parts.items():
        assert torch.equal(sd[name].view(torch.uint8), q.view(torch.uint8)), name
        got = sd[name.replace(".weight", f".{leaf}")]
        assert torch.equal(got.reshape(scale.shape), scale), name
    with torch.no_grad():  # the model runs on its parts (the dequantized weights in the eager layers)
        out = model(torch.randint(0, 128, (1, 8))).logits
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("block", [64, 128])
def test_block_scales_a_cut_would_split_are_refused_and_nothing_changes(tmp_path, block):
    """gate_up_proj's 192 rows are cut at 96, inside its second 64-row block (or its first 128-row one, of 2 block
    rows: taken for 96-row blocks, it loaded up_proj's rows 96-127 under the wrong scale): the scale of those rows
    belongs to both parts, so the checkpoint is refused, naming it, and the model is left as it was."""
    stored = hub_checkpoint(tmp_path / "bf16")
    tensors = {}
    for name, t in stored.items():
        if name.endswith("proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = ref_quantize(t, "block", (block, block))
        else:
            tensors[name] = t
    path = tmp_path / "fp8"
    path.mkdir()
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = quantization_config("block", (block, block), False, False, ["lm_head"])
    (path / "config.json").write_text(json.dumps(config))
    model = fp8fx.checkpoint.meta_model(path)
    snap = snapshot(model)
    match = (r"proj\.weight_scale_inv \(float32 \[\d, 1\] .*\) is the scale of a weight transformers cuts into "
             rf"parts of \[\d+(, \d+)+\] rows, and its \d rows of scales \({block}-row blocks, of \d+ weight rows\) "
             "cannot be cut")
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)
    assert_unchanged(model, snap)


def test_a_stored_tensor_of_other_rows_than_its_parts_is_refused(tmp_path):
    hub_checkpoint(tmp_path)
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    name = "model.L_module.layers.0.mlp.gate_up_proj.weight"
    tensors[name] = tensors[name][:190]
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    model = fp8fx.checkpoint.meta_model(tmp_path)
    snap = snapshot(model)
    match = (rf"{name} \(bfloat16 \[190, 64\] .*\) is cut by transformers into "
             r"model\.L_module\.layers\.0\.mlp\.gate_proj\.weight, .* of \[96, 96\] rows")
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, tmp_path, progress=False)
    assert_unchanged(model, snap)


def test_convert_writes_a_tensor_transformers_cuts_as_stored_and_its_load_keeps_the_parts_bf16(tmp_path):
    """convert writes what it reads, so the fused tensors stay one and bf16 (named in the ignore list, with the
    way to quantize their parts); the other layers are quantized and the whole loads back. convert refused the
    checkpoint before (the model's parts had no weight in it)."""
    stored = hub_checkpoint(tmp_path / "src")
    model = fp8fx.checkpoint.meta_model(tmp_path / "src")
    report = fp8fx.checkpoint.convert(tmp_path / "src", tmp_path / "dst", model=model, progress=False)
    fused = "model.L_module.layers.0.mlp.gate_up_proj"
    assert report.not_quantized[fused].startswith(
        "transformers cuts it into model.L_module.layers.0.mlp.gate_proj, model.L_module.layers.0.mlp.up_proj as it "
        "loads (written as stored); load_checkpoint quantizes the parts")
    assert "model.L_module.layers.0.attn.o_proj" in report.quantized
    written = safetensors_torch.load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert torch.equal(written[f"{fused}.weight"], stored[f"{fused}.weight"])
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "dst")
    load_checkpoint(loaded, tmp_path / "dst", progress=False)
    mlp = loaded.model.L_module.layers[0].mlp
    assert mlp.gate_proj.weight.dtype == torch.bfloat16
    assert torch.equal(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), stored[f"{fused}.weight"])
    assert loaded.model.L_module.layers[0].self_attn.o_proj.weight_scale.dtype == torch.float32


def test_scales_are_cut_by_the_configs_block_height():
    """A cut is judged by the config's block height, not a height guessed from the scale's rows: 2 rows of 128-row
    block scales for 192 rows were taken for 96-row blocks, and a cut at 96 (inside the first block) accepted."""
    from fp8fx.checkpoint.files import Entry
    from fp8fx.checkpoint.renames import _cut_scale

    scale = Entry("w.weight_scale_inv", "f", torch.float32, (2, 1), 0, 8)
    with pytest.raises(CheckpointError, match=r"its 2 rows of scales \(128-row blocks, of 192 weight rows\) cannot"):
        _cut_scale(scale, ["a", "b"], [96, 96], 192, 128, "ckpt")
    with pytest.raises(CheckpointError, match=r"its 2 rows of scales \(no block size in the config, of 192"):
        _cut_scale(scale, ["a", "b"], [96, 96], 192, None, "ckpt")
    ragged = _cut_scale(scale, ["a", "b"], [128, 64], 192, 128, "ckpt")  # the last block ragged: one row each
    assert [(n, e.shape, e.start, e.end) for n, e in ragged] == [("a", (1, 1), 0, 4), ("b", (1, 1), 4, 8)]
