"""The dequantized weight an fp8 layer shows in eager mode refuses in-place writes (``fp8fx.weights.views``): a
write changed a fresh copy and was lost, silently (PEFT's ``merge_and_unload`` left an fp8 model without its
adapter); reads are as before, and compiled graphs see no subclass."""
import copy
import io

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import fp8fx
from fp8fx.weights.views import Dequantized
from tests.conftest import rel_err

WRITES = {
    "add_": lambda w: w.add_(1.0),
    "+= on .data (PEFT's merge)": lambda w: w.data.__iadd__(torch.ones_like(w)),
    ".data =": lambda w: setattr(w, "data", torch.zeros_like(w)),
    "indexed assignment": lambda w: w.__setitem__(0, 0.0),
    "nn.init": lambda w: nn.init.normal_(w),
    ".data's copy_": lambda w: w.data.copy_(torch.zeros_like(w)),
    "out=": lambda w: torch.add(w, 1.0, out=w),
    "_foreach_add_": lambda w: torch._foreach_add_([w], 1.0),
    "inplace=True": lambda w: torch.nn.functional.relu(w, inplace=True),
    "an aten op": lambda w: torch.ops.aten.mul_.Tensor(w, torch.ones_like(w)),
}


def quantized_pair():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).bfloat16()
    return fp8fx.quantize_(model)


@pytest.mark.parametrize("write", sorted(WRITES))
def test_an_in_place_write_into_a_dequantized_weight_is_refused_naming_it(write):
    model = quantized_pair()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    before = model(x)
    with pytest.raises(RuntimeError, match=r"^2\.weight is dequantized from its fp8 codes and scales at each read, so "
                                           r".* would change a copy and be lost.*merge an adapter into the bf16 model"):
        WRITES[write](model[2].weight)
    assert torch.equal(model(x), before)


@pytest.mark.parametrize("ask", ["requires_grad_()", "requires_grad_(True)", "requires_grad = True"])
def test_asking_a_dequantized_weight_for_gradients_is_refused(ask):
    """``layer.weight.requires_grad_()`` ("unfreeze lm_head") marked the fresh copy and was lost: the layer trained
    nothing, with no word (h157). Refused, naming the layer; asking for none is taken, and a read that has gradients
    (of scales that take them) is left alone."""
    model = quantized_pair()
    w = model[2].weight
    with pytest.raises(RuntimeError, match=r"^2\.weight is dequantized from its fp8 codes and scales at each read, so "
                                           r"asking it for gradients \(requires_grad\) would mark a copy and be lost"):
        if ask == "requires_grad = True":
            w.requires_grad = True
        else:
            w.requires_grad_(*([True] if "True" in ask else []))
    assert not w.requires_grad and not model[2].weight.requires_grad
    w.requires_grad_(False)
    w.requires_grad = False
    assert not w.requires_grad
    w.detach().requires_grad_()  # (the caller's own copy)
    model[2].weight_scale.requires_grad_(True)
    scaled = model[2].weight
    assert scaled.requires_grad and scaled.requires_grad_() is scaled


def test_experts_views_refuse_writes_too():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    model = fp8fx.quantize_(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval())
    experts = model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        with pytest.raises(RuntimeError, match=rf"^model\.layers\.0\.mlp\.experts\.{name} is dequantized"):
            getattr(experts, name).data.mul_(2.0)


