"""transformers' ``save_pretrained`` of a model fp8fx quantized: its config.json describes the files it writes
(``fp8fx.checkpoint.pretrained``), so readers load them right or refuse them; before, ``from_pretrained`` took the
fp8 codes as bf16 weights, unscaled (logits thousands of times off bf16), warning only of unexpected keys. The
model's config object is left as it was."""
import copy
import io
import json

import pytest
import torch
from safetensors.torch import load_file

import fp8fx
from fp8fx.checkpoint import load_checkpoint, save_checkpoint
from fp8fx.checkpoint.pretrained import SavePretrained, quantization_config
from fp8fx.weights import kv_cache
from tests.conftest import quantize_stopped_at, rel_err

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def tiny(kind="llama"):
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
    else:
        cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=256,
                                          moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def tensors(folder):
    return {k: v.view(torch.uint8) if v.dtype.itemsize == 1 else v for k, v in load_file(folder / "model.safetensors")
            .items()}


SCHEMES = {
    "per-channel": (fp8fx.Fp8Config(ignored_layers=["lm_head"]), "compressed-tensors"),
    "per-tensor": (fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_granularity=fp8fx.PerTensor()),
                   "compressed-tensors"),
    "block": (fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_block_size=[128, 128]), "fp8"),
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_save_pretrained_writes_what_save_checkpoint_writes_and_it_loads_back(tmp_path, scheme):
    """A dense model: save_pretrained's files are save_checkpoint's (the same tensors, bytes and quantization_config,
    in the format transformers reads: fp8 for blocks, compressed-tensors otherwise, as its fp8 loader misreads
    per-tensor scales); fp8fx.load_checkpoint reads them into a model that computes as the saved one did
    (transformers' readers: the next test)."""
    config, method = SCHEMES[scheme]
    model = tiny()
    want = logits(fp8fx.quantize_(model, config))
    assert isinstance(vars(model)["save_pretrained"], SavePretrained)
    model.save_pretrained(tmp_path / "pretrained")
    assert not hasattr(model.config, "quantization_config")  # (set for the call only)
    qc = save_checkpoint(model, tmp_path / "saved", format=method)
    written = json.loads((tmp_path / "pretrained" / "config.json").read_text())["quantization_config"]
    assert written == qc and qc["quant_method"] == method
    assert quantization_config(model) == qc
    a, b = tensors(tmp_path / "pretrained"), tensors(tmp_path / "saved")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    fresh = tiny()
    load_checkpoint(fresh, tmp_path / "pretrained", progress=False)
    assert torch.equal(logits(fresh), want)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_transformers_loads_what_save_pretrained_wrote(tmp_path, scheme):
    """from_pretrained of save_pretrained's files computes as the quantized model did (before: the fp8 codes taken
    for bf16 weights, unscaled, thousands of times off), through compressed-tensors or transformers' fp8 loader
    (accelerate); both are test dependencies, for this test."""
    config, method = SCHEMES[scheme]
    pytest.importorskip("compressed_tensors" if method == "compressed-tensors" else "accelerate")
    if method == "fp8" and torch.cuda.is_available():  # (transformers' fp8 loader computes with the kernels package
        pytest.importorskip("kernels")  # where a GPU is; the model here runs on the CPU either way)
    model = tiny()
    want = logits(fp8fx.quantize_(model, config))
    model.save_pretrained(tmp_path / "pretrained")
    got = logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained", dtype=torch.bfloat16))
    # (the same codes and scales; compressed-tensors keeps its scales in bf16 and quantizes activations its own way)
    assert rel_err(got, want) < 0.1


