"""FP8 MoE checkpoints of a tiny HF Mixtral / Qwen3-MoE (experts_implementation="grouped_mm") built in the
test, loaded into models that transformers builds on the meta device: logits against float32 models holding
the dequantized weights (the bound is one that a wrong scale breaks), then save -> load round trips."""
import json

import pytest
import torch

from fp8fx.checkpoint import load_checkpoint, meta_model, save_checkpoint
from fp8fx.weights import is_quantized_experts
from tests.conftest import rel_err
from tests.unit.test_checkpoint_moe import E, moe_checkpoint, moe_config, reference_model, write_moe
from tests.unit.test_checkpoint_save import assert_same_state

transformers = pytest.importorskip("transformers")

LAYERS = 2
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
BOUND = 0.02  # measured 0.009-0.010: the model's bf16 compute against float32


def _transformers_version() -> tuple:
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())


# The hub layouts save_checkpoint writes are read from transformers' conversion mapping (an internal API). They
# were checked against transformers 5.24 (CI's); 5.17 (the torch 2.11 environment) writes Mixtral's expert leaves
# (w1 / w3 / w2) but keeps the block's own name (mlp, which 5.17 itself loads): its block rename is not reversed.
HUB_LAYOUT_CHECKED = pytest.mark.skipif(_transformers_version() < (5, 24), reason="hub layouts checked against "
                                        "transformers 5.24's conversion mapping; this one differs (see above)")


def float_logits(cfg, state, deq):
    model = reference_model(cfg, torch.float32)
    model.load_state_dict({**{k: v.float() for k, v in state.items()}, **{k: v.float() for k, v in deq.items()}})
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("name,granularity,naming,kw", [
    ("mixtral", "tensor", "mixtral", dict(static=True)),
    ("mixtral", "block", "hf", {}),
    ("qwen3_moe", "channel", "hf", dict(ct=True)),
])
def test_moe_checkpoint_outputs_and_roundtrip(tmp_path, name, granularity, naming, kw):
    cfg = moe_config(name, layers=LAYERS)
    state = reference_model(cfg).state_dict()
    tensors, qc, deq = moe_checkpoint(state, granularity, naming=naming, **kw)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc, shards=3)
    model = meta_model(path)
    report = load_checkpoint(model, path, progress=False)
    experts = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    assert list(report.experts) == experts and all(is_quantized_experts(model.get_submodule(f)) for f in experts)
    with torch.no_grad():
        out = model(IDS).logits.float()
    ref = float_logits(cfg, state, deq)
    assert rel_err(out, ref) < BOUND
    # a down_proj scale read 10% too large for every expert of the first layer breaks the bound
    key = f"{experts[0]}.down_proj"
    assert rel_err(float_logits(cfg, state, {**deq, key: deq[key] * 1.1}), ref) > BOUND

    saved = save_checkpoint(model, tmp_path / "saved", max_shard_size=200_000)
    assert saved["quant_method"] == qc["quant_method"]
    again = meta_model(tmp_path / "saved")
    assert list(load_checkpoint(again, tmp_path / "saved", progress=False).experts) == experts
    assert_same_state(model, again)
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


def _saved(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _fp8_and_bf16_experts(name):
    """A 2-layer model with layer 0's experts in fp8 (16x32 blocks) and layer 1's left bf16 (lm_head too, as the
    checkpoints vLLM and transformers load)."""
    import fp8fx

    model = reference_model(moe_config(name, layers=2))
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[16, 32],
                                           ignored_layers=["model.layers.1.mlp.experts", "lm_head"]))
    return model


def _check_per_expert(model, saved, experts, projs):
    """The per-expert tensors of each ``experts`` (saved prefix -> module) are the module's rows: gate, up, down."""
    for prefix, module in experts.items():
        w13, w2 = module._parameters["gate_up_proj"].detach(), module._parameters["down_proj"].detach()
        i = w2.shape[-1]
        for e in range(w13.shape[0]):
            for proj, t in zip(projs, (w13[e, :i], w13[e, i:], w2[e])):
                got = saved[f"{prefix}.{e}.{proj}.weight"]
                assert got.dtype == t.dtype, (prefix, e, proj)
                assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), (prefix, e, proj)
        assert (f"{prefix}.0.{projs[0]}.weight_scale_inv" in saved) == (w13.dtype == torch.float8_e4m3fn)
        assert not any(k.startswith(f"{prefix}.gate_up_proj") or k.startswith(f"{prefix}.down_proj") for k in saved)


