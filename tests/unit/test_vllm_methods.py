"""vLLM's method selection and its KV-cache and online-MoE methods, for loaders of one's own:
``Fp8Config.get_quant_method``, ``Fp8KVCacheMethod``, ``Fp8OnlineMoEMethod``."""
import re
import unittest.mock

import pytest
import torch
from torch import nn

import fp8fx
from fp8fx import Fp8Config, Fp8KVCacheMethod, Fp8LinearMethod, Fp8MoEMethod, Fp8OnlineMoEMethod
from tests.unit.test_moe_weights import E, H, I, Experts

transformers = pytest.importorskip("transformers")

PREFIX = "model.layers.0.self_attn"


def tiny_moe():
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, head_dim=16)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("serialized", [True, False], ids=["fp8", "online"])
def test_get_quant_method_picks_vllms_method_per_module(serialized):
    config = Fp8Config(is_checkpoint_fp8_serialized=serialized, ignored_layers=["lm_head"])
    modules = dict(tiny_moe().named_modules())
    picked = {fqn: type(config.get_quant_method(m, fqn)).__name__ for fqn, m in modules.items()}
    assert picked["model.layers.0.self_attn.q_proj"] == picked["model.layers.0.self_attn.o_proj"] == "Fp8LinearMethod"
    assert picked["model.layers.0.mlp.experts"] == ("Fp8MoEMethod" if serialized else "Fp8OnlineMoEMethod")
    assert picked[PREFIX] == "Fp8KVCacheMethod"
    for fqn in ("lm_head", "model.embed_tokens", "model.norm", "model.layers.0", "model.layers.0.mlp"):
        assert picked[fqn] == "NoneType", fqn  # (lm_head: ignored, loaded as it is)
    ignoring = Fp8Config(ignored_layers=["model.layers.0.mlp.experts"])
    assert ignoring.get_quant_method(modules["model.layers.0.mlp.experts"], "model.layers.0.mlp.experts") is None
    assert isinstance(ignoring.get_quant_method(modules["lm_head"], "lm_head"), Fp8LinearMethod)


def created():
    attention = nn.Module()
    method = Fp8KVCacheMethod(Fp8Config())
    method.create_weights(attention, prefix=PREFIX)
    return attention, method


def test_kv_cache_scales_settle_as_vllms():
    """A k_scale alone serves v_scale (vLLM's rule; the legacy kv_scale is a k_scale), a q_scale loaded stays, a
    prob_scale not loaded stays out; the scales become float32 [] buffers the state_dict saves."""
    attention, method = created()
    assert {n: p.item() for n, p in attention.named_parameters()} == dict.fromkeys(
        ("k_scale", "v_scale", "q_scale", "prob_scale"), -1.0)
    method.weight_loader(attention, f"{PREFIX}.kv_scale", torch.tensor(0.25))
    method.weight_loader(attention, "q_scale", torch.tensor([0.5], dtype=torch.bfloat16))
    method.process_weights_after_loading(attention)
    method.process_weights_after_loading(attention)  # idempotent
    state = attention.state_dict()
    assert {k: v.item() for k, v in state.items()} == {"k_scale": 0.25, "v_scale": 0.25, "q_scale": 0.5}
    assert all(v.dtype == torch.float32 and v.shape == () for v in state.values())
    assert not list(attention.parameters())
    # a v_scale alone serves k_scale too, as load_checkpoint reads it (vLLM refuses such a layer)
    attention, method = created()
    method.weight_loader(attention, "v_scale", torch.tensor(0.125))
    method.process_weights_after_loading(attention)
    assert fp8fx.weights.kv_cache.kv_scales(attention) == {"k_scale": 0.125, "v_scale": 0.125}


def test_kv_cache_scales_running_out_of_memory_leave_the_layer_to_process_again(monkeypatch):
    """process_weights_after_loading dropped the -1.0 parameters, then made the buffers: an allocation that ran out of
    memory left the layer with neither (its scales lost, a second call a no-op). The buffers are made first."""
    from fp8fx.weights import kv_method

    attention, method = created()
    method.weight_loader(attention, "k_scale", torch.tensor(0.25))
    real, calls = fp8fx.weights.kv_cache.kv_scale_tensor, []

    def second_fails(value, device=None):
        calls.append(value)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(value, device)

    for module in (kv_method, fp8fx.weights.kv_cache):  # (the method's maker, and kv_cache's own)
        monkeypatch.setattr(module, "kv_scale_tensor", second_fails, raising=False)
    with pytest.raises(torch.OutOfMemoryError):
        method.process_weights_after_loading(attention)
    assert {n: p.item() for n, p in attention.named_parameters()} == {
        "k_scale": 0.25, "v_scale": -1.0, "q_scale": -1.0, "prob_scale": -1.0}
    assert not list(attention.buffers())
    monkeypatch.undo()
    method.process_weights_after_loading(attention)
    assert fp8fx.weights.kv_cache.kv_scales(attention) == {"k_scale": 0.25, "v_scale": 0.25}
    assert not list(attention.parameters())


def test_kv_cache_scales_a_checkpoint_does_not_hold_are_not_made_up():
    """A checkpoint without KV-cache scales (every plain fp8 or bf16 one) gave each attention k_scale = v_scale =
    1.0, which load_checkpoint does not, and save_checkpoint then wrote as calibrated scales."""
    attention, method = created()
    method.process_weights_after_loading(attention)
    assert not attention.state_dict() and not list(attention.parameters())


