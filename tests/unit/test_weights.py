"""Load-time weight hooks: quantize_, Fp8LinearMethod (online shards, serialized), bad input."""
import collections
import copy
import functools
import gc
import logging
import re
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8fx
from fp8fx import quant
from fp8fx.config import Fp8Config
from fp8fx.weights import CopyNumelCounter, Fp8LinearMethod, is_quantized
from tests.conftest import quantize_stopped_at, rel_err


def _mlp(k=128, n=256, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(k, n), nn.GELU(), nn.Linear(n, k, bias=False), nn.Linear(k, 64)).to(torch.bfloat16)


@pytest.mark.parametrize(
    "config,scale_name,scale_shape",
    [
        (Fp8Config(), "weight_scale", (256, 1)),
        (Fp8Config(weight_granularity=fp8fx.PerTensor()), "weight_scale", (1,)),
        (Fp8Config(weight_block_size=[128, 128]), "weight_scale_inv", (2, 1)),
    ],
)
def test_state_dict_holds_checkpoint_names(config, scale_name, scale_shape):
    model = _mlp()
    w0 = model[0].weight.detach().clone()
    fp8fx.quantize_(model, config)
    sd = model.state_dict()
    assert sd["0.weight"].dtype == torch.float8_e4m3fn and sd["0.weight"].shape == (256, 128)
    assert sd[f"0.{scale_name}"].shape == scale_shape and sd[f"0.{scale_name}"].dtype == torch.float32
    assert "0.input_scale" not in sd
    block = config.weight.block
    # dequantize is always weight.float() * scale, broadcast per block
    deq = quant.dequantize(sd["0.weight"], sd[f"0.{scale_name}"], block)
    assert torch.equal(model[0].weight.float(), deq.bfloat16().float())
    assert rel_err(deq, w0.float()) < 0.04
    # round trip: another quantized model (other random weights) takes this state dict and then
    # computes exactly what this one does
    other = _mlp(seed=1)
    fp8fx.quantize_(other, config)
    other.load_state_dict(sd)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert torch.equal(other(x), model(x))


def test_eager_model_still_runs_and_is_close():
    model = _mlp()
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    ref = model(x)
    fp8fx.quantize_(model, Fp8Config(ignored_layers=["3"]))
    assert type(model[0]).__name__ == "Fp8Linear" and isinstance(model[0], nn.Linear)
    assert type(model[3]) is nn.Linear  # ignored
    assert rel_err(model(x), ref) < 0.05


def test_bf16_weights_are_released():
    model = _mlp()
    refs = [weakref.ref(model[i].weight) for i in (0, 2, 3)]
    fp8fx.quantize_(model)
    gc.collect()
    assert all(r() is None for r in refs)


def test_nan_weight_raises_naming_fqn_and_changes_nothing():
    model = _mlp()
    with torch.no_grad():
        model[2].weight[3, 5] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^2\.weight has 1 NaN/Inf"):
        fp8fx.quantize_(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k], after[k], equal_nan=True, rtol=0, atol=0) for k in before)
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())


def test_quantize_twice_is_an_error():
    model = _mlp()
    fp8fx.quantize_(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="already fp8-quantized"):
        fp8fx.quantize_(model)
    assert all(torch.equal(sd[k].view(torch.uint8) if sd[k].element_size() == 1 else sd[k],
                           v.view(torch.uint8) if v.element_size() == 1 else v) for k, v in model.state_dict().items())


def test_a_model_quantized_in_part_is_refused_with_the_part_by_part_route():
    """A part quantized with its prefix, then the whole model: refused as "already fp8-quantized; quantize_ a fresh
    bf16 model", naming no way on for the rest; the refusal names the part-by-part route, which quantizes it."""
    model = _mlp()
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model.double()(x.double())
    model.to(torch.bfloat16)
    fp8fx.quantize_(model[0], Fp8Config(weight_granularity=fp8fx.PerTensor()), prefix="0")
    for config in (None, Fp8Config(ignored_layers=["0"])):
        with pytest.raises(RuntimeError, match=r"^quantize_: 0 is already fp8-quantized; quantize_ a fresh bf16 model "
                                               r"instead of quantizing twice, or, for a model quantized part by part, "
                                               r"each part not quantized yet with its prefix \(quantize_\(model\."
                                               r"layers\[1\], config, prefix=\"layers\.1\"\)\)$"):
            fp8fx.quantize_(model, config)
    assert not any(fp8fx.weights.is_quantized(model[i]) for i in (2, 3))
    for i in (2, 3):
        fp8fx.quantize_(model[i], prefix=str(i))
    assert all(fp8fx.weights.is_quantized(model[i]) for i in (0, 2, 3)) and model[0].weight_scale.numel() == 1
    with torch.no_grad():
        assert rel_err(model(x), want) < 0.05


def test_shape_not_divisible_by_block_is_skipped_or_strict_error():
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 100)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^1: weight \[100, 256\] is not divisible by the 128x128 block"):
        fp8fx.quantize_(model, Fp8Config(weight_block_size=[128, 128]), strict=True)
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())
    fp8fx.quantize_(model, Fp8Config(weight_block_size=[128, 128]))
    assert fp8fx.weights.is_quantized(model[0]) and not fp8fx.weights.is_quantized(model[1])
    assert "not divisible" in model[1].weight._fp8fx_skip_reason
    # the model passed is the layer itself: named by its class, with the fix that applies (h152: ": weight ...")
    with pytest.raises(ValueError, match=r"^the Linear passed to quantize_: weight \[100, 256\] is not divisible .* "
                                         r"it is the layer itself, which no ignored_layers entry names: to keep it "
                                         r"in high precision, do not pass it to quantize_\)$"):
        fp8fx.quantize_(model[1], Fp8Config(weight_block_size=[128, 128]), strict=True)


def test_a_layer_of_a_dtype_quantize_does_not_read_is_skipped_with_the_reason():
    """A float64 layer among bf16 ones stays as it is, with its reason, and the others are quantized (without the
    check the whole call raised: online quantization takes bf16/fp16/fp32 weights)."""
    model = nn.Sequential(nn.Linear(128, 128).to(torch.bfloat16), nn.Linear(128, 128).double())
    fp8fx.quantize_(model)
    assert fp8fx.weights.is_quantized(model[0]) and not fp8fx.weights.is_quantized(model[1])
    assert model[1].weight.dtype == torch.float64
    assert model[1].weight._fp8fx_skip_reason == ("weight dtype torch.float64 is not bf16/fp16/fp32; cast the layer to "
                                                  "one of these (layer.to(torch.bfloat16)) or add it to ignored_layers")


def test_a_layer_whose_weight_is_a_buffer_says_so():
    """It was skipped as having "no 2-D weight" (a 2-D buffer), naming no fix."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).bfloat16()
    weight = model[1].weight.detach().clone()
    del model[1].weight
    model[1].register_buffer("weight", weight)
    fp8fx.quantize_(model)
    assert fp8fx.weights.is_quantized(model[0]) and not fp8fx.weights.is_quantized(model[1])
    with pytest.raises(ValueError, match=r"^1: its weight is a buffer, not a parameter: .*register it as an "
                                         r"nn.Parameter, or add the layer to ignored_layers"):
        fp8fx.quantize_(nn.Sequential(nn.Linear(64, 64), model[1]).bfloat16(), strict=True)


def test_serialized_config_rejected_by_quantize_():
    with pytest.raises(ValueError, match="is_checkpoint_fp8_serialized=True"):
        fp8fx.quantize_(_mlp(), Fp8Config(is_checkpoint_fp8_serialized=True))


@pytest.mark.parametrize("qc,scheme", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}, "w:per-block(32x32) a:per-group(1x32)"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "w:per-tensor a:per-token"),
])
def test_the_fixes_given_for_a_quantization_config_dict_keep_its_scheme(qc, scheme):
    """quantize_(model, qc_dict) said "pass Fp8Config.from_config(it)", which quantize_ then refused (an fp8
    checkpoint's config), saying "use Fp8Config(is_checkpoint_fp8_serialized=False)": typed as written, it dropped
    the dict's blocks (per-channel weights). Both refusals give the fix that keeps the dict's scheme, and it works."""
    import dataclasses

    model = _mlp()
    with pytest.raises(ValueError, match=r"a quantization_config dict describes a checkpoint \(Fp8Config\.from_config"
                                         r"\(it\), load_checkpoint's\): to quantize with its scheme pass dataclasses\."
                                         r"replace\(c, is_checkpoint_fp8_serialized=False, weight_granularity=c\.weight"
                                         r"\) of c = Fp8Config\.from_config\(it\)$"):
        fp8fx.quantize_(model, qc)
    c = Fp8Config.from_config(qc)
    with pytest.raises(ValueError, match=r"load the fp8 checkpoint with load_checkpoint, or quantize with the same "
                                         r"scheme: dataclasses\.replace\(config, is_checkpoint_fp8_serialized=False, "
                                         r"weight_granularity=config\.weight\)$"):
        fp8fx.quantize_(model, c)
    assert not fp8fx.weights.is_quantized(model[0])
    fp8fx.quantize_(model, dataclasses.replace(c, is_checkpoint_fp8_serialized=False, weight_granularity=c.weight))
    assert str(fp8fx.weights.linear.layer_scheme(model[0])) == scheme


def test_static_needs_input_scales_and_calibrate_provides_them():
    model = _mlp()
    config = Fp8Config(activation_scheme="static")
    with pytest.raises(ValueError, match=r"missing \['0', '2', '3'\]"):
        fp8fx.quantize_(model, config)
    with pytest.raises(ValueError, match=r"input_scales\['0'\]=-1.0 must be a positive finite float"):
        fp8fx.quantize_(model, config, input_scales={"0": -1.0, "2": 1.0, "3": 1.0})
    # what is checked is what the layers get: a string passed float() and then failed in the first layer's
    # torch.tensor, after the layers before it were quantized
    for bad in ("0.01", torch.ones(2), None):
        with pytest.raises(ValueError, match=r"input_scales\['3'\]=.* must be a positive finite float \(nothing was"):
            fp8fx.quantize_(model, config, input_scales={"0": 1.0, "2": torch.tensor(0.5), "3": bad})
    # a key that is no name (a layer index, the module): difflib's TypeError before
    for key in (3, model[3]):
        with pytest.raises(ValueError, match=rf"^input_scales key .* \({type(key).__name__}\): keys are layer names "
                                             r"\(str\), e.g. '0', as fp8fx.calibrate returns them"):
            fp8fx.quantize_(model, config, input_scales={"0": 1.0, "2": 1.0, "3": 1.0, key: 1.0})
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())
    # with dynamic activations: refused, saying the fix and that nothing was done (it said neither, h137)
    with pytest.raises(ValueError, match=r"activation_scheme='dynamic': the scales serve static activations only; "
                                         r"pass Fp8Config\(activation_scheme='static'\).*\(nothing was quantized\)$"):
        fp8fx.quantize_(model, Fp8Config(), input_scales={"0": 1.0})
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())
    # checked as float32, the scales' dtype: 1e39 is inf there and 1e-46 zero (the last layer's loader refused
    # them after the layers before it were fp8), and a subnormal one's reciprocal is inf
    for bad, held in ((1e39, "inf"), (1e-46, "0.0"), (1e-40, r"9\.9999\d*e-41")):
        with pytest.raises(ValueError, match=rf"input_scales\['3'\]={re.escape(repr(bad))} must be a positive finite float in "
                                             rf"float32's normal range, .*it holds this one as {held}\) \(nothing"):
            fp8fx.quantize_(model, config, input_scales={"0": 1.0, "2": 0.5, "3": bad})
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())
    batches = [torch.randn(4, 128, dtype=torch.bfloat16) for _ in range(3)]
    scales = fp8fx.calibrate(model, batches)
    assert set(scales) == {"0", "2", "3"}
    assert scales["0"] == pytest.approx(max(b.abs().max().item() for b in batches) / 448, rel=1e-6)
    fp8fx.quantize_(model, config, input_scales=scales)
    assert model[0].input_scale.shape == (1,) and model[0].input_scale.item() == pytest.approx(scales["0"])


def test_calibrate_refuses_nan_activations():
    """torch's max drops a NaN against the running amax: the layer's scale would be ~2e-15 and every activation
    saturate. calibrate names the layer and the batch instead."""
    model = _mlp()
    bad = torch.randn(4, 128, dtype=torch.bfloat16)
    bad[1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"calibrate: the input of 0 holds NaN or Inf values in batch 1"):
        fp8fx.calibrate(model, [torch.randn(4, 128, dtype=torch.bfloat16), bad])
    assert not model[0]._forward_pre_hooks  # the hooks are gone


def test_calibrate_failing_before_its_first_batch_leaves_no_hook_on_the_model():
    """calibrate registered its hooks, then read each linear's weight (a parametrized one is computed: weight_norm's
    g * v / |v|, a whole weight's memory) before the try that removes them: an error there (out of memory) left its
    hooks on the model, measuring every later forward into dicts no one reads. None is left; calibrating again gives
    what a call that never failed gives."""
    class OutOfMemoryOnce(nn.Module):
        armed = False

        def forward(self, w):
            if OutOfMemoryOnce.armed:
                OutOfMemoryOnce.armed = False
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return w

    model = _mlp()
    nn.utils.parametrize.register_parametrization(model[2], "weight", OutOfMemoryOnce())
    batches = [torch.randn(4, 128, dtype=torch.bfloat16)]
    never_failed = fp8fx.calibrate(model, batches)
    model.train()
    OutOfMemoryOnce.armed = True
    with pytest.raises(torch.OutOfMemoryError):
        fp8fx.calibrate(model, batches)
    hooks = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called")
    assert not [(name, h) for name, m in model.named_modules() for h in hooks if getattr(m, h)]
    assert model.training and all(m.training for m in model.modules())  # as it was
    assert fp8fx.calibrate(model, batches) == never_failed


def test_calibrate_runs_in_eval_mode_and_takes_any_batch():
    """Dropout stayed on in a model in training mode (scales 2x too large at p=0.5, different each run); a linear
    called with input=, one that got no rows, and a dict batch crashed."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop, self.a, self.b = nn.Dropout(0.5), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x, scale=1.0):
            return self.b(input=self.a(self.drop(x)) * scale + self.b(x[:0]).sum())

    model = Net()  # training mode, as built
    x = torch.randn(8, 16)
    for batch in (x, {"x": x}, (x, 1.0)):
        scales = fp8fx.calibrate(model, [batch])
        assert scales["a"] == pytest.approx(x.abs().max().item() / 448)
    assert model.training and model.drop.training  # put back as it was

    class DictNet(nn.Module):  # its forward takes one dict: the mapping is that argument, not keywords
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)

        def forward(self, batch):
            return self.a(batch["x"])

    assert fp8fx.calibrate(DictNet(), [{"x": x}])["a"] == pytest.approx(x.abs().max().item() / 448)
    # a dict of keywords with one the forward does not take (a tokenizer's attention_mask): it went in as one
    # argument, and failed in the model ("'dict' object has no attribute 'numel'"), naming no key
    model.train()
    with pytest.raises(ValueError, match=r"calibrate: a batch's keys \['x', 'mask'\] do not bind to "
                                         r"Net.forward\(x, scale=1.0\) .*drop the keys it does not take \(\['mask'\]\)"):
        fp8fx.calibrate(model, [{"x": x, "mask": x}])
    with pytest.raises(ValueError, match=r"do not bind to Net.forward\(x, scale=1.0\) \(missing a required argument: "
                                         r"'x'\); give each batch the arguments it lacks"):
        fp8fx.calibrate(model, [{"scale": 2.0}])
    assert model.training and not model.a._forward_pre_hooks  # put back as it was


