"""save_checkpoint and convert: the formats and names written, and save -> load round trips that give
identical tensors and outputs."""
import dataclasses
import json
import logging
import os
import re
import shutil

import pytest
import safetensors
from safetensors.torch import load_file
import torch
from torch import nn

import fp8fx
from fp8fx.checkpoint import CheckpointError, convert, load_checkpoint, save_checkpoint
from fp8fx.checkpoint.files import read_checkpoint, read_header, write_file
from fp8fx.checkpoint.load import FUSED
from fp8fx.checkpoint.save import _split
from tests.conftest import rel_err
from tests.unit.test_checkpoint_load import (
    FP8,
    IDS,
    LINEARS,
    VOCAB,
    Tiny,
    bf16_state,
    fp8_checkpoint,
    fuse,
    meta_tiny,
    snapshot,
    write_checkpoint,
)

safe_open = pytest.importorskip("safetensors").safe_open


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        x, y = sa[k], sb[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        if x.dtype == FP8:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), k


def quantized_tiny(config, fused=False):
    model = Tiny(fused).bfloat16()
    state = bf16_state()
    model.load_state_dict(fuse(state) if fused else state)
    scales = None
    if config.activation_scheme == "static":
        scales = fp8fx.calibrate(model, [IDS], config)
    fp8fx.quantize_(model, config, input_scales=scales)
    return model


def roundtrip(model, tmp_path, fused=False, **save_kw):
    qc = save_checkpoint(model, tmp_path / "saved", **save_kw)
    loaded = meta_tiny(fused)
    report = load_checkpoint(loaded, tmp_path / "saved", progress=False)
    assert_same_state(model, loaded)
    with torch.no_grad():
        assert torch.equal(model(IDS), loaded(IDS))
    return qc, loaded, report