def test_per_expert_save_writes_experts_left_in_bf16_per_expert(tmp_path):
    """Experts left in bf16 were written fused (mlp.experts.gate_up_proj) where fp8 ones are per expert: vLLM's
    per-expert loaders do not map that. They are written per expert as well (weights alone, the experts module in
    the ignore list: fp8's ignored_layers covers the modules under an entry; compressed-tensors' matches names
    exactly, so its ignore list names each expert's modules too) and load back identically; experts="fused" keeps
    them fused, and so do experts whose gate/up rows are interleaved or that have a norm after each expert (no
    per-expert tensor is a slice of them)."""
    model = _fp8_and_bf16_experts("qwen3_moe")
    bf16 = "model.layers.1.mlp.experts"
    experts = {f"model.layers.{i}.mlp.experts": model.model.layers[i].mlp.experts for i in range(2)}
    for fmt, key in (("fp8", "ignored_layers"), ("compressed-tensors", "ignore")):
        qc = save_checkpoint(model, tmp_path / fmt, format=fmt)
        if fmt == "fp8":  # (compressed-tensors names the block scales weight_scale)
            _check_per_expert(model, _saved(tmp_path / fmt), experts, ("gate_proj", "up_proj", "down_proj"))
        per_expert = {n for n in qc[key] if n.startswith(f"{bf16}.")}
        assert bf16 in qc[key] and len(per_expert) == (3 * E if fmt == "compressed-tensors" else 0), qc[key]
        assert fmt == "fp8" or {f"{bf16}.0.gate_proj", f"{bf16}.{E - 1}.down_proj"} <= per_expert
        assert not any(n.startswith("model.layers.0.mlp.experts") for n in qc[key])
        again = meta_model(tmp_path / fmt)
        report = load_checkpoint(again, tmp_path / fmt, progress=False)
        assert list(report.experts) == ["model.layers.0.mlp.experts"]
        assert report.not_quantized[bf16] == "in ignored_layers"
        assert_same_state(model, again)
        with torch.no_grad():
            assert torch.equal(again(IDS).logits, model(IDS).logits)

    save_checkpoint(model, tmp_path / "fused", experts="fused")
    assert f"{bf16}.gate_up_proj" in _saved(tmp_path / "fused")
    for flag, value in (("is_concatenated", False), ("has_post_expert_norm", True)):  # as HF flags them
        setattr(model.model.layers[1].mlp.experts, flag, value)
        qc = save_checkpoint(model, tmp_path / flag, format="compressed-tensors")
        assert f"{bf16}.gate_up_proj" in _saved(tmp_path / flag), flag
        assert f"{bf16}.0.gate_proj" not in qc["ignore"]
        setattr(model.model.layers[1].mlp.experts, flag, not value)


def _transformers_targets(model, names):
    """Where transformers' loader puts each checkpoint tensor: the model's conversion mapping, its renames then the
    converter that merges per-expert weights into the experts module's 3-D ones."""
    from transformers import conversion_mapping, core_model_loading

    transforms = conversion_mapping.get_model_conversion_mapping(model, add_legacy=True)
    renamings = [t for t in transforms if isinstance(t, core_model_loading.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, core_model_loading.WeightConverter)]
    return {n: core_model_loading.rename_source_key(n, renamings, converters)[0] for n in names}


def _check_hub_round_trip(model, fresh, path):
    """The checkpoint at ``path``: transformers places every saved tensor but the scales (its FP8 quantizer places
    those, not its mapping) on a parameter of ``fresh``, missing none, and fp8fx loads it back into the same state
    and logits as ``model``. Returns load_checkpoint's report."""
    saved = _saved(path)
    scales = ("_scale", "_scale_inv", "input_scale")
    targets = _transformers_targets(fresh, [k for k in saved if not k.endswith(scales)])
    assert set(targets.values()) == set(fresh.state_dict()), set(targets.values()) ^ set(fresh.state_dict())
    again = meta_model(path)
    report = load_checkpoint(again, path, progress=False)
    assert_same_state(model, again)
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)
    return report