def test_reads_are_plain_tensors_and_writes_elsewhere_are_taken():
    """Every op but the refused writes runs as on a plain tensor and returns one, the caller's own to write into: a
    copy, a no-op ``.float()`` of a float32 model's weight, ``detach()``; a plain tensor takes the weight's values;
    ``requires_grad_`` is metadata; the weight prints, deep-copies and pickles (``weights_only``) as a plain tensor;
    the layer computes as its dequantized weight in float64."""
    model = quantized_pair()
    w = model[2].weight
    assert type(w) is Dequantized and type(w.data) is Dequantized
    assert all(type(t) is torch.Tensor for t in (w * 2, w.clone(), w.float(), w._base, w.t() * 1))
    assert torch.equal(w.clone().add_(1.0), model[2].weight + 1.0)
    assert model[2].weight.detach().clamp_(-0.01, 0.01).abs().max() <= 0.01
    into = torch.empty_like(w, dtype=torch.bfloat16)
    into.copy_(w)
    assert torch.equal(into, model[2].weight)
    w.requires_grad_(False)
    assert "Dequantized" not in repr(w) and repr(w) == repr(w.clone())
    assert type(copy.deepcopy(w)) is torch.Tensor and torch.equal(copy.deepcopy(w), w)
    buffer = io.BytesIO()
    torch.save({"w": w}, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer)["w"], w)  # (weights_only: a subclass would be refused)
    wide = fp8fx.quantize_(nn.Sequential(nn.Linear(64, 32)))  # float32: .float() returns the same tensor, the same
    # copy (on a float32 nn.Linear, the parameter): guarded as the weight is
    with pytest.raises(RuntimeError, match=r"^0\.weight is dequantized from its fp8 codes"):
        wide[0].weight.float().abs_()
    h = torch.randn(3, 32, dtype=torch.bfloat16)
    want = h.double() @ model[2].weight.double().T + model[2].bias.double()
    assert rel_err(model[2](h).double(), want) < 0.05


VIEWS = {
    "w[0].zero_()": lambda w: w[0].zero_(),
    "w.t().copy_()": lambda w: w.t().copy_(torch.zeros_like(w.t())),
    "w.T.mul_()": lambda w: w.T.mul_(2.0),
    "w.view(-1).fill_()": lambda w: w.view(-1).fill_(0.0),
    "w.unbind(0)[1].add_()": lambda w: w.unbind(0)[1].add_(1.0),
    "w.data[:, 0] = 0": lambda w: w.data[:, 0].__setitem__(slice(None), 0.0),
    "w[0][1:].neg_()": lambda w: w[0][1:].neg_(),
    "w.contiguous().mul_()": lambda w: w.contiguous().mul_(0.0),
    "w.to(its dtype)[0].zero_()": lambda w: w.to(torch.bfloat16)[0].zero_(),
}


@pytest.mark.parametrize("write", sorted(VIEWS))
def test_a_write_through_a_view_of_the_weight_is_refused(write):
    """``layer.weight[0].zero_()`` wrote into a view of the dequantized copy: lost, silently, as a write into the
    weight itself. Views of the weight (and of its ``.data``) are guarded as it is; what is not a view (``clone()``,
    ``detach()``) is the caller's own."""
    model = quantized_pair()
    before = model[2].weight.clone()
    with pytest.raises(RuntimeError, match=r"^2\.weight is dequantized from its fp8 codes and scales at each read"):
        VIEWS[write](model[2].weight)
    assert torch.equal(model[2].weight, before)
    mine = model[2].weight.t().clone()
    mine[0].zero_()
    assert not mine[0].any() and torch.equal(model[2].weight, before)