def test_misspelt_names_are_refused_unchanged():
    """An ignored_layers entry or an input scale that names nothing: an error with the closest name, and
    nothing quantized (a typo would otherwise quantize the layer meant to stay high precision)."""
    headed = nn.Sequential(collections.OrderedDict(body=_mlp(), lm_head=nn.Linear(64, 32).to(torch.bfloat16)))
    with pytest.raises(ValueError, match=r"ignored_layers: 'lm_haed' names no module of this Sequential \(did you "
                                         r"mean 'lm_head'\?\); correct or remove the entry: .* \(nothing was "
                                         r"quantized\)"):
        fp8fx.quantize_(headed, Fp8Config(ignored_layers=["body.3", "lm_haed"]))
    assert not any(fp8fx.weights.is_quantized(m) for m in headed.modules())
    # the model's own name of a wrapped model's layer (PEFT's base_model.model.lm_head): too far for difflib
    wrapped = nn.Sequential(collections.OrderedDict(base_model=nn.Sequential(collections.OrderedDict(model=headed))))
    with pytest.raises(ValueError, match=r"'lm_head' names no module of this Sequential \(did you mean "
                                         r"'base_model.model.lm_head'\?\)"):
        fp8fx.quantize_(wrapped, Fp8Config(ignored_layers=["lm_head"]))
    with pytest.raises(ValueError, match=r"'a' names no module of this Sequential \(the last part of 2 names, "
                                         r"'body.a' \.\.\.: each by its full name\)"):  # (one would be no answer)
        fp8fx.quantize_(nn.Sequential(collections.OrderedDict(body=nn.Sequential(collections.OrderedDict(
            a=nn.Linear(16, 16))), head=nn.Sequential(collections.OrderedDict(a=nn.Linear(16, 16))))),
            Fp8Config(ignored_layers=["a"]))
    # a parameter of a module (experts.gate_up_proj), one part below it: that module, not a sibling difflib likes
    # better (difflib offered body.1, the GELU, for body.2.weight: h149); a misspelt child stays the child; an index
    # past the end is no parameter
    for entry, meant in (("body.2.weight", "body.2"), ("body.2.wieght", "body.2"), ("lm_head.bias", "lm_head")):
        with pytest.raises(ValueError, match=rf"'{entry}' names no module .* \(did you mean '{meant}'\? "
                                             rf"'{entry.rpartition('.')[2]}' is none of its modules\)"):
            fp8fx.quantize_(headed, Fp8Config(ignored_layers=[entry]))
    # a misspelt or cut child stays that child, and a layer of elsewhere stays itself (h155: 'model' had been offered
    # for 'model.embed', which would keep every decoder layer)
    for entry, meant in (("base_model.model.lm_haed", "base_model.model.lm_head"),
                         ("base_model.model.lm", "base_model.model.lm_head"), ("body.lm_head", "lm_head")):
        with pytest.raises(ValueError, match=rf"'{entry}' names no module .* \(did you mean '{meant}'\?\)"):
            fp8fx.quantize_(wrapped if entry.startswith("base") else headed, Fp8Config(ignored_layers=[entry]))
    with pytest.raises(ValueError, match=r"'body\.7' names no module .* \(did you mean 'body\.[0-3]'\?\)"):
        fp8fx.quantize_(headed, Fp8Config(ignored_layers=["body.7"]))
    assert not any(fp8fx.weights.is_quantized(m) for m in headed.modules())
    fp8fx.quantize_(headed, Fp8Config(ignored_layers=["body.3", "lm_head"]))  # a prefix or an exact name
    assert fp8fx.weights.is_quantized(headed.body[0]) and not fp8fx.weights.is_quantized(headed.lm_head)
    model = _mlp()
    config = Fp8Config(activation_scheme="static", ignored_layers=["3"])
    with pytest.raises(ValueError, match=r"input_scales\['20'\]: no linear layer \(or experts' gate_up_proj / "
                                         r"down_proj\) of the model has that name"):
        fp8fx.quantize_(model, config, input_scales={"0": 1.0, "2": 1.0, "20": 1.0})
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())
    # a scale for a layer the config leaves bf16 (calibrated without the ignore list) has no use, and is no error
    fp8fx.quantize_(model, config, input_scales={"0": 1.0, "2": 1.0, "3": 1.0})
    assert fp8fx.weights.is_quantized(model[0]) and not fp8fx.weights.is_quantized(model[3])


def test_copy_numel_counter_counts_narrowed_copies():
    dst = torch.empty(10, 4)
    with CopyNumelCounter() as c:
        dst.narrow(0, 2, 3).copy_(torch.ones(3, 4))
        dst[7:].copy_(torch.ones(3, 4))
    assert c.copied_numel == 24


@pytest.mark.parametrize("granularity,sizes", [
    ("channel", [128, 64, 64]), ("block", [128, 256, 72]), ("block", [100, 64, 64]), ("tensor", [128, 64, 64])],
    ids=["channel", "block", "block-across-shards", "tensor"])
def test_online_shards_quantize_when_last_element_arrives(granularity, sizes):
    """A fused qkv-like layer loaded shard by shard, out of order, from bf16 tensors: the whole weight's
    quantization, bit for bit. Where each shard's rows have scales of their own (per channel; 128x128 blocks with
    every partition but the last on block rows) a shard is quantized as it arrives and no bf16 weight is held;
    where a scale spans shards (per tensor; a block across two) they wait in a bf16 receive buffer."""
    full = torch.randn(sum(sizes), 200, dtype=torch.bfloat16)
    layer = nn.Linear(200, sum(sizes), bias=False, device="meta")
    block = {"channel": [1, -1], "block": [128, 128], "tensor": [-1, -1]}[granularity]
    config = Fp8Config(weight_block_size=[128, 128]) if granularity == "block" else Fp8Config(
        weight_granularity=fp8fx.PerRow() if granularity == "channel" else fp8fx.PerTensor())
    method = Fp8LinearMethod(config)
    method.create_weights(layer, 200, sizes, torch.bfloat16, device="cpu")
    assert layer.weight.is_meta  # nothing materialized before the first shard
    offsets = [0, sizes[0], sizes[0] + sizes[1]]
    streamed = granularity == "channel" or granularity == "block" and sizes[0] % 128 == 0 == sizes[1] % 128
    for shard in (2, 0):
        method.weight_loader(layer, "weight", full[offsets[shard] : offsets[shard] + sizes[shard]], shard_id=shard)
        assert layer._parameters["weight"].dtype == torch.bfloat16  # not complete yet
        assert layer._parameters["weight"].is_meta == streamed  # (streamed: no bf16 weight held)
    with pytest.raises(RuntimeError, match=f"received {200 * (sizes[0] + sizes[2])} of {200 * sum(sizes)} elements"):
        method.process_weights_after_loading(layer)
    method.weight_loader(layer, "weight", full[offsets[1] : offsets[2]], shard_id=1)
    assert layer._parameters["weight"].dtype == torch.float8_e4m3fn
    q, s = quant.quantize(full, block)
    scale_name = "weight_scale_inv" if granularity == "block" else "weight_scale"
    s = s.reshape(1) if granularity == "tensor" else s
    assert torch.equal(layer._parameters["weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(getattr(layer, scale_name), s)
    method.process_weights_after_loading(layer)
    method.process_weights_after_loading(layer)  # idempotent
    assert torch.equal(getattr(layer, scale_name), s)


def test_serialized_per_tensor_shards_requantized_to_max_scale():
    sizes = [64, 32, 32]
    layer = nn.Linear(64, 128, bias=False, device="meta")
    config = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
    method = Fp8LinearMethod(config)
    method.create_weights(layer, 64, sizes, torch.bfloat16, device="cpu")
    shards = [torch.randn(s, 64) * (i + 1) for i, s in enumerate(sizes)]
    offset = 0
    for i, (size, w) in enumerate(zip(sizes, shards)):
        q, s = quant.quantize(w, [-1, -1])
        method.weight_loader(layer, "weight", q, shard_id=i)
        method.weight_loader(layer, "weight_scale", s, shard_id=i)
        if i < 2:
            method.weight_loader(layer, "input_scale", torch.tensor([0.1 * (i + 1)]), shard_id=i)
        offset += size
    with pytest.raises(ValueError, match="input_scale was never loaded"):
        method.process_weights_after_loading(layer)
    method.weight_loader(layer, "input_scale", torch.tensor([0.05]), shard_id=2)
    method.process_weights_after_loading(layer)
    scale_max = max(quant.compute_scale(w, [-1, -1]).item() for w in shards)
    assert layer.weight_scale.shape == (1,) and layer.weight_scale.item() == pytest.approx(scale_max)
    assert layer.input_scale.item() == pytest.approx(0.2)
    assert rel_err(layer.weight.float(), torch.cat(shards)) < 0.05
    # the shard that already had the max scale is unchanged bit for bit
    q_last, _ = quant.quantize(shards[2], [-1, -1])
    assert torch.equal(layer._parameters["weight"][96:].view(torch.uint8), q_last.view(torch.uint8))


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_partition_of_no_rows_needs_no_scales(dtype, bias):
    """create_weights takes output partitions of size 0 (a fused layer with an empty shard); a checkpoint holds no
    tensor for one, so its never-loaded scales were refused: "weight_scale was never loaded for shard(s) [1]", a layer
    that could not be processed. They are passed by, as vLLM's requantization skips a shard of zero width; and so is
    its bias shard."""
    layer = nn.Linear(64, 64, bias=bias, device="meta")
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static"))
    method.create_weights(layer, 64, [32, 0, 32], dtype, device="cpu")
    torch.manual_seed(0)
    shards = [torch.randn(32, 64) * (i + 1) for i in range(2)]
    for shard_id, w in zip((0, 2), shards):
        q, s = quant.quantize(w, [-1, -1])
        method.weight_loader(layer, "weight", q, shard_id=shard_id)
        method.weight_loader(layer, "weight_scale", s, shard_id=shard_id)
        method.weight_loader(layer, "input_scale", torch.tensor([0.1 * (shard_id + 1)]), shard_id=shard_id)
        if bias:
            method.weight_loader(layer, "bias", torch.full((32,), shard_id + 1.0), shard_id=shard_id)
    method.process_weights_after_loading(layer)
    if bias:
        assert torch.equal(layer.bias.float(), torch.tensor([1.0] * 32 + [3.0] * 32))
    assert layer.weight_scale.item() == pytest.approx(quant.compute_scale(shards[1], [-1, -1]).item())
    assert layer.input_scale.item() == pytest.approx(0.3)
    assert rel_err(layer.weight.float(), torch.cat(shards)) < 0.05


def test_serialized_layer_fused_in_the_checkpoint_takes_its_one_scale_for_every_shard():
    """A checkpoint that stores q/k/v as one tensor with one weight_scale and input_scale (Phi-3's qkv_proj), loaded
    whole into a layer of logical partitions: vLLM's fused loaders take the scale for every shard; it was refused."""
    sizes = [64, 32, 32]
    layer = nn.Linear(64, 128, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static"))
    method.create_weights(layer, 64, sizes, torch.bfloat16, device="cpu", prefix="qkv_proj")
    w = torch.randn(128, 64)
    q, s = quant.quantize(w, [-1, -1])
    method.weight_loader(layer, "weight", q)
    method.weight_loader(layer, "weight_scale", s.reshape(()))
    method.weight_loader(layer, "input_scale", torch.tensor(0.25))
    method.process_weights_after_loading(layer)
    assert torch.equal(layer._parameters["weight"].view(torch.uint8), q.view(torch.uint8))  # no requantizing
    assert layer.weight_scale.item() == s.item() and layer.input_scale.item() == 0.25
    assert rel_err(layer.weight.float(), w) < 0.05
    # a scale of another count is still refused, the layer unchanged
    layer = nn.Linear(64, 128, bias=False, device="meta")
    method.create_weights(layer, 64, sizes, torch.bfloat16, device="cpu", prefix="qkv_proj")
    with pytest.raises(ValueError, match=r"^qkv_proj.weight_scale shard None: checkpoint tensor of shape \(2,\)"):
        method.weight_loader(layer, "weight_scale", torch.tensor([0.5, 0.5]))
    assert (layer._parameters["weight_scale"] < 0).all()  # still the never-loaded marker


def test_loader_rejects_wrong_shard_shape():
    layer = nn.Linear(64, 96, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config())
    method.create_weights(layer, 64, [64, 32], torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match=r"weight shard 1: checkpoint tensor of shape \(64, 64\) does not fit"):
        method.weight_loader(layer, "weight", torch.randn(64, 64), shard_id=1)


_ONLINE, _STATIC = Fp8Config(), Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
_BLOCK = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[32, 32])


@pytest.mark.parametrize("linear,config,bad", [
    (linear, config, bad) for linear in (True, False) for config in (_ONLINE, _STATIC, _BLOCK)
    for bad in ("negative", "fraction", "bool", "dtype") + (("partitions", "empty") if linear else ("tp_size",))
] + [(True, _BLOCK, "blocks")])
def test_create_weights_refuses_bad_arguments_naming_the_layer_and_changes_nothing(linear, config, bad):
    """create_weights with a negative or fractional size failed in torch (no layer, no argument named), an integer
    params_dtype at the first weight loaded, each leaving the layer with fp8fx attributes (and, static, an input
    scale); found by a bad-input probe. Each is refused naming the layer, the argument and its value, and the layer
    is as it was; the same call with good arguments then creates the weights."""
    from fp8fx.weights import Fp8MoEMethod

    args = dict(input_size=64, output_partition_sizes=[32, 32]) if linear else dict(
        num_experts=4, hidden_size=64, intermediate_size=32)
    good = dict(args)
    key, value, message = {
        "negative": ("input_size" if linear else "hidden_size", -1, "an int >= 0"),
        "fraction": ("output_partition_sizes" if linear else "intermediate_size", [16.5, 15.5] if linear else 32.0,
                     "a list of ints >= 0, one for each fused shard" if linear else "an int >= 0"),
        "bool": ("input_size" if linear else "num_experts", True, f"an int >= {0 if linear else 1}"),
        "tp_size": ("tp_size", 0, "an int >= 1"),
        "partitions": ("output_partition_sizes", 64, "a list of ints >= 0, one for each fused shard"),
        "empty": ("output_partition_sizes", [], "a list of ints >= 0, one for each fused shard"),
        "blocks": ("output_partition_sizes", [16, 48], "every partition but the last must be a multiple of block_n=32"),
        "dtype": ("params_dtype", torch.int8, "the dtype the layer computes in"),
    }[bad]
    args[key] = value
    dtype = args.pop("params_dtype", torch.bfloat16)
    layer = nn.Linear(64, 64, device="meta") if linear else nn.Module()
    before = (type(layer), dict(vars(layer)), dict(layer._parameters))
    method = (Fp8LinearMethod if linear else Fp8MoEMethod)(config)
    shown = re.escape(f"{key}={value!r}") if bad != "blocks" else r"output partitions \[16, 48\]"
    with pytest.raises(ValueError, match=rf"^model.layers.0.proj: (create_weights\({shown}\)|{shown}).*"
                                         rf"{re.escape(message)}"):
        method.create_weights(layer, params_dtype=dtype, device="cpu", prefix="model.layers.0.proj", **args)
    assert (type(layer), vars(layer), layer._parameters) == before
    method.create_weights(layer, params_dtype=torch.bfloat16, device="cpu", prefix="model.layers.0.proj", **good)
    assert layer._fp8fx_prefix == "model.layers.0.proj"


@pytest.mark.parametrize("linear", [True, False], ids=["Fp8LinearMethod", "Fp8MoEMethod"])
@pytest.mark.parametrize("config", [_ONLINE, _STATIC, _BLOCK], ids=["online", "static", "block"])
def test_create_weights_refuses_a_created_layer_and_a_device_it_cannot_use(linear, config):
    """Found by a bad-input probe: a second create_weights on a layer whose weights exist (a model quantize_ or
    load_checkpoint made fp8, a load under way) replaced its fp8 codes and scales with empty ones, silently; a device
    torch cannot make tensors on failed with torch's error (no layer named), after the layer took fp8fx attributes.
    Both are refused naming the layer, the layer as it was."""
    from fp8fx.weights import Fp8MoEMethod

    args = dict(input_size=64, output_partition_sizes=[32, 32]) if linear else dict(
        num_experts=4, hidden_size=64, intermediate_size=32)
    method = (Fp8LinearMethod if linear else Fp8MoEMethod)(config)
    layer = nn.Linear(64, 64, device="meta") if linear else nn.Module()
    before = (type(layer), dict(vars(layer)), dict(layer._parameters))
    bad = "cuda:1000" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=rf"^proj: device='{bad}': no tensor can be made there .*nothing of the "
                                         "layer changed"):
        method.create_weights(layer, params_dtype=torch.bfloat16, device=bad, prefix="proj", **args)
    assert (type(layer), vars(layer), layer._parameters) == before
    method.create_weights(layer, params_dtype=torch.bfloat16, device="cpu", prefix="proj", **args)
    created = (type(layer), dict(vars(layer)), dict(layer._parameters))
    with pytest.raises(ValueError, match=r"^proj: its weights were created already .*nothing of the layer changed"):
        method.create_weights(layer, params_dtype=torch.bfloat16, device="cpu", prefix="proj", **args)
    assert (type(layer), vars(layer), layer._parameters) == created
    # a layer quantize_ made fp8: its codes and scales stay
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if linear:
        with pytest.raises(ValueError, match=r"^0: its weights were created already"):
            method.create_weights(model[0], 64, [64], torch.bfloat16, device="cpu", prefix="0")
        assert all(torch.equal(v.view(torch.uint8) if v.dtype.itemsize == 1 else v, state[k].view(torch.uint8) if
                               v.dtype.itemsize == 1 else state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("config", [None, Fp8Config, {"quant_method": "fp8", "activation_scheme": "dynamic"}])
def test_method_classes_refuse_what_is_no_config(config):
    """A checkpoint's quantization_config dict, None or the class itself failed at the first call with an
    AttributeError naming neither the argument nor the fix (found by a bad-input probe)."""
    from fp8fx.weights import Fp8MoEMethod

    fix = (r"it takes an Fp8Config" if config is None else r"the class; pass an instance" if config is Fp8Config
           else r"Fp8Config.from_config\(it\)")
    for cls in (Fp8LinearMethod, Fp8MoEMethod):
        with pytest.raises(ValueError, match=rf"^{cls.__name__}\(config=.*{fix}") as info:
            cls(config)
        assert "or None" not in str(info.value)  # (it refuses None too)


def test_create_weights_takes_numpy_and_torch_ints():
    """Sizes from numpy or torch (a config's np.int64, a torch.Size, an array of partitions) are ints to
    create_weights, as before its argument checks (which refused them as "an int >= 0": a review's catch)."""
    import numpy as np

    from fp8fx.weights import Fp8MoEMethod

    layer = nn.Linear(64, 64, device="meta")
    Fp8LinearMethod(Fp8Config()).create_weights(layer, np.int64(64), np.array([32, 32]), torch.bfloat16, device="cpu")
    assert layer._fp8fx_partitions == (32, 32) and layer._parameters["weight"].shape == (64, 64)
    experts = nn.Module()
    Fp8MoEMethod(Fp8Config()).create_weights(experts, np.int64(4), torch.Size([64])[0], torch.tensor(32),
                                             torch.bfloat16, device="cpu")
    assert experts._parameters["gate_up_proj"].shape == (4, 64, 64)


@pytest.mark.parametrize("linear", [True, False], ids=["Fp8LinearMethod", "Fp8MoEMethod"])
def test_serialized_weight_loader_refuses_nan_codes(linear):
    """An fp8 weight with a NaN code (0x7F) loaded through the public loader of an fp8-serialized layer: its outputs
    were NaN, silently (load_checkpoint, which checks the codes itself, refused it). Refused, naming the tensor and
    the count; the same call with values_checked (the caller's own pass) takes it."""
    from fp8fx.weights import Fp8MoEMethod

    config = Fp8Config(is_checkpoint_fp8_serialized=True)
    if linear:
        layer, method = nn.Linear(64, 32, device="meta"), Fp8LinearMethod(config)
        method.create_weights(layer, 64, [32], torch.bfloat16, device="cpu", prefix="proj")
        name, codes, args = "weight", torch.randn(32, 64).to(torch.float8_e4m3fn), ()
    else:
        layer, method = nn.Module(), Fp8MoEMethod(config)
        method.create_weights(layer, 2, 64, 32, torch.bfloat16, device="cpu", prefix="experts")
        name, codes, args = "gate_up_proj", torch.randn(2, 64, 64).to(torch.float8_e4m3fn), (None, None)
    codes.view(torch.uint8).view(-1)[7] = 0xFF  # (-NaN)
    before = layer._parameters[name].clone()
    with pytest.raises(ValueError, match=rf"^(proj|experts)\.{name} \(.*shard None\) has 1 NaN fp8 codes: re-export"):
        method.weight_loader(layer, name, codes, *args)
    assert torch.equal(layer._parameters[name].view(torch.uint8), before.view(torch.uint8))
    method.weight_loader(layer, name, codes, *args, values_checked=True)  # (checked by the caller: not again)
    assert torch.equal(layer._parameters[name].view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_state_dict_of_block_scales_no_loader_takes_is_refused_naming_the_tensor(value):
    """A block-quantized layer's scales are ``weight_scale_inv``: a 0 or negative one in a state dict loaded into the
    quantized model is refused as a ``weight_scale``'s is (loaded, the layer's outputs were zero or negated; the
    NaN-codes check takes NaN and Inf scales, not these), naming it, and the layer keeps its own."""
    torch.manual_seed(0)
    model, other = (nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16) for _ in range(2))
    for m in (model, other):
        fp8fx.quantize_(m, Fp8Config(weight_block_size=[32, 32]))
    state = {k: v.clone() for k, v in other.state_dict().items()}
    state["0.weight_scale_inv"][0, 1] = value
    before = model[0].weight_scale_inv.clone()
    with pytest.raises(RuntimeError, match=rf"0\.weight_scale_inv: 1 scales are not positive finite floats "
                                           rf"\({value} at \[0, 1\]\).*this module was not loaded"):
        model.load_state_dict(state)
    assert torch.equal(model[0].weight_scale_inv, before)
    state["0.weight_scale_inv"] = other[0].weight_scale_inv.clone()
    model.load_state_dict(state)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(model(x), other(x))


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("moe", [False, True], ids=["linear", "experts"])
def test_a_state_dict_of_another_scheme_loads_nothing(moe):
    """A per-channel model's state_dict loaded into a per-tensor one: torch copied each layer's codes, then refused
    its scale's shape ([64, 1] against [1]), leaving the new codes under the old scale (outputs 1.46x their norm off
    after the error), and every other module loaded. Refused now before any module loads, naming the tensor and
    both shapes; an experts module likewise."""
    torch.manual_seed(0)
    from tests.unit.test_moe_weights import Experts

    make = (lambda: nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 64))) if not moe else (
        lambda: nn.Sequential(nn.LayerNorm(64), Experts(h=64, i=32)))
    model, other = make().to(torch.bfloat16), make().to(torch.bfloat16)
    fp8fx.quantize_(model, Fp8Config(weight_granularity=fp8fx.PerTensor()))
    fp8fx.quantize_(other, Fp8Config())
    before = _values(model)
    name = "1.weight_scale" if not moe else "1.gate_up_proj_scale"
    with pytest.raises(RuntimeError, match=rf"(?s){re.escape(name)}: shape \[(4, )?64, 1\], where this module's is "
                                           r"\[[14]\] \(a state_dict of a model quantized with another scheme.*"
                                           r"\(nothing was loaded\)$"):
        model.load_state_dict(other.state_dict())
    assert _same(_values(model), before)


@pytest.mark.parametrize("strict", [True, False])
def test_fp8_codes_for_a_layer_kept_in_high_precision_load_nothing(strict):
    """A fully quantized model's state_dict loaded into one quantized with ignored_layers=["2"]: with strict=False
    the codes went into the float layer as its weight values, unscaled, silently; with strict=True torch refused
    the scale's key only after every module had loaded (h136). Refused before any module loads, naming the tensor,
    the layer's dtype and why it was kept."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    model, other = make(), make()
    fp8fx.quantize_(model, Fp8Config(ignored_layers=["2"]))
    fp8fx.quantize_(other, Fp8Config())
    before = _values(model)
    with pytest.raises(RuntimeError, match=r"(?s)2\.weight: the state dict holds torch.float8_e4m3fn codes \[64, 64\], "
                                           r"but 2 \(Linear\) is kept in torch.bfloat16 here \(in ignored_layers\).*"
                                           r"the same Fp8Config.*\(nothing was loaded\)$"):
        model.load_state_dict(other.state_dict(), strict=strict)
    assert _same(_values(model), before)
    own = {k: v.clone() for k, v in model.state_dict().items()}  # a state dict of this model's: loads
    own["2.weight"] += 1
    model.load_state_dict(own, strict=strict)
    assert torch.equal(model[2].weight, own["2.weight"])


def test_a_refused_state_dict_leaves_every_module_as_it_was():
    """A bf16 fine-tune's state_dict loaded into the fp8 model is refused at its first fp8 layer, but torch had
    loaded the modules before it (and went on with those after): embeddings and norms replaced, logits 1.0 off
    after the error. The model quantize_ was given refuses it before any module loads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.LayerNorm(64))
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(1.0)
    fp8fx.quantize_(model.to(torch.bfloat16))
    before = _values(model)
    with pytest.raises(RuntimeError, match=r"2\.weight: a torch.float32 tensor for a module fp8fx quantized.*\n"
                                           r"\(nothing was loaded\)$"):
        model.load_state_dict(tuned.state_dict())
    assert _same(_values(model), before)
    # quantized by parts, each part checks its own layers only: the error says what it cannot vouch for
    parts = nn.Sequential(nn.Embedding(16, 64), nn.Sequential(nn.Linear(64, 64))).to(torch.bfloat16)
    fp8fx.quantize_(parts[1], prefix="1")
    with pytest.raises(RuntimeError, match=r"\n\(nothing of 1 was loaded; modules outside it that this load reached "
                                           r"before it, if any, were\)$"):
        parts.load_state_dict({"0.weight": tuned[0].weight, "1.0.weight": tuned[2].weight, "1.0.bias": tuned[2].bias})
    # a shallow copy shares the check, which holds the original: gone, it says so (not torch's "dead Module")
    shallow = copy.copy(parts[1])
    parts = None
    gc.collect()
    with pytest.raises(RuntimeError, match=r"copied with copy.copy from a quantized model that is gone, and its "
                                           r"load_state_dict check was that model's"):
        shallow.load_state_dict(shallow.state_dict())
    fp8fx.dequantize_(model)  # (the check goes with the fp8 layers)
    assert not model._load_state_dict_pre_hooks
    model.load_state_dict(tuned.state_dict())
    assert torch.equal(model[0].weight, tuned[0].weight.to(torch.bfloat16))


