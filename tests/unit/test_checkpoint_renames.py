"""Checkpoint names that differ from the model's (fp8fx.checkpoint.renames): hub Mixtral checkpoints store the MoE
block as ``block_sparse_moe`` where transformers 5 builds ``mlp``; load_checkpoint and convert apply the renames
transformers applies (or a user's key_mapping), match ignore lists written with the checkpoint's names, and refuse
mappings that merge two tensors, leaving the model unchanged."""
import json
import logging
import re

import pytest
import torch
from torch import nn

import fp8fx

from fp8fx import cli
from fp8fx.checkpoint import CheckpointError, convert, load_checkpoint, meta_model
from fp8fx.checkpoint import renames
from fp8fx.checkpoint.files import read_checkpoint
from fp8fx.weights import is_quantized_experts
from tests.unit.test_checkpoint_moe import E, EXPERTS, FP8, moe_checkpoint, moe_config, reference_model, write_moe
from tests.unit.test_checkpoint_moe_convert import CONFIGS, bf16_checkpoint
from tests.unit.test_checkpoint_save import assert_same_state
from tests.unit.test_checkpoint_load import LINEARS, Tiny, bf16_state, fp8_checkpoint, meta_tiny, snapshot
from tests.unit.test_checkpoint_load import write_checkpoint

transformers = pytest.importorskip("transformers")

HUB = "model.layers.0.block_sparse_moe"


def hub_layout(tensors):
    """The tensors as hub Mixtral checkpoints name them: the MoE block (router and experts) under block_sparse_moe."""
    return {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in tensors.items()}


def test_transformers_renamer_of_mixtral_and_of_other_models():
    cfg = moe_config("mixtral")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    rename = renames.transformers_renamer(model, [])
    assert rename(f"{HUB}.experts.0.w1.weight") == f"{EXPERTS}.0.w1.weight"
    assert rename(f"{HUB}.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert rename("model.layers.0.self_attn.k_proj.k_scale") == "model.layers.0.self_attn.k_proj.k_scale"
    assert renames.transformers_renamer(nn.Linear(2, 2), []) is None


def test_per_expert_loadable():
    """Whether transformers loads a model's experts from per-expert tensors: Mixtral and Qwen3-MoE (converters that
    merge them), not GraniteMoE (hub checkpoints hold them fused: renames only); unknown for a model it did not
    build."""
    transformers = pytest.importorskip("transformers")
    assert renames.per_expert_loadable(reference_model(moe_config("mixtral"))) is True
    assert renames.per_expert_loadable(reference_model(moe_config("qwen3_moe"))) is True
    granite = transformers.GraniteMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, intermediate_size=32, num_local_experts=4)
    assert renames.per_expert_loadable(transformers.AutoModelForCausalLM.from_config(granite)) is False
    assert renames.per_expert_loadable(Tiny()) is None


def test_renames_chain_and_add_to_the_models_own():
    """As transformers applies them: every rename that matches fires, in turn (a user's mapping adds to the model's
    renames), \\1 in a replacement takes a group; the pattern rules are those of the installed transformers."""
    cfg = moe_config("mixtral")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    mapping = {r"^base\.": "", r"\.block_sparse_moe\.experts\.(\d+)\.w1": r".block_sparse_moe.experts.\1.w3"}
    rename = renames.resolve(model, mapping, "t")  # the user's renames first, then the model's
    assert rename(f"base.{HUB}.experts.0.w1.weight") == f"{EXPERTS}.0.w3.weight"
    plain = renames.resolve(nn.Linear(2, 2), {r"\.ffn\.": ".mlp.", r"\.mlp\.w1": ".mlp.gate_proj"}, "t")
    assert plain("a.ffn.w1.weight") == "a.mlp.gate_proj.weight"