def test_kv_cache_scales_are_taken_by_the_checkpoints_names_for_this_layer_only():
    """A full name addressed to another layer, or to a projection's other scale, was read by its last part; a scale
    given twice (a legacy kv_scale and a k_scale) was taken by the order of the tensors."""
    attention, method = created()
    method.weight_loader(attention, f"{PREFIX}.k_proj.output_scale", torch.tensor(0.5))  # (AutoFP8's naming)
    with pytest.raises(ValueError, match=rf"{PREFIX}\.k_scale: loaded already \(from {PREFIX}\.k_proj\.output_scale\)"
                                         rf", now from {PREFIX}\.kv_scale: .*keep one"):
        method.weight_loader(attention, f"{PREFIX}.kv_scale", torch.tensor(0.25))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale addresses model\.layers\.1\."
                                         r"self_attn, not this layer"):
        method.weight_loader(attention, "model.layers.1.self_attn.v_scale", torch.tensor(0.25))
    with pytest.raises(ValueError, match=rf"{PREFIX}\.v_proj\.k_scale addresses {PREFIX}\.v_proj, not this layer"):
        method.weight_loader(attention, f"{PREFIX}.v_proj.k_scale", torch.tensor(0.25))
    with pytest.raises(ValueError, match=rf"{PREFIX}\.v_scale: got a meta tensor"):
        method.weight_loader(attention, "v_scale", torch.tensor(0.25, device="meta"))
    method.weight_loader(attention, f"{PREFIX}.attn.v_scale", torch.tensor(0.125))  # (vLLM's naming)
    method.process_weights_after_loading(attention)
    assert fp8fx.weights.kv_cache.kv_scales(attention) == {"k_scale": 0.5, "v_scale": 0.125}


@pytest.mark.parametrize("value, match", [
    (torch.tensor(float("nan")), r"k_scale=nan: a KV-cache scale must be a positive finite"),
    (torch.tensor(0.0), r"k_scale=0.0: a KV-cache scale must be a positive finite"),
    (torch.tensor(-0.5), r"k_scale=-0.5: a KV-cache scale must be a positive finite"),
    (torch.ones(2), r"k_scale: a KV-cache scale is one value, got shape \[2\]"),
    (torch.tensor(0.0123).to(torch.float8_e4m3fn), r"k_scale: dtype torch.float8_e4m3fn is not a float of 16 bits or "
                                                   r"more"),  # (taken, rounded: 4.7% off)
])
def test_bad_kv_cache_scales_are_refused_naming_them_and_change_nothing(value, match):
    attention, method = created()
    with pytest.raises(ValueError, match=rf"^{PREFIX}\.{match}"):
        method.weight_loader(attention, "k_scale", value)
    assert attention.k_scale.item() == -1.0
    # copied into the parameter past weight_loader (vLLM's default loader): refused at processing, the layer unchanged
    if value.numel() == 1 and value.dtype.itemsize > 1:  # (a copy of an fp8 one is a float32 value by then)
        attention.k_scale.data.copy_(value)
        with pytest.raises(ValueError, match=rf"^{PREFIX}\.{match}"):
            method.process_weights_after_loading(attention)
        assert set(dict(attention.named_parameters())) == {"k_scale", "v_scale", "q_scale", "prob_scale"}
        assert not attention._buffers


def test_a_full_name_into_a_layer_created_without_its_name_says_so():
    """create_weights(layer) with no prefix, then the checkpoint's full name: "addresses model.layers.0.self_attn, not
    this layer", of the very layer (its name was not known)."""
    attention, method = nn.Module(), Fp8KVCacheMethod(Fp8Config())
    method.create_weights(attention)
    with pytest.raises(ValueError, match=rf"^Module: {PREFIX}\.k_scale is a full name, and this layer's was not "
                                         rf"given: pass the scale's name \('k_scale'\), or create_weights\(layer, "
                                         rf"prefix='{PREFIX}'\) for full names$"):
        method.weight_loader(attention, f"{PREFIX}.k_scale", torch.tensor(0.5))
    method.weight_loader(attention, "k_scale", torch.tensor(0.5))
    assert attention.k_scale.item() == 0.5


def test_a_cast_while_scales_load_keeps_them_float32_or_is_refused():
    """model.to(bfloat16) between create_weights and process_weights_after_loading rounded the scales loaded after
    it (0.0123 -> 0.012329): Fp8KVCacheMethod's stay float32; an online Fp8LinearMethod layer's cast is refused,
    naming it (processed, it still computed in the dtype it was made for, its bias float32)."""
    model = nn.Sequential(nn.Module())
    attention, method = model[0], Fp8KVCacheMethod(Fp8Config())
    method.create_weights(attention, prefix=PREFIX)
    model.to(torch.bfloat16)
    method.weight_loader(attention, "k_scale", torch.tensor(0.0123))
    method.process_weights_after_loading(attention)
    assert attention.k_scale.dtype == torch.float32 and attention.k_scale.item() == torch.tensor(0.0123).item()
    layer = nn.Linear(64, 32)
    online = Fp8LinearMethod(Fp8Config(activation_scheme="static"))
    online.create_weights(layer, 64, [32], torch.float32, prefix="q_proj")
    with pytest.raises(ValueError, match=r"^q_proj: cast to torch\.bfloat16 while its weights are loading "
                                         r"\(Fp8LinearMethod\.create_weights made it to compute in torch\.float32\): "
                                         r"create the weights with params_dtype=torch\.bfloat16, or cast after "
                                         r"process_weights_after_loading \(nothing was converted\)$"):
        layer.to(torch.bfloat16)
    assert layer.bias.dtype == layer.input_scale.dtype == torch.float32


