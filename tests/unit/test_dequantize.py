"""``fp8fx.dequantize_`` (and a transformers model's ``dequantize()``): a quantized model back to high-precision
weights, the values the fp8 model computes with, trainable, with no fp8fx state left; all or nothing."""
import pytest
import torch
from torch import nn

import fp8fx
from fp8fx.weights import is_quantized, is_quantized_experts
from tests.unit.test_moe_weights import H, Block, routing

transformers = pytest.importorskip("transformers")


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()


def fp8fx_state(model: nn.Module) -> list[str]:
    """What fp8fx left on ``model``: its attributes on modules and tensors, its fp8 tensors."""
    left = [f"{fqn}.{k}" for fqn, m in model.named_modules() for k, v in vars(m).items()
            if k.startswith("_fp8fx_") or type(v).__module__.startswith("fp8fx")]
    left += [f"{n}.{k}" for n, t in (*model.named_parameters(), *model.named_buffers()) for k in vars(t)
             if k.startswith("_fp8fx_")]
    return left + [k for k, t in model.state_dict().items() if t.dtype.itemsize == 1 and t.is_floating_point()]


def test_a_transformers_model_dequantizes_to_the_weights_it_computed_with():
    """model.dequantize() said "You need to first quantize your model in order to dequantize it" of a model fp8fx
    quantized. It gives the model back with nn.Linear layers holding the dequantized weights (the same logits), the
    bf16 model's state_dict keys in their order, every parameter trainable, no fp8fx state; its weights take writes,
    and quantize_ takes it again."""
    model = tiny_llama()
    keys = list(model.state_dict())
    fp8fx.quantize_(model)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    down = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        want, weight = model(input_ids=ids).logits, down.weight.clone()
    assert model.dequantize() is model
    assert type(down) is nn.Linear and not any(is_quantized(m) for m in model.modules())
    assert list(model.state_dict()) == keys and fp8fx_state(model) == []
    assert type(down.weight) is nn.Parameter and torch.equal(down.weight, weight)
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    nn.init.zeros_(down.weight)  # (an fp8 layer refused it: a write into a dequantized copy)
    assert not down.weight.any()
    fp8fx.quantize_(model)
    assert is_quantized(down)


def test_experts_dequantize_and_compute_as_before():
    model = fp8fx.quantize_(Block().to(torch.bfloat16))
    x = torch.randn(6, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    ids, w = routing()
    with torch.no_grad():
        want = model.experts(x, ids, w)
    assert fp8fx.dequantize_(model) is model
    assert not is_quantized_experts(model.experts) and type(model.experts).__name__ == "Experts"
    assert [(n, p.dtype, tuple(p.shape), p.requires_grad) for n, p in model.experts.named_parameters()] == [
        ("gate_up_proj", torch.bfloat16, (4, 256, 256), True), ("down_proj", torch.bfloat16, (4, 256, 128), True)]
    with torch.no_grad():
        assert torch.equal(model.experts(x, ids, w), want)
    assert fp8fx_state(model) == []


def test_a_loaded_checkpoint_dequantizes_and_saves_as_bf16(tmp_path):
    """A model load_checkpoint filled (its config holding the checkpoint's quantization_config, KV-cache scales on
    its attentions): dequantized, its config no longer says fp8 and the scales are gone, so transformers'
    save_pretrained writes bf16 files that from_pretrained reads back to the same logits."""
    model = fp8fx.quantize_(tiny_llama(), fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    fp8fx.save_checkpoint(model, tmp_path / "fp8")
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "fp8")
    fp8fx.load_checkpoint(loaded, tmp_path / "fp8", progress=False)
    attention = loaded.model.layers[0].self_attn
    fp8fx.weights.kv_cache.attach_kv_scales(attention, {"k_scale": 0.5, "v_scale": 0.25})
    assert loaded.config.quantization_config and "model.layers.0.self_attn.k_scale" in loaded.state_dict()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
    loaded.dequantize()
    assert not hasattr(loaded.config, "quantization_config") and fp8fx_state(loaded) == []
    assert "k_scale" not in attention._buffers and not attention._load_state_dict_pre_hooks
    loaded.save_pretrained(tmp_path / "bf16")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, want)