@pytest.mark.parametrize("granularity,static", [("tensor", True), ("block", False)])
def test_hub_mixtral_fp8_checkpoint_loads_as_the_models_own_layout(tmp_path, granularity, static):
    """An fp8 Mixtral checkpoint in the hub's layout, with its router in ignored_layers by the hub's name (as
    AutoFP8 writes it), loads into the transformers model bit for bit as the same checkpoint in the model's
    layout does; without the renames it is refused."""
    cfg = moe_config("mixtral")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), granularity, naming="mixtral", static=static)
    own = write_moe(tmp_path / "own", cfg, tensors, qc)
    qc = json.loads(json.dumps(qc))
    qc["ignored_layers"].append(f"{HUB}.gate")
    hub = write_moe(tmp_path / "hub", cfg, hub_layout(tensors), qc)
    assert any(".block_sparse_moe.experts.0.w1.weight_scale" in k for k in read_checkpoint(hub)[1])

    expected, model = meta_model(own), meta_model(hub)
    load_checkpoint(expected, own, progress=False)
    report = load_checkpoint(model, hub, progress=False)
    assert list(report.experts) == [EXPERTS] and is_quantized_experts(model.get_submodule(EXPERTS))
    assert_same_state(expected, model)
    # one expert's scale missing: named as the file would hold it too (it had named only the model's name, which is
    # in neither the checkpoint nor the model, whose experts are fused: h149)
    leaf = "input_scale" if static else "weight_scale_inv"
    cut = write_moe(tmp_path / "cut", cfg, {k: v for k, v in hub_layout(tensors).items()
                                            if k != f"{HUB}.experts.3.w3.{leaf}"}, qc)
    with pytest.raises(CheckpointError, match=rf"^{EXPERTS}\.3\.w3\.{leaf} \(stored as {HUB}\.experts\.3\.w3\.{leaf}\) "
                                              r"is missing from the checkpoint"):
        load_checkpoint(meta_model(cut), cut, progress=False)


def test_ignored_layers_match_the_checkpoints_names(tmp_path, capsys, caplog):
    """Experts a checkpoint keeps bf16 and lists under its own name stay bf16 (matched as the checkpoint
    names them: before, the renamed experts were taken as fp8 and their bf16 weights refused)."""
    cfg = moe_config("mixtral")
    state = reference_model(cfg).state_dict()
    tensors, qc, _ = moe_checkpoint(state, "tensor", naming="mixtral")
    for key in [k for k in tensors if k.startswith(EXPERTS + ".")]:
        del tensors[key]
    for e in range(E):
        w1, w3 = state[f"{EXPERTS}.gate_up_proj"][e].chunk(2)
        tensors.update({f"{EXPERTS}.{e}.w1.weight": w1, f"{EXPERTS}.{e}.w3.weight": w3,
                        f"{EXPERTS}.{e}.w2.weight": state[f"{EXPERTS}.down_proj"][e]})
    qc["ignored_layers"].append(f"{HUB}.experts")
    path = write_moe(tmp_path / "ckpt", cfg, hub_layout(tensors), qc)
    model = meta_model(path)
    report = load_checkpoint(model, path, progress=False)
    experts = model.get_submodule(EXPERTS)
    assert not is_quantized_experts(experts) and report.not_quantized[EXPERTS] == "in ignored_layers"
    for base in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(experts, base), state[f"{EXPERTS}.{base}"])
    # inspect reads the ignore list as the load does (it predicted the experts rewritten, by the model's names alone)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    rows = {r["fqn"]: r for r in json.loads(capsys.readouterr().out)["sites"]}
    assert not rows[EXPERTS]["would_rewrite"] and rows[EXPERTS]["reason"] == "in ignored_layers"
    assert rows["model.layers.0.self_attn.q_proj"]["would_rewrite"]
    # inspect needs no weights: a shard missing (a download in part) leaves the names unread, said, not refused
    next(path.glob("*-00002-of-00002.safetensors")).unlink()
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        assert cli.main(["inspect", str(path), "--json"]) == 0
    assert "the checkpoint's tensor names were not read" in caplog.text and "missing" in caplog.text
    for shard in path.glob("*.safetensors"):  # the index alone (a download under way): said too, not silent
        shard.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        assert cli.main(["inspect", str(path), "--json"]) == 0
    assert "the checkpoint's tensor names were not read" in caplog.text


def _tiny_checkpoint(tmp_path, rename):
    torch.manual_seed(0)
    state = {rename(k): v for k, v in Tiny().bfloat16().state_dict().items()}
    return write_checkpoint(tmp_path / "ckpt", state)