def test_kv_cache_method_refuses_what_it_cannot_create_changing_nothing():
    attention, method = created()
    with pytest.raises(ValueError, match=rf"^{PREFIX}: its KV-cache scales were created \(or loaded\) already"):
        method.create_weights(attention, prefix=PREFIX)
    with pytest.raises(ValueError, match=r"'bias' is no KV-cache scale"):
        method.weight_loader(attention, "bias", torch.tensor(1.0))
    # the model's own attribute of a name (MiMo-V2-Flash's float v_scale): left to it, as load_checkpoint leaves it
    # (create_weights refused the layer, and a loader could not load the model); a checkpoint's scale for it is refused
    own = nn.Module()
    own.v_scale = 0.5
    method.create_weights(own, prefix=PREFIX)
    assert set(dict(own.named_parameters())) == {"k_scale", "q_scale", "prob_scale"} and own.v_scale == 0.5
    with pytest.raises(ValueError, match=r"v_scale: Module already has an attribute 'v_scale' \(float\).*"
                                         r"\(the checkpoint's v_scale\)"):
        method.weight_loader(own, "v_scale", torch.tensor(0.25))
    method.weight_loader(own, "k_scale", torch.tensor(0.25))
    method.process_weights_after_loading(own)
    assert fp8fx.weights.kv_cache.kv_scales(own) == {"k_scale": 0.25} and own.v_scale == 0.5
    with pytest.raises(ValueError, match="makes meta tensors"):
        method.create_weights(nn.Module(), prefix=PREFIX, device="meta")
    with pytest.raises(ValueError, match=r"create_weights was not called on this layer"):
        method.weight_loader(nn.Module(), "k_scale", torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"Fp8KVCacheMethod\(config=None\)"):
        Fp8KVCacheMethod(None)


def test_online_moe_method_is_fp8_moe_methods_online_load():
    """Experts of a bf16 checkpoint through Fp8OnlineMoEMethod: the codes and scales quantize_ gives; a serialized
    config is refused (its experts load through Fp8MoEMethod)."""
    with pytest.raises(ValueError, match="Fp8OnlineMoEMethod quantizes bf16 experts as they load.*Fp8MoEMethod"):
        Fp8OnlineMoEMethod(Fp8Config(is_checkpoint_fp8_serialized=True))
    ref = Experts().to(torch.bfloat16)
    whole = Experts().to(torch.bfloat16)
    whole.load_state_dict(ref.state_dict())
    fp8fx.quantize_(whole, Fp8Config())
    layer = nn.Module()
    method = Fp8OnlineMoEMethod(Fp8Config())
    assert isinstance(method, Fp8MoEMethod)
    method.create_weights(layer, E, H, I, torch.bfloat16)
    method.weight_loader(layer, "gate_up_proj", ref.gate_up_proj.detach())
    method.weight_loader(layer, "down_proj", ref.down_proj.detach())
    method.process_weights_after_loading(layer)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale", "down_proj_scale"):
        assert torch.equal(layer._parameters[name].view(torch.uint8) if "scale" not in name else layer._parameters[name],
                           whole._parameters[name].view(torch.uint8) if "scale" not in name else whole._parameters[name])


def test_get_quant_method_keeps_what_quantize_keeps():
    """Picked for modules quantize_ / load_checkpoint keep in high precision: every *Attention (a vision tower's,
    Gemma3n's audio attention with a q_scale of its own: create_weights refused, the load stopped), experts named
    one by one in ignored_layers, nn.MultiheadAttention's out_proj; with model=, a router (Qwen2-MoE's
    shared_expert_gate) and an lm_head tied to the embeddings (its checkpoint holds no lm_head.weight)."""
    online = Fp8Config()

    class VisionAttention(nn.Module):  # (no layer_idx: no KV cache)
        pass

    vision = VisionAttention()
    assert online.get_quant_method(vision, "vision.layers.0.attn") is None
    vision.layer_idx = 0
    assert isinstance(online.get_quant_method(vision, "model.layers.0.self_attn"), Fp8KVCacheMethod)
    assert online.get_quant_method(nn.MultiheadAttention(64, 4).out_proj, "attn.out_proj") is None
    experts = dict(tiny_moe().named_modules())["model.layers.0.mlp.experts"]
    by_expert = Fp8Config(is_checkpoint_fp8_serialized=True, ignored_layers=["model.layers.0.mlp.experts.0.gate_proj"])
    assert by_expert.get_quant_method(experts, "model.layers.0.mlp.experts") is None
    assert isinstance(by_expert.get_quant_method(experts, "model.layers.1.mlp.experts"), Fp8MoEMethod)

    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    qwen2 = transformers.AutoModelForCausalLM.from_config(cfg)
    gate = "model.layers.0.mlp.shared_expert_gate"
    # (without the model nothing tells a router: a linear layer)
    assert isinstance(online.get_quant_method(qwen2.get_submodule(gate), gate), Fp8LinearMethod)
    assert online.get_quant_method(qwen2.get_submodule(gate), gate, model=qwen2) is None
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True))
    assert online.get_quant_method(llama.lm_head, "lm_head", model=llama) is None
    q_proj = "model.layers.0.self_attn.q_proj"
    assert isinstance(online.get_quant_method(llama.get_submodule(q_proj), q_proj, model=llama), Fp8LinearMethod)
    # an fp8 checkpoint's lm_head is stored in high precision (vLLM and transformers load it so)
    assert Fp8Config(is_checkpoint_fp8_serialized=True).get_quant_method(llama.lm_head, "lm_head") is None
    # and, with the model, a layer the model keeps out of quantization (T5's wo: _keep_in_fp32_modules), as
    # load_checkpoint keeps it where the checkpoint stores it so (DeepSeek-V3.2's indexer.weights_proj): it was given
    # Fp8LinearMethod, its bf16 weight then refused
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=4))
    wo, wi = "encoder.block.0.layer.1.DenseReluDense.wo", "encoder.block.0.layer.1.DenseReluDense.wi"
    fp8 = Fp8Config(is_checkpoint_fp8_serialized=True)
    assert fp8.get_quant_method(t5.get_submodule(wo), wo, model=t5) is None
    assert isinstance(fp8.get_quant_method(t5.get_submodule(wi), wi, model=t5), Fp8LinearMethod)