def test_a_compiled_dequantized_model_is_not_rewritten():
    """Compiled with a new backend, the dequantized model's linears are bf16 GEMMs, each reported as not fp8."""
    model = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16))
    compiled = torch.compile(model, backend=(backend := fp8fx.Fp8Backend()))
    assert fp8fx.dequantize_(compiled) is compiled
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out = compiled(x)
    assert torch.equal(out, model(x))
    assert [s.rewritten for s in backend.report.sites] == [False, False]


def test_refusals_change_nothing(monkeypatch):
    """A model without fp8 layers, a module whose class was made from fp8fx's, and an error while the new weights are
    made (out of memory on the second layer): each refused, the model as it was."""
    bf16 = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"^dequantize_: this Sequential holds no fp8 layer .*\(nothing was done\)"):
        fp8fx.dequantize_(bf16)

    def quantized():
        model = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16))
        return model, {k: v.clone() for k, v in model.state_dict().items()}

    def unchanged(model, state):
        assert all(is_quantized(model[i]) for i in (0, 2)) and model[0]._fp8fx_prefix == "0"
        after = model.state_dict()
        return after.keys() == state.keys() and all(
            torch.equal(after[k].view(torch.uint8), v.view(torch.uint8)) if v.dtype.itemsize == 1 else
            torch.equal(after[k], v) for k, v in state.items())

    model, state = quantized()
    model[2].__class__ = type("Mine", (type(model[2]),), {})
    with pytest.raises(ValueError, match=r"^dequantize_: 2 is a Mine, a class made from fp8fx's Fp8Linear .*"
                                         r"\(nothing was done\)"):
        fp8fx.dequantize_(model)
    assert unchanged(model, state) and type(model[0]).__name__ == "Fp8Linear"

    model, state = quantized()
    real, calls = torch.ops.fp8fx.dequantize, []

    def second_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args)

    monkeypatch.setattr(torch.ops.fp8fx, "dequantize", second_fails)
    with pytest.raises(torch.OutOfMemoryError):
        fp8fx.dequantize_(model)
    monkeypatch.undo()
    assert unchanged(model, state) and not any(type(m) is nn.Linear for m in model.modules())


@pytest.mark.cuda
@pytest.mark.parametrize("config", [fp8fx.Fp8Config(), fp8fx.Fp8Config(weight_block_size=[128, 128])])
def test_dequantize_on_cuda(config):
    """On the GPU: the dequantized model computes as the fp8 model's eager path did (the same weights), and the
    compiled bf16 model agrees with it."""
    model = fp8fx.quantize_(Block().to("cuda", torch.bfloat16), config)
    x = torch.randn(6, H, device="cuda", dtype=torch.bfloat16)
    ids, w = (t.cuda() for t in routing())
    with torch.no_grad():
        want = model.proj(x), model.experts(x, ids, w)
    fp8fx.dequantize_(model)
    assert model.proj.weight.device.type == "cuda" and model.experts.down_proj.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(model.proj(x), want[0]) and torch.equal(model.experts(x, ids, w), want[1])
        compiled = torch.compile(model.proj, backend=fp8fx.Fp8Backend())(x)
    assert (compiled.float() - want[0].float()).norm() / want[0].float().norm() < 1e-2