CONFIGS = {
    "per-channel": (fp8fx.Fp8Config(ignored_layers=["lm_head"]), "compressed-tensors"),
    "per-tensor": (fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor()), "fp8"),
    "per-tensor-act": (fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor(), activation_granularity=fp8fx.PerTensor()),
                       "compressed-tensors"),
    "block": (fp8fx.Fp8Config(weight_block_size=[32, 32], ignored_layers=["lm_head"]), "fp8"),
    "static": (fp8fx.Fp8Config(activation_scheme="static", ignored_layers=["lm_head"]), "compressed-tensors"),
    "static-per-tensor": (fp8fx.Fp8Config(activation_scheme="static", weight_granularity=fp8fx.PerTensor()), "fp8"),
    # 1 x 32 weight blocks: read back as per-group (an activation granularity) they were saved as per tensor
    "row-blocks": (fp8fx.Fp8Config(weight_block_size=[1, 32], ignored_layers=["lm_head"]), "fp8"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_load_roundtrip_is_identical(tmp_path, name):
    config, method = CONFIGS[name]
    model = quantized_tiny(config)
    qc, loaded, report = roundtrip(model, tmp_path)
    assert qc["quant_method"] == method
    layers = LINEARS + ([] if config.ignored_layers else ["lm_head"])
    assert report.quantized == {f: str(config.scheme()) for f in layers}
    written = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert written == qc


def test_fp8_formats_use_the_names_other_engines_load(tmp_path):
    """fp8 blocks: weight_scale_inv [N/bn, K/bk] float32; compressed-tensors blocks: weight_scale;
    static per-tensor: weight_scale and input_scale of one value. The safetensors package reads them."""
    model = quantized_tiny(fp8fx.Fp8Config(weight_block_size=[32, 32], ignored_layers=["lm_head"]))
    save_checkpoint(model, tmp_path / "fp8")
    save_checkpoint(model, tmp_path / "ct", format="compressed-tensors")
    down = "model.layers.0.mlp.down_proj"
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        assert f.get_tensor(f"{down}.weight").dtype == FP8
        assert f.get_tensor(f"{down}.weight_scale_inv").shape == (2, 3)
        assert f"{down}.weight_scale" not in f.keys() and "lm_head.weight" in f.keys()
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        assert f.get_tensor(f"{down}.weight_scale").shape == (2, 3) and f"{down}.weight_scale_inv" not in f.keys()
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [32, 32]
    assert group["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                          "strategy": "group", "group_size": 32}
    assert qc["ignore"] == ["lm_head"]
    for d in ("fp8", "ct"):  # both load back to the same model
        loaded = meta_tiny()
        load_checkpoint(loaded, tmp_path / d, progress=False)
        assert_same_state(model, loaded)

    static = quantized_tiny(fp8fx.Fp8Config(activation_scheme="static", weight_granularity=fp8fx.PerTensor()))
    save_checkpoint(static, tmp_path / "static")
    header = read_header(str(tmp_path / "static" / "model.safetensors"))
    assert header[f"{down}.weight_scale"].shape == (1,) and header[f"{down}.input_scale"].shape == (1,)
    qc = json.loads((tmp_path / "static" / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": [],
                  "modules_to_not_convert": []}


@pytest.mark.parametrize("config", [fp8fx.Fp8Config(), fp8fx.Fp8Config(weight_block_size=[32, 32],
                                                                         activation_granularity=fp8fx.PerRow())])
def test_fp8_format_cannot_hold_per_channel_or_blocks_with_per_token_activations(tmp_path, config):
    """The refusal says what the format holds: block weights go with 1 x block_k groups (it said "block weights with
    per-token activations", the very scheme it refused), and names the activation granularity that fits."""
    model = quantized_tiny(config)
    with pytest.raises(ValueError, match=r"format='fp8' stores one scheme for all layers: per-tensor weights with "
                                         r"per-token \(dynamic\) or static per-tensor activations, or block weights "
                                         r"with 1 x block_k groups of activations \(dynamic, activation_granularity="
                                         r"PerGroup\(block_k\)\); this model has .* use format='compressed-tensors'"):
        save_checkpoint(model, tmp_path / "x", format="fp8")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("fmt", ["modelopt", "gguf"])
def test_a_format_fp8fx_does_not_write_is_refused_before_anything_is_written(tmp_path, fmt):
    """format='modelopt' (a format fp8fx reads, whose name the refusal of a bad format listed) was taken, and wrote
    an fp8 quantization_config with nothing of ModelOpt's in it."""
    model = quantized_tiny(fp8fx.Fp8Config())
    read = r" \(fp8fx reads ModelOpt checkpoints, and writes none\)" if fmt == "modelopt" else ""
    with pytest.raises(ValueError, match=rf"^format='{fmt}' is not one of the formats fp8fx writes, \('fp8', "
                                         rf"'compressed-tensors'\){read}: pass one of them, or None"):
        save_checkpoint(model, tmp_path / "x", format=fmt)
    assert not (tmp_path / "x").exists()


def test_loaded_format_and_kv_scales_survive_a_roundtrip(tmp_path):
    """A compressed-tensors checkpoint with KV scales, loaded, saved (format kept), loaded again."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor", ct=True)
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.prob_output_scale"] = torch.tensor(0.25)
    model = meta_tiny()
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc, extra_config={"model_type": "tiny"}),
                    progress=False)
    assert model.model.layers[1].self_attn.prob_scale.item() == 0.25
    saved, loaded, report = roundtrip(model, tmp_path)
    assert saved["quant_method"] == "compressed-tensors" and saved["kv_cache_scheme"]["strategy"] == "tensor"
    assert report.kv_defaults == []  # every scale is in the saved file now
    assert report.kv_scales["model.layers.0.self_attn"] == {"k_scale": 0.5, "v_scale": 0.5}  # v took k
    # the softmax scale under the name vLLM reads (self_attn.prob_scale, as state_dict names it, it does not)
    names = {n for f in (tmp_path / "saved").glob("*.safetensors") for n in safetensors.safe_open(f, "pt").keys()}
    assert "model.layers.1.self_attn.prob_output_scale" in names and not any(n.endswith(".prob_scale") for n in names)
    assert report.kv_scales["model.layers.1.self_attn"]["prob_scale"] == 0.25
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "tiny"


def test_a_checkpoint_read_with_a_config_is_saved_in_its_own_format(tmp_path):
    """A compressed-tensors per-channel checkpoint read with config= (serialized, per row): the model was recorded
    as loaded from "fp8" whatever config.json said, and save_checkpoint's default then refused it (fp8 holds no
    per-channel scale). Its own format is kept; the load report says the config was given."""
    model = quantized_tiny(fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    assert save_checkpoint(model, tmp_path / "ct")["quant_method"] == "compressed-tensors"
    loaded = meta_tiny()
    config = fp8fx.Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=fp8fx.PerRow(),
                             ignored_layers=["lm_head"])
    report = load_checkpoint(loaded, tmp_path / "ct", config, progress=False)
    assert report.format.startswith("fp8, read with config= (w:per-channel")
    assert_same_state(model, loaded)
    assert save_checkpoint(loaded, tmp_path / "again")["quant_method"] == "compressed-tensors"


def test_fused_model_roundtrip_and_shards(tmp_path):
    """A fused model saves its fused names; a sharded save has an index and loads back identically."""
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "channel", ct=True)
    model = meta_tiny(fused=True)
    load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    _, _, report = roundtrip(model, tmp_path, fused=True, max_shard_size=20_000)
    assert report.fused == {}  # the saved checkpoint holds qkv_proj / gate_up_proj as they are
    index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 3 and all((tmp_path / "saved" / f).exists() for f in files)
    assert index["weight_map"]["model.layers.0.self_attn.qkv_proj.weight_scale"] in files


def test_shards_are_filled_up_to_max_shard_size_and_no_further():
    """Each shard holds at most max_shard_size bytes of tensor data (a tensor over it alone), in the tensors' order,
    and as much as fits: a shard and the next one's first tensor are over it. A tensor that ends exactly at the
    limit stays in its shard."""
    sizes = [100, 60, 40, 250, 10, 90, 1]  # bytes (uint8 tensors)
    tensors = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    for limit, want in [
        (200, [[0, 1, 2], [3], [4, 5, 6]]),  # 100 + 60 + 40 is exactly 200
        (199, [[0, 1], [2], [3], [4, 5, 6]]),
        (101, [[0], [1, 2], [3], [4, 5, 6]]),
        (1000, [[0, 1, 2, 3, 4, 5, 6]]),
    ]:
        shards = _split(tensors, limit)
        assert [[int(k[1:]) for k in shard] for shard in shards] == want, limit
        for shard, after in zip(shards, shards[1:]):
            data = sum(t.numel() for t in shard.values())
            assert data <= limit or len(shard) == 1
            assert data + next(iter(after.values())).numel() > limit


def test_mixed_schemes_saved_as_compressed_tensors_groups(tmp_path):
    model = Tiny().bfloat16()
    model.load_state_dict(bf16_state())
    fp8fx.quantize_(model.model.layers[0], fp8fx.Fp8Config(weight_block_size=[32, 32]))
    fp8fx.quantize_(model.model.layers[1], fp8fx.Fp8Config())
    for i in range(2):  # quantize_ on a submodule names layers relative to it
        for name, m in model.model.layers[i].named_modules():
            if fp8fx.weights.is_quantized(m):
                m._parameters["weight"]._fp8fx_fqn = f"model.layers.{i}.{name}"
    qc, _, report = roundtrip(model, tmp_path)
    assert qc["quant_method"] == "compressed-tensors" and len(qc["config_groups"]) == 2
    targets = sorted(t for g in qc["config_groups"].values() for t in g["targets"])
    assert targets == sorted(LINEARS)
    assert qc["ignore"] == ["lm_head"]


class SubLinear(torch.nn.Linear):
    """A model's own nn.Linear subclass (compressed-tensors' "Linear" target must cover it, as in vLLM)."""


def test_a_linear_subclass_loads_its_compressed_tensors_checkpoint(tmp_path):
    def build():
        return torch.nn.Sequential(SubLinear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False)).bfloat16()

    torch.manual_seed(0)
    model = build()
    fp8fx.quantize_(model, fp8fx.Fp8Config())
    qc = save_checkpoint(model, tmp_path / "saved")
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    with torch.device("meta"):
        loaded = build()
    report = load_checkpoint(loaded, tmp_path / "saved", progress=False)
    assert sorted(report.quantized) == ["0", "1"] and not report.not_quantized
    assert_same_state(model, loaded)


@pytest.mark.parametrize("bad,match", [
    ("not-a-mapping", r"config_json must be a mapping \(the rest of config.json\), got str"),
    ([1], r"config_json must be a mapping \(the rest of config.json\), got list"),  # (was dict()'s TypeError)
    ({"a": 1, 2: "b"}, r"config_json cannot be written as JSON"),
])
def test_a_config_json_that_cannot_be_written_leaves_nothing(tmp_path, bad, match):
    """It was written after the shards: a checkpoint without config.json (or a truncated one), refused on retry."""
    model = quantized_tiny(fp8fx.Fp8Config())
    # (embeddings as transformers' models name them, untied: the config is read for its tie_word_embeddings first)
    model.get_input_embeddings, model.get_output_embeddings = lambda: model.model.embed_tokens, lambda: model.lm_head
    with pytest.raises(ValueError, match=match):
        save_checkpoint(model, tmp_path / "x", config_json=bad, max_shard_size=1 << 12)
    assert not (tmp_path / "x").exists()
    save_checkpoint(model, tmp_path / "x")  # the retry goes through
    assert (tmp_path / "x" / "config.json").exists()


def test_load_and_convert_refuse_an_ignored_layer_that_names_nothing(tmp_path):
    """quantize_ refused a misspelt entry; load_checkpoint and convert quantized the layer it meant to keep."""
    write_checkpoint(tmp_path / "bf16", bf16_state())
    config = fp8fx.Fp8Config(ignored_layers=["lm_haed"])
    model = meta_tiny()
    before = {k: (v.dtype, v.device) for k, v in model.state_dict().items()}
    msg = (r"ignored_layers: 'lm_haed' names no module of .* \(did you mean 'lm_head'\?\); correct or remove the "
           r"entry: a module.s full name or a prefix of names, no regex or suffix")
    with pytest.raises(ValueError, match=msg + r" \(nothing was loaded\)"):
        load_checkpoint(model, tmp_path / "bf16", config, progress=False)
    assert {k: (v.dtype, v.device) for k, v in model.state_dict().items()} == before
    with pytest.raises(ValueError, match=msg + r" \(nothing was written\)"):
        convert(tmp_path / "bf16", tmp_path / "out", config, model=meta_tiny(), progress=False)
    assert not (tmp_path / "out").exists()
    # checkpoint modules the model fuses (q/k/v_proj of a qkv_proj model) are valid entries
    fused_config = fp8fx.Fp8Config(ignored_layers=[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])
    report = load_checkpoint(meta_tiny(fused=True), tmp_path / "bf16", fused_config, progress=False)
    assert "model.layers.0.self_attn.qkv_proj" in report.not_quantized


def test_save_refuses_a_dtype_safetensors_cannot_hold_naming_the_tensor(tmp_path):
    model = quantized_tiny(fp8fx.Fp8Config())
    model.register_buffer("freqs_cis", torch.ones(4, dtype=torch.complex64))
    with pytest.raises(CheckpointError, match=r"freqs_cis: dtype torch.complex64 is not one fp8fx writes to "
                                              r"safetensors .*register it as a non-persistent buffer"):
        save_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_save_refuses_an_unquantized_model(tmp_path):
    with pytest.raises(ValueError, match="has no fp8fx-quantized layer"):
        save_checkpoint(Tiny(), tmp_path / "x")


def test_save_refuses_a_directory_that_holds_a_checkpoint(tmp_path):
    """Shards or an index left from another save would be loaded back under this model's config."""
    model = quantized_tiny(fp8fx.Fp8Config())
    save_checkpoint(model, tmp_path / "x", max_shard_size=1 << 12)  # sharded: an index and several files
    before = sorted(os.listdir(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"already holds a checkpoint .*pass an empty or new directory"):
        save_checkpoint(model, tmp_path / "x")
    assert sorted(os.listdir(tmp_path / "x")) == before
    # another model's config.json or pickled weights: the config was overwritten, the .bin left beside the fp8 files
    for held in ("config.json", "pytorch_model.bin"):
        other = tmp_path / held.replace(".", "_")
        other.mkdir()
        (other / held).write_text("{}")
        (other / "tokenizer.json").write_text("{}")
        with pytest.raises(ValueError, match=rf"already holds a checkpoint \({held}\)"):
            save_checkpoint(model, other)
        assert sorted(os.listdir(other)) == sorted([held, "tokenizer.json"])
        assert (other / held).read_text() == "{}"
    tokenizer_only = tmp_path / "tok"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    save_checkpoint(model, tokenizer_only)  # a tokenizer saved first is the usual order
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= set(os.listdir(tokenizer_only))


# --- convert -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config,method",
    [(fp8fx.Fp8Config(ignored_layers=["lm_head"]), "compressed-tensors"),
     (fp8fx.Fp8Config(weight_block_size=[64, 64]), "fp8")],
    ids=["per-channel", "block"],
)
def test_convert_then_load_equals_quantize_(tmp_path, caplog, config, method):
    """convert writes what load_checkpoint turns into exactly the model quantize_ makes; layers the
    block does not divide stay bf16 and are listed in the ignore list. Other files are copied; folders and pickles
    are not, with a warning naming them (they were left silently)."""
    state = bf16_state()
    src = write_checkpoint(tmp_path / "src", state, shards=2, extra_config={"model_type": "tiny"})
    (src / "tokenizer.json").write_text("{}")
    (src / "training_args.bin").write_bytes(b"not copied")
    (src / "original").mkdir()
    write_file(str(src / "adapter_model.safetensors"), {"a": torch.ones(2)})  # outside the index: dropped silently
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        report = convert(src, tmp_path / "dst", config, model=meta_tiny(), progress=False)
    assert f"convert did not copy adapter_model.safetensors, original/, training_args.bin from {src}" in caplog.text
    dst = tmp_path / "dst"
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json",
    ]
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == method
    if method == "fp8":
        assert qc["weight_block_size"] == [64, 64]
        assert sorted(qc["ignored_layers"]) == sorted(report.not_quantized)
        assert "model.layers.0.self_attn.k_proj" in report.not_quantized  # [32, 64]
    loaded = meta_tiny()
    load_checkpoint(loaded, dst, progress=False)
    ref = Tiny().bfloat16()
    ref.load_state_dict(state)
    if method == "fp8":  # q_proj [64, 64] takes the block, but engines fuse it with k_proj: bf16 with it
        q = [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
        assert report.not_quantized[q[0]].startswith("fused with model.layers.0.self_attn.k_proj into one layer")
        # lm_head, named so in a model without get_output_embeddings, stays bf16 as in a transformers model
        assert report.not_quantized["lm_head"].startswith("the output embeddings: vLLM loads lm_head in bf16 only")
        config = dataclasses.replace(config, ignored_layers=q + ["lm_head"])
    fp8fx.quantize_(ref, config)
    assert_same_state(ref, loaded)


@pytest.mark.parametrize("how", ["save", "convert"])
def test_a_per_tensor_fp8_checkpoint_warns_that_transformers_misreads_it(tmp_path, caplog, how):
    """transformers' fp8 loader reads per-tensor codes unscaled (logits off by 137%): a user saving a per-tensor
    model for it was told nothing; compressed-tensors (which transformers loads) and block scales give no warning."""
    per_tensor = fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor())
    for i, (config, fmt, warned) in enumerate([(per_tensor, None, True), (per_tensor, "compressed-tensors", False),
                                               (fp8fx.Fp8Config(weight_block_size=[32, 32]), None, False)]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fp8fx"):
            if how == "save":
                save_checkpoint(quantized_tiny(config), tmp_path / str(i), format=fmt)
            else:
                src = write_checkpoint(tmp_path / f"src{i}", bf16_state())
                convert(src, tmp_path / str(i), config, model=meta_tiny(), progress=False, format=fmt)
        assert ("misreads (its fp8 loader takes block scales only)" in caplog.text) == warned, (config, fmt)


def test_convert_keeps_the_index_of_a_one_file_checkpoint(tmp_path):
    """A source of one model-00001-of-00001.safetensors and its index (a layout transformers writes): the output
    kept the file's name but had no index, and transformers finds such a file through the index only."""
    src = write_checkpoint(tmp_path / "src", bf16_state(), extra_config={"model_type": "tiny"})
    names = safetensors_names(src / "model.safetensors")
    (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    convert(src, tmp_path / "dst", model=meta_tiny(), progress=False)
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert set(index["weight_map"]) == set(safetensors_names(tmp_path / "dst" / "model-00001-of-00001.safetensors"))
    loaded = meta_tiny()
    load_checkpoint(loaded, tmp_path / "dst", progress=False)
    # a plain model.safetensors stays alone, as before
    convert(write_checkpoint(tmp_path / "one", bf16_state(), extra_config={"model_type": "tiny"}), tmp_path / "d2",
            model=meta_tiny(), progress=False)
    assert sorted(p.name for p in (tmp_path / "d2").iterdir()) == ["config.json", "model.safetensors"]


def test_convert_says_why_no_layer_can_be_quantized_in_one_short_line(tmp_path):
    """Every layer of the tiny model is too small for 128x128 blocks: the error gave the whole plan, tens of KB on one
    line for a 32-layer model; now each reason once, with a count and two layers. An fp8 source without its
    quantization_config got that same dump (every weight "not bf16") before the error that names its cause."""
    src = write_checkpoint(tmp_path / "src", bf16_state(), extra_config={"model_type": "tiny"})
    with pytest.raises(ValueError, match=r"can be quantized with w:per-block\(128x128\) a:per-group\(1x128\): "
                                         r"\d+ layers \([^)]*, \.\.\.\): weight \[\d+, \d+\] is not divisible") as e:
        convert(src, tmp_path / "dst", fp8fx.Fp8Config(weight_block_size=[128, 128]), model=meta_tiny(),
                progress=False)
    assert len(str(e.value)) < 800 and "\n" not in str(e.value)
    state = {n: t.to(torch.float8_e4m3fn) if n.endswith("proj.weight") else t for n, t in bf16_state().items()}
    fp8 = write_checkpoint(tmp_path / "fp8", state, extra_config={"model_type": "tiny"})
    with pytest.raises(CheckpointError, match="an fp8 tensor, but .* has no quantization_config"):
        convert(fp8, tmp_path / "dst", model=meta_tiny(), progress=False)
    assert not (tmp_path / "dst").exists()


class _TiedTiny(Tiny):
    def __init__(self):
        super().__init__()
        self.lm_head.weight = self.model.embed_tokens.weight


def test_convert_refuses_quantize_lm_head_with_lm_head_ignored(tmp_path):
    """--quantize-lm-head with --ignore lm_head: the ignore list won, unsaid (lm_head bf16, the report's row "in
    ignored_layers" alone said so). Refused, naming both, before anything is written."""
    src = write_checkpoint(tmp_path / "src", bf16_state(), extra_config={"model_type": "tiny"})
    with pytest.raises(ValueError, match=r"^convert: quantize_lm_head=True \(--quantize-lm-head\) asks for lm_head in "
                                         r"fp8, and the ignore list \(ignored_layers, --ignore\) keeps it in bf16: drop "
                                         r"one of the two \(nothing was written\)$"):
        convert(src, tmp_path / "dst", model=meta_tiny(), config=fp8fx.Fp8Config(ignored_layers=["lm_head"]),
                quantize_lm_head=True, progress=False)
    assert not (tmp_path / "dst").exists()
    convert(src, tmp_path / "dst", model=meta_tiny(), quantize_lm_head=True, progress=False)  # (either alone: fine)


def test_convert_reports_a_tied_head_asked_for_a_broken_link_and_the_source_dtype(tmp_path, caplog):
    """--quantize-lm-head on a head tied to the embedding (no lm_head.weight stored) had no row in the report and no
    word; a side file that is a broken link was neither copied nor named; an fp32 source was reported as bf16."""
    state = {n: t.float() if t.is_floating_point() else t for n, t in bf16_state().items() if n != "lm_head.weight"}
    src = write_checkpoint(tmp_path / "src", state, extra_config={"model_type": "tiny"})
    os.symlink(tmp_path / "gone.json", src / "tokenizer.json")
    with torch.device("meta"):
        model = _TiedTiny().bfloat16()
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        report = convert(src, tmp_path / "dst", model=model, quantize_lm_head=True, progress=False)
    assert report.not_quantized["lm_head"].startswith("tied to model.embed_tokens.weight, which the checkpoint "
                                                      "stores for both")
    assert "quantize_lm_head: lm_head tied to model.embed_tokens.weight" in caplog.text
    assert "convert did not copy tokenizer.json (a broken link)" in caplog.text
    assert report.format.startswith("fp32 -> compressed-tensors")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_convert_lists_a_tied_head_in_the_ignore_list(tmp_path, caplog, fmt):
    """A head tied to the embedding, stored as the embedding alone (save_pretrained of a tie_word_embeddings model),
    had no row in the report and no name in the written ignore list by default: a compressed-tensors loader (every
    Linear its target) took lm_head for an fp8 layer whose scale was missing, and transformers' logits were NaN
    (h135). It is in both, as with --quantize-lm-head, with no warning (nothing was asked for)."""
    state = {n: t for n, t in bf16_state().items() if n != "lm_head.weight"}
    src = write_checkpoint(tmp_path / "src", state, extra_config={"model_type": "tiny"})
    with torch.device("meta"):
        model = _TiedTiny().bfloat16()
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        report = convert(src, tmp_path / "dst", model=model, progress=False,
                         config=fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor()) if fmt == "fp8" else None)
    assert report.not_quantized["lm_head"] == ("tied to model.embed_tokens.weight, which the checkpoint stores for "
                                               "both (not a linear weight of it): not quantized")
    assert "quantize_lm_head" not in caplog.text
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == fmt
    assert "lm_head" in (qc["ignore"] if fmt == "compressed-tensors" else qc["ignored_layers"]), qc


def test_kv_cache_scales_still_loading_are_refused_before_anything_is_written(tmp_path):
    """An attention Fp8KVCacheMethod made scales on, one loaded, not processed: its -1.0 placeholders were written
    beside the loaded k_scale (prob_scale under its raw name), a checkpoint load_checkpoint then refused."""
    from fp8fx.weights.kv_method import Fp8KVCacheMethod

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = fp8fx.quantize_(transformers.LlamaForCausalLM(cfg).eval(), fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    name = "model.layers.0.self_attn"
    method = Fp8KVCacheMethod(fp8fx.Fp8Config())
    method.create_weights(model.get_submodule(name), prefix=name)
    method.weight_loader(model.get_submodule(name), "k_scale", torch.tensor(0.5))
    with pytest.raises(ValueError, match=rf"^{name}: its KV-cache scales are still loading .*run the method's "
                                         r"process_weights_after_loading\(layer\) first \(nothing was written\)$"):
        save_checkpoint(model, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    method.process_weights_after_loading(model.get_submodule(name))
    save_checkpoint(model, tmp_path / "c")
    back = transformers.LlamaForCausalLM(cfg).eval()
    load_checkpoint(back, tmp_path / "c", progress=False)
    assert fp8fx.weights.kv_cache.kv_scales(back.get_submodule(name)) == {"k_scale": 0.5, "v_scale": 0.5}


def test_a_config_json_saying_untied_for_a_tied_model_gets_the_head_stored_under_its_name(tmp_path):
    """save_checkpoint(config_json=...) of a tied model with tie_word_embeddings: false (a config of the untied
    model): the tied tensor was stored once, as the embeddings', and the untied model that config describes found
    "lm_head.weight is missing" (transformers: a random head). It is stored under both names; the model loads back."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = fp8fx.quantize_(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval())
    config_json = {**model.config.to_dict(), "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"]}
    save_checkpoint(model, tmp_path / "c", config_json=config_json)
    stored = load_file(tmp_path / "c" / "model.safetensors")
    assert torch.equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"])
    back = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "c"))
    load_checkpoint(back.to(torch.bfloat16).eval(), tmp_path / "c", progress=False)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)
    save_checkpoint(model, tmp_path / "own")  # (its own config, tied: the tensor stored once)
    assert "lm_head.weight" not in load_file(tmp_path / "own" / "model.safetensors")


@pytest.mark.parametrize("case", ["other-sizes", "missing-embedding", "never-saved", "bias-of-no-layer",
                                  "integer-norm", "tied-apart", "zero-kv-scale", "kv-scale-of-an-mlp"])
def test_convert_refuses_what_load_would_refuse_in_its_output(tmp_path, case):
    """A config.json of other sizes than the weights, or a --rename that left the embedding out: convert checked the
    linear weights alone and wrote a checkpoint load_checkpoint then refused. A parameter the model's class never
    saves (Marian's sinusoidal embed_positions: ``_keys_to_ignore_on_save``) may be missing. The rest of load's plan
    and value checks too, now that convert runs load's plan over its source: a bias of a bias-less layer, an integer
    norm, a tied head stored with other values, a KV-cache scale of 0 or of an MLP."""
    state = bf16_state()
    model = meta_tiny()
    refusals = {  # case -> (change to the source, what the error says)
        "bias-of-no-layer": ({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64, dtype=torch.bfloat16)},
                             r"o_proj\.bias \(bfloat16 \[64\] .*\) has no place in "),
        "integer-norm": ({"model.layers.0.norm.weight": torch.ones(64, dtype=torch.int32)},
                         r"norm\.weight \(int32 \[64\] .*\): the model's model\.layers\.0\.norm\.weight is "
                         r"torch\.bfloat16"),
        "tied-apart": ({"lm_head.weight": state["lm_head.weight"] * 2},
                       r"the model ties lm_head\.weight to model\.embed_tokens\.weight \(one tensor\), but the "
                       r"checkpoint holds different values"),
        "zero-kv-scale": ({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)},
                          r"k_scale=0\.0: a KV-cache scale must be a positive finite float32"),
        "kv-scale-of-an-mlp": ({"model.layers.0.mlp.k_scale": torch.tensor(1.0)},
                               r"is a scale that no layer takes: a KV-cache scale \(k_scale\) addressed to "
                               r"model\.layers\.0\.mlp"),
    }
    if case in refusals:
        change, message = refusals[case]
        if case == "tied-apart":
            state["model.embed_tokens.weight"] = state["lm_head.weight"].clone()
            with torch.device("meta"):
                model = _TiedTiny().bfloat16()
        src = write_checkpoint(tmp_path / "src", {**state, **change}, extra_config={"model_type": "tiny"})
        snap = snapshot(model)
        with pytest.raises(CheckpointError, match=message):
            convert(src, tmp_path / "dst", model=model, progress=False)
        assert not (tmp_path / "dst").exists() and snapshot(model) == snap
        del state["lm_head.weight"]  # (the same head stored once: converted)
        if case == "tied-apart":
            convert(write_checkpoint(tmp_path / "one", state, extra_config={"model_type": "tiny"}), tmp_path / "dst",
                    model=model, progress=False)
        return
    if case == "never-saved":  # converted, and loaded back with the table computed by the model's initializer
        del state["model.embed_tokens.weight"]
        src = write_checkpoint(tmp_path / "src", state, extra_config={"model_type": "tiny"})

        def lets_it_miss(init=lambda m: m.weight.copy_(torch.ones_like(m.weight)) if isinstance(m, nn.Embedding)
                         else None):
            model = meta_tiny()
            model._keys_to_ignore_on_load_missing, model._init_weights = [r"model\.embed_tokens\.weight"], init
            return model

        convert(src, tmp_path / "dst", model=lets_it_miss(), progress=False)
        model = lets_it_miss()
        load_checkpoint(model, tmp_path / "dst", progress=False)
        assert torch.equal(model.model.embed_tokens.weight, torch.ones(VOCAB, 64, dtype=torch.bfloat16))
        assert model.model.embed_tokens.weight.requires_grad  # (as built)
        with pytest.raises(CheckpointError, match=r"^model\.embed_tokens\.weight: a tensor the model's class lets "
                                                  r"checkpoints leave out .*Tiny\._init_weights does not compute it"):
            load_checkpoint(lets_it_miss(lambda m: None), tmp_path / "dst", progress=False)
        return
    if case == "other-sizes":
        state["model.embed_tokens.weight"] = torch.zeros(state["model.embed_tokens.weight"].shape[0] + 1, 64,
                                                          dtype=torch.bfloat16)
        message = r"the model's model.embed_tokens.weight has shape \[\d+, 64\]; a config.json of other sizes"
    else:
        state["backbone.embed_tokens.weight"] = state.pop("model.embed_tokens.weight")
        message = r"the model's model.embed_tokens.weight has no tensor in the checkpoint; .* nothing was written"
    src = write_checkpoint(tmp_path / "src", state, extra_config={"model_type": "tiny"})
    with pytest.raises(CheckpointError, match=message):
        convert(src, tmp_path / "dst", model=meta_tiny(), progress=False)
    assert not (tmp_path / "dst").exists()


def test_convert_plans_a_meta_model_without_computing_its_buffers(tmp_path):
    """convert reads no buffer: its plan of the source (load's, dry) refused a meta-built model whose non-persistent
    buffer no initializer computes, which convert had converted before."""
    src = write_checkpoint(tmp_path / "src", bf16_state(), extra_config={"model_type": "tiny"})
    with torch.device("meta"):
        model = Tiny().bfloat16()
        model.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
    convert(src, tmp_path / "dst", model=model, progress=False)
    assert load_checkpoint(meta_tiny(), tmp_path / "dst", progress=False).quantized


def test_convert_failing_at_a_side_file_leaves_nothing(tmp_path, monkeypatch):
    """The tokenizer's copy failing (a full disk) after the shards were written left a checkpoint without it, which
    blocked a second try ("already holds files")."""
    src = write_checkpoint(tmp_path / "src", bf16_state(), extra_config={"model_type": "tiny"})
    (src / "tokenizer.json").write_text("{}")

    def full(a, b):
        open(b, "w").write("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copy2", full)
    with pytest.raises(OSError, match="No space left"):
        convert(src, tmp_path / "dst", model=meta_tiny(), progress=False)
    assert not (tmp_path / "dst").exists()


def test_convert_of_a_model_without_linears_says_so(tmp_path):
    class Embedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)

    src = write_checkpoint(tmp_path / "src", {"embed.weight": torch.ones(8, 4, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"a:per-token: Embedding has no nn.Linear \(or experts module\) whose"):
        convert(src, tmp_path / "dst", model=Embedding(), progress=False)


def test_meta_model_builds_the_architectures_class_of_this_config(tmp_path):
    """A fine-tune may keep its base's architectures (a Mistral config naming LlamaForCausalLM): that class cannot
    take the config (no attention_bias), and meta_model failed where it had built the Mistral causal LM."""
    import transformers

    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    assert type(fp8fx.checkpoint.meta_model(tmp_path)) is transformers.MistralForCausalLM


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_save_records_the_dtype_the_model_computes_in(tmp_path, dtype):
    """A model cast after it was built has config.dtype None, which save_checkpoint wrote; meta_model then built it
    in bf16, and the reloaded fp32 or fp16 model computed in bf16 (save_pretrained writes the model's dtype)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    fp8fx.save_checkpoint(model, tmp_path / "c")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    again = fp8fx.checkpoint.meta_model(tmp_path / "c")
    fp8fx.load_checkpoint(again, tmp_path / "c", progress=False)
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        out, ref = again(ids).logits, model(ids).logits
    assert again.model.norm.weight.dtype == out.dtype == dtype
    # (a model cast to 16 bits rounded its rotary inv_freq buffer, which the one built again keeps in float32)
    assert torch.equal(out, ref) if dtype == torch.float32 else rel_err(out.float(), ref.float()) < 0.02


def safetensors_names(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_convert_failing_in_a_later_file_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    from fp8fx.checkpoint import save

    written = []
    real_write = save._write_shard
    monkeypatch.setattr(save, "_write_shard", lambda dst, name, *a: written.append(name) or real_write(dst, name, *a))
    state = bf16_state()
    probe = write_checkpoint(tmp_path / "probe", state, shards=2, extra_config={"model_type": "tiny"})
    weight_map = json.loads((probe / "model.safetensors.index.json").read_text())["weight_map"]
    second = next(n for n, f in weight_map.items() if f.startswith("model-00002") and "layers" in n and n.endswith("proj.weight"))
    state[second][0, 0] = float("nan")  # in the second of two files
    src = write_checkpoint(tmp_path / "src", state, shards=2, extra_config={"model_type": "tiny"})
    with pytest.raises(CheckpointError, match="NaN/Inf"):
        convert(src, tmp_path / "new" / "deeper" / "dst", model=meta_tiny(), progress=False)
    assert written == ["model-00001-of-00002.safetensors"]  # the first file was written ...
    assert not (tmp_path / "new").exists()  # ... then removed, with the folders convert made (new/ and deeper/ were
    # left)


@pytest.mark.parametrize("how", ["save", "convert"])
def test_a_write_failing_halfway_leaves_no_partial_checkpoint(tmp_path, monkeypatch, how):
    """The second shard's write fails after its file was created (a full disk): that file and the first shard
    are removed, and so is the folder the call made."""
    from fp8fx.checkpoint import save

    real_write_file, calls = save.write_file, []

    def failing(file, tensors, metadata=None):
        calls.append(os.path.basename(file))
        if len(calls) == 2:
            open(file, "wb").write(b"half a shard")
            raise OSError(28, "No space left on device")
        real_write_file(file, tensors, metadata=metadata)

    monkeypatch.setattr(save, "write_file", failing)
    with pytest.raises(OSError, match="No space left"):
        if how == "save":
            save_checkpoint(quantized_tiny(fp8fx.Fp8Config()), tmp_path / "dst", max_shard_size=64 << 10)
        else:
            src = write_checkpoint(tmp_path / "src", bf16_state(), shards=2, extra_config={"model_type": "tiny"})
            convert(src, tmp_path / "dst", model=meta_tiny(), progress=False)
    assert len(calls) == 2 and not (tmp_path / "dst").exists()


def write_into(how, src, dst):
    """convert ``src`` into ``dst``, or load it and save_checkpoint into ``dst`` (``how``: "convert ..." / "save ...")."""
    if how.startswith("convert"):
        convert(src, dst, model=meta_tiny(), progress=False)
    else:
        model = meta_tiny()
        load_checkpoint(model, src, progress=False)
        save_checkpoint(model, dst, max_shard_size=64 << 10)


@pytest.mark.parametrize("how", ["convert into an empty folder", "save into an empty folder"])
def test_a_move_into_an_existing_folder_failing_takes_back_the_files_moved(tmp_path, how, monkeypatch):
    """Into an existing folder the staged files are moved one by one: a move the disk refused (a full disk growing
    the directory) left those moved before it there, a partial checkpoint (an index naming a shard not moved, or
    every shard without config.json) that every later run refused as holding files. They are taken back, the error
    names the file, and config.json is moved last."""
    import errno

    from fp8fx.checkpoint import save

    src = write_checkpoint(tmp_path / "src", bf16_state(), shards=2, extra_config={"model_type": "tiny"})
    write_into(how, src, tmp_path / "probe")  # (a new folder: the stage is renamed to it, nothing is moved)
    files = sorted(os.listdir(tmp_path / "probe"))
    assert "config.json" in files and "model.safetensors.index.json" in files and len(files) >= 4
    dst = tmp_path / "dst"
    dst.mkdir()
    before = []
    if how.startswith("save"):
        (dst / "tokenizer.json").write_text("{}")  # (the user's: kept)
        before = ["tokenizer.json"]
    real, left, errors = os.replace, [], []
    for n in range(1, len(files) + 1):
        calls = []

        def full(a, b, *args, n=n, calls=calls, **kwargs):
            if os.path.dirname(b) == str(dst):
                calls.append(os.path.basename(b))
                if len(calls) == n:
                    raise OSError(errno.ENOSPC, "No space left on device")
            return real(a, b, *args, **kwargs)

        monkeypatch.setattr(save.os, "replace", full)
        with pytest.raises(OSError) as e:
            write_into(how, src, dst)
        monkeypatch.undo()
        assert len(calls) == n
        left.append(sorted(os.listdir(dst)))
        errors.append((calls[-1], e.value))
        for f in set(left[-1]) - set(before):  # (for the next try)
            os.remove(dst / f)
    assert left == [before] * len(files)  # as it was: no shard, index, config.json or stage folder left
    assert [f for f, _ in errors][-1] == "config.json"  # (moved last)
    what = "convert" if how.startswith("convert") else "save_checkpoint"
    for f, error in errors:
        assert error.errno == errno.ENOSPC and error.strerror == (
            f"{what}: moving {dst / f} into place failed: No space left on device; free space, or pick another "
            "directory where you can write (nothing was written)")
    write_into(how, src, dst)  # (and the next run writes it)
    assert sorted(os.listdir(dst)) == sorted(files + before)
    assert load_checkpoint(meta_tiny(), dst, progress=False).quantized


@pytest.mark.parametrize("how", ["convert into a new folder", "save into an empty folder"])
def test_a_killed_write_leaves_the_destination_as_it_was(tmp_path, how, caplog):
    """SIGTERM (timeout, Slurm, docker stop) after the first shard: its default action ends the process with no
    Python cleanup, and left a DST of one shard that every later run refused ("already holds files"). The files go
    to a hidden folder that becomes DST when complete: DST is as it was, and the next run says what to remove."""
    import signal
    import subprocess
    import sys
    import textwrap

    src = write_checkpoint(tmp_path / "src", bf16_state(), shards=2, extra_config={"model_type": "tiny"})
    dst = tmp_path / "dst"
    if how.startswith("save"):
        dst.mkdir()
        (dst / "tokenizer.json").write_text("{}")  # (the user's: kept)
    call = ("convert(src, dst, model=meta_tiny(), progress=False)" if how.startswith("convert") else
            "m = meta_tiny(); load_checkpoint(m, src, progress=False); "
            "save_checkpoint(m, dst, max_shard_size=64 << 10)")
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from fp8fx.checkpoint import convert, load_checkpoint, save, save_checkpoint
        from tests.unit.test_checkpoint_load import meta_tiny
        real = save.write_file
        def killed_after(file, tensors, metadata=None):
            real(file, tensors, metadata=metadata)
            os.kill(os.getpid(), signal.SIGTERM)
        save.write_file = killed_after
        src, dst = {str(src)!r}, {str(dst)!r}
        {call}
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGTERM, done.stderr
    parent = dst if how.startswith("save") else tmp_path
    left = [f for f in os.listdir(parent) if ".fp8fx-partial-" in f]
    assert len(left) == 1 and os.listdir(parent / left[0])  # (the shard written before the kill)
    if how.startswith("convert"):
        assert not dst.exists()
    else:
        assert sorted(os.listdir(dst)) == sorted(["tokenizer.json", left[0]])
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        write_into(how, src, dst)
    assert f"holds {left[0]}, left by a" in caplog.text and "that was stopped on the way: remove it" in caplog.text
    assert load_checkpoint(meta_tiny(), dst, progress=False).quantized


@pytest.mark.parametrize("how", ["convert into a new folder", "save into an empty folder"])
def test_two_runs_into_one_destination(tmp_path, how, monkeypatch, caplog):
    """Two runs writing one DST at once: the second failed at its very end with a bare OSError (a new DST: the first
    had renamed its folder to it) or replaced the first's files with its own (an existing folder: a mix of two
    checkpoints), and called the first's live folder a leftover to remove. A run that finds another one writing DST
    now (its folder's lock held) is refused before writing; a folder whose run is gone is a leftover, whatever process
    has its number now; a run whose DST changes under it while it writes removes its own files and says so, DST left
    as the other run made it."""
    import subprocess
    import sys

    from fp8fx.checkpoint import save

    src = write_checkpoint(tmp_path / "src", bf16_state(), shards=2, extra_config={"model_type": "tiny"})
    dst = tmp_path / "dst"
    parent = tmp_path
    if how.startswith("save"):
        dst.mkdir()
        (dst / "tokenizer.json").write_text("{}")  # (the user's: kept)
        parent = dst

    busy = parent / f"{'.dst' if how.startswith('convert') else ''}.fp8fx-partial-{os.getpid()}-0a1b2c3d"
    busy.mkdir()
    holder = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
              "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", holder, str(busy / save._LOCK)], stdout=subprocess.PIPE, text=True)
    try:  # the other run's folder, its lock held by a live process
        assert other.stdout.readline() == "held\n"
        before = sorted(os.listdir(parent))
        with pytest.raises(FileExistsError, match=rf"another run is writing {dst} now \(in {busy}\): wait for it to "
                                                  "end, or pick another directory"):
            write_into(how, src, dst)
        assert sorted(os.listdir(parent)) == before
    finally:
        other.kill()
        other.wait()
    # the same folder once its run is gone: a leftover, whatever process has that number now (this one: a container's
    # pid 1 is every run's)
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        write_into(how, src, dst)
    assert f"holds {busy.name}, left by a" in caplog.text
    shutil.rmtree(busy)
    for f in os.listdir(dst):  # (back to the destination as it was)
        if f != "tokenizer.json":
            os.remove(dst / f)
    if how.startswith("convert"):
        dst.rmdir()
    # the other run finishes while this one writes
    real = save.write_file

    def theirs_lands(file, tensors, metadata=None):
        real(file, tensors, metadata=metadata)
        dst.mkdir(exist_ok=True)
        (dst / os.path.basename(file)).write_bytes(b"theirs")

    monkeypatch.setattr(save, "write_file", theirs_lands)
    with pytest.raises(FileExistsError, match="while this run wrote \\(another run into the same directory\\?\\): "
                                              "this run's files were removed"):
        write_into(how, src, dst)
    assert not [f for f in os.listdir(parent) if ".fp8fx-partial-" in f]
    assert {(dst / f).read_bytes() for f in os.listdir(dst) if f.endswith(".safetensors")} == {b"theirs"}


def test_convert_for_a_fused_model(tmp_path):
    """Separate q/k/v and gate/up weights are quantized one by one (own per-channel scales); loading
    them into the fused model gives what quantize_ gives on the fused model."""
    state = bf16_state()
    src = write_checkpoint(tmp_path / "src", state)
    convert(src, tmp_path / "dst", model=meta_tiny(fused=True), progress=False)
    assert "model.layers.0.self_attn.k_proj.weight_scale" in read_header(str(tmp_path / "dst" / "model.safetensors"))
    loaded = meta_tiny(fused=True)
    load_checkpoint(loaded, tmp_path / "dst", progress=False)  # (lm_head: the output embeddings, kept bf16)
    assert_same_state(quantized_tiny(fp8fx.Fp8Config(ignored_layers=["lm_head"]), fused=True), loaded)


def test_convert_refuses(tmp_path):
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor")
    fp8 = write_checkpoint(tmp_path / "fp8", tensors, qc)
    with pytest.raises(CheckpointError, match="already has a quantization_config"):
        convert(fp8, tmp_path / "out", model=meta_tiny(), progress=False)
    src = write_checkpoint(tmp_path / "src", bf16_state())
    with pytest.raises(ValueError, match="static activation scales need fp8fx.calibrate"):
        convert(src, tmp_path / "out", fp8fx.Fp8Config(activation_scheme="static"), model=meta_tiny())
    with pytest.raises(ValueError, match=r"already holds files \(config\.json, model\.safetensors\)"):
        convert(src, fp8, model=meta_tiny())
    (tmp_path / "stale").mkdir()  # an index left from another save: the new shards would be read through it
    (tmp_path / "stale" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds files"):
        convert(src, tmp_path / "stale", model=meta_tiny())
    (tmp_path / "mine").mkdir()  # the user's own config.json and notes: convert wrote over the config
    (tmp_path / "mine" / "config.json").write_text('{"mine": 1}')
    (tmp_path / "mine" / "notes.txt").write_text("notes")
    with pytest.raises(ValueError, match=r"mine already holds files \(config\.json, notes\.txt\); pass an empty"):
        convert(src, tmp_path / "mine", model=meta_tiny())
    assert (tmp_path / "mine" / "config.json").read_text() == '{"mine": 1}'
    assert sorted(os.listdir(tmp_path / "mine")) == ["config.json", "notes.txt"]
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"convert: dst .*a_file is a file; pass a new or empty directory"):
        convert(src, tmp_path / "a_file", model=meta_tiny())  # it was "[Errno 17] File exists"
    state = bf16_state()
    state["model.layers.1.mlp.up_proj.weight"][2, 2] = float("inf")
    bad = write_checkpoint(tmp_path / "bad", state)
    match = r"^model\.layers\.1\.mlp\.up_proj\.weight \(bfloat16 \[96, 64\] .*\) has 1 NaN/Inf"
    with pytest.raises(CheckpointError, match=match):
        convert(bad, tmp_path / "out2", model=meta_tiny(), progress=False)


def test_convert_refuses_a_checkpoint_that_is_not_all_bf16(tmp_path):
    """A stale scale beside a bf16 weight took the name of the scale convert writes: one of the two was lost (the
    last in the file won) and the output loaded with the weight scaled by 123, silently. An fp8 weight in a checkpoint
    without a quantization_config was written as stored, into an output no loader reads. Both are refused before
    anything is written."""
    state = bf16_state()
    stale = dict(state, **{"model.layers.0.mlp.up_proj.weight_scale": torch.full((96, 1), 123.0)})
    src = write_checkpoint(tmp_path / "stale", stale)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_scale is already in the "
                                              r"checkpoint, beside the bf16 weight model\.layers\.0\.mlp\.up_proj"
                                              r"\.weight .*remove the stale tensor"):
        convert(src, tmp_path / "out", model=meta_tiny(), progress=False)
    assert not (tmp_path / "out").exists()
    stray = dict(state, **{"model.layers.0.mlp.up_proj.input_scale": torch.tensor([0.5])})  # copied through before,
    with pytest.raises(CheckpointError, match=r"^model\.layers\.0\.mlp\.up_proj\.input_scale \(float32 \[1\] in "
                                              r"model\.safetensors\): a scale in a checkpoint without a "
                                              r"quantization_config .* remove the tensor"):  # into what nothing loads
        convert(write_checkpoint(tmp_path / "stray", stray), tmp_path / "out", model=meta_tiny(), progress=False)
    assert not (tmp_path / "out").exists()
    fp8 = dict(state, **{"model.layers.1.mlp.down_proj.weight":
                         state["model.layers.1.mlp.down_proj.weight"].to(torch.float8_e4m3fn)})
    src = write_checkpoint(tmp_path / "fp8", fp8)
    with pytest.raises(CheckpointError, match=r"^model\.layers\.1\.mlp\.down_proj\.weight \(float8_e4m3fn .*: an "
                                              r"fp8 tensor, but .* has no quantization_config"):
        convert(src, tmp_path / "out", model=meta_tiny(), progress=False)
    assert not (tmp_path / "out").exists()


def test_save_arguments_and_a_compiled_model(tmp_path):
    """max_shard_size 0 or '5GB' (one file per tensor, or a bare TypeError), a path that is a file (a bare
    FileExistsError); a torch.compile wrapper was saved under _orig_mod.* names nothing loads. A size written as
    save_pretrained takes it ('5GB', '2GiB') is read as save_pretrained reads it (it was refused)."""
    model = quantized_tiny(fp8fx.Fp8Config())
    for bad in (0, -1, "5 apples", "GB", "-5GB", "0KB", 10.5, "5iB", "5IB"):  # (KeyError 'IB' for the last two)
        with pytest.raises(ValueError, match=rf"max_shard_size={re.escape(repr(bad))} must be a positive number of "
                                             r"bytes \(an int, e.g. 5 \* 2\*\*30\) or a size such as '5GB'"):
            save_checkpoint(model, tmp_path / "a", max_shard_size=bad)
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match=r"max_shard_size='5gb': a unit ending in a lowercase b is bits to "
                                         r"transformers' save_pretrained .*write it as '5gB' \(bytes\)"):
        save_checkpoint(model, tmp_path / "a", max_shard_size="5gb")
    # (binary units in any case, as transformers reads them: "4kib" was refused as bits)
    for size, as_bytes in (("4KiB", 1 << 12), ("4kib", 1 << 12), ("12kB", 12_000), (" 0.02 MB ", 20_000)):
        dirs = [tmp_path / "sizes" / size.strip(), tmp_path / "sizes" / f"{size.strip()}-{as_bytes}"]
        save_checkpoint(model, dirs[0], max_shard_size=size)
        save_checkpoint(model, dirs[1], max_shard_size=as_bytes)
        files = [sorted(os.listdir(d)) for d in dirs]
        index = [json.loads((d / "model.safetensors.index.json").read_text())["weight_map"] for d in dirs]
        assert files[0] == files[1] and index[0] == index[1] and len(set(index[0].values())) > 1, (size, files)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"save_checkpoint: .*file is a file; pass a new or empty directory"):
        save_checkpoint(model, tmp_path / "file")
    # a folder under a file, a broken link: a bare "[Errno 20] Not a directory" / "[Errno 17] File exists"
    with pytest.raises(NotADirectoryError, match=r"^\[Errno 20\] save_checkpoint: cannot make the directory .*file/a/b"
                                                 r": .*file is a file; pass a new or empty directory"):
        save_checkpoint(model, tmp_path / "file" / "a" / "b")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OSError, match=r"save_checkpoint: cannot make the directory .*link/c: .*link is a "
                                      r"broken link; .*\(nothing was written\)"):
        save_checkpoint(model, tmp_path / "link" / "c")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # DST itself a broken link: refused before writing
    with pytest.raises(OSError, match=r"save_checkpoint: cannot make the directory .*dangling: it is a broken link"):
        save_checkpoint(model, tmp_path / "dangling")
    assert sorted(os.listdir(tmp_path)) == ["dangling", "file", "link", "sizes"]
    save_checkpoint(torch.compile(model), tmp_path / "compiled")
    names = read_checkpoint(tmp_path / "compiled")[1]
    assert names and not any(n.startswith("_orig_mod.") for n in names)


def test_a_fused_group_is_saved_in_one_precision(tmp_path, caplog):
    """64x64 blocks divide q_proj [64, 64] but not k_proj / v_proj [32, 64]: quantize_ leaves q fp8 and k, v bf16,
    and the checkpoint held them so; vLLM fuses them into qkv_proj and refuses shards of two precisions. q_proj is
    written dequantized, the three in the ignore list (vLLM's rule per fused layer: all shards or none), with a
    warning naming them; it loads back with q_proj in bf16 holding its dequantized weight, the rest as it was."""
    model = quantized_tiny(fp8fx.Fp8Config(weight_block_size=[64, 64]))
    q = [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        qc = save_checkpoint(model, tmp_path / "saved")
    assert f"writes {q[0]}, {q[1]} in high precision" in caplog.text
    assert "model.layers.0.self_attn.k_proj: weight [32, 64] is not divisible by the 64x64 block" in caplog.text
    ignored = set(qc["ignored_layers"])
    assert set(q) <= ignored and "model.layers.0.self_attn.o_proj" not in ignored
    for parent in {n.rpartition(".")[0] for n in LINEARS}:
        for parts in FUSED.values():
            assert len({f"{parent}.{p}" in ignored for p in parts if f"{parent}.{p}" in LINEARS}) <= 1, parent
    header = read_header(str(tmp_path / "saved" / "model.safetensors"))
    assert header[f"{q[0]}.weight"].dtype == torch.bfloat16 and f"{q[0]}.weight_scale_inv" not in header
    loaded = meta_tiny()
    report = load_checkpoint(loaded, tmp_path / "saved", progress=False)
    fp8_layers = {f for f, m in model.named_modules() if fp8fx.weights.is_quantized(m)}
    assert set(report.quantized) == fp8_layers - set(q) and "model.layers.0.self_attn.o_proj" in report.quantized
    for name, t in loaded.state_dict().items():
        owner = name.rpartition(".")[0]
        dequantized = owner in q and name.endswith(".weight")
        expected = model.get_submodule(owner).weight if dequantized else model.state_dict()[name]
        assert t.dtype == expected.dtype and torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), name


def test_a_model_of_split_groups_alone_is_refused_without_a_warning_of_a_write(tmp_path, caplog):
    """Every fp8 layer in a fused group split by the weight block (q_proj fp8, k / v_proj bf16, the rest ignored):
    nothing would be written in fp8, so it is refused, nothing written, and no warning says they are being written
    in high precision first (it did, then the refusal followed)."""
    ignored = [f for f in LINEARS if not f.endswith("q_proj")] + ["lm_head"]
    model = quantized_tiny(fp8fx.Fp8Config(weight_block_size=[64, 64], ignored_layers=ignored))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        with pytest.raises(ValueError, match=r"save_checkpoint: every fp8 layer of the model .*q_proj.* is a Conv1D "
                                             r"or in a fused group whose other layers stay in high precision"):
            save_checkpoint(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists() and "in high precision (dequantized" not in caplog.text


def test_a_fused_group_split_by_ignored_layers_says_to_fix_the_ignore_list(tmp_path, caplog):
    """k_proj kept bf16 by ignored_layers (not by the weight block): the warning said to change the weight block,
    which changes nothing; it says to remove the entry from ignored_layers (or ignore the rest of the group)."""
    k = "model.layers.0.self_attn.k_proj"
    model = quantized_tiny(fp8fx.Fp8Config(ignored_layers=[k]))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        qc = save_checkpoint(model, tmp_path / "saved")
    assert f"({k}: in ignored_layers); to keep them fp8, remove {k} from ignored_layers (or, to keep the groups in " \
           "high precision without this warning, add their other layers to it)" in caplog.text
    assert "weight block" not in caplog.text
    assert {k, "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"} <= set(qc["ignore"])

    caplog.clear()  # k_proj ignored, v_proj not divisible by the 64x64 block: both fixes
    model = quantized_tiny(fp8fx.Fp8Config(weight_block_size=[64, 64], ignored_layers=[k]))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        save_checkpoint(model, tmp_path / "both")
    assert f"remove {k} from ignored_layers" in caplog.text
    assert "quantize with a scheme every layer of the group takes (e.g. a weight block" in caplog.text


def test_a_fused_group_quantized_with_two_schemes_is_refused(tmp_path):
    """vLLM runs q/k/v_proj as one layer of one scheme and refuses a checkpoint that quantizes them differently."""
    model = Tiny().bfloat16()
    model.load_state_dict(bf16_state())
    attn = "model.layers.0.self_attn"
    per_tensor = fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor())
    for proj, config in (("q_proj", per_tensor), ("k_proj", fp8fx.Fp8Config()), ("v_proj", fp8fx.Fp8Config())):
        fp8fx.quantize_(model.get_submodule(f"{attn}.{proj}"), config, prefix=f"{attn}.{proj}")
    with pytest.raises(ValueError, match=rf"{attn}\.q_proj \(w:per-tensor.*\), {attn}\.k_proj \(w:per-channel.*\), "
                                         r".* are quantized differently, .*quantize them with one config \(nothing"):
        save_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_compiled_submodule_is_saved_under_the_models_names(tmp_path):
    """model.model.layers[0] = torch.compile(layer): its tensors were saved as model.layers.0._orig_mod.*, which no
    model loads, and so were its layers in the ignore list; now under the uncompiled model's names, which load."""
    model = quantized_tiny(fp8fx.Fp8Config(ignored_layers=["model.layers.0.mlp.down_proj", "lm_head"]))
    with torch.no_grad():
        expected = model(IDS)
    state = {k.replace("._orig_mod", ""): v for k, v in model.state_dict().items()}
    model.model.layers[0] = torch.compile(model.model.layers[0])
    qc = save_checkpoint(model, tmp_path / "saved")
    assert qc["ignore"] == ["model.layers.0.mlp.down_proj", "lm_head"]
    assert not any("_orig_mod" in n for n in read_checkpoint(tmp_path / "saved")[1])
    loaded = meta_tiny()
    report = load_checkpoint(loaded, tmp_path / "saved", progress=False)
    assert "model.layers.0.self_attn.q_proj" in report.quantized
    assert loaded.state_dict().keys() == state.keys()
    for name, t in loaded.state_dict().items():
        assert t.dtype == state[name].dtype and torch.equal(t.view(torch.uint8), state[name].view(torch.uint8)), name
    with torch.no_grad():
        assert torch.equal(loaded(IDS), expected)
    compiled = meta_tiny()  # the same structure, its layer compiled before the load: its names have _orig_mod.
    compiled.model.layers[0] = torch.compile(compiled.model.layers[0])
    with pytest.raises(ValueError, match=r"load_checkpoint: model.layers.0 is a torch.compile wrapper "
                                         r"of a submodule.*load into the model first, then compile its submodules"):
        load_checkpoint(compiled, tmp_path / "saved", progress=False)
    assert all(p.is_meta for p in compiled.parameters())


def test_names_that_collide_without_orig_mod_are_refused(tmp_path):
    """A module's proj and its child _orig_mod's proj would be saved under one name: refused, naming both."""
    inner = torch.nn.Module()
    inner.proj, inner._orig_mod = torch.nn.Linear(64, 64, bias=False), torch.nn.Module()
    inner._orig_mod.proj = torch.nn.Linear(64, 64, bias=False)
    model = torch.nn.Module()
    model.inner = inner
    fp8fx.quantize_(model.bfloat16())
    match = r"inner\.proj\.weight and inner\._orig_mod\.proj\.weight would both be saved as inner\.proj\.weight "
    with pytest.raises(ValueError, match=match + r".*rename one of the modules.*nothing was written"):
        save_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_save_refuses_a_tensor_on_the_meta_device_naming_it(tmp_path):
    """torch's "Cannot copy out of meta tensor; no data!" named no tensor."""
    model = quantized_tiny(fp8fx.Fp8Config())
    norm = model.model.layers[0].norm
    norm.weight = nn.Parameter(torch.empty(norm.weight.shape, device="meta"))
    with pytest.raises(ValueError, match=r"save_checkpoint: model.layers.0.norm.weight is on the meta device \(1 such "
                                         r"tensors\).*load the model's weights first .*nothing was written"):
        save_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_save_of_a_quantized_model_on_the_meta_device_names_a_tensor(tmp_path):
    """The scales' check ran first: torch's "Tensor.item() cannot be called on meta tensors"."""
    model = quantized_tiny(fp8fx.Fp8Config()).to("meta")
    with pytest.raises(ValueError, match=r"save_checkpoint: \S+ is on the meta device .*nothing was written"):
        save_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_models_own_q_scale_is_no_kv_cache_scale(tmp_path):
    """A learned per-head ``q_scale`` parameter was checked as a KV-cache scale ("one value, got shape [8]") and the
    save refused; it is the model's own, saved and loaded back as it is, and declares no KV-cache scheme."""
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.q_scale = nn.Linear(64, 64), nn.Parameter(torch.linspace(0.5, 2, 8))

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(Attn()).bfloat16()
        m[0].q_scale.data = m[0].q_scale.data.float()
        return m

    source = model()
    fp8fx.quantize_(source)
    qc = save_checkpoint(source, tmp_path / "x")
    assert "kv_cache_scheme" not in qc or not qc["kv_cache_scheme"]
    loaded = model()
    fp8fx.load_checkpoint(loaded, tmp_path / "x", progress=False)
    assert torch.equal(loaded[0].q_scale, source[0].q_scale) and loaded[0].q_scale.dtype == torch.float32


def test_save_refuses_an_fp8_layer_whose_weight_is_no_longer_fp8(tmp_path):
    """Cast by hand after quantize_: its bf16 values would be written under the fp8 checkpoint's names."""
    model = quantized_tiny(fp8fx.Fp8Config())
    layer = model.model.layers[0].mlp.up_proj
    layer._parameters["weight"] = torch.nn.Parameter(layer._parameters["weight"].bfloat16(), requires_grad=False)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight of the fp8 layer .* is torch.bfloat16, "
                                         r"not torch.float8_e4m3fn .*nothing was written"):
        save_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad", ["nan weight_scale", "zero input_scale", "negative k_scale", "inf block scale",
                                 "nan weight"])