def test_a_conv1d_weight_as_gpt2_stores_it_is_refused_saying_to_transpose_it():
    """GPT-2's checkpoints hold a Conv1D's weight [in, out]; the codes are [out, in]: "load the checkpoint's tensor for
    this layer and shard" was what had been passed."""
    conv = transformers.pytorch_utils.Conv1D(192, 64)
    method = Fp8Config().get_quant_method(conv, "transformer.h.0.attn.c_attn")
    method.create_weights(conv, 64, [192], torch.bfloat16, device="cpu", prefix="transformer.h.0.attn.c_attn")
    with pytest.raises(ValueError, match=r"shape \(64, 192\) does not fit .*\(192, 64\).*stored \[in, out\]: pass "
                                         r"it transposed"):
        method.weight_loader(conv, "weight", torch.randn(64, 192))
    method.weight_loader(conv, "weight", torch.randn(64, 192).t())


def test_get_quant_method_with_the_model_reads_it_once_and_as_the_loaders_do():
    """With model=: each call built quantize_'s rules of the whole model again (quadratic in its size); an fp8
    checkpoint's router (Qwen2-MoE's shared_expert_gate, stored bf16) was given Fp8LinearMethod."""
    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    fp8 = Fp8Config(is_checkpoint_fp8_serialized=True)
    built = []
    real = fp8fx.weights.quantize.LinearDecider

    class Counting(real):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    with unittest.mock.patch.object(fp8fx.weights.quantize, "LinearDecider", Counting):
        picked = {fqn: type(fp8.get_quant_method(m, fqn, model=model)).__name__ for fqn, m in model.named_modules()}
    assert len(built) == 1
    assert picked["model.layers.1.mlp.shared_expert_gate"] == "NoneType" and picked["lm_head"] == "NoneType"
    assert picked["model.layers.1.mlp.shared_expert.down_proj"] == "Fp8LinearMethod"
    assert picked["model.layers.1.self_attn"] == "Fp8KVCacheMethod"