def test_a_load_scans_each_fp8_tensor_once(monkeypatch):
    """The model's check before any module loads and each layer's own scanned every fp8 tensor for NaN codes twice
    (loads 2.4x slower): the layer takes the model's word for the tensors it checked."""
    from fp8fx.weights import chunked

    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))).to(torch.bfloat16)
    fp8fx.quantize_(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    scans = collections.Counter()
    count = chunked.count_nonfinite
    monkeypatch.setattr(chunked, "count_nonfinite", lambda t: scans.update([t.data_ptr()]) or count(t))
    model.load_state_dict(state)
    assert len(scans) == 4 and set(scans.values()) == {1}, scans
    state["1.weight_scale"] = state["1.weight_scale"].view(1, 64)  # the same values in another shape: the fix named
    with pytest.raises(RuntimeError, match=r"1\.weight_scale: shape \[1, 64\], where this module's is \[64, 1\] \(the "
                                           r"same 64 values in another shape: reshape it to \[64, 1\]"):
        model.load_state_dict(state)


def test_a_transposed_block_scale_is_named_so_not_as_a_reshape():
    """A 128x128 block scale given transposed ([K blocks, N blocks], a writer's [in, out] layout): the refusal said
    "the same 6 values in another shape: reshape it to [2, 3]", and the reshaped scale loaded with each block under
    another block's scale (weight 33% off, silently; a review's catch). It now says to transpose; the model is
    untouched, and the transposed scale loads exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(384, 256)).to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[128, 128]))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.weight_scale_inv"] *= torch.rand(2, 3) + 0.5
    before = model[0].weight.clone()
    given = {**state, "0.weight_scale_inv": state["0.weight_scale_inv"].t().contiguous()}
    with pytest.raises(RuntimeError, match=r"0\.weight_scale_inv: shape \[3, 2\], where this module's is \[2, 3\] "
                                           r"\(the transposed shape, a writer's \[in, out\] layout .* transpose it "
                                           r"\(\.t\(\)\.contiguous\(\)\); a reshape would put its values in the wrong "
                                           r"places; this module was not loaded"):
        model.load_state_dict(given)
    assert torch.equal(model[0].weight, before)
    model.load_state_dict({**given, "0.weight_scale_inv": given["0.weight_scale_inv"].t()})
    assert torch.equal(model[0].weight_scale_inv, state["0.weight_scale_inv"])


def test_loads_into_a_part_or_a_layer_of_two_names_are_checked_first(monkeypatch):
    """The check was the model's alone: a load into one of its modules (``model.body.load_state_dict``) loaded the
    modules before the refusing fp8 layer; a layer registered under two names was checked under its first, while
    torch loads it under each, the modules between loaded. A part quantized on its own inside a model quantized as a
    whole had each later layer's codes scanned twice, and a layer given to quantize_ itself (a loader's part by part)
    kept its checked tensors alive in a thread-local after the load."""
    from fp8fx.weights import chunked, linear

    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64))  # noqa: E731
    model = nn.Sequential(nn.Embedding(16, 64), nn.Sequential(block(), block())).to(torch.bfloat16)
    model.dec = model[1][1][1]  # (the second block's linear under a second name)
    fp8fx.quantize_(model)
    before = _values(model)
    bad = {k: v.clone() for k, v in model[1].state_dict().items()}
    bad["0.0.weight"] = torch.full_like(bad["0.0.weight"], 7.0)
    bad["1.1.weight"] = torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"1\.1\.weight: a torch.bfloat16 tensor .*\n\(nothing was loaded\)$"):
        model[1].load_state_dict(bad)
    assert _same(_values(model), before)
    twice = {k: v.clone() for k, v in model.state_dict().items()}
    twice["1.0.0.weight"] = torch.full_like(twice["1.0.0.weight"], 7.0)
    twice["dec.weight"] = torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"dec\.weight: a torch.bfloat16 tensor .*\n\(nothing was loaded\)$"):
        model.load_state_dict(twice)
    assert _same(_values(model), before)
    whole = nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64)), nn.Linear(64, 64)).to(torch.bfloat16)
    fp8fx.quantize_(whole, fp8fx.Fp8Config(ignored_layers=["1"]))
    fp8fx.quantize_(whole[1], prefix="1")
    scans = collections.Counter()
    count = chunked.count_nonfinite
    monkeypatch.setattr(chunked, "count_nonfinite", lambda t: scans.update([t.data_ptr()]) or count(t))
    whole.load_state_dict({k: v.clone() for k, v in whole.state_dict().items()})
    assert len(scans) == 3 and set(scans.values()) == {1}, scans
    assert not linear._checked_loads()
    layer = nn.Linear(64, 64).to(torch.bfloat16)
    fp8fx.quantize_(layer, prefix="model.layers.0.mlp.down_proj")
    layer.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()})
    assert not layer._load_state_dict_pre_hooks and not linear._checked_loads()


def test_a_load_that_raises_elsewhere_keeps_no_layer_alive():
    """A load that raised in another module after the check passed left the records of the layers it never reached,
    which held them and the loaded tensors alive for good (three dropped models, all alive after a later load)."""
    from fp8fx.weights import linear

    class Refusing(nn.Module):
        def _load_from_state_dict(self, *args, **kwargs):
            raise ValueError("refused")

    dropped = []
    for _ in range(3):
        model = nn.Sequential(Refusing(), nn.Linear(64, 64)).to(torch.bfloat16)
        fp8fx.quantize_(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match="refused"):
            model.load_state_dict(state)
        dropped.append((weakref.ref(model[1]), weakref.ref(state["1.weight"])))
        del model, state
    other = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16))
    other.load_state_dict(other.state_dict())
    gc.collect()
    assert not any(a() is not None or b() is not None for a, b in dropped)
    assert not linear._checked_loads()


def test_a_float16_model_refuses_codes_and_scales_beyond_its_range():
    """model.half() refuses an fp8 layer whose dequantized weight float16 cannot hold; loading such codes and scales
    into the float16 model took them, silently: 29371 inf weights, every output NaN."""
    torch.manual_seed(0)
    model, big = (nn.Sequential(nn.Linear(128, 128)).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        big[0].weight.mul_(1e6)
    fp8fx.quantize_(model)
    fp8fx.quantize_(big)
    model.half()
    before = _values(model)
    with pytest.raises(RuntimeError, match=r"0\.weight: a scale of .* is beyond torch.float16's range \(at most "
                                           r"65504\), the dtype this module computes in: \d+ values .* would be inf"):
        model.load_state_dict(big.state_dict())
    assert _same(_values(model), before)
    model.to(torch.bfloat16).load_state_dict(big.state_dict())  # (its fix)
    assert torch.isfinite(model(torch.randn(2, 128, dtype=torch.bfloat16))).all()


def test_a_state_dict_of_a_float32_bias_loads_into_a_quantized_layer_as_into_a_bf16_one():
    """The fp8 checks of a quantized layer's ``load_state_dict`` are for its fp8 codes and float32 scales: its bias
    is the model's, and a float32 one (a state dict saved in float32) is cast to the layer's dtype as torch casts it
    for a bf16 nn.Linear, not refused as "a tensor whose values would be taken as codes"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    fp8fx.quantize_(model, Fp8Config())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    bias = torch.randn(64)
    state["0.bias"] = bias
    model.load_state_dict(state)
    reference.load_state_dict({"0.weight": reference[0].weight.detach().float(), "0.bias": bias})
    assert model[0].bias.dtype == torch.bfloat16 and torch.equal(model[0].bias, reference[0].bias)
    assert model[0]._parameters["weight"].dtype == torch.float8_e4m3fn