def test_the_config_is_the_model_s_at_each_save(tmp_path):
    """The config follows the model: KV-cache scales attached after quantize_ are declared in it; a deep copy's and a
    torch.save round trip's describe the copy; a model that drops its fp8 layers' values (cast to float64, the
    quantized model's reference) gets a config every reader refuses; a bf16 model built from the same config object
    saves none."""
    model = tiny()
    fp8fx.quantize_(model, SCHEMES["per-channel"][0])
    assert quantization_config(model)["kv_cache_scheme"] is None
    for layer in model.model.layers:
        kv_cache.attach_kv_scales(layer.self_attn, {"k_scale": 0.5, "v_scale": 0.25})
    model.save_pretrained(tmp_path / "kv")
    written = json.loads((tmp_path / "kv" / "config.json").read_text())["quantization_config"]
    assert written["kv_cache_scheme"] is not None and written == quantization_config(model)
    copied = copy.deepcopy(model)
    assert vars(copied)["save_pretrained"]._model() is copied
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert vars(loaded)["save_pretrained"]._model() is loaded
    assert quantization_config(loaded) == quantization_config(model)
    copied.double()
    refused = quantization_config(copied)
    assert "is torch.float64" in refused["activation_scheme"]
    assert quantization_config(model) != refused  # (the original is still bf16)
    other = transformers.AutoModelForCausalLM.from_config(model.config)
    other.save_pretrained(tmp_path / "other")
    assert "quantization_config" not in json.loads((tmp_path / "other" / "config.json").read_text())


def test_save_pretrained_of_fp8_experts_is_refused_by_every_reader(tmp_path):
    """transformers' save_pretrained writes experts per expert (its conversion mapping, reversed) but keeps fp8fx's
    fused scale names (5.25; 5.17 writes per-expert scale names too): no reader can load that. The config says so,
    and transformers, fp8fx.load_checkpoint and Fp8Config refuse it naming the fix; fp8fx.save_checkpoint's files load
    back."""
    model = tiny("moe")
    want = logits(fp8fx.quantize_(model, SCHEMES["per-channel"][0]))
    model.save_pretrained(tmp_path / "pretrained")
    fix = r"save the model with fp8fx.save_checkpoint\(model, path\) instead"
    written = r"(?i)written by save_pretrained of a model fp8fx quantized.*experts.gate_up_proj_scale.*"
    with pytest.raises(ValueError, match=written + fix):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    with pytest.raises(ValueError, match=fix):
        load_checkpoint(tiny("moe"), tmp_path / "pretrained", progress=False)
    # (it names the model's scale, of the state_dict save_pretrained writes: it named experts.0.gate_proj.weight as
    # missing from what save_pretrained writes, which wrote it; which names transformers writes depends on its
    # version, 5.25 the fused scale's, 5.17 per-expert ones too)
    why = json.loads((tmp_path / "pretrained" / "config.json").read_text())["quantization_config"]
    holds = "the model's state_dict, which save_pretrained writes, holds model.layers.0.mlp.experts.gate_up_proj_scale"
    assert holds in why["fp8fx_not_loadable"], why
    save_checkpoint(model, tmp_path / "saved")
    fresh = tiny("moe")
    load_checkpoint(fresh, tmp_path / "saved", progress=False)
    assert torch.equal(logits(fresh), want)