def test_get_quant_method_reads_the_model_again_where_its_parameters_were_replaced():
    """Read once, the model's tied-weight rule (by the parameters' ids) went stale after to_empty / tie_weights: the
    tied lm_head was given Fp8LinearMethod, and parameters at freed ids made unrelated layers "tied"."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    online = Fp8Config()
    planned = {fqn: type(online.get_quant_method(m, fqn, model=model)).__name__ for fqn, m in model.named_modules()}
    model.to_empty(device="cpu")
    model.tie_weights()
    again = {fqn: type(online.get_quant_method(m, fqn, model=model)).__name__ for fqn, m in model.named_modules()}
    assert again == planned and again["lm_head"] == "NoneType"
    assert again["model.layers.0.mlp.up_proj"] == "Fp8LinearMethod"


def _state(module: nn.Module) -> dict:
    """Each tensor's dtype, shape and bytes (None on meta): uninitialized buffers may hold NaN, which torch.equal
    finds unequal to itself."""
    return {k: (v.dtype, tuple(v.shape), None if v.is_meta else v.detach().contiguous().view(torch.uint8).clone())
            for k, v in module.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k][:2] == b[k][:2] and (a[k][2] is None) == (b[k][2] is None) and (
        a[k][2] is None or torch.equal(a[k][2], b[k][2])) for k in a)


@pytest.mark.parametrize("granularity", [fp8fx.PerTensor(), fp8fx.PerRow(), fp8fx.PerBlock(32, 64)],
                         ids=["tensor", "row", "block"])
def test_a_shards_scale_loaded_twice_is_refused_changing_nothing(granularity):
    """A weight shard loaded twice was refused, its scale loaded twice replaced the first silently (q's rows then
    dequantized 5x too large); so did a whole scale after a shard's, or a shard's after the whole."""
    block = isinstance(granularity, fp8fx.PerBlock)  # (block scales take dynamic activations only)
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=granularity,
                                       activation_scheme="dynamic" if block else "static"))
    layer = nn.Linear(64, 128, bias=False, device="meta")
    method.create_weights(layer, 64, [64, 32, 32], torch.bfloat16, device="cpu", prefix=f"{PREFIX}.qkv_proj")
    name = "weight_scale_inv" if block else "weight_scale"
    shapes = {fp8fx.PerTensor: [(1,), (1,)], fp8fx.PerRow: [(64, 1), (32, 1)], fp8fx.PerBlock: [(2, 1), (1, 1)]}
    shape, shape1 = shapes[type(granularity)]
    method.weight_loader(layer, name, torch.full(shape, 0.1), 0)
    repeats = [(name, torch.full(shape, 0.5), 0), (name, torch.full(layer._parameters[name].shape, 0.5), None)]
    if not block:
        method.weight_loader(layer, "input_scale", torch.tensor([0.2]), 0)
        repeats.append(("input_scale", torch.tensor([0.5]), 0))
    before = _state(layer)
    for what, scale, shard in repeats:
        with pytest.raises(ValueError, match=rf"^{PREFIX}.qkv_proj.{what} \(shard {shard}\) was loaded before "
                                             r"\(shards \[0\].*each shard's scale must arrive once"):
            method.weight_loader(layer, what, scale, shard)
        assert _same(_state(layer), before)
    method.weight_loader(layer, name, torch.full(shape1, 0.1), 1)  # the other shards still load
    if block:
        return
    # a whole scale first: no shard's after it
    layer = nn.Linear(64, 128, bias=False, device="meta")
    method.create_weights(layer, 64, [64, 32, 32], torch.bfloat16, device="cpu", prefix=f"{PREFIX}.qkv_proj")
    method.weight_loader(layer, "input_scale", torch.tensor(0.2))  # (Phi-3's one scale of a fused qkv_proj)
    with pytest.raises(ValueError, match=r"input_scale \(shard 2\) was loaded before \(shards \['all'\]"):
        method.weight_loader(layer, "input_scale", torch.tensor([0.5]), 2)


def test_an_expert_scale_loaded_twice_is_refused_and_w1_w3_input_scales_keep_their_max():
    method = Fp8MoEMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=fp8fx.PerTensor(),
                                    activation_scheme="static"))
    layer = nn.Module()
    method.create_weights(layer, E, H, I, torch.bfloat16, prefix="experts")
    method.weight_loader(layer, "gate_up_proj_scale", torch.tensor([0.1]), "w1", 0)
    method.weight_loader(layer, "gate_up_proj_scale", torch.tensor([0.3]), "w3", 0)  # the other shard: its own
    method.weight_loader(layer, "down_proj_scale", torch.full((E,), 0.2))
    before = _state(layer)
    for args in [(torch.tensor([0.5]), "w1", 0), (torch.full((E, 2), 0.5), None, None)]:
        with pytest.raises(ValueError, match=r"^experts.gate_up_proj_scale \(expert .*overlaps what was loaded before "
                                             r"\(expert 0, shard w[13].*must arrive once"):
            method.weight_loader(layer, "gate_up_proj_scale", *args)
        assert _same(_state(layer), before)
    with pytest.raises(ValueError, match=r"^experts.down_proj_scale \(expert 2, shard w2\) overlaps"):
        method.weight_loader(layer, "down_proj_scale", torch.tensor([0.5]), "w2", 2)
    assert _same(_state(layer), before)
    method.weight_loader(layer, "gate_up_proj_scale", torch.tensor([0.1]), "w1", 1)  # another expert: its own
    for shard, value in (("w1", 0.4), ("w3", 0.2)):  # w1's and w3's input scales of one expert: their max (vLLM's)
        method.weight_loader(layer, "gate_up_proj_input_scale", torch.tensor(value), shard, 0)
    method.weight_loader(layer, "down_proj_input_scale", torch.tensor(0.3), "w2", 0)
    before = _state(layer)
    for name, shard, value in (("gate_up_proj_input_scale", "w1", 0.5), ("down_proj_input_scale", "w2", 0.5)):
        with pytest.raises(ValueError, match=rf"^experts.{name} \(expert 0, shard {shard}\) overlaps what was loaded "
                                             rf"before \(expert 0, shard {shard if shard != 'w2' else None}"):
            method.weight_loader(layer, name, torch.tensor(value), shard, 0)  # (kept in the max, or lost in it)
    assert _same(_state(layer), before)
    assert layer.gate_up_proj_input_scale.flatten()[0].item() == pytest.approx(0.4)
    assert layer.down_proj_input_scale.flatten()[0].item() == pytest.approx(0.3)


@pytest.mark.parametrize("experts", [False, True], ids=["linear", "experts"])
def test_a_bias_float16_cannot_hold_is_refused_naming_it(experts):
    """A finite bias past float16's 65504, loaded into a float16 layer, was stored as inf (outputs inf / NaN), where
    load_checkpoint and the online weights refuse such values."""
    big = torch.full((64,), 7e4)
    if experts:
        layer = nn.Module()
        layer.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I, device="meta"))
        Fp8MoEMethod(Fp8Config(is_checkpoint_fp8_serialized=True)).create_weights(layer, E, H, I, torch.float16,
                                                                                  device="cpu", prefix="experts")
        load = lambda: Fp8MoEMethod(Fp8Config(is_checkpoint_fp8_serialized=True)).weight_loader(  # noqa: E731
            layer, "gate_up_proj_bias", torch.full((2 * I,), 7e4), expert_id=1)
        where = r"experts.gate_up_proj_bias \(expert 1\)"
    else:
        layer = nn.Linear(64, 64, device="meta")
        method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True))
        method.create_weights(layer, 64, [64], torch.float16, device="cpu", prefix="proj")
        load = lambda: method.weight_loader(layer, "bias", big)  # noqa: E731
        where = r"proj.bias \(shard None\)"
    with pytest.raises(ValueError, match=rf"^{where} has \d+ values that the layer's torch.float16 makes inf \(largest "
                                         r"70000\): create the layer with params_dtype=torch.bfloat16"):
        load()
    bias = layer._parameters["gate_up_proj_bias" if experts else "bias"]
    assert bias.is_meta  # nothing loaded


@pytest.mark.parametrize("serialized", [True, False], ids=["fp8", "online"])
def test_a_tensor_on_meta_is_refused_naming_it(serialized):
    """A loader that passes a tensor still on meta (its module built on meta, never read) failed in torch's
    "Tensor.item() cannot be called on meta tensors", naming no layer or tensor."""
    dtype = torch.float8_e4m3fn if serialized else torch.bfloat16
    layer = nn.Linear(64, 64, device="meta")
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=serialized))
    method.create_weights(layer, 64, [64], torch.bfloat16, device="cpu", prefix="proj")
    experts = nn.Module()
    moe_method = Fp8MoEMethod(Fp8Config(is_checkpoint_fp8_serialized=serialized))
    moe_method.create_weights(experts, E, H, I, torch.bfloat16, device="cpu", prefix="experts")
    loads = [("proj.weight (shard None)", lambda: method.weight_loader(layer, "weight", torch.empty(64, 64, dtype=dtype,
                                                                                                   device="meta"))),
             ("proj.bias (shard None)", lambda: method.weight_loader(layer, "bias", torch.empty(64, device="meta"))),
             ("experts.gate_up_proj (expert 0, shard None)", lambda: moe_method.weight_loader(
                 experts, "gate_up_proj", torch.empty(2 * I, H, dtype=dtype, device="meta"), expert_id=0))]
    if serialized:
        loads.append(("proj.weight_scale (shard None)", lambda: method.weight_loader(
            layer, "weight_scale", torch.empty(1, device="meta"))))
    before = _state(layer), _state(experts)
    for where, load in loads:
        with pytest.raises(ValueError, match=rf"^{re.escape(where)}: the tensor is on the meta device and holds no "
                                             r"values; pass the checkpoint's tensor"):
            load()
    assert _same(_state(layer), before[0]) and _same(_state(experts), before[1])


def test_get_quant_method_reads_a_fused_layer_by_its_checkpoint_shards():
    """vLLM's and ModelOpt's fp8 checkpoints list a fused layer's shards (q_proj, k_proj, v_proj) in their ignore
    list; qkv_proj was given Fp8LinearMethod, which then refused the checkpoint's bf16 q/k/v weights blaming their
    dtype (load_checkpoint read the list right). vLLM's is_layer_skipped reads the shards of the model's
    packed_modules_mapping, and refuses a list naming some of them only. A model= without one is taken as its
    checkpoint stores it (h128: Phi-3's qkv_proj, stored fused, was refused under transformers' suffix entry
    modules_to_not_convert=["q_proj"], which load_checkpoint and quantize_ read as naming none of its modules); the
    shards are read by both lists, as load_checkpoint reads them (h130: modules_to_not_convert was not)."""
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj, self.wqkv = nn.Linear(32, 96, bias=False), nn.Linear(32, 96, bias=False)

    model = nn.Module()
    model.attn = Attn()
    qkv, other = model.attn.qkv_proj, model.attn.wqkv
    for serialized in (True, False):
        every = Fp8Config(is_checkpoint_fp8_serialized=serialized, ignored_layers=[f"attn.{p}_proj" for p in "qkv"])
        assert every.get_quant_method(qkv, "attn.qkv_proj") is None
        # (a model with no packed_modules_mapping is taken as its checkpoint stores it: Phi-3's qkv_proj, fused)
        assert isinstance(every.get_quant_method(qkv, "attn.qkv_proj", model=model), Fp8LinearMethod)
        model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        assert every.get_quant_method(qkv, "attn.qkv_proj", model=model) is None
        assert isinstance(every.get_quant_method(other, "attn.wqkv"), Fp8LinearMethod)
        suffix = Fp8Config(is_checkpoint_fp8_serialized=serialized, modules_to_not_convert=["q_proj"])
        with pytest.raises(ValueError, match=r"covers \['attn.q_proj'\] but not .* \(with no model=, its checkpoint is "
                                             r"taken to store them apart: pass model= for a model whose checkpoint"):
            suffix.get_quant_method(qkv, "attn.qkv_proj")
        phi3 = nn.Module()  # (a model with no packed_modules_mapping: its qkv_proj is stored fused)
        phi3.attn = model.attn
        assert isinstance(suffix.get_quant_method(qkv, "attn.qkv_proj", model=phi3), Fp8LinearMethod)
        for kept in ([f"attn.{p}_proj" for p in "qkv"], [r"attn\.[qkv]_proj"]):  # (by modules_to_not_convert too)
            listed = Fp8Config(is_checkpoint_fp8_serialized=serialized, modules_to_not_convert=kept)
            assert listed.get_quant_method(qkv, "attn.qkv_proj", model=model) is None
        some = Fp8Config(is_checkpoint_fp8_serialized=serialized, ignored_layers=["attn.q_proj", "attn.v_proj"])
        with pytest.raises(ValueError, match=r"covers \['attn.q_proj', 'attn.v_proj'\] but not \['attn.k_proj'\], "
                                             r"shards of the fused layer 'attn.qkv_proj'"):
            some.get_quant_method(qkv, "attn.qkv_proj")
        # the fused name itself, as before; the model's own mapping (vLLM's models carry one) for other names
        fused = Fp8Config(is_checkpoint_fp8_serialized=serialized, ignored_layers=["attn.qkv_proj"])
        assert fused.get_quant_method(qkv, "attn.qkv_proj") is None
        assert fused.get_quant_method(qkv, "attn.qkv_proj", model=model) is None
        model.packed_modules_mapping = {"wqkv": ["wq", "wk", "wv"]}
        mapped = Fp8Config(is_checkpoint_fp8_serialized=serialized, ignored_layers=["attn.wq", "attn.wk", "attn.wv"])
        assert mapped.get_quant_method(other, "attn.wqkv", model=model) is None
        assert isinstance(mapped.get_quant_method(other, "attn.wqkv"), Fp8LinearMethod)  # (no model: FUSED's)
        del model.packed_modules_mapping
    gate_up = nn.Linear(32, 128, bias=False)
    both = Fp8Config(ignored_layers=["mlp.gate_proj", "mlp.up_proj"])
    assert both.get_quant_method(gate_up, "mlp.gate_up_proj") is None
    assert isinstance(Fp8Config(ignored_layers=["mlp.down_proj"]).get_quant_method(gate_up, "mlp.gate_up_proj"),
                      Fp8LinearMethod)


def test_a_bias_loaded_in_part_is_refused_wherever_it_was_built_and_its_shard_id_checked():
    """A layer built on its device (vLLM builds them so) whose bias came through weight_loader for some shards only
    was processed, the others keeping nn.Linear's random values (on meta it was refused); the bias's shard_id was
    not checked: 'q' and 3 failed inside torch, -1 wrote shard 2's rows recorded as -1, True wrote shard 1."""
    def built(device):
        layer = nn.Linear(64, 64, device=device)
        method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True))
        method.create_weights(layer, 64, [32, 16, 16], torch.bfloat16, device="cpu", prefix="qkv_proj")
        for i, n in enumerate((32, 16, 16)):
            method.weight_loader(layer, "weight", torch.ones(n, 64).to(torch.float8_e4m3fn), i)
            method.weight_loader(layer, "weight_scale", torch.tensor(0.5), i)
        return layer, method

    for device in ("cpu", "meta"):
        layer, method = built(device)
        method.weight_loader(layer, "bias", torch.zeros(32), 0)
        method.weight_loader(layer, "bias", torch.zeros(16), 1)
        before = _state(layer)
        with pytest.raises(ValueError, match=r"^qkv_proj: bias shard\(s\) \[2\] of output partitions \[32, 16, 16\] "
                                             r"never loaded \((shard\(s\) \[0, 1\] came through weight_loader|the "
                                             r"layer was built with its bias on the meta device)"):
            method.process_weights_after_loading(layer)
        assert _same(_state(layer), before) and not layer._fp8fx_processed
        method.weight_loader(layer, "bias", torch.full((16,), 3.0), 2)
        method.process_weights_after_loading(layer)
        assert torch.equal(layer.bias, torch.cat([torch.zeros(48), torch.full((16,), 3.0)]).bfloat16())
    layer, method = built("cpu")  # a bias shard again, or the whole after shards: refused (the last copy had
    method.weight_loader(layer, "bias", torch.zeros(32), 0)  # replaced the first, silently: h145)
    before = _state(layer)
    for again, shard_id in ((torch.ones(32), 0), (torch.ones(64), None)):
        with pytest.raises(ValueError, match=rf"^qkv_proj.bias \(shard {shard_id}\) was loaded before \(shards \[0\]"):
            method.weight_loader(layer, "bias", again, shard_id)
        assert _same(_state(layer), before)
    layer, method = built("cpu")  # a bias copied in whole, as vLLM's default loader does: the caller's, as before
    method.process_weights_after_loading(layer)
    layer, method = built("cpu")
    before = _state(layer)
    for shard_id in ("q", 3, -1, True):
        with pytest.raises(ValueError, match=rf"^qkv_proj.bias: shard_id={re.escape(repr(shard_id))}, but the layer's "
                                             r"output partitions are \[32, 16, 16\]: pass an int 0..2"):
            method.weight_loader(layer, "bias", torch.zeros(16), shard_id)
    assert _same(_state(layer), before) and layer._fp8fx_bias_loaded == set()