def test_a_meta_state_dict_assigned_to_a_quantized_model_is_taken_as_by_a_bf16_one():
    """``load_state_dict(meta_state, assign=True)`` (a model turned into a skeleton, as ``to_empty`` flows do): the
    scale and NaN-code checks read values a meta tensor does not hold (``Tensor.item() cannot be called on meta
    tensors``); a meta tensor is left to torch, which assigns it, as for a bf16 model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    fp8fx.quantize_(model, Fp8Config(ignored_layers=["1"]))
    for m in (model, reference):
        meta = {k: torch.empty_like(v, device="meta") for k, v in m.state_dict().items()}
        assert str(m.load_state_dict(meta, assign=True)) == "<All keys matched successfully>"
        assert all(v.is_meta for v in m.state_dict().values())
    assert model[0]._parameters["weight"].dtype == torch.float8_e4m3fn


def test_online_shard_loaded_twice_is_an_error():
    """Counting copied elements alone would reach numel with a repeated shard and quantize a weight
    whose other rows were never written."""
    layer = nn.Linear(64, 96, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config())
    method.create_weights(layer, 64, [32, 32, 32], torch.bfloat16, device="cpu")
    shard = torch.randn(32, 64, dtype=torch.bfloat16)
    method.weight_loader(layer, "weight", shard, shard_id=0)
    method.weight_loader(layer, "weight", shard, shard_id=1)
    with pytest.raises(ValueError, match="weight shard 1 was loaded twice"):
        method.weight_loader(layer, "weight", shard, shard_id=1)
    assert layer._parameters["weight"].dtype == torch.bfloat16  # not quantized


@pytest.mark.parametrize("granularity", [fp8fx.PerTensor(), fp8fx.PerRow(), fp8fx.PerBlock(128, 128)])
@pytest.mark.parametrize("when", ["before", "after"])
def test_online_layer_refuses_a_weight_scale(granularity, when):
    """Online, the weight's scale is computed when its last element arrives; a weight_scale loaded after that (a
    stray checkpoint tensor) replaced it, silently, and the weight read back ~10^4x too large. Before it, the layer
    named no such parameter."""
    method = Fp8LinearMethod(Fp8Config(weight_granularity=granularity))
    layer = nn.Linear(128, 64, bias=False, device="meta")
    method.create_weights(layer, 128, [64], torch.bfloat16, device="cpu", prefix="l")
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    if when == "after":
        method.weight_loader(layer, "weight", w)
    before = {k: v.clone() for k, v in layer.state_dict().items() if not v.is_meta}
    name = "weight_scale_inv" if isinstance(granularity, fp8fx.PerBlock) else "weight_scale"
    with pytest.raises(ValueError, match=rf"l\.{name} \(shard None\): online quantization computes the weight's "
                                         "scales"):
        method.weight_loader(layer, name, torch.full((64, 1), 100.0))
    after = {k: v for k, v in layer.state_dict().items() if not v.is_meta}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    if when == "after":
        method.process_weights_after_loading(layer)
        assert rel_err(layer.weight.float(), w.float()) < 0.05


@pytest.mark.parametrize("device", [None, "cpu"])  # None: the whole bf16 weight copied, "cpu": adopted as it is
@pytest.mark.parametrize("serialized", [False, True])
def test_whole_weight_loaded_twice_is_an_error_and_changes_nothing(device, serialized):
    """Online, a second whole weight was copied raw (no scaling) into the fp8 weight and requantized: weights off by
    30x. Serialized, a shard after the whole weight counted past numel."""
    layer = nn.Linear(64, 32, bias=False, device="meta")
    config = Fp8Config(is_checkpoint_fp8_serialized=serialized, weight_granularity=fp8fx.PerRow())
    method = Fp8LinearMethod(config)
    method.create_weights(layer, 64, [16, 16], torch.bfloat16, device=device)
    w = torch.randn(32, 64, dtype=torch.bfloat16) * 1000
    w = w.clamp(-448, 448).to(torch.float8_e4m3fn) if serialized else w  # (torch 2.11's cast makes NaN past 448)
    method.weight_loader(layer, "weight", w)
    before = layer._parameters["weight"].detach().view(torch.uint8).clone()
    for again, shard in ((w, None), (w[:16], 0)):
        with pytest.raises(ValueError, match=r"weight \(shard .*\) of \d+ elements, but 2048 of the weight's 2048 were "
                                             r"loaded before; the whole weight, or each of its shards, must arrive once"):
            method.weight_loader(layer, "weight", again, shard_id=shard)
    assert torch.equal(layer._parameters["weight"].detach().view(torch.uint8), before)


def test_serialized_shard_loaded_twice_is_an_error():
    """fp8 shards are counted in elements too: a repeated shard must not stand in for one never loaded."""
    layer = nn.Linear(64, 16, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=fp8fx.PerRow()))
    method.create_weights(layer, 64, [8, 8], torch.bfloat16, device="cpu")
    shard = torch.randn(8, 64).to(torch.float8_e4m3fn)
    method.weight_loader(layer, "weight", shard, shard_id=0)
    with pytest.raises(ValueError, match=r"weight shard 0 was loaded twice; each shard of \[8, 8\] must arrive once$"):
        method.weight_loader(layer, "weight", shard, shard_id=0)
    method.weight_loader(layer, "weight_scale", torch.rand(16, 1))
    with pytest.raises(ValueError, match=r"weight received 512 of 1024 elements"):
        method.process_weights_after_loading(layer)  # shard 1 never came


@pytest.mark.parametrize("granularity,rows,cols", [(fp8fx.PerRow(), 1, 64), (None, 64, 64)])
def test_one_element_scale_never_loaded_is_an_error(granularity, rows, cols):
    """A one-row head's [1, 1] per-channel scale, or the single block of a layer no bigger than one 128x128 block,
    left at its unloaded marker: refused, not run as a scale of -3.4e38."""
    config = (Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=granularity) if granularity is not None
              else Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]))
    layer = nn.Linear(cols, rows, bias=False, device="meta")
    method = Fp8LinearMethod(config)
    method.create_weights(layer, cols, [rows], torch.bfloat16, device="cpu")
    method.weight_loader(layer, "weight", torch.randn(rows, cols).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"1 of 1 entries of weight_scale(_inv)? were never loaded"):
        method.process_weights_after_loading(layer)


class TiedHead(nn.Module):
    """An embedding and an output projection sharing one weight (tie_word_embeddings)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)))


@pytest.mark.parametrize("strict", [False, True])
def test_tied_weight_is_left_tied(strict):
    """Quantizing one user of a tied weight would untie it (the embedding keeps bf16) and the saved model
    could not be loaded back: it is skipped with the reason, even under strict."""
    model = TiedHead().bfloat16()
    fp8fx.quantize_(model, strict=strict)
    assert model.head.weight is model.embed.weight and model.head.weight.dtype == torch.bfloat16
    assert model.proj._parameters["weight"].dtype == torch.float8_e4m3fn
    assert model.head.weight._fp8fx_skip_reason == "weight tied to embed.weight"


def test_loaders_refuse_tensors_that_only_have_the_right_size():
    """A transposed shard or scale has the slot's element count but not its layout: refused, naming both
    shapes. Scales stored as [N] / [] go into fp8fx's [N, 1] / [1]."""
    from fp8fx.weights import Fp8MoEMethod

    layer = nn.Linear(128, 64, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config())
    method.create_weights(layer, 128, [32, 32], torch.bfloat16, device="cpu")
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"shape \(128, 32\) does not fit the parameter slice of shape \(32, 128\)"):
        method.weight_loader(layer, "weight", w[:32].t().contiguous(), 0)
    block = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=(128, 128))
    layer = nn.Linear(256, 128, bias=False, device="meta")
    method = Fp8LinearMethod(block)
    method.create_weights(layer, 256, [128], torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match=r"shape \(2, 1\) does not fit the parameter slice of shape \(1, 2\)"):
        method.weight_loader(layer, "weight_scale_inv", torch.tensor([[1.0], [2.0]]))
    channel = Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=fp8fx.PerRow())
    layer = nn.Linear(64, 32, bias=False, device="meta")
    method = Fp8LinearMethod(channel)
    method.create_weights(layer, 64, [32], torch.bfloat16, device="cpu")
    method.weight_loader(layer, "weight_scale", torch.rand(32) + 0.5)  # [N] as checkpoints store it: fine
    experts = nn.Module()
    Fp8MoEMethod(block).create_weights(experts, 1, 256, 128, torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match=r"shape \(128, 256\) does not fit the slice of shape \(256, 128\)"):
        Fp8MoEMethod(block).weight_loader(experts, "w2_weight", torch.zeros(128, 256).to(torch.float8_e4m3fn), "w2", 0)


def test_linear_loader_refuses_bad_input_before_changing_anything():
    """Fp8LinearMethod.weight_loader, as vLLM's engines call it: a shard id out of range raised an IndexError after
    the receive buffer had replaced the meta weight; scales of 0, <0, NaN or Inf were taken (outputs zero, NaN or
    sign-flipped); online, a NaN weight gave a NaN scale, an fp8 tensor was read as real values, and a float32 1e5
    became inf in a float16 layer's buffer. Each is refused naming the layer (``prefix``), the value and the fix,
    and the layer keeps every tensor as it was."""
    fqn = "model.layers.0.self_attn.qkv_proj"
    where = re.escape(fqn)

    def fresh(config, dtype=torch.bfloat16):
        layer = nn.Linear(64, 32, bias=False, device="meta")
        method = Fp8LinearMethod(config)
        method.create_weights(layer, 64, [16, 16], dtype, device="cpu", prefix=fqn)
        return layer, method

    def state(layer):
        return {k: (v.device, v.dtype, None if v.is_meta else v.view(torch.uint8).clone())
                for k, v in layer._parameters.items() if v is not None}

    def same(a, b):
        return a.keys() == b.keys() and all(x[:2] == y[:2] and (x[2] is None) == (y[2] is None)
                                            and (x[2] is None or torch.equal(x[2], y[2])) for x, y in
                                            ((a[k], b[k]) for k in a))

    static = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
    for config in (Fp8Config(), static):
        layer, method = fresh(config)
        before = state(layer)
        for shard in (2, -1, "q"):
            with pytest.raises(ValueError, match=rf"^{where}\.weight: shard_id={shard!r}, but the layer's output "
                                                 r"partitions are \[16, 16\]: pass an int 0\.\.1, or None"):
                method.weight_loader(layer, "weight", torch.randn(16, 64).to(torch.float8_e4m3fn), shard)
        expected = ((KeyError, rf"{where}: no fp8fx parameter 'weight_scale_inv'; it takes \['weight'")
                    if config is static else
                    (ValueError, rf"{where}\.weight_scale_inv \(shard None\): online quantization computes"))
        with pytest.raises(expected[0], match=expected[1]):
            method.weight_loader(layer, "weight_scale_inv", torch.ones(1))
        # a shard of the wrong shape, a whole weight too large: the receive buffer replaced the meta weight first
        wq = (lambda t: t.to(torch.float8_e4m3fn)) if config is static else (lambda t: t.to(torch.bfloat16))
        with pytest.raises(ValueError, match=r"shard 0: checkpoint tensor of shape \(32, 16\) does not fit"):
            method.weight_loader(layer, "weight", wq(torch.randn(32, 16)), 0)
        with pytest.raises(ValueError, match=r"weight \(shard None\) of 4096 elements, but 0 of the weight's 2048"):
            method.weight_loader(layer, "weight", wq(torch.randn(64, 64)), None)
        assert same(before, state(layer))
    layer, method = fresh(static)
    before = state(layer)
    for name in ("weight_scale", "input_scale"):
        for value in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=rf"^{where}\.{name} \(shard 1\): 1 scales are not positive finite "
                                                 r"floats .*re-export the checkpoint"):
                method.weight_loader(layer, name, torch.tensor([value]), 1)
    assert same(before, state(layer))
    layer, method = fresh(Fp8Config())
    before = state(layer)
    nan = torch.randn(16, 64, dtype=torch.bfloat16)
    nan[3, 3] = float("nan")
    with pytest.raises(ValueError, match=rf"^{where}\.weight \(shard 0\) has 1 NaN/Inf values; .*ignored_layers"):
        method.weight_loader(layer, "weight", nan, 0)
    with pytest.raises(ValueError, match=rf"^{where}\.weight \(shard 0\): the tensor is torch.float8_e4m3fn; "
                                         r"online .*is_checkpoint_fp8_serialized=True"):
        method.weight_loader(layer, "weight", torch.randn(16, 64).to(torch.float8_e4m3fn), 0)
    assert same(before, state(layer))
    layer, method = fresh(Fp8Config(), torch.float16)
    wide = torch.randn(16, 64)
    wide[0, 0] = 1e5
    with pytest.raises(ValueError, match=rf"^{where}\.weight \(shard 1\) has 1 values that a torch.float16 copy "
                                         r"makes inf \(largest 100000\); .*wider dtype"):
        method.weight_loader(layer, "weight", wide, 1)
    assert layer._parameters["weight"].is_meta and layer._fp8fx_copied == 0


def test_serialized_linear_needs_its_fp8_weight_and_every_scale():
    channel = Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=fp8fx.PerRow())
    wq = torch.randn(32, 64).to(torch.float8_e4m3fn)

    def fresh():
        layer = nn.Linear(64, 32, bias=False, device="meta")
        method = Fp8LinearMethod(channel)
        method.create_weights(layer, 64, [32], torch.bfloat16, device="cpu")
        return layer, method

    layer, method = fresh()
    method.weight_loader(layer, "weight_scale", torch.rand(32, 1))
    with pytest.raises(ValueError, match=r"weight received 0 of 2048 elements"):
        method.process_weights_after_loading(layer)  # the weight never came
    layer, method = fresh()
    method.weight_loader(layer, "weight", wq)
    with pytest.raises(ValueError, match=r"32 of 32 entries of weight_scale were never loaded"):
        method.process_weights_after_loading(layer)
    layer, method = fresh()
    with pytest.raises(ValueError, match=r"weight of dtype torch.bfloat16 for an fp8-serialized layer"):
        method.weight_loader(layer, "weight", torch.randn(32, 64, dtype=torch.bfloat16))


def test_online_weights_without_a_device_land_where_they_come_from():
    layer = nn.Linear(64, 32, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config())
    method.create_weights(layer, 64, [16, 16], torch.bfloat16)  # no device
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    method.weight_loader(layer, "weight", w[:16], 0)
    method.weight_loader(layer, "weight", w[16:], 1)
    method.process_weights_after_loading(layer)
    assert layer._parameters["weight"].device.type == "cpu"
    assert rel_err(layer.weight.float(), w.float()) < 0.05


def test_quantize_on_a_meta_model_points_to_load_checkpoint():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"0.weight is on the meta device: .*fp8fx.load_checkpoint"):
        fp8fx.quantize_(model)
    assert model[0].weight.dtype == torch.float32 and model[0].weight.is_meta