def test_key_mapping_of_a_plain_model(tmp_path):
    """A user's key_mapping on a model transformers knows nothing of: the checkpoint stores the MLP as ``ffn``;
    the first pattern that matches a name renames it (as transformers' key_mapping)."""
    path = _tiny_checkpoint(tmp_path, lambda k: k.replace(".mlp.", ".ffn."))
    mapping = {r"\.ffn\.": ".mlp.", r"\.ffn\.gate_proj": ".never."}
    loaded, expected = meta_tiny(), meta_tiny()
    report = load_checkpoint(loaded, path, key_mapping=mapping, progress=False)
    plain_path = _tiny_checkpoint(tmp_path / "plain", lambda k: k)
    assert report.quantized == load_checkpoint(expected, plain_path, progress=False).quantized
    assert set(LINEARS) <= set(report.quantized)
    assert_same_state(expected, loaded)


@pytest.mark.parametrize("mapping,error,match", [
    ({r"\.ffn\.(gate|up)_proj": ".mlp.gate_proj"}, CheckpointError,
     r"ffn\.(gate|up)_proj\.weight and model\.layers\.0\.ffn\.(gate|up)_proj\.weight both load as "
     r"model\.layers\.0\.mlp\.gate_proj\.weight"),
    ({"(": ".mlp."}, ValueError, r"key_mapping pattern '\(' is not a regex"),
    ([("a", "b")], TypeError, "not a dict"),
    ({r"\.ffn\.": 1}, TypeError, "is not str -> str"),
    ({r"\.ffn\.": r".mlp.\1"}, ValueError, "refers to group 1, which the pattern does not have"),
    ({r"\.(ffn)\.": r".mlp.\2"}, ValueError, r"'\.mlp\.\\\\2' refers to group 2, which the pattern does not have \(it "
     r"has 1 group\)"),
    ({r"\.ffn\.": r".mlp.\g<1>"}, ValueError, r"refers to group \\g<1>, which the pattern does not have"),
    ({r"\.(?P<x>ffn)\.": r".\g<y>."}, ValueError, r"refers to group \\g<y>, which the pattern does not have \(it "
     r"has 1 group, named x\)"),
    ({r"\.ffn\.": r".mlp\q"}, ValueError, r"'\.mlp\\\\q' is not a replacement for that pattern \(bad escape"),
    ({r"\.ffn\.down_proj": ".mlp.down_proj"}, CheckpointError,
     r"model\.layers\.0\.mlp\.gate_proj\.weight is missing from the checkpoint; the checkpoint has 4 tensors the "
     r"model has no place for \(model\.layers\.\d\.ffn\.(gate|up)_proj\.weight \.\.\.\): if it names modules "
     r"differently, pass key_mapping="),
])
def test_bad_key_mapping_is_refused_and_changes_nothing(tmp_path, mapping, error, match):
    path = _tiny_checkpoint(tmp_path, lambda k: k.replace(".mlp.", ".ffn."))
    model = meta_tiny()
    before = snapshot(model)
    with pytest.raises(error, match=match):
        load_checkpoint(model, path, key_mapping=mapping, progress=False)
    assert snapshot(model) == before