def test_experts_bias_loaded_for_some_experts_is_refused_wherever_it_was_built():
    """The experts' side: a bias built on the device, loaded through weight_loader for one expert, was processed with
    the other experts' initial values."""
    layer = nn.Module()
    layer.gate_up_proj_bias = nn.Parameter(torch.full((E, 2 * I), 7.0))
    method = Fp8MoEMethod(Fp8Config(is_checkpoint_fp8_serialized=True))
    method.create_weights(layer, E, H, I, torch.bfloat16, prefix="experts")
    method.weight_loader(layer, "gate_up_proj", torch.ones(E, 2 * I, H).to(torch.float8_e4m3fn))
    method.weight_loader(layer, "gate_up_proj_scale", torch.ones(E))
    method.weight_loader(layer, "down_proj", torch.ones(E, H, I).to(torch.float8_e4m3fn))
    method.weight_loader(layer, "down_proj_scale", torch.ones(E))
    method.weight_loader(layer, "gate_up_proj_bias", torch.zeros(2 * I), expert_id=1)
    with pytest.raises(ValueError, match=r"^experts.gate_up_proj_bias: experts \[0, 2, 3\] never loaded \(experts "
                                         r"\[1\] came through weight_loader"):
        method.process_weights_after_loading(layer)
    assert not layer._fp8fx_processed
    before = _state(layer)
    for again in ((torch.zeros(E, 2 * I), None), (torch.ones(2 * I), 1)):  # the whole, or expert 1 again: refused as
        # a weight's or a scale's repeat is (the last copy replaced the first, silently: h145)
        with pytest.raises(ValueError, match=r"^experts.gate_up_proj_bias \(expert (None|1)\) was loaded before "
                                             r"\(experts \[1\].*each expert's bias must arrive once"):
            method.weight_loader(layer, "gate_up_proj_bias", again[0], expert_id=again[1])
        assert _same(_state(layer), before)
    for e in (0, 2, 3):
        method.weight_loader(layer, "gate_up_proj_bias", torch.zeros(2 * I), expert_id=e)
    method.process_weights_after_loading(layer)
    assert not layer.gate_up_proj_bias.any()


