"""GPT-2's projections are transformers' Conv1D: ``addmm(bias, x, weight)`` of a weight stored [in, out]. quantize_
and load_checkpoint quantize them (their fp8 codes stored as a linear's, [out, in]), the linear pass rewrites them,
fp8 checkpoints are read with their codes [in, out], as GPT-2's hold its weights, and dequantize_ gives back the
Conv1D of [in, out]. save_checkpoint and convert write them in high precision: transformers' fp8 loaders take
nn.Linear layers only."""
import copy
import json

import pytest
import torch

import fp8fx
from fp8fx.checkpoint import convert, meta_model
from tests.conftest import rel_err

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
safetensors_torch = pytest.importorskip("safetensors.torch")
from transformers.pytorch_utils import Conv1D  # noqa: E402

CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def tiny_gpt2(embd=64, layers=2, device="cpu"):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=embd, n_layer=layers, n_head=4, vocab_size=128, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).to(device=device, dtype=torch.bfloat16).eval()


def conv1d_names(layers=2):
    return {f"transformer.h.{i}.{p}" for i in range(layers) for p in CONV1D}


def reference(model, ids):
    """The float64 logits of ``model``'s bf16 weights."""
    with torch.no_grad():
        return copy.deepcopy(model).double()(ids).logits


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_gpt2_conv1d_layers_are_quantized_and_rewritten(compiler):
    """Each Conv1D stayed bf16 ("Conv1D is no nn.Linear"), as in vLLM's and torchao's quantize_: GPT-2 saved nothing.
    Now each is an fp8 layer whose ``weight`` is still [in, out], and a rewritten site; the logits stay within fp8's
    error of the float64 reference (a site that read the codes untransposed would be ~100% off)."""
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (2, 9))
    ref = reference(model, ids)
    fp8fx.quantize_(model)
    layer = model.transformer.h[0].mlp.c_fc
    assert isinstance(layer, Conv1D) and layer.weight.shape == (64, 256) and layer.weight.dtype == torch.bfloat16
    assert layer._parameters["weight"].shape == (256, 64) and layer._parameters["weight_scale"].shape == (256, 1)
    backend = fp8fx.Fp8Backend(compiler=compiler)
    with torch.no_grad():
        eager = model(ids).logits
        out = torch.compile(model, backend=backend)(ids).logits
    rows = {s.fqn: s for s in backend.report.sites}
    assert {f for f, s in rows.items() if s.rewritten} == conv1d_names()
    assert rows["transformer.h.0.mlp.c_fc"].weight_shape == (256, 64)
    assert rows["lm_head"].reason == "not quantized: weight tied to transformer.wte.weight"
    assert rel_err(eager, ref) < 0.05 and rel_err(out, ref) < 0.08


def test_a_conv1d_in_128x128_blocks():
    """Block scales are over the codes as a linear's, [out, in]: c_attn's [384, 128] codes have [3, 1] blocks."""
    model = tiny_gpt2(embd=128, layers=1)
    ids = torch.randint(0, 128, (2, 9))
    ref = reference(model, ids)
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[128, 128]))
    assert model.transformer.h[0].attn.c_attn._parameters["weight_scale_inv"].shape == (3, 1)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(ids).logits
    assert {s.fqn for s in backend.report.rewritten} == conv1d_names(1)
    assert rel_err(out, ref) < 0.08


def test_a_conv1d_the_block_does_not_divide_names_its_linear_shape():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn: weight \[192, 64\] is not divisible by the "
                                         r"128x128 block"):
        fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[128, 128]), strict=True)
    assert not any(p.dtype == torch.float8_e4m3fn for p in model.parameters())  # (nothing was quantized)


def test_dequantize_gives_back_conv1d_layers_of_in_out_weights():
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (2, 9))
    fp8fx.quantize_(model)
    layer = model.transformer.h[1].attn.c_proj
    view = layer.weight.clone()
    with torch.no_grad():
        want = model(ids).logits
    fp8fx.dequantize_(model)
    assert type(layer) is Conv1D and torch.equal(layer.weight, view) and layer.weight.is_contiguous()
    with torch.no_grad():
        got = model(ids).logits
    # the same weights, laid out [in, out] now where the fp8 layer's view was the codes' [out, in] transposed: CPU
    # matmuls of the two layouts were bit-equal on CI's machines until one of AVX2 (AMD EPYC), where 2% of the
    # logits differ by an ulp; a wrong weight (transposed, unscaled) is off by the logits' own size
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


def test_calibrated_static_scales_for_conv1d_layers():
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (2, 9))
    ref = reference(model, ids)
    config = fp8fx.Fp8Config(activation_scheme="static")
    scales = fp8fx.calibrate(model, [ids, torch.randint(0, 128, (2, 9))], config)
    assert conv1d_names() <= set(scales)
    fp8fx.quantize_(model, config, input_scales=scales)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(ids).logits
    assert {s.scheme for s in backend.report.rewritten} == {"w:per-channel a:static per-tensor"}
    assert rel_err(out, ref) < 0.1