@pytest.mark.parametrize("read", ["weight", "weight.detach()", "weight.data"])
def test_a_parameter_made_of_the_weight_trains(read):
    """Dequantizing back to a bf16 layer: ``nn.Parameter(fp8_layer.weight)`` (torch detaches it, and keeps a
    subclass's class) is the new layer's own, which an optimizer steps and nn.init writes."""
    model = quantized_pair()
    new = nn.Linear(64, 32).bfloat16()
    layer = model[0]
    new.weight = nn.Parameter({"weight": layer.weight, "weight.detach()": layer.weight.detach(),
                               "weight.data": layer.weight.data}[read])
    before = new.weight.detach().clone()
    new(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    torch.optim.SGD(new.parameters(), lr=0.1).step()
    assert not torch.equal(new.weight.detach(), before)
    nn.init.zeros_(new.weight)
    assert not new.weight.detach().any()
    twin = copy.deepcopy(new)  # a plain parameter, a leaf: an optimizer takes it
    assert type(twin.weight) is nn.Parameter and twin.weight.is_leaf and twin.weight.requires_grad
    torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(torch.compile(new, backend="eager", fullgraph=True)(x), new(x))


def test_peft_merge_into_fp8_layers_is_refused_and_changes_nothing():
    """PEFT's merge_and_unload wrote ``base_layer.weight.data += delta`` into the dequantized copy: the merged model
    lost its adapter (107% off the adapted model's outputs), silently. It is refused naming the layer, the model as
    it was; the adapted model's forward is untouched."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = fp8fx.quantize_(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval())
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        state = {k: v.clone() for k, v in adapted.state_dict().items()}
        with pytest.raises(RuntimeError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight is dequantized .*"
                                               r"merge an adapter into the bf16 model"):
            adapted.merge_and_unload()
        after = adapted.state_dict()
        assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
        assert torch.equal(adapted(input_ids=ids).logits, want)


def test_adapters_added_after_quantize_are_reported_as_adapters_under_their_names():
    """quantize_, then get_peft_model (adapters trained on an fp8 base): the adapters' sites were named
    "__dict__._modules.base_model.__dict__._modules.model...lora_A.default" (Dynamo reads PeftModel's base model
    through its __dict__), said "run fp8fx.quantize_" (which had run), and unhandled_weights listed the ignored
    lm_head, which ran, under the wrapper's name. They are named as the PeftModel names them, reported as adapters."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(adapted, backend=backend)(input_ids=torch.randint(0, 128, (1, 8)))
    names = dict(adapted.named_modules())
    lora = [s for s in backend.report.sites if ".lora_" in s.fqn]
    assert len(lora) == 4 and all(s.fqn in names and not s.rewritten for s in lora), [s.fqn for s in lora]
    assert all(s.reason.startswith("not quantized: an adapter layer (PEFT's lora_") for s in lora), lora[0].reason
    assert [n for n, *_ in backend.report.unhandled_weights(adapted)] == ["base_model.model.model.embed_tokens.weight"]
    fp8fx.testing.assert_rewritten(backend, "model.layers.*_proj")
    # the wrapped layers by their quantize_ names, as the others (named by the LoRA layer's base_layer for a while)
    projections = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    assert sorted(s.fqn for s in backend.report.sites if s.rewritten) == sorted(
        f"model.layers.0.{p}" for p in projections), backend.report
    backend = fp8fx.Fp8Backend(compiler="eager")  # the attention compiled alone: the model's names still
    attention = adapted.base_model.model.model.layers[0].self_attn
    with torch.no_grad():
        torch.compile(attention.q_proj, backend=backend)(torch.randn(1, 8, 64, dtype=torch.bfloat16))
    assert [s.fqn for s in backend.report.sites if s.rewritten] == ["model.layers.0.self_attn.q_proj"]


def test_compiled_graphs_see_no_subclass():
    """Under torch.compile the view is a plain tensor: the linear pass rewrites the layers as before, in one graph. A
    weight read in eager code and passed to a compiled function compiles (Dynamo followed ``_base`` of a view whose
    ``_base`` was a view again, without end)."""
    model = quantized_pair()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    backend = fp8fx.Fp8Backend()
    got = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert [s.rewritten for s in backend.report.sites] == [True, True]
    assert rel_err(got.float(), model(x).float()) < 0.05
    fused = torch.compile(lambda a, w: torch.nn.functional.linear(a, w).float().logsumexp(-1), backend="eager")
    want = torch.nn.functional.linear(x, model[0].weight.clone()).float().logsumexp(-1)
    assert torch.equal(fused(x, model[0].weight), want)
    # through fp8fx's backend the site is the layer's, and says why it is not rewritten (it was "out": "run
    # fp8fx.quantize_", which had run)
    backend = fp8fx.Fp8Backend(compiler="eager")
    torch._dynamo.reset()
    torch.compile(lambda a, w: torch.nn.functional.linear(a, w), backend=backend)(x, model[0].weight)
    [site] = backend.report.sites
    assert site.fqn == "0" and not site.rewritten
    assert site.reason.startswith("weight is 0.weight dequantized in eager code and passed in as a tensor")


def test_quantize_of_a_peft_model_keeps_its_adapters_trainable():
    """quantize_ of a LoRA-wrapped model made lora_A / lora_B fp8 and froze them: 0 trainable parameters, silently.
    The adapters stay in high precision (the reason in their tag), their base layers are fp8, and training reaches
    the adapters."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    fp8fx.quantize_(adapted)
    assert {n for n, p in adapted.named_parameters() if p.requires_grad} == trainable and len(trainable) == 8
    q = adapted.base_model.model.model.layers[0].self_attn.q_proj
    assert fp8fx.weights.is_quantized(q.base_layer) and not fp8fx.weights.is_quantized(q.lora_A["default"])
    assert q.lora_A["default"].weight._fp8fx_skip_reason.startswith("an adapter Linear trains (lora_A): adapters stay "
                                                                    "in high precision")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    adapted(input_ids=ids, labels=ids).loss.backward()
    assert q.lora_B["default"].weight.grad is not None and q.lora_B["default"].weight.grad.any()


class Doubled(nn.Module):
    def forward(self, w):
        return w * 2


def test_a_parametrization_of_an_fp8_weight_is_refused_naming_it_and_changes_nothing():
    """register_parametrization (PEFT's target_parameters too) deletes the parameter it parametrizes: the fp8 layer
    then held a scale over no codes, and a read failed with a bare KeyError: 'weight' (later, a refusal after the
    deletion). The deletion is refused, naming the layer and the fix, and the layer is as it was."""
    from torch.nn.utils import parametrize

    model = quantized_pair()
    x = torch.randn(3, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, state = model(x), {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"^2\.weight \(torch\.float8_e4m3fn, \[16, 32\]\) holds the fp8 layer's "
                                           r"codes.*register_parametrization.*parametrize the high-precision model, "
                                           r"then quantize_ it \(nothing was changed\)"):
        parametrize.register_parametrization(model[2], "weight", Doubled())
    with pytest.raises(RuntimeError, match=r"^0\.weight_scale \(torch\.float32, .*nothing was changed"):
        del model[0].weight_scale
    assert not parametrize.is_parametrized(model[2]) and type(model[2]).__name__ == "Fp8Linear"
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v.view(torch.uint8) if v.dtype.itemsize == 1 else v, state[k].view(torch.uint8)
                           if v.dtype.itemsize == 1 else state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(x), before)
    del model[2].bias  # what holds no fp8 value is deleted as before
    assert "bias" not in model[2]._parameters


def test_a_parametrization_of_fp8_experts_is_refused_and_changes_nothing():
    """PEFT's LoRA on MoE experts (target_parameters) parametrizes gate_up_proj / down_proj."""
    from torch.nn.utils import parametrize

    from tests.unit.test_moe_weights import Block
    model = fp8fx.quantize_(Block().to(torch.bfloat16))
    codes = model.experts._parameters["down_proj"]
    with pytest.raises(RuntimeError, match=r"^experts\.down_proj \(torch\.float8_e4m3fn, .*nothing was changed"):
        parametrize.register_parametrization(model.experts, "down_proj", Doubled())
    assert model.experts._parameters["down_proj"] is codes and not parametrize.is_parametrized(model.experts)
    assert model.experts.down_proj.dtype == torch.bfloat16


@pytest.mark.parametrize("reparametrize", [
    pytest.param(lambda m, name: nn.utils.weight_norm(m, name), id="weight_norm"),
    pytest.param(lambda m, name: nn.utils.prune.l1_unstructured(m, name, amount=0.5), id="prune"),
    pytest.param(lambda m, name: nn.utils.prune.global_unstructured(
        [(m, name)], pruning_method=nn.utils.prune.L1Unstructured, amount=0.5), id="global_prune"),
])
@pytest.mark.filterwarnings("ignore::FutureWarning")  # (weight_norm's old API is deprecated)
def test_hook_reparametrizations_of_fp8_weights_are_refused_before_they_change_anything(reparametrize):
    """torch's forward-pre-hook reparametrizations take the weight out of _parameters directly, past __delattr__:
    weight_norm's old API deleted the fp8 codes, then failed with "property 'weight' ... has no setter" (the layer
    broken for good, weight_g / weight_v left on it); prune failed with torch's bare "cannot assign ... to parameter
    'weight_orig'". Both are refused at their read of the weight, naming the tool and the fix, the layer as it was;
    the same calls still work where fp8fx is not (a bf16 layer, the experts' bf16 router)."""
    from tests.unit.test_moe_weights import Block

    model = quantized_pair()
    x = torch.randn(3, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, state = model(x), dict(model[0].state_dict(keep_vars=True))
    with pytest.raises(RuntimeError, match=r"^0\.weight: torch\.nn\.utils\.(weight_norm|prune) reparametrizes a "
                                           r"weight by taking it out of the module .*parametrize the high-precision "
                                           r"model, then quantize_ it \(.* the model before quantize_; nothing was "
                                           r"changed\)$"):
        reparametrize(model[0], "weight")
    assert dict(model[0].state_dict(keep_vars=True)) == state and not model[0]._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(model(x), before)
    moe = fp8fx.quantize_(Block().to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"^experts\.gate_up_proj: torch\.nn\.utils\."):
        reparametrize(moe.experts, "gate_up_proj")
    assert moe.experts._parameters["gate_up_proj"].dtype == torch.float8_e4m3fn
    plain = nn.Linear(8, 8)
    reparametrize(plain, "weight")
    assert plain._forward_pre_hooks


def test_an_input_of_another_dtype_is_refused_naming_the_layer_and_the_cast():
    """A float32 input on a bf16 fp8 layer failed in torch's F.linear with "expected m1 and m2 to have the same
    dtype": no layer named, no fix. The error names the weight, both dtypes and the cast; the same model cast as a
    whole runs in float32, against the float64 run of the same fp8 weights."""
    model = quantized_pair()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"^0\.weight is torch\.bfloat16 \(the fp8 layer's weight.*\) and linear got "
                                           r"a torch\.float32 tensor with it \(.*same dtype.*\).*"
                                           r"model\.to\(torch\.float32\)"):
        model(x)
    with torch.no_grad():
        got = model.to(torch.float32)(x)
        want = model.to(torch.float64)(x.double())
    assert got.dtype == torch.float32 and rel_err(got, want.float()) < 1e-5


def test_an_input_of_a_dtype_no_layer_computes_in_is_told_to_cast_the_input():
    """An fp8 (float8_e4m3fn) input on a bf16 fp8 layer - codes passed where an activation belongs - was told to cast
    the model as a whole, model.to(torch.float8_e4m3fn), a cast fp8fx refuses: the fix offered is a cast of the
    input, as for an integer one; a float64 input keeps model.to(torch.float64), the model's float64 reference."""
    model = quantized_pair()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"^0\.weight is torch\.bfloat16 .* got a torch\.float8_e4m3fn tensor .*"
                                           r"torch\.float8_e4m3fn is no dtype an fp8 layer computes in .*: cast the "
                                           r"input to torch\.bfloat16") as raised:
        model(x.to(torch.float8_e4m3fn))
    assert "model.to(torch.float8_e4m3fn)" not in str(raised.value)
    with pytest.raises(RuntimeError, match=r"^0\.weight is torch\.bfloat16 .* got a torch\.float64 tensor .*"
                                           r"model\.to\(torch\.float64\) makes its fp8 layers compute in"):
        model(x.double())
    with pytest.raises(ValueError, match=r"cast to torch\.float8_e4m3fn, but fp8 layers compute in"):
        model.to(torch.float8_e4m3fn)  # (why the old advice was wrong)
    # an integer input (token ids where activations belong) got torch's bare "mat1 and mat2 must have the same dtype",
    # into F.linear and into GPT-2's Conv1D (addmm, the input its second operand)
    from transformers.pytorch_utils import Conv1D

    conv = fp8fx.quantize_(nn.Sequential(Conv1D(32, 64)).to(torch.bfloat16))
    for layer, ids in ((model, torch.ones(3, 64, dtype=torch.int64)), (model, torch.ones(3, 64, dtype=torch.bool)),
                       (conv, torch.ones(3, 64, dtype=torch.int64))):
        with pytest.raises(RuntimeError, match=rf"^0\.weight is torch\.bfloat16 .* got a {ids.dtype} tensor .*"
                                               rf"{ids.dtype} is no dtype an fp8 layer computes in .*: cast the input to "
                                               r"torch\.bfloat16"):
            layer(ids)
    # an integer operand of another op is that op's to refuse: an embedding's int16 indices keep torch's message
    with pytest.raises(RuntimeError, match=r"^Expected tensor for argument #1 'indices'"):
        F.embedding(torch.ones(3, dtype=torch.int16), model[0].weight)


def test_peft_kbit_preparation_gets_the_cast_to_make():
    """PEFT's prepare_model_for_kbit_training casts every bf16 parameter but the fp8 codes to float32; the first fp8
    layer then failed with torch's unnamed dtype error. It names the layer and model.to(torch.float32), after which
    LoRA training runs and reaches the adapters."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = fp8fx.quantize_(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16))
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"^model\.layers\.0\.self_attn\.q_proj\.weight is torch\.bfloat16 .*"
                                           r"prepare_model_for_kbit_training .*call model\.to\(torch\.float32\) after"):
        adapted(input_ids=ids, labels=ids)
    adapted.to(torch.float32)(input_ids=ids, labels=ids).loss.backward()
    q = adapted.base_model.model.model.layers[0].self_attn.q_proj
    assert fp8fx.weights.is_quantized(q.base_layer) and q.base_layer._parameters["weight"].dtype.itemsize == 1
    assert q.lora_B["default"].weight.grad is not None and q.lora_B["default"].weight.grad.any()


def test_fx_symbolic_tracing_of_a_weight_read_warns_that_it_is_a_constant(caplog, monkeypatch):
    """torch.fx.symbolic_trace of code that reads an fp8 layer's weight (F.linear(x, layer.weight)) ran the
    dequantization on real tensors: the graph held a high-precision constant, which follows no load_state_dict and
    which fp8fx's backend reported as "not an fp8fx-quantized weight (run fp8fx.quantize_ ...)", silently. It warns
    once; make_fx and torch.export, which record the dequantization, do not warn."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8fx.weights import views

    monkeypatch.setattr(views, "_FX_CONSTANT_WARNED", set())
    layer = nn.Linear(64, 64).to(torch.bfloat16)
    fp8fx.quantize_(layer)

    class ReadsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return F.linear(x, self.layer.weight)

    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="fp8fx"):
        assert "fp8fx.dequantize" in make_fx(ReadsWeight())(x).code
        assert "fp8fx.dequantize" in make_fx(ReadsWeight(), pre_dispatch=True)(x).code
        assert "fp8fx.dequantize" in str(torch.export.export(ReadsWeight(), (x,)).graph)
        assert not caplog.records
        traced = torch.fx.symbolic_trace(ReadsWeight())
        torch.fx.symbolic_trace(ReadsWeight())
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "symbolic tracing read Linear.weight" in said[0] and "as a constant" in said[0], said
    assert "dequantize" not in traced.code and "_tensor_constant" in traced.code  # (what it warns of)


def test_numpy_writes_into_the_view_are_refused():
    """Writes through w.numpy() / np.asarray(w) reach no torch function: they changed the copy made at this read
    and were lost, silently. The arrays are read-only (reads work); the caller's own copy (w.detach()) takes writes."""
    import numpy as np

    layer = nn.Linear(64, 32)
    fp8fx.quantize_(layer)
    w = layer.weight
    for array in (w.numpy(), np.asarray(w)):
        assert np.array_equal(array, layer.weight.detach().clone().numpy())
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1.0
    own = w.detach().numpy()
    own[0, 0] = 1.0
    assert own[0, 0] == 1.0