@pytest.mark.parametrize("experts", [False, True])
def test_a_scale_copied_into_its_parameter_is_checked_at_processing(experts):
    """weight_loader refuses a scale of 0, <0, NaN or Inf; one copied into the parameter itself (vLLM's default
    loader's plain copy) was processed, every output NaN or zero."""
    config = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
    if experts:
        layer, method = nn.Module(), Fp8MoEMethod(config)
        method.create_weights(layer, E, H, I, torch.bfloat16, prefix="experts")
        method.weight_loader(layer, "gate_up_proj", torch.ones(E, 2 * I, H).to(torch.float8_e4m3fn))
        method.weight_loader(layer, "down_proj", torch.ones(E, H, I).to(torch.float8_e4m3fn))
        method.weight_loader(layer, "gate_up_proj_scale", torch.ones(E))
        layer.down_proj_scale.data.copy_(torch.tensor([1.0, float("nan"), 1.0, 1.0]))
        for name in ("gate_up_proj_input_scale", "down_proj_input_scale"):
            getattr(layer, name).data.fill_(1.0)
        bad = r"^experts.down_proj_scale \(copied into the parameter, not through weight_loader\): 1 scales are not "
    else:
        layer, method = nn.Linear(64, 32, bias=False, device="meta"), Fp8LinearMethod(config)
        method.create_weights(layer, 64, [32], torch.bfloat16, device="cpu", prefix="o_proj")
        method.weight_loader(layer, "weight", torch.ones(32, 64).to(torch.float8_e4m3fn))
        layer.weight_scale.data.copy_(torch.tensor([0.5]))
        layer.input_scale.data.copy_(torch.tensor([0.0]))
        bad = r"^o_proj.input_scale: 1 scales are not positive finite floats \(0.0 at \[0\]\).* \(copied into the "
    before = _state(layer)
    with pytest.raises(ValueError, match=bad):
        method.process_weights_after_loading(layer)
    assert _same(_state(layer), before) and not layer._fp8fx_processed