def test_parameters_take_gradients_as_before_quantize():
    """dequantize_ made every fp8 layer's weight and bias trainable: a PEFT model's frozen base came back trainable
    (training it then trained the whole base). Each parameter takes gradients as it did before quantize_, also where
    quantize_ ran under torch.inference_mode (its bias an inference tensor, on which requires_grad_ raised halfway
    through, leaving an Fp8Linear with a bf16 weight and no scale); model.dequantize(dtype) casts, as transformers'."""
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    trainable = sorted(n for n, p in adapted.named_parameters() if p.requires_grad)
    fp8fx.quantize_(adapted)
    fp8fx.dequantize_(adapted)
    assert sorted(n for n, p in adapted.named_parameters() if p.requires_grad) == trainable and len(trainable) == 4

    with torch.inference_mode():
        model = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16))
    fp8fx.dequantize_(model)
    assert all(p.requires_grad and not p.is_inference() for p in model.parameters())
    model(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum().backward()
    assert model[0].bias.grad is not None

    llama = fp8fx.quantize_(tiny_llama())
    assert llama.dequantize(torch.float32) is llama and llama.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    with pytest.raises(TypeError, match=r"dequantize\(dtype='bf16'\): a 16- or 32-bit floating-point torch\.dtype"):
        fp8fx.quantize_(tiny_llama()).dequantize("bf16")
    # an 8-bit float is refused before any layer is dequantized (it dequantized them all, then cast the whole model,
    # norms and embeddings too, to fp8)
    llama = fp8fx.quantize_(tiny_llama())
    with pytest.raises(TypeError, match=r"dequantize\(dtype=torch\.float8_e4m3fn\).*\(nothing was changed\)"):
        llama.dequantize(torch.float8_e4m3fn)
    assert type(llama.model.layers[0].mlp.down_proj).__name__ == "Fp8Linear"
    assert llama.model.norm.weight.dtype == torch.bfloat16


def test_a_model_still_loading_is_refused():
    """A layer a vLLM method made and did not process (an online qkv with one shard of three in its receive buffer, an
    attention's KV-cache scales still -1.0 parameters, experts still loading) was dequantized around: the rest of the
    model went bf16, the loading layer lost the state its loading needs (its next shard and process_weights_after_
    loading refused it as not made by the method) but kept its refusal to run, and the KV placeholders stayed in the
    state_dict. Refused, naming the layer and the fix, nothing changed; the layer then loads on, and dequantizes."""
    from tests.unit.test_moe_weights import E, I

    model = nn.Sequential(nn.Linear(32, 48, bias=False), fp8fx.quantize_(nn.Linear(48, 16).to(torch.bfloat16)))
    method = fp8fx.Fp8LinearMethod(fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor()))
    method.create_weights(model[0], 32, [16, 16, 16], torch.bfloat16, prefix="0")
    shards = [torch.randn(16, 32, dtype=torch.bfloat16) for _ in range(3)]
    method.weight_loader(model[0], "weight", shards[0], 0)
    with pytest.raises(ValueError, match=r"^dequantize_: 0 is still loading \(Fp8LinearMethod\.create_weights made "
                                         r"its weights, its process_weights_after_loading did not run\): .*"
                                         r"\(nothing was done\)$"):
        fp8fx.dequantize_(model)
    assert is_quantized(model[1]) and "_fp8fx_partitions" in vars(model[0])
    for i in (1, 2):
        method.weight_loader(model[0], "weight", shards[i], i)
    method.process_weights_after_loading(model[0])
    fp8fx.dequantize_(model)
    assert type(model[0]) is nn.Linear and fp8fx_state(model) == []
    assert (model[0].weight.float() - torch.cat(shards).float()).norm() / torch.cat(shards).float().norm() < 0.1

    attention = nn.Module()
    attention.proj = fp8fx.quantize_(nn.Linear(16, 16).to(torch.bfloat16))
    kv = fp8fx.Fp8KVCacheMethod(fp8fx.Fp8Config())
    kv.create_weights(attention, prefix="layers.0.attn")
    with pytest.raises(ValueError, match=r"^dequantize_: the model is still loading \(Fp8KVCacheMethod\.create_weights "
                                         r"made its KV-cache scales, .*\(nothing was done\)$"):
        fp8fx.dequantize_(attention)
    assert is_quantized(attention.proj) and "_fp8fx_kv_prefix" in vars(attention)
    kv.weight_loader(attention, "k_scale", torch.tensor(0.5))
    kv.process_weights_after_loading(attention)
    fp8fx.dequantize_(attention)
    assert sorted(attention.state_dict()) == ["proj.bias", "proj.weight"] and fp8fx_state(attention) == []

    experts = nn.Module()
    fp8fx.Fp8OnlineMoEMethod(fp8fx.Fp8Config()).create_weights(experts, E, H, I, torch.bfloat16, prefix="experts")
    with pytest.raises(ValueError, match=r"^dequantize_: the model is still loading \(Fp8MoEMethod \(or "
                                         r"Fp8OnlineMoEMethod\)\.create_weights made its weights"):
        fp8fx.dequantize_(experts)
    assert is_quantized_experts(experts)
