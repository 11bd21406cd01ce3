"""The dequantized weight an fp8 layer shows in eager mode refuses in-place writes (``fp8fx.weights.views``): a
write changed a fresh copy and was lost, silently (PEFT's ``merge_and_unload`` left an fp8 model without its
adapter); reads are as before, and compiled graphs see no subclass."""
import pytest
import torch
from torch import nn

import fp8fx
from fp8fx.weights.views import Dequantized
from tests.conftest import rel_err

WRITES = {
    "add_": lambda w: w.add_(1.0),
    "+= on .data (PEFT's merge)": lambda w: w.data.__iadd__(torch.ones_like(w)),
    ".data =": lambda w: setattr(w, "data", torch.zeros_like(w)),
    "indexed assignment": lambda w: w.__setitem__(0, 0.0),
    "nn.init": lambda w: nn.init.normal_(w),
    "a view's zero_": lambda w: w.t().zero_(),
    "a row's copy_": lambda w: w[0].copy_(torch.zeros_like(w[0])),
    "out=": lambda w: torch.add(w, 1.0, out=w),
    "_foreach_add_": lambda w: torch._foreach_add_([w], 1.0),
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
    """Every op that writes into no view of the weight runs as on a plain tensor and returns one: a copy of the
    weight is writable, a plain tensor takes the weight's values, ``requires_grad_`` is metadata; the layer computes
    the same as its dequantized weight in float64."""
    model = quantized_pair()
    w = model[2].weight
    assert type(w) is Dequantized and type(w.data) is Dequantized and type(w.t()) is Dequantized
    assert type(w * 2) is torch.Tensor and type(w.clone()) is torch.Tensor and type(w.float()) is torch.Tensor
    copy = w.clone().add_(1.0)
    assert torch.equal(copy, model[2].weight + 1.0)
    into = torch.empty_like(w, dtype=torch.bfloat16)
    into.copy_(w)
    assert torch.equal(into, model[2].weight)
    w.requires_grad_(False)
    h = torch.randn(3, 32, dtype=torch.bfloat16)
    want = h.double() @ model[2].weight.double().T + model[2].bias.double()
    assert rel_err(model[2](h).double(), want) < 0.05


def test_compiled_graphs_see_no_subclass():
    """Under torch.compile the view is a plain tensor: the linear pass rewrites the layers as before, in one graph."""
    model = quantized_pair()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    backend = fp8fx.Fp8Backend()
    got = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert [s.rewritten for s in backend.report.sites] == [True, True]
    assert rel_err(got.float(), model(x).float()) < 0.05