def test_save_pretrained_of_layers_their_blocks_do_not_divide_is_refused_by_every_reader(tmp_path, caplog):
    """An fp8 checkpoint whose 128x128 blocks do not divide its layers (hidden 200, as DeepSeek-V3's 576-row
    kv_a_proj_with_mqa), loaded and saved with save_pretrained: written as fp8 blocks, which transformers' loader
    read with the block size of the scale grid (logits 6.7% off, no word). The config says why no reader loads it;
    save_checkpoint writes it with a warning, and it loads back in fp8fx."""
    from safetensors.torch import save_file

    from fp8fx import quant

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=200, intermediate_size=330, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=50)
    torch.manual_seed(0)
    state = {}
    for k, v in transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).state_dict().items():
        if k.endswith("proj.weight"):
            state[k], state[k + "_scale_inv"] = quant.quantize(v.contiguous(), [128, 128])
        else:
            state[k] = v.contiguous()
    (tmp_path / "src").mkdir()
    save_file(state, tmp_path / "src" / "model.safetensors")
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                               "ignored_layers": ["lm_head"]}
    cfg.save_pretrained(tmp_path / "src")
    model = fp8fx.checkpoint.meta_model(tmp_path / "src")
    load_checkpoint(model, tmp_path / "src", progress=False)
    want = logits(model.eval())
    model.save_pretrained(tmp_path / "pretrained")
    fix = r"save the model with fp8fx.save_checkpoint\(model, path\) instead"
    ragged = r"model\.layers\.0\.self_attn\.q_proj \[200, 200\] in 128x128 blocks: transformers' fp8 loader takes"
    with pytest.raises(ValueError, match=r"(?i)written by save_pretrained of a model fp8fx quantized.*" + ragged + ".*"
                                         + fix):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    with caplog.at_level("WARNING", logger="fp8fx"):
        save_checkpoint(model, tmp_path / "saved")
    assert "writes layers their weight blocks do not divide (model.layers.0.self_attn.q_proj [200, 200] in " in (
        caplog.text)
    back = fp8fx.checkpoint.meta_model(tmp_path / "saved")
    load_checkpoint(back, tmp_path / "saved", progress=False)
    assert torch.equal(logits(back.eval()), want)


def test_a_transformers_model_inside_saves_its_own_files(tmp_path):
    """The base model of a quantized LlamaForCausalLM (a VLM's language model alike) has a save_pretrained of its own,
    which wrote fp8 codes with no quantization_config: it describes its files too."""
    model = tiny()
    fp8fx.quantize_(model, SCHEMES["per-channel"][0])
    model.model.save_pretrained(tmp_path / "base")
    assert json.loads((tmp_path / "base" / "config.json").read_text())["quantization_config"] == quantization_config(
        model.model)
    fresh = transformers.AutoModel.from_config(model.config).to(torch.bfloat16).eval()
    load_checkpoint(fresh, tmp_path / "base", progress=False)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=IDS).last_hidden_state, model.model(input_ids=IDS).last_hidden_state)


def test_experts_kept_in_bf16_save_as_save_checkpoint_names_them(tmp_path):
    """An MoE model whose experts stay bf16 (only attention fp8): transformers writes the bf16 experts per expert, as
    save_checkpoint names them, so the config describes the files (it was refused: the names differ from the
    state_dict's, but only for tensors transformers renames itself)."""
    model = tiny("moe")
    config = fp8fx.Fp8Config(ignored_layers=["lm_head"] + [f"model.layers.{i}.mlp" for i in range(2)])
    want = logits(fp8fx.quantize_(model, config))
    model.save_pretrained(tmp_path / "pretrained")
    written = json.loads((tmp_path / "pretrained" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "compressed-tensors" and "fp8fx_not_loadable" not in written
    fresh = tiny("moe")
    load_checkpoint(fresh, tmp_path / "pretrained", progress=False)
    assert torch.equal(logits(fresh), want)


def test_models_without_fp8_layers_or_save_pretrained_are_left_alone():
    """transformers' own save_pretrained where nothing is fp8 (everything ignored), none on a model that is no
    transformers model; a part quantized on its own (prefix) leaves its model's to its model."""
    model = tiny()
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["model", "lm_head"]))
    assert "save_pretrained" not in vars(model)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 32)).bfloat16()
    fp8fx.quantize_(plain)
    assert "save_pretrained" not in vars(plain)
    model = tiny()
    fp8fx.quantize_(model.model.layers[0], prefix="model.layers.0")
    assert "save_pretrained" not in vars(model) and "save_pretrained" not in vars(model.model.layers[0])