class Aliased(nn.Module):
    """One layer registered under two names (``self.last = self.layers[-1]``): nothing is tied."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])
        self.last = self.layers[-1]

    def forward(self, x):
        return self.last(self.layers[0](x))


def test_a_module_under_two_names_is_quantized():
    model = Aliased().bfloat16()
    fp8fx.quantize_(model, strict=True)
    assert all(m._parameters["weight"].dtype == torch.float8_e4m3fn for m in model.layers)


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_prefix_names_a_model_quantized_part_by_part(caplog):
    """quantize_ per block, each with its prefix: the report names every site by its full name (without one, both
    blocks' layers were '0' and '2'); ignored_layers and input_scales take full names, a whole model's serve each
    part (the other parts' entries left to them); a bad prefix is refused."""
    torch.manual_seed(0)
    model = TwoBlocks().to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    config = Fp8Config(activation_scheme="static", ignored_layers=["blocks.1.2"])
    scales = fp8fx.calibrate(model.blocks[1], [x], config, prefix="blocks.1")
    assert set(scales) == {"blocks.1.0"}
    with pytest.raises(ValueError, match=r"prefix='blocks.1.'\): the dotted name"):
        fp8fx.quantize_(model.blocks[1], config, input_scales=scales, prefix="blocks.1.")
    with pytest.raises(ValueError, match=r"'blocks.1.3' names no module of this Sequential"):
        fp8fx.quantize_(model.blocks[1], Fp8Config(ignored_layers=["blocks.1.3", "blocks.0"]), prefix="blocks.1")
    # an entry by its name inside the part (not its full name) would quantize the layer it keeps: refused, by both
    relative = "Fp8Config.ignored_layers: '2' names 'blocks.1.2' by its name inside the part \\(prefix='blocks.1'\\)"
    with pytest.raises(ValueError, match=rf"^{relative}, and entries are full names: write 'blocks.1.2'; if it "
                                         r"names a module outside this part, pass this part a config without it"):
        fp8fx.quantize_(model.blocks[1], Fp8Config(ignored_layers=["2"]), prefix="blocks.1")
    with pytest.raises(ValueError, match=rf"^{relative}.*\(nothing was measured\)"):
        fp8fx.calibrate(model.blocks[1], [x], Fp8Config(activation_scheme="static", ignored_layers=["2"]),
                        prefix="blocks.1")
    # a prefix missing the model's root (the part is "blocks.1", given "1"), or one root too many: every entry looked
    # like another part's, and the layer it keeps was quantized without a word; warned of (a model may have both
    # "1" and "blocks.1": not refused)
    for wrong, entry in [("1", "blocks.1.2"), ("net.blocks.1", "blocks.1.2"), ("1", "blocks.1")]:
        part = copy.deepcopy(model.blocks[1])
        with caplog.at_level(logging.WARNING, logger="fp8fx"):
            fp8fx.quantize_(part, Fp8Config(ignored_layers=[entry]), prefix=wrong)
        assert re.search(rf"Fp8Config\.ignored_layers: '{entry}' names .* of a part named 'blocks\.1', and this part "
                         rf"was given prefix='{wrong}'.* pass the part's full name inside the model, "
                         r"prefix='blocks\.1'", caplog.text)
        caplog.clear()
    own_names = fp8fx.calibrate(model.blocks[1], [x], Fp8Config(activation_scheme="static", ignored_layers=["2"]))
    with pytest.raises(ValueError, match=r"missing \['blocks\.1\.0'\]: input_scales names no layer under "
                                         r"prefix='blocks\.1' \(e\.g\. '0'\); scales of this part alone take its "
                                         r"prefix too: fp8fx\.calibrate\(part, batches, prefix='blocks\.1'\)"):
        fp8fx.quantize_(model.blocks[1], config, input_scales=own_names, prefix="blocks.1")  # ({"0": ...})
    with pytest.raises(ValueError, match=r"input_scales\['blocks.1.9'\]: no linear layer"):
        fp8fx.quantize_(model.blocks[1], config, input_scales={**scales, "blocks.1.9": 1.0}, prefix="blocks.1")
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())
    fp8fx.quantize_(model.blocks[0], Fp8Config(ignored_layers=["blocks.1.2"]), prefix="blocks.0")  # the other part's
    fp8fx.quantize_(model.blocks[1], config, input_scales={**scales, "blocks.0.0": 1.0}, prefix="blocks.1")
    assert model.blocks[1][0].input_scale.item() == pytest.approx(scales["blocks.1.0"])
    assert not fp8fx.weights.is_quantized(model.blocks[1][2])
    torch._dynamo.reset()
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    sites = {s.fqn: s.rewritten for s in backend.report.sites}
    assert sites == {"blocks.0.0": True, "blocks.0.2": True, "blocks.1.0": True, "blocks.1.2": False}


def test_calibrate_measures_a_refilled_input_buffer_in_every_batch():
    """A loader that refills one tensor for each batch (buf.copy_(next); yield buf), read directly by the first
    layer: calibrate skipped a tensor that was the one it measured last (its pre-hook and its F.linear see one call
    twice), across batches too, and kept the first batch's amax (3.3 of 325). A layer called twice in one batch on
    a tensor written in place in between is measured after the write too."""
    model = _mlp()
    batches = [torch.randn(4, 128, dtype=torch.bfloat16) * s for s in (1.0, 100.0, 10.0)]
    buf = torch.empty_like(batches[0])

    def refilled():
        for b in batches:
            buf.copy_(b)
            yield buf

    scales = fp8fx.calibrate(model, refilled())
    want = max(b.float().abs().max().item() for b in batches) / 448
    assert scales["0"] == pytest.approx(want, rel=1e-6)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            self.lin(x)
            return self.lin(x.mul_(50))

    x = torch.randn(2, 16)
    want = x.abs().max().item() * 50 / 448
    assert fp8fx.calibrate(Twice(), [x.clone()])["lin"] == pytest.approx(want, rel=1e-6)
    with torch.inference_mode():  # (inference tensors keep no version: the second call was skipped, a probe found)
        assert fp8fx.calibrate(Twice(), [x.clone()])["lin"] == pytest.approx(want, rel=1e-6)


def test_calibrate_and_quantize_under_a_meta_device_block_and_a_call_that_raised():
    """A review's catches: a layer's call that raised (a path tried, then another) was measured, its input's amax
    taken as the scale (2.23 for 0.0053); quantize_ with static scales inside a torch.device("meta") block failed on
    its scale check's tensor (Tensor.item() on meta), the model on the CPU."""

    class Fallback(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            try:
                return self.proj(x.reshape(-1, 8) * 1000)  # the wrong width: proj raises
            except RuntimeError:
                return self.proj(x)

    torch.manual_seed(0)
    model = Fallback()
    x = torch.randn(4, 16)
    scales = fp8fx.calibrate(model, [x])
    assert scales == {"proj": pytest.approx(x.abs().max().item() / 448, rel=1e-6)}
    with torch.device("meta"):
        fp8fx.quantize_(model, Fp8Config(activation_scheme="static"), input_scales=scales)
    assert is_quantized(model.proj) and model.proj.input_scale.device.type == "cpu"


def test_calibrate_measures_what_each_gemm_reads():
    """Found by a probe: a linear called with its input by keyword under another name (Conv1D's forward(x), a
    subclass's forward(hidden_states)) failed with a bare KeyError: 'input'; a subclass that transforms its input
    before F.linear (a pre-norm, muP's MuReadout) got the max of its module input and its GEMM's input (a 320x larger
    scale); an fp8 layer whose weight another module reads (F.linear(x, layer.weight)) got no scale."""

    class Scaled(nn.Linear):
        def forward(self, hidden_states):
            return super().forward(hidden_states / 100)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = Scaled(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = self.a(hidden_states=x)
            return nn.functional.linear(self.b(h), self.c.weight, self.c.bias)

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(4, 16) * 10
    with torch.no_grad():
        h = model.a(x)
        want = {"a": (x / 100).abs().max().item() / 448, "b": h.abs().max().item() / 448,
                "c": model.b(h).abs().max().item() / 448}
    got = fp8fx.calibrate(model, [x])
    assert got == pytest.approx(want, rel=1e-6)
    fp8fx.quantize_(model)  # fp8 weights, dynamic activations, calibrated for static ones
    got = fp8fx.calibrate(model, [x])
    assert set(got) == {"a", "b", "c"} and got["a"] == pytest.approx(want["a"], rel=1e-6)


def test_quantize_frees_each_bf16_weight_before_the_next_layer(monkeypatch):
    """quantize_ promises each layer's bf16 weight is released before the next layer starts; the tags it kept to
    undo a failure at the first layer held every parameter to the end: the bf16 and the fp8 model at once (a peak
    RSS rise of 72 MiB for a 128 MiB bf16 model, 23 MiB with the tags dropped once a layer is done)."""
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(4)]).to(torch.bfloat16)
    weights = [weakref.ref(layer.weight) for layer in model]
    alive = []
    create = Fp8LinearMethod.create_weights

    def spying(self, layer, *args, **kwargs):
        gc.collect()  # (only references count, not a collection that did not run)
        alive.append([i for i, w in enumerate(weights) if w() is not None])
        return create(self, layer, *args, **kwargs)

    def at_the_end(*args, **kwargs):  # (quantize_'s last step, after the experts)
        gc.collect()
        alive.append([i for i, w in enumerate(weights) if w() is not None])

    monkeypatch.setattr(Fp8LinearMethod, "create_weights", spying)
    monkeypatch.setattr(fp8fx.weights.quantize, "_left_alone", at_the_end)
    fp8fx.quantize_(model)
    # (the layers not quantized yet hold theirs; the last one was held by the checks to the end)
    assert alive == [[0, 1, 2, 3], [1, 2, 3], [2, 3], [3], []]


def test_calibrate_refuses_an_ignored_layers_entry_that_names_no_module():
    """The entry was taken (quantize_ refuses it): the layer meant to stay high precision would be measured, then
    quantized statically."""
    x = torch.randn(2, 8)
    static = functools.partial(Fp8Config, activation_scheme="static")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"^Fp8Config\.ignored_layers: '9' names no module of this Sequential.*"
                                         r"\(nothing was measured\)"):
        fp8fx.calibrate(model, [(x,)], static(ignored_layers=["9"]))
    assert not model[0]._forward_pre_hooks
    assert list(fp8fx.calibrate(model, [(x,)], static(ignored_layers=["2"]))) == ["0"]


def test_calibrate_without_batches_is_an_error():
    """An empty list or a used-up generator gave {} silently, and quantize_ then asked for calibrate's scales."""
    model = nn.Sequential(nn.Linear(8, 8))
    batches = (x for x in [torch.randn(2, 8)])
    assert list(fp8fx.calibrate(model, batches)) == ["0"]
    for empty in ([], batches):
        with pytest.raises(ValueError, match=r"calibrate: batches gave no batch \(an empty list, or a generator"):
            fp8fx.calibrate(model, empty)
    assert not model[0]._forward_pre_hooks


class Conv1DLike(nn.Module):
    """transformers' Conv1D (GPT-2): a linear layer that is no nn.Linear, its weight [in, out]."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.weight


def test_nothing_to_quantize_says_why(caplog):
    """GPT-2 (Conv1D layers, lm_head tied to the embeddings) was quantized into nothing, silently, even with
    strict=True: a warning now says why, strict raises; a model whose every layer is ignored only warns."""
    model = nn.Sequential(Conv1DLike(), nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied
    with caplog.at_level("WARNING", logger="fp8fx"):
        fp8fx.quantize_(model)
    message = ("nothing in this Sequential is quantized: 1 layer (1): weight tied to 0.weight; modules of other kinds "
               "with 2-D weights, which fp8fx does not quantize: ['Conv1DLike']")
    assert message in caplog.text
    with pytest.raises(ValueError, match=r"nothing in this Sequential is quantized: .*\['Conv1DLike'\]"):
        fp8fx.quantize_(nn.Sequential(Conv1DLike()), strict=True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fp8fx"):
        fp8fx.quantize_(nn.Sequential(nn.Linear(8, 8)), Fp8Config(ignored_layers=["0"]), strict=True)
    assert "1 layer (0): in ignored_layers" in caplog.text
    caplog.clear()  # with something quantized (GPT-2 with its head untied) the Conv1D layers went by in silence
    with caplog.at_level("WARNING", logger="fp8fx"):
        fp8fx.quantize_(nn.Sequential(Conv1DLike(), Conv1DLike(), nn.Linear(8, 8)))
    assert "quantize_ left 2 modules in high precision (['0', '1']): Conv1DLike is no nn.Linear" in caplog.text


def test_more_bad_arguments_named():
    """strict='no' read as True, an input scale of True as 1.0, and a tensor passed as batches ran one batch per
    row; each is refused with its value."""
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"quantize_\(strict='no'\): True or False"):
        fp8fx.quantize_(model, strict="no")
    with pytest.raises(ValueError, match=r"input_scales\['0'\]=True must be a positive finite float"):
        fp8fx.quantize_(model, Fp8Config(activation_scheme="static"), input_scales={"0": True})
    assert model[0].weight.dtype == torch.float32
    with pytest.raises(ValueError, match=r"calibrate: batches is a tensor \[4, 8\]; pass an iterable of batches"):
        fp8fx.calibrate(model, torch.randn(4, 8))
    # one tokenizer output (a mapping): the model ran on its keys, a TypeError naming neither batches nor the fix
    with pytest.raises(ValueError, match=r"calibrate: batches is one mapping \(keys \['input_ids'\]\), a single "
                                         r"batch; pass an iterable of batches, e.g. \[batch\]"):
        fp8fx.calibrate(model, {"input_ids": torch.randn(4, 8)})


def _fp8_tensors(model):
    """The state dict's fp8 weights (as bytes) and float32 scales, which a cast of the model must leave as they are."""
    return {k: v.view(torch.uint8) if v.dtype == quant.FP8_DTYPE else v
            for k, v in model.state_dict().items() if v.dtype == quant.FP8_DTYPE or k.endswith("scale")}


@pytest.mark.parametrize("cast,dtype", [
    (lambda m: m.to(torch.bfloat16), torch.bfloat16), (lambda m: m.half(), torch.float16),
    (lambda m: m.float(), torch.float32), (lambda m: m.to("cpu", torch.float16), torch.float16),
    (lambda m: m.to(device="cpu", dtype=torch.float32), torch.float32),
])
def test_a_dtype_cast_after_quantize_keeps_fp8_weights_and_scales(cast, dtype):
    """quantize_ then .to(dtype): the cast becomes the layers' compute dtype (and casts the biases); the fp8
    weights and float32 scales stay as they are (cast, they were bf16 tensors the layers could not run)."""
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(3, 128)
    config = Fp8Config(activation_scheme="static")
    fp8fx.quantize_(model, config, input_scales=fp8fx.calibrate(model, [x.bfloat16()]))
    before, ref = _fp8_tensors(model), model(x.bfloat16())
    assert cast(model) is model
    after = _fp8_tensors(model)
    assert after.keys() == before.keys() and "0.input_scale" in after
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in after)
    assert model[0].bias.dtype == dtype and model[0]._fp8fx_dtype == dtype and model[0].weight.dtype == dtype
    out = model(x.to(dtype))
    assert out.dtype == dtype and rel_err(out, ref) < 0.02
    assert model[0]._parameters["weight"]._fp8fx_fqn == "0"  # the report's tag


def test_a_quantized_model_moves_to_meta_and_back_and_compiles_after_a_cast():
    model = _mlp()
    fp8fx.quantize_(model)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    state, ref = model.state_dict(), model(x)
    model.to("meta")
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in state.items()}
    assert model[0]._parameters["weight"].is_meta and model[0]._parameters["weight"]._fp8fx_fqn == "0"
    model.to_empty(device="cpu").load_state_dict(state)
    assert torch.equal(model(x), ref)
    model.half()
    backend = fp8fx.Fp8Backend()
    out = torch.compile(model, backend=backend)(x.half())
    assert out.dtype == torch.float16 and rel_err(out, ref) < 0.08  # activations in fp8 too
    assert len(backend.report.rewritten) == 3


@pytest.mark.cuda
def test_a_quantized_model_moves_to_the_gpu_and_compiles():
    """quantize_ on the CPU, then .cuda(): the move goes through the layers' own ``_apply``: the fp8 weights and
    float32 scales arrive as they are, and the compiled model's three GEMMs are fp8fx's."""
    torch.manual_seed(0)
    model = _mlp()
    fp8fx.quantize_(model)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    before, ref = _fp8_tensors(model), model(x)
    assert model.cuda() is model
    after = _fp8_tensors(model)
    assert after.keys() == before.keys()
    assert all(after[k].is_cuda and after[k].dtype == before[k].dtype and torch.equal(after[k].cpu(), before[k])
               for k in after)
    assert model[0]._parameters["weight"]._fp8fx_fqn == "0"  # the report's tag survives the move
    backend = fp8fx.Fp8Backend()
    out = torch.compile(model, backend=backend)(x.cuda())
    assert out.is_cuda and out.dtype == torch.bfloat16 and rel_err(out.cpu(), ref) < 0.08
    assert len(backend.report.rewritten) == 3


def test_a_float64_cast_is_the_quantized_models_exact_reference(caplog):
    """``model.double()`` of a quantized model: the fp8 weights and float32 scales stay as they are, the layers
    compute in float64 with the weights dequantized exactly (the product of code and scale in float64: 4 bits times
    24 may round in float32), and the compiled model leaves them to torch, saying why in the report. Before, the
    cast was refused after the modules ahead of the first fp8 layer had been cast (a half-cast model)."""
    model = _mlp()
    fp8fx.quantize_(model)
    before = _fp8_tensors(model)
    assert model.double() is model
    after = _fp8_tensors(model)
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in after)
    assert model[0]._fp8fx_dtype == torch.float64 and model[0].bias.dtype == torch.float64
    x = torch.randn(3, 128, dtype=torch.float64)
    want = x
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Linear):
            q, s = layer._parameters["weight"], layer._parameters["weight_scale"]
            w = q.double() * s.double()  # per-channel [N, 1]: exact in float64
            want = want @ w.t() + (layer.bias if layer.bias is not None else 0)
        else:
            want = layer(want)
    got = model(x)
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    q0, s0 = model[0]._parameters["weight"], model[0]._parameters["weight_scale"]
    assert model[0].weight.dtype == torch.float64 and torch.equal(model[0].weight, q0.double() * s0.double())
    assert not torch.equal(q0.float() * s0, q0.double() * s0.double())  # float32's products round: not exact
    backend = fp8fx.Fp8Backend()
    with caplog.at_level(logging.INFO, logger="fp8fx"):
        assert torch.allclose(torch.compile(model, backend=backend)(x), want, rtol=1e-12, atol=1e-12)
    reasons = {site.fqn: site.reason for site in backend.report.sites}
    assert not backend.report.rewritten and set(reasons) == {"0", "2", "3"}, reasons
    # (the reason said "is not bf16/fp16/fp32", a WARNING whose README row said to cast the model to bf16)
    assert all(r == "activation dtype torch.float64: the float64 reference, computed with the dequantized weight"
               for r in reasons.values()), reasons
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_float64_reference_is_not_saved(tmp_path):
    """save_checkpoint wrote a float64-cast quantized model's biases as F64, which load_checkpoint then refused: the
    error came after the files were written."""
    model = _mlp()
    fp8fx.quantize_(model)
    model.double()
    with pytest.raises(ValueError, match=r"save_checkpoint: 0.bias is torch.float64 \(2 such tensors\); a quantized "
                                         r"model cast to float64 is a reference.*cast it back \(model.to\(torch."
                                         r"bfloat16\)\), then save \(nothing was written\)"):
        fp8fx.save_checkpoint(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    model.to(torch.bfloat16)
    fp8fx.save_checkpoint(model, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists()


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.complex64])
def test_a_cast_to_a_dtype_fp8_layers_cannot_compute_in_is_refused_naming_the_layer(dtype):
    """Refused before any module is converted: torch casts module by module, and the first fp8 layer's refusal came
    after the LayerNorm before it had become float8_e5m2 (a model of two dtypes whose forward failed). A cast of one
    submodule alone is still refused at its first fp8 layer, which says what was converted. A complex dtype was
    taken: the plain parameters became complex, the fp8 layers stayed bf16, and the forward failed."""
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    before = {k: v.view(torch.uint8) if v.element_size() == 1 else v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"^1: cast to {dtype}, but fp8 layers compute in bf16/fp16/fp32 "
                                         r"\(or fp64, as a reference\); cast the model to one of these \(nothing was "
                                         r"converted\)$"):
        model.to(dtype)
    after = model.state_dict()
    assert all(v.dtype == after[k].dtype or v.element_size() == 1 for k, v in before.items())
    assert all(torch.equal(v, after[k].view(torch.uint8) if v.dtype == torch.uint8 else after[k])
               for k, v in before.items())
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert model(x).dtype == torch.bfloat16  # still runs
    with pytest.raises(ValueError, match=rf"^3: cast to {dtype}, .*a cast of a module holding it converts the "
                                         r"modules it reaches before this layer, if any"):
        model[2:].to(dtype)  # a submodule: no check of its own before torch's
    assert model[3]._fp8fx_dtype == torch.bfloat16 and model[3].bias.dtype == torch.bfloat16
    model.to(torch.float16)  # a cast they compute in goes through the check
    assert model[1]._fp8fx_dtype == torch.float16 and model[0].weight.dtype == torch.float16