def test_load_checkpoint_quantizes_conv1d_weights_as_quantize_does(tmp_path):
    """A bf16 GPT-2 checkpoint's Conv1D weights ([in, out]) were loaded bf16: quantized online now, bit for bit as
    quantize_ quantizes them."""
    model = tiny_gpt2()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (2, 9))
    fp8fx.quantize_(model)
    loaded = meta_model(tmp_path)
    report = fp8fx.load_checkpoint(loaded, tmp_path, progress=False)
    assert set(report.quantized) == conv1d_names()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


def test_an_fp8_checkpoint_of_conv1d_codes_in_out_loads(tmp_path):
    """An fp8 checkpoint holds a Conv1D's codes as GPT-2's checkpoints hold its weight, [in, out] (vLLM's GPT-2 loader
    transposes every Conv1D weight it reads), with the scales of the codes as a linear's: loaded into the layer's
    [out, in] codes."""
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (2, 9))
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor()))
    state = {k: v.t().contiguous() if v.dtype == torch.float8_e4m3fn else v for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = {**model.config.to_dict(), "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = meta_model(tmp_path)
    report = fp8fx.load_checkpoint(loaded, tmp_path, progress=False)
    assert set(report.quantized) == conv1d_names()
    layer = loaded.transformer.h[0].attn.c_attn
    assert torch.equal(layer._parameters["weight"].view(torch.uint8),
                       model.transformer.h[0].attn.c_attn._parameters["weight"].view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


def test_save_checkpoint_writes_conv1d_layers_in_high_precision(tmp_path, caplog):
    """transformers' fp8 loaders take nn.Linear layers only: from_pretrained read a Conv1D's fp8 codes as its bf16
    weight, unscaled (logits 120% off), noting the scales as unexpected keys. save_checkpoint writes them dequantized,
    [in, out], in the ignore list, and says so; a model whose fp8 layers are all Conv1D (GPT-2's, lm_head tied) is
    refused, nothing written."""
    model = tiny_gpt2(layers=1)
    fp8fx.quantize_(model)
    with caplog.at_level("WARNING", logger="fp8fx"):
        with pytest.raises(ValueError, match=r"every fp8 layer of the model .* is a Conv1D \(transformers' fp8 "
                                             r"loaders.*the checkpoint would hold no fp8 layer; save the "
                                             r"high-precision model instead .*dequantize_"):
            fp8fx.save_checkpoint(model, tmp_path / "all")
    # (refused before it warned that it writes them: it did, then wrote nothing)
    assert not (tmp_path / "all").exists() and "save_checkpoint writes" not in caplog.text
    torch.manual_seed(0)
    mixed = torch.nn.Sequential(Conv1D(32, 16), torch.nn.Linear(32, 16)).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    fp8fx.quantize_(mixed)
    with caplog.at_level("WARNING", logger="fp8fx"):
        fp8fx.save_checkpoint(mixed, tmp_path / "mixed")
    assert "save_checkpoint writes 1 Conv1D layers (['0']) in high precision" in caplog.text
    with safetensors.safe_open(str(tmp_path / "mixed" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.weight_scale"}
        assert torch.equal(f.get_tensor("0.weight"), mixed[0].weight)
    with torch.device("meta"):
        again = torch.nn.Sequential(Conv1D(32, 16), torch.nn.Linear(32, 16)).to(torch.bfloat16)
    report = fp8fx.load_checkpoint(again, tmp_path / "mixed", progress=False)
    assert set(report.quantized) == {"1"} and report.not_quantized == {"0": "in ignored_layers"}
    with torch.no_grad():
        assert torch.equal(again(x), mixed(x))


def test_convert_leaves_conv1d_weights_in_high_precision_and_says_why(tmp_path):
    """convert writes what transformers' fp8 loaders read right: a Conv1D's weight stays bf16 (save_checkpoint's
    reason); GPT-2, whose linears are all Conv1D (lm_head tied), has nothing to convert."""
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "bf16")
    with pytest.raises(ValueError, match=r"no linear weight of .* can be quantized .* transformers' fp8 loaders"):
        convert(tmp_path / "bf16", tmp_path / "fp8", progress=False)
    assert not (tmp_path / "fp8").exists()


def test_a_checkpoint_weight_of_another_shape_names_the_conv1d_layout(tmp_path):
    model = tiny_gpt2(layers=1)
    state = {k: v.t().contiguous() if k == "transformer.h.0.mlp.c_fc.weight" else v
             for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(fp8fx.CheckpointError, match=r"transformer.h.0.mlp.c_fc takes \[64, cols\] weights \(a "
                                                    r"Conv1D's weight is \[in_features, out_features\]"):
        fp8fx.load_checkpoint(meta_model(tmp_path), tmp_path, progress=False)


def test_save_pretrained_of_fp8_conv1d_layers_writes_a_config_every_reader_refuses(tmp_path):
    """save_pretrained writes the state_dict, Conv1D codes that transformers' fp8 loaders read as bf16 weights: a
    quantization_config every reader refuses, saying why."""
    model = tiny_gpt2(layers=1)
    fp8fx.quantize_(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert "fp8fx.save_checkpoint" in config["fp8fx_not_loadable"]
    assert "every fp8 layer of the model" in config["fp8fx_not_loadable"]
    assert "Conv1D (transformers' fp8 loaders" in config["fp8fx_not_loadable"]


@pytest.mark.cuda
def test_gpt2_conv1d_layers_cuda():
    model = tiny_gpt2(embd=128, device="cuda")
    ids = torch.randint(0, 128, (4, 17), device="cuda")
    ref = reference(model, ids)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(ids).logits
    assert {s.fqn for s in backend.report.rewritten} == conv1d_names()
    assert all(s.kernel for s in backend.report.rewritten)
    assert rel_err(out, ref) < 0.08


def test_load_state_dict_of_conv1d_codes_in_out_says_transpose():
    """A state dict of a checkpoint's [in, out] codes was told to "reshape" them: the values would be scrambled."""
    model = tiny_gpt2(layers=1)
    fp8fx.quantize_(model)
    state = {k: v.t().contiguous() if v.dtype == torch.float8_e4m3fn else v for k, v in model.state_dict().items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"transformer.h.0.attn.c_attn.weight: shape \[64, 192\], where this "
                                           r"module's is \[192, 64\] \(a Conv1D's fp8 codes .* transpose it"):
        model.load_state_dict(state)
    assert all(torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           before[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else before[k])
               for k, v in model.state_dict().items())


def test_gpt2_s_hub_checkpoints_of_its_base_model_load(tmp_path):
    """GPT-2's hub checkpoints were saved from GPT2Model: h.0.attn.c_attn.weight, wte.weight, no "transformer."
    (float32, with the old attention-mask buffers). load_checkpoint refused them ("transformer.wte.weight is missing
    from the checkpoint") where from_pretrained adds the base model's prefix; it adds it too now, and strips it for
    a base model given a checkpoint of the model with its head."""
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (2, 9))
    state = {k.removeprefix("transformer."): v.float() for k, v in model.state_dict().items()
             if k.startswith("transformer.")}
    state.update({f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 32, 32)) for i in range(2)})
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**model.config.to_dict(), "architectures": ["GPT2LMHeadModel"]}))
    loaded = meta_model(tmp_path)
    report = fp8fx.load_checkpoint(loaded, tmp_path, progress=False)
    assert set(report.quantized) == conv1d_names()
    fp8fx.quantize_(model)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "head")
    with torch.device("meta"):
        base = transformers.GPT2Model(model.config).to(torch.bfloat16)
    report = fp8fx.load_checkpoint(base, tmp_path / "head", progress=False)
    assert set(report.quantized) == {n.removeprefix("transformer.") for n in conv1d_names()}