def test_the_generation_config_is_saved_and_read_back(tmp_path, caplog):
    """save_checkpoint wrote config.json alone, and meta_model built the model's generation config from config.json
    (from_pretrained reads generation_config.json): an instruct model's eos_token_id and sampling settings were lost,
    and generate() ran past its end of sequence. save_checkpoint writes the model's, as save_pretrained does, and
    meta_model reads it."""
    model = tiny()
    model.generation_config.eos_token_id = [2, 53]
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.6
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    save_checkpoint(model, tmp_path / "c")
    assert json.loads((tmp_path / "c" / "generation_config.json").read_text())["eos_token_id"] == [2, 53]
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "c")
    assert loaded.generation_config.eos_token_id == [2, 53] and loaded.generation_config.temperature == 0.6
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "c").eos_token_id == [2, 53]  # (from_pretrained's)
    (tmp_path / "c" / "generation_config.json").write_text("{not json")  # said, and the model built, as transformers
    with caplog.at_level("WARNING", logger="fp8fx"):
        assert fp8fx.checkpoint.meta_model(tmp_path / "c").generation_config.eos_token_id != [2, 53]
    assert "generation_config.json not read" in caplog.text


def test_a_backend_deep_copied_by_transformers_fills_its_own_report():
    """generate() with a static cache hands torch.compile a deep copy of CompileConfig's fields: the copy of the
    Fp8Backend compiled, with a report of its own, and the one the user gave stayed empty."""
    backend = fp8fx.Fp8Backend()
    assert copy.deepcopy(backend) is backend
    config = transformers.CompileConfig(backend=backend)
    assert config.to_dict()["backend"] is backend