def test_a_cast_of_a_submodule_an_fp8_layer_refuses_converts_nothing():
    """``model.model.half()`` (a submodule: no guard of its own) was refused at its first fp8 layer whose dequantized
    weight float16 cannot hold, after the modules before it had become float16 (norms, the fp8 layers' compute
    dtype). Every module that holds an fp8 layer checks the cast first now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64))))
    with torch.no_grad():
        model[0][2][0].weight[0, 0] = 1e6  # dequantized past float16's 65504
    model.bfloat16()
    fp8fx.quantize_(model)
    for part in (model[0], model[0][2]):
        with pytest.raises(ValueError, match=r"^0\.2\.0: cast to torch.float16, but a scale of .* beyond "
                                             r"torch.float16's range .*\(nothing was converted\)$"):
            part.half()
        assert model[0][0].weight.dtype == torch.bfloat16 and model[0][1]._fp8fx_dtype == torch.bfloat16
        assert model[0][2][0]._fp8fx_dtype == torch.bfloat16
    model[0][1].half()  # an fp8 layer of its own: its own check
    assert model[0][1]._fp8fx_dtype == torch.float16
    # the refusing layer itself converts nothing, and said that the modules before it were converted
    with pytest.raises(ValueError, match=r"torch.float16's range .*\(nothing was converted\)$"):
        model[0][2][0].half()
    assert model[0][2][0]._fp8fx_dtype == torch.bfloat16
    # a module built around the model afterwards has no guard: torch's recursion converts what comes first
    wrapper = nn.Sequential(nn.LayerNorm(64).bfloat16(), model)
    with pytest.raises(ValueError, match=r"\(nothing of this model was converted, but a cast of a module holding it "
                                         r"converts the modules it reaches before this model, if any: cast this "
                                         r"model itself"):
        wrapper.half()
    assert wrapper[0].weight.dtype == torch.float16 and model[0][2][0]._fp8fx_dtype == torch.bfloat16
    # and around the layer alone (no guard on the way): the layers before it were converted
    wrapper = nn.Sequential(nn.LayerNorm(64).bfloat16(), model[0][2][0])
    with pytest.raises(ValueError, match=r"\(this layer and the ones after it were not converted, but a cast of a "
                                         r"module holding it converts the modules it reaches before this layer, if "
                                         r"any"):
        wrapper.half()
    assert wrapper[0].weight.dtype == torch.float16 and model[0][2][0]._fp8fx_dtype == torch.bfloat16


def test_a_module_reaching_a_shared_fp8_layer_by_a_second_path_is_guarded_too():
    """``b`` holds ``shared`` after ``a`` does: named_modules() met it under ``a`` alone, so ``b`` had no guard and its
    refused cast left its first layer converted."""
    shared = nn.Linear(64, 64)
    a, b = nn.Sequential(shared), nn.Sequential(nn.Linear(64, 64), shared)
    model = nn.Sequential(a, b).bfloat16()
    fp8fx.quantize_(model, Fp8Config(ignored_layers=["1.0"]))
    with pytest.raises(ValueError, match=r"cast to torch.float8_e4m3fn, .*\(nothing was converted\)$"):
        b.to(torch.float8_e4m3fn)
    assert b[0].weight.dtype == torch.bfloat16


def test_a_cast_checks_each_fp8_layer_once_however_deep(monkeypatch):
    """Each guarded module on the way down checked its whole part again: 33 layers 32 deep were checked 593 times."""
    from fp8fx.weights import linear

    model = layer = nn.Sequential(nn.Linear(16, 16))
    for _ in range(31):
        layer.append(nn.Sequential(nn.Linear(16, 16)))
        layer = layer[-1]
    fp8fx.quantize_(model.bfloat16())
    calls = collections.Counter()
    cast_of = linear._cast_of
    monkeypatch.setattr(linear, "_cast_of", lambda m, fn: calls.update([id(m)]) or cast_of(m, fn))
    model.half()
    layers = [m for m in model.modules() if fp8fx.weights.is_quantized(m)]
    assert len(layers) == 32 and all(m._fp8fx_dtype == torch.float16 for m in layers)
    assert max(calls.values()) <= 2  # the model's check, then the layer's own (fp8_apply)


def test_a_dtype_cast_keeps_quantized_experts_fp8():
    from tests.unit.test_moe_weights import Experts, routing

    experts = Experts().bfloat16()
    fp8fx.quantize_(experts)
    before = _fp8_tensors(experts)
    x = torch.randn(6, 256)
    ids, weights = routing()
    ref = experts(x.bfloat16(), ids, weights.bfloat16())
    experts.half()
    after = _fp8_tensors(experts)
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in after)
    assert experts._fp8fx_dtype == torch.float16 and experts.gate_up_proj.dtype == torch.float16
    assert rel_err(experts(x.half(), ids, weights.half()), ref) < 0.02
    experts.double()  # the reference: the fp8 experts dequantized exactly, in float64
    assert all(torch.equal(t, before[k]) for k, t in _fp8_tensors(experts).items())
    assert experts._fp8fx_dtype == torch.float64 and experts.gate_up_proj.dtype == torch.float64
    assert rel_err(experts(x.double(), ids, weights.double()), ref) < 0.02


def test_calibrate_refuses_a_layer_whose_inputs_were_all_zero():
    """Its scale was ~2e-15: every nonzero activation saturated at inference (relative error 1), no warning."""
    model = _mlp()
    with pytest.raises(ValueError, match=r"calibrate: the inputs of \['0'\] were all zero in every batch, or below "
                                         r"1e-12 \(amax 0\), .* more or other batches, or add \['0'\] to "
                                         "ignored_layers"):
        fp8fx.calibrate(model, [torch.zeros(4, 128, dtype=torch.bfloat16)] * 2)
    assert not model[0]._forward_pre_hooks
    # tiny, not zero: the message said "all zero" and quoted a nonzero amax
    with pytest.raises(ValueError, match=r"or below 1e-12 \(amax 3e-30\)"):
        fp8fx.calibrate(model.float(), [torch.full((4, 128), 3e-30)])


def test_calibrate_of_a_model_that_is_the_layer_names_no_empty_module():
    """The model itself a linear: the advice read "add [''] to ignored_layers", which ignored_layers refuses."""
    layer = nn.Linear(128, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"calibrate: the inputs of \[''\] were all zero .* or keep the model in high "
                                         "precision: it is the layer itself, which ignored_layers does not name$"):
        fp8fx.calibrate(layer, [torch.zeros(4, 128, dtype=torch.bfloat16)])


class Branch(nn.Module):
    """``b`` runs only when asked (calibrate does not see it run), ``c`` through its weight."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(64, 64) for _ in range(3))

    def forward(self, x, use_b=False):
        x = self.a(x)
        return nn.functional.linear(self.b(x) if use_b else x, self.c.weight)


def test_a_layer_that_never_ran_during_calibration_is_named_as_such(caplog):
    """quantize_ said "pass input_scales=fp8fx.calibrate(model, batches)", which the user had done."""
    model = Branch().to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="fp8fx"):
        scales = fp8fx.calibrate(model, [torch.randn(4, 64, dtype=torch.bfloat16)])
    assert set(scales) == {"a", "c"} and "['b'] received no input during calibration" in caplog.text
    with pytest.raises(ValueError, match=r"missing \['b'\] in input_scales: fp8fx.calibrate gives none to a "
                                         r"layer that received no input during calibration .*ignored_layers"):
        fp8fx.quantize_(model, Fp8Config(activation_scheme="static"), input_scales=scales)
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())
    fp8fx.quantize_(model, Fp8Config(activation_scheme="static", ignored_layers=["b"]), input_scales=scales)


class WeightReads(nn.Module):
    """Linears read through their weights in each spelling the linear pass rewrites (``l``: the weight on the left,
    ``l.weight @ h.t()``), one called as a module, and ``g`` read untransposed (``h @ g.weight``: no linear of g).
    ``inputs`` keeps what each linear read."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e, self.f, self.g, self.l = (nn.Linear(64, 64) for _ in range(8))
        self.inputs = {}

    def forward(self, x):
        def read(name, h):
            self.inputs[name] = torch.maximum(self.inputs.get(name, h.abs().amax()), h.abs().amax()).detach()
            return h

        h = nn.functional.linear(read("a", x), self.a.weight)
        h = torch.mm(read("b", h * 2), self.b.weight.t())
        h = read("c", h * 3) @ self.c.weight.T
        h = torch.addmm(self.d.bias, read("d", h / 2), self.d.weight.mT)
        h = read("e", h * 5).matmul(self.e.weight.permute(1, 0).contiguous())
        h = self.f(read("f", h - 1))
        h = (self.l.weight @ read("l", h * 0.5).t()).t()
        return h + (h @ self.g.weight) * 1e-3 + (h @ h.t()).sum() * 1e-6  # (nor is an activation's product)


def test_calibrate_measures_linears_read_through_their_weights(caplog):
    """calibrate hooked the modules only: a layer whose parent read its weight (``torch.mm(x, layer.weight.t())``,
    which the linear pass rewrites) got no input scale, and static quantize_ then refused the model."""
    torch.manual_seed(0)
    model = WeightReads().to(torch.bfloat16)
    batches = [torch.randn(4, 64, dtype=torch.bfloat16) * s for s in (1, 3)]
    with caplog.at_level("WARNING", logger="fp8fx"):
        scales = fp8fx.calibrate(model, batches)
    assert "['g'] received no input during calibration" in caplog.text
    assert scales == {k: v.float().item() / quant.FP8_MAX for k, v in model.inputs.items()}
    measured = collections.Counter()  # f's call is seen by its pre-hook and as F.linear: measured once a batch
    real = fp8fx.weights.quantize._record
    with mock.patch.object(fp8fx.weights.quantize, "_record", lambda *a: measured.update([a[1]]) or real(*a)):
        fp8fx.calibrate(model, batches)
    assert measured == dict.fromkeys("abcdefl", len(batches))
    ref = model.double()(batches[1].double())
    model.to(torch.bfloat16)
    fp8fx.quantize_(model, Fp8Config(activation_scheme="static", ignored_layers=["g"]), input_scales=scales)
    backend = fp8fx.Fp8Backend()
    out = torch.compile(model, backend=backend)(batches[1])
    assert sorted(s.fqn for s in backend.report.rewritten) == list("abcdefl")
    assert all("static" in str(s.scheme) for s in backend.report.rewritten)
    assert rel_err(out, ref) < 0.12  # six fp8 layers in a row, weights and activations: 0.087


def test_calibrate_gives_linears_sharing_a_weight_each_its_own_input():
    """Two linears holding one weight (tied, or one module registered twice over a copy): the F.linear of a call of
    either was recorded for both, so the one fed small inputs got the other's scale (100x its own here)."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.a(x * 100) + self.b(x) + F.linear(x * 10, self.a.weight)  # (the last: a read of neither's call)

    class Outer(nn.Linear):  # a linear whose forward runs another holding its weight: the innermost call's input
        def __init__(self):
            super().__init__(16, 16)
            self.inner = nn.Linear(16, 16)
            self.inner.weight = self.weight

        def forward(self, x):
            return F.linear(x, self.weight, self.bias) + self.inner(x * 100)

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    amax = x.abs().max().item()
    scales = fp8fx.calibrate(Tied(), [x])
    assert scales == pytest.approx({"a": 100 * amax / quant.FP8_MAX, "b": 10 * amax / quant.FP8_MAX}, rel=1e-6)
    scales = fp8fx.calibrate(Outer(), [x])
    assert scales == pytest.approx({"": amax / quant.FP8_MAX, "inner": 100 * amax / quant.FP8_MAX}, rel=1e-6)


def test_calibrate_leaves_out_reads_through_a_cast_the_pass_does_not_rewrite():
    """``F.linear(x.float() * 50, layer.weight.float())`` computes in float32 on the dequantized weight (the pass does
    not rewrite it: a cast that changes the dtype); calibrate counted its input into the layer's scale, and the
    rewritten call of the layer quantized its own input with a scale 50x too coarse (its small values into fp8's
    subnormals)."""

    class SideRead(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(64, 64)

        def forward(self, x):
            return self.l(x), F.linear(x.float() * 50, self.l.weight.float()), x @ self.l.weight.bfloat16().t()

    torch.manual_seed(0)
    model = SideRead().to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    scales = fp8fx.calibrate(model, [x])
    assert scales["l"] == pytest.approx(x.abs().max().item() / quant.FP8_MAX, rel=1e-6)  # (it was 50x that)
    ref = F.linear(x.double(), model.l.weight.double(), model.l.bias.double())
    fp8fx.quantize_(model, Fp8Config(activation_scheme="static"), input_scales=scales)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)[0]
    assert len(backend.report.rewritten) == 2  # the call and the read through a cast to its own dtype
    assert rel_err(out, ref) < 0.045  # 0.035-0.037 (fp8's exponent keeps most of a 50x scale's loss: 0.033-0.034)


def test_calibrate_runs_a_module_compiled_inside_the_model_eagerly():
    """Dynamo traced calibrate's weight-read mode and hooks inside the compiled block: AttributeError."""
    model = _mlp()
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    want = fp8fx.calibrate(model, [x])
    model[2] = torch.compile(model[2])
    assert fp8fx.calibrate(model, [x]) == {"2._orig_mod" if k == "2" else k: v for k, v in want.items()}


def test_a_compiled_module_is_calibrated_and_quantized_under_its_own_names():
    """calibrate returned '_orig_mod.0', which quantize_ then refused, and ignored_layers=['3'] named nothing."""
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    scales = fp8fx.calibrate(compiled, [torch.randn(4, 128, dtype=torch.bfloat16)])
    assert set(scales) == {"0", "2", "3"}
    config = Fp8Config(activation_scheme="static", ignored_layers=["3"])
    assert fp8fx.quantize_(compiled, config, input_scales=scales) is compiled
    assert [fp8fx.weights.is_quantized(model[i]) for i in (0, 2, 3)] == [True, True, False]
    assert model[0]._parameters["weight"]._fp8fx_fqn == "0"


def test_arguments_of_the_wrong_type_are_named():
    """A quantization_config dict or the Fp8Config class as config, a list or a tensor as input_scales, None as
    calibrate's batches: each failed deep inside (an AttributeError, a TypeError, an ambiguous tensor truth value);
    each is refused naming the argument and the fix, the model unchanged."""
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calibrate = lambda m, config: fp8fx.calibrate(m, [], config)  # noqa: E731
    for where, call in (("quantize_", fp8fx.quantize_), ("calibrate", calibrate)):
        with pytest.raises(ValueError, match=rf"{where}\(config=\{{'quant_method': 'fp8'\}}\): a dict; it takes an "
                                             r"Fp8Config or None; a quantization_config dict describes a checkpoint "
                                             r"\(Fp8Config.from_config\(it\), load_checkpoint's\): to quantize"):
            call(model, config={"quant_method": "fp8"})
        with pytest.raises(ValueError, match=rf"{where}\(config=Fp8Config\): the class; pass an instance"):
            call(model, config=Fp8Config)
        # the two swapped: the message held the model's repr, cut mid-line, and never said so
        with pytest.raises(ValueError, match=rf"^{where}\(config=<a Sequential>\): a model where the config goes; the "
                                             rf"model comes first: {where}\(model, Fp8Config\(...\)\)$"):
            call(Fp8Config(), config=model)
    static = Fp8Config(activation_scheme="static")
    for scales in ([0.1, 0.2], torch.tensor([0.1, 0.2])):
        with pytest.raises(ValueError, match=rf"quantize_\(input_scales=.*\): a {type(scales).__name__}; it takes a "
                                             r"dict of layer name -> scale"):
            fp8fx.quantize_(model, static, input_scales=scales)
    with pytest.raises(ValueError, match=r"calibrate: batches is None; pass an iterable of batches"):
        fp8fx.calibrate(model, None)
    assert not any(fp8fx.weights.is_quantized(m) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_quantize_failing_at_its_first_layer_leaves_the_model_as_it_was(monkeypatch):
    """It had quantized nothing, yet marked the model half-quantized (save_checkpoint and another config refused it)
    and left its reasons' tags on the layers it keeps (the report read them for a model quantize_ had not done)."""
    from fp8fx.weights import chunked

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32)).bfloat16()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(chunked, "quantize", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError) as failure:
            fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["2"]))
    assert "the first layer it quantizes: nothing was quantized" in "".join(failure.value.__notes__)
    assert not [k for k in vars(model) if k.startswith("_fp8fx")]
    assert not [k for p in model.parameters() for k in vars(p) if k.startswith("_fp8fx")]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[32, 32]))  # another config: not a half-quantized model
    assert all(fp8fx.weights.is_quantized(m) for m in model)