def test_conv1d_layers_quantize_did_not_reach_have_rows():
    """A block left out of a model quantized block by block: its bf16 Conv1D layers (untagged, read as addmm(b, x, w))
    had no row ("4 of 5 sites"), where an nn.Linear left out has one saying to quantize it; a skipped Conv1D's row
    gave its weight [in, out], where its reason and a quantized Conv1D's row give [out, in]."""
    model = tiny_gpt2(embd=128)
    fp8fx.quantize_(model.transformer.h[0], fp8fx.Fp8Config(weight_block_size=[256, 128]), prefix="transformer.h.0")
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randint(0, 128, (2, 9)))
    rows = {s.fqn: s for s in backend.report.sites}
    assert conv1d_names() <= set(rows)
    left = rows["transformer.h.1.mlp.c_fc"]
    assert not left.rewritten and left.reason.startswith(
        "weight is not an fp8fx-quantized weight, in a graph whose other layers are: a layer no quantize_ call took")
    assert left.reason.endswith("fp8fx.quantize_(layer, config, prefix='transformer.h.1.mlp.c_fc')")
    assert left.weight_shape == (512, 128)
    skipped = rows["transformer.h.0.attn.c_attn"]  # (384 rows: no 256-row block divides them)
    assert not skipped.rewritten and "weight [384, 128] is not divisible" in skipped.reason
    assert skipped.weight_shape == (384, 128) and rows["transformer.h.0.mlp.c_fc"].weight_shape == (512, 128)
    assert rows["transformer.h.0.mlp.c_fc"].rewritten