def test_save_refuses_a_scale_no_loader_takes(tmp_path, bad):
    """A NaN weight scale, a negative KV-cache scale or a NaN fp8 code was written without a word, and load_checkpoint
    then refused the checkpoint save_checkpoint had written."""
    from fp8fx.weights import kv_cache

    kind, name = bad.split(" ", 1)
    config = fp8fx.Fp8Config(weight_block_size=[32, 32]) if name == "block scale" else fp8fx.Fp8Config(
        activation_scheme="static" if name == "input_scale" else "dynamic")
    model = quantized_tiny(config)
    attn = model.model.layers[0].self_attn
    kv_cache.attach_kv_scales(attn, {"k_scale": 0.5, "v_scale": 0.5})
    value = {"nan": float("nan"), "zero": 0.0, "negative": -2.0, "inf": float("inf")}[kind]
    leaf = {"block scale": "weight_scale_inv"}.get(name, name)
    owner = attn if leaf == "k_scale" else attn.o_proj
    (owner._parameters[leaf] if leaf == "weight" else getattr(owner, leaf)).data.view(-1)[-1] = value  # (the codes)
    fqn = "model.layers.0.self_attn" + ("" if leaf == "k_scale" else ".o_proj")
    with pytest.raises(ValueError, match=rf"save_checkpoint: {fqn}\.{leaf}.*nothing was written"):
        save_checkpoint(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("config", [fp8fx.Fp8Config(), fp8fx.Fp8Config(weight_block_size=[128, 128])],
                         ids=["per-channel", "block"])
def test_a_layer_of_no_rows_loads_back(tmp_path, config):
    """nn.Linear(128, 0) quantizes and saves with a [0, 1] / [0, 1] scale; loading it failed on the range check of
    its scale (max() of no values, a raw torch error)."""
    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"empty": torch.nn.Linear(128, 0), "full": torch.nn.Linear(128, 128)}).bfloat16()

    saved = model()
    fp8fx.quantize_(saved, config)
    save_checkpoint(saved, tmp_path / "saved")
    with torch.device("meta"):
        loaded = model()
    report = load_checkpoint(loaded, tmp_path / "saved", progress=False)
    assert sorted(report.quantized) == ["empty", "full"]
    assert_same_state(saved, loaded)