def test_a_cast_of_a_half_quantized_model_is_refused_before_any_module_converts():
    """quantize_ stopped at its last layer (out of memory): ``.half()``, which the fp8 layer 1 refuses (its scale
    times 448 is beyond float16), had converted layer 0's bias and the bf16 layers first; it is refused before any
    module converts, as for a finished model (found by a bad-input probe)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        model[2].weight[0, 0] = 1e6
    quantize_stopped_at(model, 3)
    assert fp8fx.weights.is_quantized(model[2]) and not fp8fx.weights.is_quantized(model[3])
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^2: cast to torch.float16, but a scale of .* is beyond torch.float16"):
        model.half()
    after = model.state_dict()
    assert all(after[k].dtype == dtype and torch.equal(after[k], v) for k, (dtype, v) in before.items())
    model.double()  # a cast its fp8 layers take: every module converts
    assert model[3].weight.dtype == model[1].weight.dtype == model[0].bias.dtype == torch.float64


def test_quantize_failing_on_the_way_leaves_each_layer_whole_and_finishes_when_called_again(monkeypatch, tmp_path):
    """An error in a late layer's quantization (out of memory on a full GPU) left that layer half changed (a plain
    Linear with fp8fx attributes) and the model refused by the next quantize_ ("already fp8-quantized"). The layer
    is put back as it was, the error says how far it got, and the same call finishes the model: as one quantize_
    of it would have; another config is refused."""
    from fp8fx.weights import chunked

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32)).bfloat16()
    fresh = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real = chunked.quantize

    def failing_at(n):  # chunked.quantize raising at its n-th call from now
        calls = []

        def quantize(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(*args, **kwargs)
        return quantize

    monkeypatch.setattr(chunked, "quantize", failing_at(2))
    with pytest.raises(torch.OutOfMemoryError) as failure:
        fp8fx.quantize_(model)
    assert "quantize_ stopped at 1, which is as it was; 1 of 3 layers are fp8 by now: call quantize_ again" in str(
        failure.value.__notes__)
    assert type(model[1]) is nn.Linear and not [a for a in vars(model[1]) if a.startswith("_fp8fx")]
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in ("1.weight", "1.bias", "2.weight", "2.bias"))
    # the layers still bf16 carry why, which the compiled model's report gives (it had said nothing of it)
    reason = ("quantize_ stopped at 1 (OutOfMemoryError) before it quantized this layer; call quantize_ again with "
              "the same arguments to finish")
    assert [getattr(m.weight, "_fp8fx_skip_reason", None) for m in model[1:]] == [reason] * 2
    backend = fp8fx.Fp8Backend()
    torch.compile(model, backend=backend)(torch.randn(2, 64, dtype=torch.bfloat16))
    assert {s.fqn: s.reason or "rewritten" for s in backend.report.sites} == {
        "0": "rewritten", "1": "not quantized: " + reason, "2": "not quantized: " + reason}
    # another call is refused, and the message says the model is half-quantized and which argument differs
    for other, differs in ((dict(config=Fp8Config(weight_granularity=fp8fx.PerTensor())), r"config=Fp8Config\("),
                           (dict(strict=True), "strict=False, this call strict=True")):
        with pytest.raises(RuntimeError, match=r"^quantize_: the model is half-quantized by a quantize_ call that "
                                               rf"stopped on the way \(1 fp8 by now, .*: it had {differs}.*; call "
                                               r"quantize_ again with that call's arguments"):
            fp8fx.quantize_(model, **other)
    # saved now, its bf16 layers were written as kept on purpose (in the ignore list): refused, nothing written
    parent = nn.Sequential(model)
    for m in (model, parent):
        with pytest.raises(ValueError, match=r"^save_checkpoint: (the model|0) is half-quantized .* call quantize_ "
                                             r"again with the same arguments to finish it first"):
            fp8fx.save_checkpoint(m, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    # calibrated now, its fp8 layers' outputs would be measured as the bf16 model's (a resumed static quantize_
    # takes the first call's scales)
    with pytest.raises(ValueError, match=r"^calibrate: the model is half-quantized"):
        fp8fx.calibrate(model, [torch.randn(2, 64, dtype=torch.bfloat16)])
    monkeypatch.setattr(chunked, "quantize", real)
    fp8fx.quantize_(model)
    fp8fx.quantize_(fresh)
    assert all(type(a) is type(b) for a, b in zip(model, fresh))
    assert model.state_dict().keys() == fresh.state_dict().keys()
    assert all(torch.equal(v.view(torch.uint8) if v.dtype.itemsize == 1 else v, fresh.state_dict()[k].view(
        torch.uint8) if v.dtype.itemsize == 1 else fresh.state_dict()[k]) for k, v in model.state_dict().items())
    assert "_fp8fx_unfinished" not in vars(model)
    with pytest.raises(RuntimeError, match="already fp8-quantized"):  # done: not a third time
        fp8fx.quantize_(model)
    # static activations: the same input_scales again (the finished layers' were refused as unknown names), and a
    # second failure counts the layers done before it
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32)).bfloat16()
    static = Fp8Config(activation_scheme="static")
    scales = fp8fx.calibrate(model, [torch.randn(4, 64, dtype=torch.bfloat16)])
    monkeypatch.setattr(chunked, "quantize", failing_at(2))
    with pytest.raises(torch.OutOfMemoryError):
        fp8fx.quantize_(model, static, input_scales=scales)
    monkeypatch.setattr(chunked, "quantize", failing_at(1))  # the next layer fails too
    with pytest.raises(torch.OutOfMemoryError) as failure:
        fp8fx.quantize_(model, static, input_scales=scales)
    assert "stopped at 1, which is as it was; 1 of 3 layers are fp8 by now" in str(failure.value.__notes__)
    monkeypatch.setattr(chunked, "quantize", real)
    # other scales (calibrated again) would leave layer 0 with the first ones: refused, naming it and both values
    other = {n: v * 10 for n, v in scales.items()}
    with pytest.raises(ValueError, match=rf"quantize_: 0 was quantized with the input scale {scales['0']:.6g} by the "
                                         rf"call that stopped on the way, and input_scales now gives it "
                                         rf"{torch.tensor(other['0']).item():.6g}"):
        fp8fx.quantize_(model, static, input_scales=other)
    assert type(model[1]) is nn.Linear
    fp8fx.quantize_(model, static, input_scales=scales)
    assert [m.input_scale.item() for m in model] == [torch.tensor(scales[n]).item() for n in ("0", "1", "2")]


def test_a_bf16_parameter_assigned_over_the_fp8_weight_is_named_at_the_forward():
    """nn.Module.__setattr__ registers it in place of the fp8 codes; the forward failed with
    "fp8fx.dequantize: q is torch.bfloat16", which did not say that the layer was fp8 or what to do."""
    model = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    other = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
    fp8fx.quantize_(other)
    model.load_state_dict(other.state_dict())  # (the way the message gives: codes with their scales)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(model(x), other(x))
    model[0].weight = nn.Parameter(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"0: its weight parameter was replaced by a torch.bfloat16 one, where the "
                                           r"fp8 layer holds torch.float8_e4m3fn codes and their scales, and it "
                                           r"takes no high-precision weights: build the model with the new weights "
                                           r"and quantize_ it"):
        model(torch.randn(2, 64, dtype=torch.bfloat16))


def test_accelerate_offload_of_a_quantized_model_is_named_in_the_refusal():
    """accelerate's cpu_offload reads an fp8 layer's weight through its dequantized view and registers a bf16 meta
    parameter over the codes; the forward's refusal blamed the user ("build the model with the new weights"). It
    names offloading and what to do instead."""
    accelerate = pytest.importorskip("accelerate")
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16)).to(torch.bfloat16)
    fp8fx.quantize_(model)
    accelerate.cpu_offload(model, execution_device="cpu")
    with pytest.raises(RuntimeError, match=r"0: its weight parameter was replaced by a torch.bfloat16 one on the meta "
                                           r"device, .*accelerate's offload .*keep a quantized model on one device"):
        model(torch.randn(2, 64, dtype=torch.bfloat16))


class ThreeNames(nn.Module):
    """One linear registered under three names (``self.last = self.layers[-1]``): named_modules() gives it once."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(64, 64)
        self.a, self.b, self.seq, self.c = shared, shared, nn.Sequential(shared, nn.ReLU()), nn.Linear(64, 64)

    def forward(self, x):
        return self.c(self.b(torch.relu(self.a(x))) + self.seq(x))


@pytest.mark.parametrize("entry", ["a", "b", "seq.0", "seq"])
def test_ignored_layers_name_a_module_by_any_of_its_names(entry):
    """ignored_layers=["b"] / ["seq.0"] were refused as naming no module, and ["seq"] quantized seq.0 (named "a")."""
    model = ThreeNames().to(torch.bfloat16)
    config = Fp8Config(ignored_layers=[entry])
    fp8fx.quantize_(model, config)
    assert not is_quantized(model.a) and is_quantized(model.c)
    model = ThreeNames().to(torch.bfloat16)
    assert sorted(fp8fx.calibrate(model, [torch.randn(2, 64, dtype=torch.bfloat16)], config)) == ["c"]


@pytest.mark.parametrize("entry", ["a", "b", "seq.0"])
def test_input_scales_name_a_module_by_any_of_its_names(entry):
    """input_scales={"b": ...} for a linear registered as a and b was refused as naming no linear layer, where
    ignored_layers takes either name (a review's catch). Any of its names gives the layer its scale; two names with
    two scales are refused, naming both, and nothing is quantized."""
    model = ThreeNames().to(torch.bfloat16)
    fp8fx.quantize_(model, Fp8Config(activation_scheme="static"), input_scales={entry: 0.02, "c": 0.01})
    assert model.a.input_scale.item() == pytest.approx(0.02) and model.c.input_scale.item() == pytest.approx(0.01)
    model = ThreeNames().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"input_scales\['a'\]=0.02 and input_scales\['b'\]=0.03: two names of one "
                                         r"layer, two scales; keep one \(nothing was quantized\)"):
        fp8fx.quantize_(model, Fp8Config(activation_scheme="static"), input_scales={"a": 0.02, "b": 0.03, "c": 0.01})
    assert not is_quantized(model.a) and not is_quantized(model.c)
    fp8fx.quantize_(model, Fp8Config(activation_scheme="static"),
                    input_scales={"a": 0.02, "b": torch.tensor(0.02), "c": 0.01})  # (one scale twice: taken)
    assert is_quantized(model.a)


def test_an_input_scale_under_no_name_is_refused_as_given():
    """Keys under a parent's other name were renamed to the first before the check, and a typo was refused under a
    name the user never wrote (input_scales['layers.0.qq'] for 'blocks.0.qq'; a review's catch)."""
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(64, 64)])
    model.blocks = model.layers
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^input_scales\['blocks.0.qq'\]: no linear layer .* has that name"):
        fp8fx.quantize_(model, Fp8Config(activation_scheme="static"), input_scales={"blocks.0.qq": 0.01})
    fp8fx.quantize_(model, Fp8Config(activation_scheme="static"), input_scales={"blocks.0": 0.01})
    assert model.layers[0].input_scale.item() == pytest.approx(0.01)


def test_a_module_under_several_names_loads_its_own_checkpoint(tmp_path):
    """A linear registered under several names: load_checkpoint took its other names for a tied weight and refused
    the checkpoint save_checkpoint wrote ("a float8 tensor for a.weight, which is not quantized (weight tied to
    b.weight)"), and a bf16 checkpoint failed half-loaded (KeyError 'b', the biases swapped in); one holding every
    name (a state_dict) failed with a KeyError, one holding only another name (safetensors' save_model keeps the
    alphabetically first) was refused as missing z.weight (reviews' catches). Each loads, the layer quantized once
    and still one module under every name; different values under two names are refused, the model untouched."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    source = ThreeNames().to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    fp8fx.quantize_(fp8 := copy.deepcopy(source))
    fp8fx.save_checkpoint(fp8, tmp_path / "fp8")
    state = source.state_dict()
    held = {"first names": lambda k: k.startswith(("a.", "c.")), "every name": lambda k: True,
            "another name": lambda k: k.startswith(("b.", "c."))}
    for case, keep in held.items():
        folder = tmp_path / case.replace(" ", "_")
        folder.mkdir()
        safetensors_torch.save_file({k: v.clone() for k, v in state.items() if keep(k)},
                                    str(folder / "model.safetensors"))
        (folder / "config.json").write_text("{}")
    stored = safetensors_torch.load_file(str(tmp_path / "fp8" / "model.safetensors"))  # (fp8 codes under b's name)
    safetensors_torch.save_file({k.replace("a.", "b.", 1) if k.startswith("a.") else k: v for k, v in stored.items()},
                                str(tmp_path / "fp8" / "model.safetensors"))
    for folder, config in [(tmp_path / "fp8", None)] + [(tmp_path / c.replace(" ", "_"), Fp8Config()) for c in held]:
        with torch.device("meta"):
            model = ThreeNames().to(torch.bfloat16)
        fp8fx.load_checkpoint(model, folder, config=config, progress=False)
        assert model.a is model.b is model.seq[0] and is_quantized(model.a) and is_quantized(model.c), folder
        with torch.no_grad():
            assert torch.equal(model(x), fp8(x)), folder
    state["b.bias"] = state["b.bias"] + 1  # (a checkpoint of a model whose a and b are two layers)
    safetensors_torch.save_file({k: v.clone() for k, v in state.items()}, str(tmp_path / "two.safetensors"))
    (tmp_path / "every_name" / "model.safetensors").unlink()
    (tmp_path / "two.safetensors").rename(tmp_path / "every_name" / "model.safetensors")
    with torch.device("meta"):
        model = ThreeNames().to(torch.bfloat16)
    with pytest.raises(fp8fx.CheckpointError, match=r"a\.bias \(bfloat16 \[64\] in model\.safetensors as b\.bias\): "
                                                    r"the model ties b\.bias to a\.bias \(one tensor\), but the "
                                                    r"checkpoint holds different values for them \(64 of 64 differ\)"):
        fp8fx.load_checkpoint(model, tmp_path / "every_name", config=Fp8Config(), progress=False)
    assert model.a.weight.is_meta and not is_quantized(model.a)


@pytest.mark.parametrize("held", ["first names", "every name", "another name"])
def test_a_module_under_several_names_is_ignored_and_converted_by_any_of_them(tmp_path, held):
    """The loader planned a module under its first name, and ignored_layers=["b"] of its other name was read against
    that one: the layer the user kept was quantized, silently, and with a checkpoint of the first names the entry was
    refused as naming no module; convert counted the module's names as a tie and called its other name "no module
    of the model" (a review's catch). Each name is the module's, for the ignore list and for convert."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from fp8fx.checkpoint.save import convert

    torch.manual_seed(0)
    state = ThreeNames().to(torch.bfloat16).state_dict()
    keep = {"first names": ("a.", "c."), "every name": ("",), "another name": ("b.", "c.")}[held]
    src = tmp_path / "src"
    src.mkdir()
    safetensors_torch.save_file({k: v.clone() for k, v in state.items() if k.startswith(keep)},
                                str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    with torch.device("meta"):
        model = ThreeNames().to(torch.bfloat16)
    fp8fx.load_checkpoint(model, src, config=Fp8Config(ignored_layers=["b"]), progress=False)
    assert not is_quantized(model.a) and is_quantized(model.c) and model.a is model.b
    # (convert's ignore list by another name too, in either of Fp8Config's lists)
    for i, config in enumerate((Fp8Config(), Fp8Config(ignored_layers=["b"]), Fp8Config(modules_to_not_convert=["b"]))):
        convert(src, tmp_path / f"fp8_{i}", config, model=ThreeNames().to(torch.bfloat16), progress=False)
        with torch.device("meta"):
            model = ThreeNames().to(torch.bfloat16)
        fp8fx.load_checkpoint(model, tmp_path / f"fp8_{i}", progress=False)
        assert is_quantized(model.a) == (i == 0) and is_quantized(model.c) and model.a is model.b is model.seq[0]


class ExpertsTwice(nn.Module):
    """An experts module under a second name (alt); HF transformers 5 layout."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(2, 256, 128) * 0.02)
        self.experts.down_proj = nn.Parameter(torch.randn(2, 128, 128) * 0.02)
        self.alt, self.c = self.experts, nn.Linear(128, 128)


@pytest.mark.parametrize("stored", ["experts", "alt"])
def test_experts_under_two_names_are_ignored_and_converted_by_either(tmp_path, stored):
    """An experts module registered twice: load_checkpoint's experts loader read the ignore list against the first
    name only (ignored_layers=["alt"] quantized them, silently), and convert planned no experts stored under the
    other name, writing them bf16 undeclared - a checkpoint its own loader refused (a review's catch)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from fp8fx.checkpoint.save import convert
    from fp8fx.weights.moe import is_quantized_experts

    torch.manual_seed(0)
    state = ExpertsTwice().to(torch.bfloat16).state_dict()
    (src := tmp_path / "src").mkdir()
    safetensors_torch.save_file({k: v.clone() for k, v in state.items() if k.startswith((f"{stored}.", "c."))},
                                str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    for ignored in (["alt"], []):
        with torch.device("meta"):
            model = ExpertsTwice().to(torch.bfloat16)
        fp8fx.load_checkpoint(model, src, config=Fp8Config(ignored_layers=ignored), progress=False)
        assert is_quantized_experts(model.experts) != bool(ignored) and model.alt is model.experts
    convert(src, tmp_path / "fp8", Fp8Config(), model=ExpertsTwice().to(torch.bfloat16), progress=False)
    with torch.device("meta"):
        model = ExpertsTwice().to(torch.bfloat16)
    fp8fx.load_checkpoint(model, tmp_path / "fp8", progress=False)
    assert is_quantized_experts(model.experts) and is_quantized(model.c)


class HeadTwice(nn.Module):
    """The output embeddings under a second name (safetensors' save_model keeps the alphabetically first: head)."""

    def __init__(self):
        super().__init__()
        self.body, self.lm_head = nn.Linear(64, 64), nn.Linear(64, 128, bias=False)
        self.head = self.lm_head

    def forward(self, x):
        return self.lm_head(self.body(x))


def test_convert_keeps_the_output_embeddings_stored_under_another_name(tmp_path):
    """convert's plan compared a linear's name with lm_head's first name: the head stored as "head" was quantized,
    quantize_lm_head=False notwithstanding (a review's catch). It stays bf16, said so, as load_checkpoint keeps it."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from fp8fx.checkpoint.save import convert

    (src := tmp_path / "src").mkdir()
    safetensors_torch.save_model(HeadTwice().to(torch.bfloat16), str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    report = convert(src, tmp_path / "fp8", Fp8Config(), model=HeadTwice().to(torch.bfloat16), progress=False)
    assert sorted(report.quantized) == ["body"] and "output embeddings" in report.not_quantized["head"], report
    assert safetensors_torch.load_file(str(tmp_path / "fp8" / "model.safetensors"))["head.weight"].dtype == (
        torch.bfloat16)


def test_a_fused_block_layers_ragged_last_shard_takes_its_scale_row():
    """q (128 rows) and k (64: one ragged 128-row block) of a serialized 128x128 layer load shard by shard, each
    scale row in its place: a floor division put the ragged shard's row past the end."""
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]))
    layer = nn.Linear(128, 192, bias=False)
    method.create_weights(layer, 128, [128, 64], torch.bfloat16, prefix="qk")
    w = torch.randn(192, 128).to(torch.float8_e4m3fn)
    for i, rows in enumerate((slice(0, 128), slice(128, 192))):
        method.weight_loader(layer, "weight", w[rows], shard_id=i)
        method.weight_loader(layer, "weight_scale_inv", torch.full((1, 1), 0.5 + i), shard_id=i)
    method.process_weights_after_loading(layer)
    assert layer.weight_scale_inv.flatten().tolist() == [0.5, 1.5]