def test_online_whole_weight_after_its_shards_is_refused():
    """Online per-channel and block layers quantize shards aside (the weight's receive buffer stays on meta): a whole
    bf16 weight after two shards was adopted, replacing them, with no error (per-tensor and serialized layers
    refused it: "the whole weight, or each of its shards, must arrive once"; h145)."""
    for granularity in (fp8fx.PerRow(), fp8fx.PerBlock(32, 32)):
        method = Fp8LinearMethod(Fp8Config(weight_granularity=granularity))
        layer = nn.Linear(64, 128, bias=False, device="meta")
        method.create_weights(layer, 64, [64, 32, 32], torch.bfloat16, device="cpu", prefix="qkv_proj")
        method.weight_loader(layer, "weight", torch.randn(64, 64, dtype=torch.bfloat16), 0)
        method.weight_loader(layer, "weight", torch.randn(32, 64, dtype=torch.bfloat16), 1)
        with pytest.raises(ValueError, match=r"^qkv_proj: weight \(shard None\) of 8192 elements, but 6144 of the "
                                             r"weight's 8192 were loaded before"):
            method.weight_loader(layer, "weight", torch.randn(128, 64, dtype=torch.bfloat16))
        assert layer._parameters["weight"].is_meta
        method.weight_loader(layer, "weight", torch.randn(32, 64, dtype=torch.bfloat16), 2)  # the last shard still
        assert fp8fx.weights.is_quantized(layer)  # loads, and completes the layer


@pytest.mark.parametrize("shards", [[64, 32, 32], [128]], ids=["qkv", "whole"])
def test_online_quantization_failing_at_the_last_load_leaves_it_to_load_again(shards, monkeypatch):
    """An online per-tensor layer quantizes its bf16 weight at the load that completes it: where that failed (out of
    memory), the shard had been counted as arrived (and a whole weight adopted) first, so loading it again was
    refused as "loaded twice" / "loaded before", and process_weights_after_loading asked for every shard, all
    received: the layer could never be finished. Now the failed load is not counted: it loads again, and the layer
    is the one a load that never failed gives."""
    method = Fp8LinearMethod(Fp8Config(weight_granularity=fp8fx.PerTensor()))
    w = torch.randn(128, 64, dtype=torch.bfloat16)
    parts = w.split(shards)

    def made(fail: bool) -> nn.Module:
        layer = nn.Linear(64, 128, bias=False, device="meta")
        method.create_weights(layer, 64, shards, torch.bfloat16, device="cpu", prefix="qkv_proj")
        shard_ids = range(len(parts)) if len(parts) > 1 else [None]
        for i, part in zip(shard_ids, parts[:-1]):
            method.weight_loader(layer, "weight", part, i)
        if fail:
            real = fp8fx.weights.chunked.quantize

            def oom(*args, **kwargs):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

            monkeypatch.setattr(fp8fx.weights.chunked, "quantize", oom)
            copied, arrived = layer._fp8fx_copied, {k: set(v) for k, v in layer._fp8fx_arrived.items()}
            with pytest.raises(torch.OutOfMemoryError):
                method.weight_loader(layer, "weight", parts[-1], shard_ids[-1])
            assert (layer._fp8fx_copied, layer._fp8fx_arrived) == (copied, arrived)
            assert layer._parameters["weight"].dtype == torch.bfloat16 and not fp8fx.weights.is_quantized(layer)
            with pytest.raises(RuntimeError, match=rf"^qkv_proj: weight received {copied} of 8192 elements"):
                method.process_weights_after_loading(layer)
            monkeypatch.setattr(fp8fx.weights.chunked, "quantize", real)
        method.weight_loader(layer, "weight", parts[-1], shard_ids[-1])  # (again, after the failure)
        method.process_weights_after_loading(layer)
        return layer

    again, never_failed = made(fail=True), made(fail=False)
    assert fp8fx.weights.is_quantized(again) and _same(_state(again), _state(never_failed))


def test_a_vllm_ordered_create_weights_call_is_refused_naming_the_order():
    """vLLM's create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
    params_dtype) called positionally put the dtype into prefix: the error named the layer "torch.bfloat16"."""
    layer = nn.Linear(48, 128, bias=False, device="meta")
    with pytest.raises(ValueError, match=r"^Linear: create_weights\(layer, 48, \[64, 32, 32\], 48, 128, "
                                         r"torch.bfloat16\): fp8fx's order is \(layer, input_size, "
                                         r"output_partition_sizes, params_dtype, device=None, prefix=''\), not vLLM's"):
        Fp8LinearMethod(Fp8Config()).create_weights(layer, 48, [64, 32, 32], 48, 128, torch.bfloat16)
    assert not hasattr(layer, "_fp8fx_partitions")
    # prefix=None, as "": the layer's class names it (it was refused as vLLM's order: h147)
    Fp8LinearMethod(Fp8Config()).create_weights(layer, 48, [64, 32, 32], params_dtype=torch.bfloat16, prefix=None)
    with pytest.raises(KeyError, match=r"Linear: no fp8fx parameter 'w'"):
        Fp8LinearMethod(Fp8Config()).weight_loader(layer, "w", torch.zeros(1))


def test_kv_cache_scales_of_the_method_stay_float32_through_a_cast_and_a_number_is_named():
    """A model loaded through Fp8KVCacheMethod had no cast guard: model.to(torch.bfloat16) rounded k_scale 0.0123 to
    0.01233 (load_checkpoint's and quantize_'s models keep them float32); a float for the scale was said to hold no
    value (h145)."""
    attention = nn.Module()
    attention.o_proj = nn.Linear(8, 8)
    model = nn.Sequential(attention)
    method = Fp8KVCacheMethod(Fp8Config(is_checkpoint_fp8_serialized=True))
    method.create_weights(attention, prefix="layers.0.self_attn")
    with pytest.raises(ValueError, match=r"^layers.0.self_attn.k_scale: got 0.5, a float, not a tensor; pass the "
                                         r"checkpoint's tensor \(torch.tensor\(0.5\) for a number\)"):
        method.weight_loader(attention, "k_scale", 0.5)
    method.weight_loader(attention, "k_scale", torch.tensor(0.0123))
    method.process_weights_after_loading(attention)
    model.to(torch.bfloat16)
    assert attention.o_proj.weight.dtype == torch.bfloat16
    for name in ("k_scale", "v_scale"):
        scale = getattr(attention, name)
        assert scale.dtype == torch.float32 and scale.item() == torch.tensor(0.0123).item()