@HUB_LAYOUT_CHECKED
def test_per_expert_save_writes_mixtrals_hub_layout(tmp_path, caplog):
    """Mixtral's hub checkpoints hold its MoE block as block_sparse_moe, its experts as experts.<e>.w1 / w3 / w2 (gate,
    up, down). save_checkpoint wrote mlp.experts.<e>.gate_proj ..., which transformers' conversion mapping does not
    map (from_pretrained loaded random experts, no error) and vLLM's Mixtral does not find; it only warned. Now
    written as save_pretrained writes it: transformers places every weight, fp8fx.load_checkpoint reads it back
    identically, and nothing is warned."""
    import logging

    model = _fp8_and_bf16_experts("mixtral")
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        qc = save_checkpoint(model, tmp_path / "saved")
    assert not caplog.records, caplog.text
    saved = _saved(tmp_path / "saved")
    hub = "model.layers.{}.block_sparse_moe"
    experts = {f"{hub.format(i)}.experts": model.model.layers[i].mlp.experts for i in range(2)}
    _check_per_expert(model, saved, experts, ("w1", "w3", "w2"))
    assert f"{hub.format(0)}.gate.weight" in saved and not any(".mlp." in k for k in saved)
    assert f"{hub.format(1)}.experts" in qc["ignored_layers"]  # covering its experts' modules (fp8's rule)

    report = _check_hub_round_trip(model, reference_model(moe_config("mixtral", layers=2)), tmp_path / "saved")
    assert list(report.experts) == ["model.layers.0.mlp.experts"]


@HUB_LAYOUT_CHECKED
def test_compressed_tensors_names_mixtrals_experts_as_vllm_looks_them_up(tmp_path):
    """compressed-tensors matches names exactly, and vLLM looks an experts module's scheme up by
    ``<experts>.0.gate_proj`` / ``up_proj`` / ``down_proj`` whatever the checkpoint calls them. Mixtral's experts,
    written as w1 / w3 / w2, were named so alone: vLLM built fp8 experts over layer 1's bf16 ones (nothing in the
    ignore list matched) and refused a model of two schemes (no target matched). Both names are in the config now;
    the tensors keep the hub's names, and transformers and fp8fx load them as before."""
    import fp8fx

    model = _fp8_and_bf16_experts("mixtral")
    qc = save_checkpoint(model, tmp_path / "saved", format="compressed-tensors")
    bf16, fp8 = "model.layers.1.block_sparse_moe.experts", "model.layers.0.block_sparse_moe.experts"
    assert {f"{bf16}.0.{p}" for p in ("w1", "w3", "w2", "gate_proj", "up_proj", "down_proj")} <= set(qc["ignore"])
    assert not any(name.startswith(fp8) for name in qc["ignore"])
    assert not any(".gate_proj." in k or ".up_proj." in k for k in _saved(tmp_path / "saved"))
    _check_hub_round_trip(model, reference_model(moe_config("mixtral", layers=2)), tmp_path / "saved")

    two = reference_model(moe_config("mixtral", layers=2))  # two schemes: each group's targets name its layer's
    fp8fx.quantize_(two.model.layers[0], fp8fx.Fp8Config(), prefix="model.layers.0")
    fp8fx.quantize_(two.model.layers[1], fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor()),
                    prefix="model.layers.1")
    qc = save_checkpoint(two, tmp_path / "two")
    groups = {g["weights"]["strategy"]: set(g["targets"]) for g in qc["config_groups"].values()}
    for layer, strategy in ((0, "channel"), (1, "tensor")):
        experts = f"model.layers.{layer}.block_sparse_moe.experts.0"
        assert {f"{experts}.{p}" for p in ("w1", "gate_proj", "down_proj")} <= groups[strategy]
    _check_hub_round_trip(two, reference_model(moe_config("mixtral", layers=2)), tmp_path / "two")


@HUB_LAYOUT_CHECKED
def test_per_expert_save_renames_the_moe_blocks_alone(tmp_path):
    """Kimi-Linear's hub checkpoints name its MoE blocks block_sparse_moe and its dense layers' MLPs mlp; transformers
    renames the first to mlp. The reversed rename was applied to every name: the dense layer's MLP was written as
    block_sparse_moe.gate_proj ..., where the hub and vLLM (KimiMLP) name it mlp. Only the MoE blocks' names (experts,
    router, shared experts) are renamed now; transformers still places every tensor, and fp8fx loads it back."""
    import fp8fx

    cfg = transformers.AutoConfig.for_model(
        "kimi_linear", vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_token=2,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, mlp_layer_types=["dense", "sparse"],
        layer_types=["full_attention", "full_attention"], max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.set_experts_implementation("grouped_mm")
    fp8fx.quantize_(model)
    qc = save_checkpoint(model, tmp_path / "saved")
    saved = _saved(tmp_path / "saved")
    dense = [k for k in saved if k.startswith("model.layers.0.") and "_proj" in k and "self_attn" not in k]
    assert dense and all(k.startswith("model.layers.0.mlp.") for k in dense), dense
    assert "layers.0.block_sparse_moe" not in json.dumps(qc)
    moe = [k for k in saved if k.startswith("model.layers.1.") and "self_attn" not in k and "layernorm" not in k]
    assert moe and all(k.startswith("model.layers.1.block_sparse_moe.") for k in moe), moe
    assert {"model.layers.1.block_sparse_moe.experts.0.w1.weight", "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"} <= set(saved)

    _check_hub_round_trip(model, transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16),
                          tmp_path / "saved")