def test_a_model_that_rescales_its_weights_in_place_is_refused_until_it_would_not(tmp_path):
    """transformers' RWKV divides its blocks' attention.output / feed_forward.value weights in place (``weight.div_``)
    at its first eval forward (rescale_every > 0) and then halves its hidden states: on fp8 layers the division
    changed a copy, and the outputs were 0.85 off bf16, silently, every site reported rewritten (found by an HF
    architecture sweep). quantize_ and load_checkpoint refuse it, naming the fix, and change nothing; with
    rescale_every = 0 (no rescaling, no halving) the fp8 model follows the bf16 one."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.RwkvConfig(vocab_size=100, hidden_size=64, num_hidden_layers=4, attention_hidden_size=64,
                                  intermediate_size=128, context_length=32, rescale_every=1)
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "bf16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fix = r"set model.config.rescale_every = 0 first, which turns both off \(nothing was {}\)"
    with pytest.raises(ValueError, match=r"^quantize_: rwkv \(RwkvModel\) divides its blocks' attention.output and "
                                         r"feed_forward.value weights in place .*rescale_every=1.*" +
                                         fix.format("quantized")):
        fp8fx.quantize_(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not fp8fx.weights.is_quantized(model.rwkv.blocks[0].attention.output)
    with torch.device("meta"):
        meta = transformers.RwkvForCausalLM(cfg).to(torch.bfloat16).eval()
    with pytest.raises(ValueError, match=r"^load_checkpoint: rwkv .*" + fix.format("loaded")):
        fp8fx.load_checkpoint(meta, tmp_path / "bf16", Fp8Config(), progress=False)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    model.config.rescale_every = 0
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        fp8fx.quantize_(model)
        got = model(input_ids=ids).logits.float()
    assert rel_err(got, want) < 0.15


def test_a_layer_with_a_parametrized_bias_is_quantized_and_keeps_it():
    """register_parametrization(layer, "bias", ...): quantize_ froze the layer's bias with requires_grad_(False) on
    the parametrization's computed tensor, and failed with torch's "you can only change requires_grad flags of leaf
    variables", naming neither the layer nor the cause. The weight is quantized; the bias stays computed at each
    call from its original, which keeps training as the model's other high-precision parameters do."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, b):
            return 2 * b

    model = _mlp()
    parametrize.register_parametrization(model[0], "bias", Double())
    reference = copy.deepcopy(model).double()
    fp8fx.quantize_(model)
    assert is_quantized(model[0]) and parametrize.is_parametrized(model[0], "bias")
    assert model[0].parametrizations.bias.original.requires_grad
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        for m in (model, reference):  # (a bias frozen at quantize_ would miss this by 2 in every feature of layer 0)
            m[0].parametrizations.bias.original.add_(1.0)
        want = reference(x.double())
        assert rel_err(model(x), want) < 0.05  # the fp8 weights
        assert rel_err(torch.compile(model, backend=backend)(x), want) < 0.08  # and activations: measured 0.058
    fp8fx.testing.assert_rewritten(backend, "0", "2", "3")


@pytest.mark.parametrize("moe", [False, True], ids=["linear", "experts"])
def test_torch_jit_script_is_refused_naming_the_layer_and_trace_works(moe):
    """torch.jit.script of a quantized model failed in TorchScript's internals ("Module 'Fp8Linear' has no attribute
    '_parameters'", and on a second try "Can't redefine method: __weight_getter"). It is refused naming the layer and
    what works; torch.jit.trace records fp8fx.dequantize and matches the eager model."""
    from tests.unit.test_moe_weights import Experts

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU()) if not moe else nn.Sequential(Experts(h=64, i=32))
    fp8fx.quantize_(model.to(torch.bfloat16))
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"^torch.jit.script: 0 is an fp8fx layer, .* use torch.jit.trace"):
            torch.jit.script(model)
    if not moe:
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        traced = torch.jit.trace(model, (x,))
        assert "fp8fx::dequantize" in str(traced.inlined_graph) and torch.equal(traced(x), model(x))


class _OtherLibraryTensor(torch.Tensor):
    """A weight another library quantized (torchao's Float8Tensor): a wrapper subclass that says bf16 and implements
    few ops (torchao's raised NotImplementedError for aten.abs inside quantize_'s NaN check, naming no layer)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return cls(args[0].inner)
        raise NotImplementedError(f"_OtherLibraryTensor dispatch: {func}")


def test_weights_quantize_cannot_read_are_said_by_layer():
    """A weight of another library's tensor subclass, a lazy module's uninitialized weight, and a parameter made
    under torch.inference_mode: quantize_ failed inside torch or that library ("aten.abs", "Attempted to use an
    uninitialized parameter", "abs(): functions with out=... arguments don't support automatic differentiation"),
    naming no layer. The first is skipped with its reason (strict: refused, naming the layer), the second refused
    before anything changes, the last one quantizes."""
    model = _mlp()
    model[2].weight = nn.Parameter(_OtherLibraryTensor(model[2].weight.detach()), requires_grad=False)
    with pytest.raises(ValueError, match=r"^2: its weight is a tests\.unit\.test_weights\._OtherLibraryTensor, a "
                                         r"tensor subclass of another library .*quantize_ the unquantized model"):
        fp8fx.quantize_(model, strict=True)
    assert not any(is_quantized(m) for m in model.modules())
    fp8fx.quantize_(model)
    assert is_quantized(model[0]) and not is_quantized(model[2])
    assert model[2].weight._fp8fx_skip_reason.startswith("its weight is a tests.unit.test_weights._OtherLibraryTensor")

    lazy = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 16))
    with pytest.raises(ValueError, match=r"^quantize_: 0 \(LazyLinear\) is a lazy module whose weights are not "
                                         r"initialized yet; run a forward with a batch first"):
        fp8fx.quantize_(lazy)
    assert not any(is_quantized(m) for m in lazy.modules())
    lazy(torch.randn(2, 8))
    fp8fx.quantize_(lazy)
    assert is_quantized(lazy[0]) and is_quantized(lazy[2])

    with torch.inference_mode():
        made = _mlp()
    fp8fx.quantize_(made)  # (outside inference_mode)
    assert all(is_quantized(made[i]) for i in (0, 2, 3))


def test_assigned_scales_of_another_dtype_are_refused():
    """load_state_dict(assign=True) of a state dict whose float32 tensors were halved put float16 scales into the
    fp8 layers, silently (save_checkpoint then refused them, blaming a cast after quantize_); without assign their
    values are copied into the float32 scales, as before."""
    other = _mlp(seed=1)
    fp8fx.quantize_(other)
    sd = {k: (v.half() if v.dtype == torch.float32 else v) for k, v in other.state_dict().items()}
    model = fp8fx.quantize_(_mlp())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"0\.weight_scale: a torch\.float16 scale, where fp8fx's scales are "
                                           r"torch\.float32; load_state_dict\(assign=True\) puts it in as it is"):
        model.load_state_dict(sd, assign=True)
    assert all(torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v,
                           before[k].view(torch.uint8) if v.element_size() == 1 else before[k])
               for k, v in model.state_dict().items())
    model.load_state_dict(sd)
    assert model[0].weight_scale.dtype == torch.float32
    assert torch.equal(model[0].weight_scale, sd["0.weight_scale"].float())


def test_calibrate_refuses_a_batch_that_is_no_tensor():
    """A numpy batch failed inside calibrate's own hook ("'numpy.ndarray' object has no attribute 'numel'")."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match=r"^calibrate: batch 1 gave 0 a numpy\.ndarray input, not a torch\.Tensor"):
        fp8fx.calibrate(model, [x, x.numpy()])


def test_calibrate_says_a_layer_was_called_on_no_rows(caplog):
    """A layer called on inputs of no rows only was said to have received no input at all ("a branch the batches did
    not take, or a layer whose weight is read in a spelling the linear pass does not take")."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        assert fp8fx.calibrate(model, [torch.zeros(0, 16)]) == {}
    assert "['0', '2'] were called on inputs of no rows only (no token reached them" in caplog.text
    assert "received no input" not in caplog.text
    # an experts module's two scales likewise (they were said to have received no input, h137)
    from tests.unit.test_moe_weights import H, ExpertsModel

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        assert fp8fx.calibrate(ExpertsModel(), [(torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.long),
                                                 torch.zeros(0, 2))]) == {}
    assert ("['experts.gate_up_proj', 'experts.down_proj'] were called on inputs of no rows only" in caplog.text
            and "received no input" not in caplog.text), caplog.text


def _serialized_qkv(static=False):
    layer = nn.Linear(64, 96, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=fp8fx.PerTensor(),
                                       activation_scheme="static" if static else "dynamic"))
    method.create_weights(layer, 64, [32, 32, 32], torch.float32, device="cpu", prefix="qkv_proj")
    for i in range(3):
        q, s = quant.quantize(torch.randn(32, 64) * (i + 1), [-1, -1])
        method.weight_loader(layer, "weight", q, shard_id=i)
        method.weight_loader(layer, "weight_scale", s, shard_id=i)
    return layer, method


def test_serialized_loads_as_vllms_loaders_drive_them():
    """Fp8LinearMethod driven as vLLM's loaders drive it: shard ids of numpy and 0-d tensor ints are taken, a bool is
    refused (True wrote shard 1); the layer is not read before process_weights_after_loading (it ran on scales still
    loading: NaN); process_weights_after_loading checks every scale before it changes the layer (it requantized the
    weight, then found an input_scale missing, and a scale loaded after that replaced every shard's); no tensor
    loads after it (a per-shard scale replaced the merged one: 24% off)."""
    import numpy as np

    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=fp8fx.PerTensor()))
    method.create_weights(layer, 64, [32, 32, 32], torch.float32, device="cpu", prefix="qkv_proj")
    q, s = quant.quantize(torch.randn(32, 64), [-1, -1])
    method.weight_loader(layer, "weight_scale", s, shard_id=np.int64(2))
    method.weight_loader(layer, "weight_scale", s, shard_id=torch.tensor(1))
    assert layer.weight_scale[1:].tolist() == [s.item()] * 2
    with pytest.raises(ValueError, match=r"^qkv_proj\.weight_scale: shard_id=True, but the layer's output partitions "
                                         r"are \[32, 32, 32\]: pass an int 0\.\.2"):
        method.weight_loader(layer, "weight_scale", s, shard_id=True)

    layer, method = _serialized_qkv(static=True)
    with pytest.raises(RuntimeError, match=r"^qkv_proj\.weight: read before process_weights_after_loading ran"):
        layer(torch.randn(2, 64))
    method.weight_loader(layer, "input_scale", torch.tensor([0.5]), shard_id=0)
    before = {k: v.clone() for k, v in layer._parameters.items() if v is not None}
    with pytest.raises(ValueError, match=r"^qkv_proj: input_scale was never loaded for shard\(s\) \[1, 2\] \(of "
                                         r"output partitions \[32, 32, 32\]\).*\(the layer is as it was\)$"):
        method.process_weights_after_loading(layer)
    assert all(torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v,
                           before[k].view(torch.uint8) if v.element_size() == 1 else before[k])
               for k, v in layer._parameters.items() if v is not None)
    for i in (1, 2):
        method.weight_loader(layer, "input_scale", torch.tensor([0.25]), shard_id=i)
    method.process_weights_after_loading(layer)
    merged = layer.weight_scale.clone()
    with pytest.raises(ValueError, match=r"^qkv_proj\.weight_scale \(shard 0\): process_weights_after_loading "
                                         r"already ran on this layer"):
        method.weight_loader(layer, "weight_scale", torch.tensor([1.0]), shard_id=0)
    assert torch.equal(layer.weight_scale, merged) and layer(torch.randn(2, 64)).isfinite().all()


def test_an_online_layer_refuses_to_run_until_processed():
    """An online layer is the model's own nn.Linear over a receive buffer until its shards are all in: it ran on the
    shards loaded so far and uninitialized memory (outputs of 1e8, silently)."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config(weight_granularity=fp8fx.PerTensor()))
    method.create_weights(layer, 64, [32, 32, 32], torch.float32, device="cpu", prefix="qkv_proj")
    shards = [torch.randn(32, 64) for _ in range(3)]
    method.weight_loader(layer, "weight", shards[0], shard_id=0)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"^qkv_proj: called before process_weights_after_loading ran on it"):
        layer(x)
    for i in (1, 2):
        method.weight_loader(layer, "weight", shards[i], shard_id=i)
    method.process_weights_after_loading(layer)
    assert not layer._forward_pre_hooks
    assert rel_err(layer(x), x @ torch.cat(shards).t()) < 0.1


def test_a_layer_the_model_keeps_is_kept_whatever_the_block():
    """T5's wo (_keep_in_fp32_modules) with a weight block that does not divide it: its reason was the block's ("use
    per-channel scales", which keep it bf16 all the same) and strict=True refused the whole model over a layer no
    scheme quantizes (found by a probe). The model's keep is the reason, as for routers; strict quantizes the rest."""

    class Keeps(nn.Module):
        _keep_in_fp32_modules = ["wo"]

        def __init__(self):
            super().__init__()
            self.wi, self.wo = nn.Linear(64, 128), nn.Linear(128, 96)

    model = Keeps().to(torch.bfloat16)
    fp8fx.quantize_(model, Fp8Config(weight_block_size=[64, 64]), strict=True)
    assert is_quantized(model.wi) and not is_quantized(model.wo)
    why = model.wo.weight._fp8fx_skip_reason
    assert why.startswith("kept in high precision by Keeps._keep_in_fp32_modules ('wo')"), why