def test_a_bias_shared_by_two_layers_loads_back_shared(tmp_path):
    """Two quantized layers sharing one bias Parameter: save_checkpoint writes it once (under the first name), and
    load_checkpoint asked for it under each layer's name ("b.bias is missing"). The second layer now takes the first
    one's: the same values, still one Parameter."""
    def model():
        torch.manual_seed(0)
        layers = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 64), "b": torch.nn.Linear(64, 64)}).bfloat16()
        layers.b.bias = layers.a.bias
        return layers

    saved = model()
    fp8fx.quantize_(saved, fp8fx.Fp8Config())
    save_checkpoint(saved, tmp_path / "saved")
    with torch.device("meta"):
        loaded = model()
    report = load_checkpoint(loaded, tmp_path / "saved", progress=False)
    assert sorted(report.quantized) == ["a", "b"] and loaded.a.bias is loaded.b.bias
    assert_same_state(saved, loaded)


class _ScaledHead(torch.nn.Module):
    """An output head that wraps its linear (logit scaling around ``nn.Linear``, as some models have)."""

    def __init__(self, linear):
        super().__init__()
        self.proj = linear

    def forward(self, x):
        return self.proj(x) * 0.5


class _TinyWrappedHead(Tiny):
    def __init__(self, fused=False, layers=2):
        super().__init__(fused, layers)
        self.head = _ScaledHead(self.lm_head)
        del self.lm_head

    def forward(self, ids):
        return self.head(self.model(ids))

    def get_output_embeddings(self):
        return self.head