@HUB_LAYOUT_CHECKED
def test_experts_transformers_reads_fused_only_are_written_fused_in_the_hub_layout(tmp_path, caplog):
    """GraniteMoE's hub checkpoints hold its experts fused (block_sparse_moe.input_linear / output_linear, which
    transformers renames), and transformers has no converter from per-expert tensors: save_checkpoint wrote
    experts.<e>.gate_proj ..., from which from_pretrained loaded random experts, with no error. By default they are
    written fused in the hub's layout, with a warning naming the model: transformers places every tensor, and fp8fx
    loads it back. experts="per-expert" is refused for it, before anything is written."""
    import logging

    import fp8fx

    cfg = transformers.GraniteMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=64, intermediate_size=32,
                                        num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    bf16 = "model.layers.1.block_sparse_moe.experts"
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=[bf16]))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        qc = save_checkpoint(model, tmp_path / "saved")
    assert "writes experts fused, in the hub's layout, not per expert: transformers loads the experts of " \
           "GraniteMoeForCausalLM (model_type 'granitemoe') from fused tensors only" in caplog.text
    saved = _saved(tmp_path / "saved")
    for i in range(2):
        hub = f"model.layers.{i}.block_sparse_moe"
        assert {f"{hub}.input_linear.weight", f"{hub}.output_linear.weight", f"{hub}.router.layer.weight"} <= set(saved)
    assert saved["model.layers.0.block_sparse_moe.input_linear.weight"].dtype == torch.float8_e4m3fn
    assert not any(".experts.0." in k for k in saved) and not any(".experts.0." in n for n in qc["ignore"])
    assert bf16 in qc["ignore"]

    report = _check_hub_round_trip(model, transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16),
                                   tmp_path / "saved")
    assert list(report.experts) == ["model.layers.0.block_sparse_moe.experts"]

    match = (r"save_checkpoint\(experts='per-expert'\): transformers loads the experts of GraniteMoeForCausalLM "
             r"\(model_type 'granitemoe'\) from fused tensors only.*random experts.*leave experts=None to write them "
             r"fused in the hub's layout, or pass experts='fused' \(nothing was written\)")
    with pytest.raises(ValueError, match=match):
        save_checkpoint(model, tmp_path / "per-expert", experts="per-expert")
    assert not (tmp_path / "per-expert").exists()


@HUB_LAYOUT_CHECKED
def test_per_expert_save_keeps_the_models_names_where_the_hub_renames_do_not_reverse(tmp_path, caplog,
                                                                                      monkeypatch):
    """Names the reversed renames would write are checked against the renames load_checkpoint applies: where one
    would not load back as itself (here: load renames nothing), the model's names are kept, with a warning."""
    import logging

    from fp8fx.checkpoint import renames

    model = _fp8_and_bf16_experts("mixtral")
    monkeypatch.setattr(renames, "resolve", lambda *args, **kwargs: None)
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        save_checkpoint(model, tmp_path / "saved")
    assert "keeps MixtralForCausalLM's own tensor names" in caplog.text
    experts = {f"model.layers.{i}.mlp.experts": model.model.layers[i].mlp.experts for i in range(2)}
    _check_per_expert(model, _saved(tmp_path / "saved"), experts, ("w1", "w3", "w2"))
    again = meta_model(tmp_path / "saved")
    load_checkpoint(again, tmp_path / "saved", progress=False)
    assert_same_state(model, again)


def test_per_expert_save_keeps_the_experts_modules_other_tensors(tmp_path):
    """Per-expert names replace an fp8 experts module's expert tensors; a tensor of its own besides them (a buffer)
    was dropped, and the checkpoint then failed to load ("missing from the checkpoint")."""
    import fp8fx

    cfg = moe_config("qwen3_moe", layers=1)
    model = reference_model(cfg)
    experts = model.model.layers[0].mlp.experts
    n = experts.gate_up_proj.shape[0]
    experts.register_buffer("expert_scale", torch.arange(n, dtype=torch.float32) + 1)
    fp8fx.quantize_(model)
    save_checkpoint(model, tmp_path / "saved")
    again = meta_model(tmp_path / "saved")
    again.model.layers[0].mlp.experts.register_buffer("expert_scale", torch.zeros(n, device="meta"))
    load_checkpoint(again, tmp_path / "saved", progress=False)
    assert torch.equal(again.model.layers[0].mlp.experts.expert_scale, torch.arange(n, dtype=torch.float32) + 1)
    assert_same_state(model, again)