def test_errors_name_the_stored_name(tmp_path):
    """A tensor renamed by key_mapping is named in errors as the model knows it and as the file stores it."""
    model = Tiny().bfloat16()
    state = {k.replace(".mlp.", ".ffn."): v for k, v in model.state_dict().items()}
    state["model.layers.0.ffn.down_proj.weight"] = state["model.layers.0.ffn.down_proj.weight"][:, :-1].clone()
    path = write_checkpoint(tmp_path / "ckpt", state)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight \(bfloat16 .* as "
                                              r"model\.layers\.0\.ffn\.down_proj\.weight\)"):
        load_checkpoint(meta_tiny(), path, key_mapping={r"\.ffn\.": ".mlp."}, progress=False)
    # a tensor the file lacks: under both names too (h149)
    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor", static=True)
    state = {k.replace(".mlp.", ".ffn."): v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.input_scale"}
    path = write_checkpoint(tmp_path / "static", state, qc)
    with pytest.raises(CheckpointError, match=r"^model\.layers\.1\.mlp\.up_proj\.input_scale \(stored as "
                                              r"model\.layers\.1\.ffn\.up_proj\.input_scale\) is missing"):
        load_checkpoint(meta_tiny(), path, key_mapping={r"\.ffn\.": ".mlp."}, progress=False)


def _moved(src, dst, old, new):
    """The checkpoint in ``src`` with ``old`` renamed ``new`` in every name, written to ``dst``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k.replace(old, new): v for k, v in load_file(f).items()}
            save_file(tensors, dst / f.name, metadata={"format": "pt"})
        else:
            (dst / f.name).write_text(f.read_text().replace(old, new))
    return dst


def test_convert_of_hub_mixtral_keeps_its_layout(tmp_path):
    """convert of a hub-layout bf16 Mixtral: the experts are found through the rename, quantized and written under
    the names the checkpoint has (the hub's layout, which transformers and vLLM load); the output loads back with
    fp8 experts. A user's ignore list may name them as stored."""
    cfg = moe_config("mixtral")
    state = reference_model(cfg).state_dict()
    src = bf16_checkpoint(tmp_path / "src", cfg, state, "mixtral")
    moved = _moved(src, tmp_path / "moved", ".mlp.", ".block_sparse_moe.")
    report = convert(moved, tmp_path / "dst", CONFIGS["per-channel"], progress=False)
    assert list(report.experts) == [f"{HUB}.experts"]
    names = read_checkpoint(tmp_path / "dst")[1]
    assert names[f"{HUB}.experts.0.w1.weight"].dtype == FP8 and f"{HUB}.experts.0.w1.weight_scale" in names
    assert not any(".mlp." in n for n in names)
    model = meta_model(tmp_path / "dst")
    load_checkpoint(model, tmp_path / "dst", progress=False)
    assert is_quantized_experts(model.get_submodule(EXPERTS))

    config = fp8fx.Fp8Config(ignored_layers=["lm_head", f"{HUB}.experts"])
    report = convert(moved, tmp_path / "kept", config, progress=False)
    assert not report.experts and report.not_quantized[f"{HUB}.experts.0.w1"] == "in ignored_layers"
    assert read_checkpoint(tmp_path / "kept")[1][f"{HUB}.experts.0.w1.weight"].dtype == torch.bfloat16


def test_convert_refusing_every_layer_names_them_as_the_checkpoint_stores_them(tmp_path):
    """h127: a hub Mixtral no block of which divides a layer was refused naming its experts
    model.layers.0.mlp.experts.0.w1 - the model's container, the file's leaf: a name in neither layout."""
    cfg = moe_config("mixtral")
    src = bf16_checkpoint(tmp_path / "src", cfg, reference_model(cfg).state_dict(), "mixtral")
    moved = _moved(src, tmp_path / "moved", ".mlp.", ".block_sparse_moe.")
    config = fp8fx.Fp8Config(weight_block_size=[128, 128], ignored_layers=["lm_head"])
    with pytest.raises(ValueError, match=rf"can be quantized with .*\({re.escape(HUB)}\.experts\.0\.w1, ") as refused:
        convert(moved, tmp_path / "dst", config, progress=False)
    assert ".mlp.experts" not in str(refused.value)


def test_convert_refuses_expert_weights_it_cannot_place(tmp_path):
    """Per-expert weights under a container neither the model nor a rename knows: they were written bf16 and
    ignored, and load_checkpoint refused the output (the model's experts missing). Refused before writing, as load
    refuses them, naming the names to map."""
    cfg = moe_config("mixtral")
    src = bf16_checkpoint(tmp_path / "src", cfg, reference_model(cfg).state_dict(), "mixtral")
    moved = _moved(src, tmp_path / "moved", ".mlp.experts.", ".moe_block.experts.")
    with pytest.raises(CheckpointError, match=r"^model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight is missing from "
                                              r"the checkpoint; .* the checkpoint has \d+ tensors the model has no place "
                                              r"for \(model\.layers\.\d\.moe_block\.experts.* pass key_mapping="):
        convert(moved, tmp_path / "dst", CONFIGS["per-channel"], progress=False)
    assert not (tmp_path / "dst").exists()
    mapping = {r"\.moe_block\.": ".mlp."}  # (the output keeps the checkpoint's names: loaded with the same mapping)
    convert(moved, tmp_path / "dst", CONFIGS["per-channel"], progress=False, key_mapping=mapping)
    assert load_checkpoint(meta_model(tmp_path / "dst"), tmp_path / "dst", progress=False, key_mapping=mapping).experts


def test_the_models_renames_skip_names_the_model_has(tmp_path, monkeypatch):
    """A checkpoint in the model's own layout (save_checkpoint writes one) loads as it is, whatever renames a hub
    layout would need: the model's renames apply only to a name with no place in the model (transformers' renames of
    some models change the model's own names, e.g. laguna's shared_experts). A stand-in for such a model's renames:
    .mlp. -> .ffn., which would leave every MLP weight unloaded."""
    real = renames.transformers_renamer
    monkeypatch.setattr(renames, "transformers_renamer", lambda model, user, model_renames=True: (
        (lambda n: n.replace(".mlp.", ".ffn.")) if model_renames else real(model, user, model_renames)))
    path = _tiny_checkpoint(tmp_path, lambda k: k)
    model, expected = meta_tiny(), meta_tiny()
    rename = renames.resolve(model, None, "test")
    assert rename("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert rename("model.layers.0.mlp.extra.weight") == "model.layers.0.ffn.extra.weight"
    load_checkpoint(model, path, progress=False)
    monkeypatch.setattr(renames, "transformers_renamer", real)
    load_checkpoint(expected, path, progress=False)
    assert_same_state(expected, model)


def test_key_mapping_renames_a_tensor_of_a_module_the_model_has(tmp_path):
    """key_mapping applies to every name, as from_pretrained(key_mapping=) does: q_proj.kernel -> q_proj.weight
    renames a tensor of a module the model has (it was kept as it was: convert exited 0 with q_proj left bf16 under
    its old name and declared fp8, and neither load_checkpoint nor transformers could load the output)."""
    path = _tiny_checkpoint(tmp_path, lambda k: k.replace("q_proj.weight", "q_proj.kernel"))
    plain = _tiny_checkpoint(tmp_path / "plain", lambda k: k)
    mapping = {r"\.kernel$": ".weight"}
    model, expected = meta_tiny(), meta_tiny()
    load_checkpoint(model, path, key_mapping=mapping, progress=False)
    load_checkpoint(expected, plain, progress=False)
    assert_same_state(expected, model)
    # convert quantizes it and writes it under its stored name, which loads back with the same key_mapping
    out, plain_out = tmp_path / "fp8", tmp_path / "plain_fp8"
    report = convert(path, out, key_mapping=mapping, model=meta_tiny(), progress=False)
    convert(plain, plain_out, model=meta_tiny(), progress=False)
    q = "model.layers.0.self_attn.q_proj"
    assert q in report.quantized
    stored = read_checkpoint(out)[1]
    assert stored[f"{q}.kernel"].dtype == torch.float8_e4m3fn and f"{q}.weight_scale" in stored
    model, expected = meta_tiny(), meta_tiny()
    load_checkpoint(model, out, key_mapping=mapping, progress=False)
    load_checkpoint(expected, plain_out, progress=False)
    assert_same_state(expected, model)


def test_convert_refuses_a_checkpoint_without_a_linears_weight(tmp_path):
    """A linear of the model whose weight the checkpoint lacks: convert exited 0, its output declared the layer fp8
    and no loader could read it. Refused, naming the layer, and nothing is written."""
    q = "model.layers.0.self_attn.q_proj"
    torch.manual_seed(0)
    state = {k: v for k, v in Tiny().bfloat16().state_dict().items() if k != f"{q}.weight"}
    path = write_checkpoint(tmp_path / "ckpt", state)
    with pytest.raises(CheckpointError, match=rf"linear layer {q} has no weight in the checkpoint.*--rename"):
        convert(path, tmp_path / "out", model=meta_tiny(), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_weights_scales_follow_a_rename_of_the_weight(tmp_path):
    """A rename of the weight alone (Phimoe's .gate.weight -> .router.weight): its weight_scale and input_scale move
    with it (they stayed under the old name, and the layer's scales were missing)."""
    from tests.unit.test_checkpoint_load import bf16_state, fp8_checkpoint

    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor", static=True)
    expected = meta_tiny()
    load_checkpoint(expected, write_checkpoint(tmp_path / "own", tensors, qc), progress=False)
    moved = {k.replace(".mlp.gate_proj.", ".mlp.gate."): v for k, v in tensors.items()}
    assert "model.layers.0.mlp.gate.input_scale" in moved
    model = meta_tiny()
    load_checkpoint(model, write_checkpoint(tmp_path / "moved", moved, qc),
                    key_mapping={r"\.mlp\.gate\.weight$": ".mlp.gate_proj.weight"}, progress=False)
    assert_same_state(expected, model)


def test_autofp8_kv_cache_scheme_string_is_kept_on_save(tmp_path):
    """AutoFP8 / Quark declare their KV cache as "kv_cache_scheme": "static" (it was not read: without scales in the
    checkpoint no attention got its 1.0 defaults, and a save declared no KV cache)."""
    import json

    from fp8fx.checkpoint import save_checkpoint
    from tests.unit.test_checkpoint_load import bf16_state, fp8_checkpoint

    tensors, qc, _ = fp8_checkpoint(bf16_state(), "tensor", static=True)
    qc["kv_cache_scheme"] = "static"
    model = meta_tiny()
    report = load_checkpoint(model, write_checkpoint(tmp_path / "c", tensors, qc), progress=False)
    assert len(report.kv_defaults) == 4
    assert report.kv_scales["model.layers.1.self_attn"] == {"k_scale": 1.0, "v_scale": 1.0}
    save_checkpoint(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["kv_cache_scheme"] is not None


def test_convert_reports_linear_weights_it_cannot_place(tmp_path):
    """A checkpoint whose MLP is stored as ``ffn``, converted without the rename: its six MLP weights were written
    bf16 under a quantization_config claiming every Linear, with "0 not quantized". The model's MLP layers have no
    weight in it, so convert refuses it and says to map the names; a weight no module has beside all the model's
    (``extra``) is written as stored, reported and in the ignore list. A key_mapping pattern found in no tensor
    name (here written the wrong way round) is refused."""
    path = _tiny_checkpoint(tmp_path, lambda k: k.replace(".mlp.", ".ffn."))
    with pytest.raises(ValueError, match=r"convert: key_mapping pattern .* \(-> '.ffn.'\) is in no tensor name"):
        convert(path, tmp_path / "wrong", key_mapping={r"\.mlp\.": ".ffn."}, model=meta_tiny(), progress=False)
    assert not (tmp_path / "wrong").exists()
    with pytest.raises(CheckpointError, match=r"linear layer model\.layers\.0\.mlp\.\w+ has no weight .* and 5 more"):
        convert(path, tmp_path / "dst", model=meta_tiny(), progress=False)
    assert not (tmp_path / "dst").exists()
    fixed = convert(path, tmp_path / "fixed", key_mapping={r"\.ffn\.": ".mlp."}, model=meta_tiny(), progress=False)
    assert list(fixed.not_quantized) == ["lm_head"] and len(fixed.quantized) == len(LINEARS)  # (kept bf16)
    torch.manual_seed(0)
    state = dict(Tiny().bfloat16().state_dict(), **{"model.layers.0.extra.weight": torch.ones(4, 8)})
    report = convert(write_checkpoint(tmp_path / "extra", state), tmp_path / "extra_fp8", model=meta_tiny(),
                     progress=False)
    assert report.not_quantized["model.layers.0.extra"] == ("no module of the model has this weight (written as "
                                                             "stored); map its name with --rename")
    qc = json.loads((tmp_path / "extra_fp8" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.extra" in qc.get("ignore", qc.get("ignored_layers"))
    assert read_checkpoint(tmp_path / "extra_fp8")[1]["model.layers.0.extra.weight"].dtype == torch.float32


def test_group_references_transformers_would_leave_as_text_are_refused():
    """transformers' key renaming (used whenever it is installed) substitutes \\1 only: \\2 or \\g<1>, valid for
    the pattern, stayed in the names as text and the load failed later on missing tensors."""
    model = meta_tiny()
    names = ["transformer.layers.0.mlp.up_proj.weight"]
    for replacement in (r"model.\2.\1.", r"model.\g<1>.", r"model.\g<0>"):
        with pytest.raises(ValueError, match=r"substitutes only \\1"):
            renames.resolve(model, {r"^transformer\.(layers)\.(0)\.": replacement}, "t", names)
    rename = renames.resolve(model, {r"^transformer\.(layers)\.": r"model.\1."}, "t", names)
    assert rename(names[0]) == "model.layers.0.mlp.up_proj.weight"


class _Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(4, 4, bias=False)


def test_without_transformers_each_key_mapping_pattern_replaces_its_first_match(monkeypatch):
    monkeypatch.setattr(renames, "transformers_renamer", lambda *a, **k: None)  # as where transformers is absent
    rename = renames.resolve(_Up(), {r"proj": "linear"}, "test", names=["mlp.proj_a.proj.weight"])
    assert rename("mlp.proj_a.proj.weight") == "mlp.linear_a.proj.weight"


def test_model_renames_skip_the_scales_of_a_module_the_model_has(monkeypatch):
    """An fp8 checkpoint in the model's own layout loaded into the bf16 model: the scale is no parameter yet, but its
    module is one of the model's; the model's renames must not move it away from its weight."""
    monkeypatch.setattr(renames, "transformers_renamer", lambda model, user, model_renames=True: (
        (lambda n: n.replace("mlp.", "ffn.")) if model_renames else None))
    rename = renames.resolve(_Up(), None, "test")
    assert rename("mlp.up_proj.weight") == "mlp.up_proj.weight"
    assert rename("mlp.up_proj.weight_scale") == "mlp.up_proj.weight_scale"
    assert rename("mlp.other.weight") == "ffn.other.weight"


def test_a_weight_renamed_to_a_3d_experts_leaf_takes_its_scales_along():
    """GraniteMoE-like: ``input_linear.weight`` -> ``experts.gate_up_proj``, a leaf that is no ".weight"."""
    rename = lambda n: re.sub(r"input_linear\.weight$", "experts.gate_up_proj", n)  # noqa: E731
    names = ["m.input_linear.weight", "m.input_linear.weight_scale", "m.input_linear.input_scale"]
    assert renames.renamed(names, rename) == {
        "m.input_linear.weight": "m.experts.gate_up_proj",
        "m.input_linear.weight_scale": "m.experts.gate_up_proj_scale",
        "m.input_linear.input_scale": "m.experts.gate_up_proj_input_scale",
    }


def test_model_renames_of_a_leaf_alone_go_through(monkeypatch):
    """transformers' legacy LayerNorm.gamma / .beta -> .weight / .bias keep the module: the rename goes through (a
    module the model has kept every tensor of its as stored, and a legacy checkpoint's norms went missing)."""
    monkeypatch.setattr(renames, "transformers_renamer", lambda model, user, model_renames=True: (
        (lambda n: re.sub(r"\.gamma$", ".weight", n)) if model_renames else None))
    assert renames.resolve(_Up(), None, "test")("mlp.up_proj.gamma") == "mlp.up_proj.weight"


def test_the_base_model_prefix_is_added_or_stripped_name_by_name(tmp_path):
    """from_pretrained adds or strips base_model_prefix for each name where that gives a name of the model; fp8fx
    decided for the whole checkpoint: a VLM's base checkpoint, whose vision tower transformers' own renames move
    under the prefix (^visual -> model.visual), left its language model without it ("model.language_model.
    embed_tokens.weight is missing"), and GPT-2's base names beside an untied lm_head.weight put the prefix on the
    head too ("lm_head.weight is missing ...; the checkpoint has 1 tensors the model has no place for (lm_head...)")."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        tie_word_embeddings=True,
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=128,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2))
    transformers.Qwen2VLModel(config).to(torch.bfloat16).save_pretrained(tmp_path / "vlm")
    report = load_checkpoint(transformers.Qwen2VLForConditionalGeneration(config).to(torch.bfloat16),
                             tmp_path / "vlm", progress=False)
    assert "model.language_model.layers.0.self_attn.q_proj" in report.quantized
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                   tie_word_embeddings=False)
    source = transformers.GPT2LMHeadModel(gpt2).to(torch.bfloat16)
    (tmp_path / "gpt2").mkdir()
    save_file({k.removeprefix("transformer."): v.contiguous() for k, v in source.state_dict().items()},
              str(tmp_path / "gpt2" / "model.safetensors"), metadata={"format": "pt"})
    gpt2.save_pretrained(tmp_path / "gpt2")
    model = meta_model(tmp_path / "gpt2")
    report = load_checkpoint(model, tmp_path / "gpt2", progress=False)
    assert "transformer.h.0.attn.c_attn" in report.quantized and "lm_head" in report.quantized