def test_a_tied_head_quantized_on_its_own_round_trips_with_what_the_tie_shared(tmp_path):
    """BertForMaskedLM, its parts quantized apart (the README's way to have the tied head in fp8): save_checkpoint
    writes tie_word_embeddings: false, and stored the decoder bias that the tie shares with cls.predictions.bias once,
    so the untied model that config describes missed it ("cls.predictions.decoder.bias is missing"). It is stored
    under both names."""
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg).eval()
    fp8fx.quantize_(model.bert, fp8fx.Fp8Config(), prefix="bert")
    fp8fx.quantize_(model.cls, fp8fx.Fp8Config(), prefix="cls")
    save_checkpoint(model, tmp_path / "c")
    stored = load_file(tmp_path / "c" / "model.safetensors")
    assert torch.equal(stored["cls.predictions.decoder.bias"], stored["cls.predictions.bias"])
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "c", dtype=torch.float32)
    load_checkpoint(loaded, tmp_path / "c", progress=False)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_tied_lm_head_quantized_on_its_own_is_saved_untied_and_loads_back(tmp_path, caplog):
    """The README's untying (quantize_(model.lm_head) of a tied model) then save_pretrained: the config kept
    tie_word_embeddings: true beside an fp8 lm_head, which load_checkpoint refused ("a float8 tensor for
    lm_head.weight, which is not quantized (weight tied ...)") and transformers and vLLM tie again. It writes false,
    says so, and the model's config is as it was; the files load back to the same logits."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    fp8fx.quantize_(model, fp8fx.Fp8Config())  # (the tied lm_head kept in bf16)
    fp8fx.quantize_(model.lm_head, fp8fx.Fp8Config(), prefix="lm_head")
    with caplog.at_level("WARNING", logger="fp8fx"):
        model.save_pretrained(tmp_path / "p")
    assert "save_pretrained writes tie_word_embeddings: false" in caplog.text
    assert model.config.tie_word_embeddings is True
    assert json.loads((tmp_path / "p" / "config.json").read_text())["tie_word_embeddings"] is False
    assert load_file(tmp_path / "p" / "model.safetensors")["lm_head.weight"].dtype == torch.float8_e4m3fn
    saved = transformers.AutoConfig.from_pretrained(tmp_path / "p")  # (built as the model was: bf16 after float32)
    back = transformers.AutoModelForCausalLM.from_config(saved).to(torch.bfloat16).eval()
    load_checkpoint(back, tmp_path / "p", progress=False)
    assert torch.equal(logits(back), logits(model))


def test_a_model_quantized_part_by_part_warns_that_its_save_pretrained_does_not_know(tmp_path, caplog, monkeypatch):
    """quantize_(layer, prefix=...) per layer: the model holding the layers is out of fp8fx's reach, and its
    save_pretrained wrote the fp8 codes with no quantization_config; from_pretrained read them as bf16 weights
    (logits 1.4x their norm off), with no word from fp8fx. It warns, once, naming save_checkpoint, whose files
    from_pretrained loads right."""
    from fp8fx.weights import quantize as quantize_module

    pytest.importorskip("compressed_tensors")  # (the reader of the per-channel files)
    monkeypatch.setattr(quantize_module, "_PART_SAVE_WARNED", False)
    model = tiny()
    for i, layer in enumerate(model.model.layers):
        with caplog.at_level("WARNING", logger="fp8fx"):
            fp8fx.quantize_(layer, prefix=f"model.layers.{i}")
    said = [r.getMessage() for r in caplog.records if "save_pretrained" in r.getMessage()]
    assert len(said) == 1 and "prefix='model.layers.0'" in said[0] and "fp8fx.save_checkpoint" in said[0], said
    # a loader's parts that are bare nn.Linear layers of the HF model (no transformers module in them) were not said
    monkeypatch.setattr(quantize_module, "_PART_SAVE_WARNED", False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fp8fx"):
        fp8fx.quantize_(tiny().lm_head, prefix="lm_head")
    assert [r.getMessage() for r in caplog.records if "save_pretrained" in r.getMessage()]
    want = logits(model)
    save_checkpoint(model, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert rel_err(logits(back), want) < 0.05


def test_save_pretrained_of_a_half_quantized_model_is_refused_by_every_reader(tmp_path):
    """quantize_ stopped in a later layer (out of memory) leaves the layers before fp8 until the same call finishes;
    transformers' save_pretrained then wrote their codes with no quantization_config (from_pretrained read them as
    bf16 weights, up to 448). Its config now says why no reader loads it, as save_checkpoint refuses the model; once
    finished, it saves what save_checkpoint writes."""
    model = tiny()
    quantize_stopped_at(model, 3, SCHEMES["per-channel"][0])
    model.save_pretrained(tmp_path / "half")
    written = json.loads((tmp_path / "half" / "config.json").read_text())["quantization_config"]
    assert "half-quantized" in written["fp8fx_not_loadable"], written
    # said as what happened: save_pretrained wrote the files, save_checkpoint refuses the model as well (its "nothing
    # was done" and "save with fp8fx.save_checkpoint instead", which refuses it, were said)
    assert "which fp8fx.save_checkpoint refuses as well (the model is half-quantized" in written["fp8fx_not_loadable"]
    assert "nothing was" not in written["fp8fx_not_loadable"] and "instead" not in written["fp8fx_not_loadable"]
    with pytest.raises(ValueError, match=r"(?i)written by save_pretrained of a model fp8fx quantized.*half-quantized"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "half")
    fp8fx.quantize_(model, SCHEMES["per-channel"][0])  # finished: the files are what save_checkpoint writes
    model.save_pretrained(tmp_path / "done")
    written = json.loads((tmp_path / "done" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "compressed-tensors" and "fp8fx_not_loadable" not in written


def test_a_transformers_base_model_quantized_alone_warns_and_a_dequantized_one_saves_plain(tmp_path, caplog,
                                                                                         monkeypatch):
    """Found by a probe: quantize_(model.model) with no prefix (to keep lm_head bf16) said nothing, and the outer
    model's save_pretrained wrote fp8 codes with no quantization_config (reloaded 1.38 off); model.model.dequantize()
    after quantize_(model) left the outer model's save_pretrained writing a config every reader refuses, of a model
    with no fp8 tensor left."""
    from fp8fx.weights import quantize as quantize_module

    monkeypatch.setattr(quantize_module, "_PART_SAVE_WARNED", False)
    model = tiny()
    with caplog.at_level("WARNING", logger="fp8fx"):
        fp8fx.quantize_(model.model)
    said = [r.getMessage() for r in caplog.records if "save_pretrained" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("fp8fx: quantize_(LlamaModel) quantized what may be a part"), said

    model = tiny()
    fp8fx.quantize_(model, SCHEMES["per-channel"][0])
    model.model.dequantize()
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    held = model.state_dict()  # (the dequantized weights, as the model holds them)
    assert all(torch.equal(t, held[k]) for k, t in back.state_dict().items()) and back.state_dict().keys() == held.keys()


def test_a_model_whose_base_model_is_itself_by_a_missing_prefix_is_warned_of_as_whole_and_maybe_a_part(
        caplog, monkeypatch):
    """Llama4ForCausalLM's base_model_prefix names the VLM's language_model, an attribute it lacks, so its base_model
    is itself: quantize_ of the whole model warned that it "may be a part of a model" whose save_pretrained writes no
    quantization_config, where its own writes one (h123); judged whole instead, the language model of a
    Llama4ForConditionalGeneration, the same class, was not warned of at all, and that VLM's save_pretrained wrote no
    quantization_config (h128). Nothing in the module tells the two apart: the warning says both."""
    from fp8fx.weights import quantize as quantize_module

    text = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, intermediate_size_mlp=128, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=8, no_rope_layers=[1, 1])
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
        patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    said = {}
    for case in ("whole", "vlm", "base"):
        if case == "vlm":
            part = transformers.Llama4ForConditionalGeneration(
                transformers.Llama4Config(vision_config=vision, text_config=text)).language_model
        else:
            part = transformers.Llama4ForCausalLM(text)
            part = part if case == "whole" else part.model
        assert (part.base_model is part) and type(part).__name__ == ("Llama4TextModel" if case == "base" else
                                                                     "Llama4ForCausalLM")
        monkeypatch.setattr(quantize_module, "_PART_SAVE_WARNED", False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="fp8fx"):
            fp8fx.quantize_(part, fp8fx.Fp8Config(ignored_layers=["lm_head"] if case != "base" else None))
        said[case] = [r.getMessage() for r in caplog.records if "save_pretrained" in r.getMessage()]
    for case in ("whole", "vlm"):
        assert len(said[case]) == 1 and "may also be a part of another, as a VLM's language model: its own " \
            "save_pretrained writes its quantization_config" in said[case][0], said
    assert len(said["base"]) == 1 and "quantized what may be a part of a model" in said["base"][0], said


def test_a_composite_model_is_whole_and_a_peft_wrapped_base_model_a_part(caplog, monkeypatch):
    """h130: a whole Blip-2 (its base_model_prefix "blip" names nothing, it has output embeddings) was warned of as
    maybe a VLM's language model, the VLM itself; a base model wrapped by PEFT was judged by the wrapper's module
    (peft's), and got no part warning where the unwrapped one got it."""
    from fp8fx.weights import quantize as quantize_module

    peft = pytest.importorskip("peft")
    opt = transformers.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 ffn_dim=64, word_embed_proj_dim=32)
    blip2 = transformers.Blip2ForConditionalGeneration(transformers.Blip2Config(
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           image_size=28, patch_size=14),
        qformer_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                            encoder_hidden_size=32, vocab_size=128),
        text_config=opt.to_dict(), num_query_tokens=2))
    llama = tiny().model
    wrapped = peft.get_peft_model(llama, peft.LoraConfig(target_modules=["o_proj"], r=2))
    said = {}
    for name, model, config in (("blip2", blip2, fp8fx.Fp8Config(ignored_layers=["language_model.lm_head"])),
                                ("peft", wrapped, None)):
        monkeypatch.setattr(quantize_module, "_PART_SAVE_WARNED", False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="fp8fx"):
            fp8fx.quantize_(model, config)
        said[name] = [r.getMessage() for r in caplog.records if "save_pretrained" in r.getMessage()]
    assert said["blip2"] == [], said
    assert len(said["peft"]) == 1 and "quantized what may be a part of a model" in said["peft"][0], said