def test_output_embeddings_behind_a_wrapper_are_the_linear_it_wraps(tmp_path, caplog):
    """get_output_embeddings() may give a module that wraps the linear: convert keeps that linear bf16 (it was
    quantized: a checkpoint vLLM and transformers read wrong) and save_checkpoint warns when it is fp8."""
    from fp8fx.checkpoint.load import output_embeddings
    with torch.device("meta"):
        model = _TinyWrappedHead().bfloat16()
    assert output_embeddings(model, dict(model.named_modules())) == "head.proj"
    model.head.extra = torch.nn.Linear(64, 64)  # a head of two linears names neither
    assert output_embeddings(model, dict(model.named_modules())) is None
    assert output_embeddings(Tiny(), dict(Tiny().named_modules())) == "lm_head"  # no get_output_embeddings: by name

    state = {("head.proj.weight" if k == "lm_head.weight" else k): v for k, v in bf16_state().items()}
    src = write_checkpoint(tmp_path / "src", state, extra_config={"model_type": "tiny"})
    with torch.device("meta"):
        model = _TinyWrappedHead().bfloat16()
    report = convert(src, tmp_path / "dst", fp8fx.Fp8Config(), model=model, progress=False)
    assert report.not_quantized["head.proj"].startswith("the output embeddings: vLLM loads lm_head in bf16 only")
    with safe_open(str(tmp_path / "dst" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("head.proj.weight").dtype == torch.bfloat16 and "head.proj.weight_scale" not in f.keys()

    model = _TinyWrappedHead().bfloat16()
    fp8fx.quantize_(model, fp8fx.Fp8Config())
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        save_checkpoint(model, tmp_path / "saved")
    assert "save_checkpoint writes the output embeddings head.proj in fp8" in caplog.text


def test_meta_model_names_what_is_wrong(tmp_path):
    """A missing folder, a folder without config.json and a dtype that is no float all read "config.json: transformers
    cannot build the model it describes ... or pass model=" (an argument meta_model has not)."""
    from fp8fx.checkpoint import meta_model

    transformers = pytest.importorskip("transformers")
    with pytest.raises(CheckpointError, match=r"^meta_model: .*nothing/config.json does not exist; pass a "
                                              r"checkpoint's folder"):
        meta_model(tmp_path / "nothing")
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path / "llama")
    for dtype in ("bf16", torch.int8, torch.float8_e4m3fn):  # (fp8: transformers' error, "fix the config")
        with pytest.raises(ValueError, match=r"^meta_model\(dtype=.*\): a floating-point torch.dtype of 16 bits"):
            meta_model(tmp_path / "llama", dtype)
    assert next(meta_model(tmp_path / "llama", torch.float16).parameters()).dtype == torch.float16


def test_a_model_whose_embedding_getter_raises_saves(tmp_path):
    """transformers' CLIPModel, Wav2Vec2Model and ConvNext raise NotImplementedError from get_input_embeddings ("not
    auto-handled"): save_checkpoint failed with it, writing nothing. The getter counts as giving no embeddings."""

    class NoEmbeddings(nn.Sequential):
        def get_input_embeddings(self):
            raise NotImplementedError("get_input_embeddings not auto-handled for NoEmbeddings")

        def get_output_embeddings(self):
            return self[1]

    torch.manual_seed(0)
    model = NoEmbeddings(nn.Linear(64, 64), nn.Linear(64, 32)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    fp8fx.save_checkpoint(model, tmp_path / "c")
    with torch.device("meta"):
        loaded = NoEmbeddings(nn.Linear(64, 64), nn.Linear(64, 32)).to(torch.bfloat16)
    fp8fx.load_checkpoint(loaded, tmp_path / "c", progress=False)
    assert torch.equal(loaded(x), model(x))


def test_load_checkpoint_inside_the_meta_block_that_built_the_model(tmp_path):
    """load_checkpoint called inside the torch.device("meta") block that built the model: its reads of the file made
    their buffers on meta and failed naming nothing ("PyMemoryView_FromBuffer(): info->buf must not be NULL"); a
    review's catch."""
    from benchmarks.bench_linear import MLP

    torch.manual_seed(0)
    src = MLP(64, 96).to(torch.bfloat16)
    fp8fx.quantize_(src)
    fp8fx.save_checkpoint(src, tmp_path)
    with torch.device("meta"):
        model = MLP(64, 96).to(torch.bfloat16)
        fp8fx.load_checkpoint(model, tmp_path, progress=False)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(model(x), src(x))
