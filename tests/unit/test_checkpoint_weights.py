"""Weight hooks the checkpoint loader relies on: chunked quantization, exact per-channel / block shard
loading of fused layers, the no-copy online path, KV-cache scale helpers."""
import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fp8fx
from fp8fx import quant
from fp8fx.config import Fp8Config, PerBlock, PerRow, PerTensor
from fp8fx.weights import Fp8LinearMethod, chunked, kv_cache
from fp8fx.weights.linear import layer_scheme


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 70),
    cols=st.integers(1, 40),
    block=st.sampled_from([(-1, -1), (1, -1), (16, 16), (7, 5), (-1, 8)]),
    chunk=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_chunked_quantize_is_bit_identical(rows, cols, block, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 10).to(torch.bfloat16)
    q, s = chunked.quantize(x, block, chunk_numel=chunk)
    q_ref, s_ref = quant.quantize(x, block)
    assert torch.equal(_bits(q), _bits(q_ref))
    assert torch.equal(s, s_ref)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 40), block=st.sampled_from([(-1, -1), (-1, 8)]),
       chunk=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_chunked_quantize_with_a_shared_scale(rows, cols, block, chunk, seed):
    """One scale for two weights (convert's per-tensor gate and up of an expert): per_tensor_scale is x's own scale,
    and quantize with the max of two gives the codes quant.quantize_with_scale gives, in any chunks."""
    g = torch.Generator().manual_seed(seed)
    x, y = ((torch.randn(rows, cols, generator=g) * torch.rand(1, generator=g) * 10).to(torch.bfloat16)
            for _ in range(2))
    assert torch.equal(chunked.per_tensor_scale(x, block, chunk_numel=chunk), quant.compute_scale(x, block))
    shared = torch.maximum(chunked.per_tensor_scale(x, block), chunked.per_tensor_scale(y, block))
    for t in (x, y):
        q, s = chunked.quantize(t, block, chunk_numel=chunk, scale=shared)
        assert torch.equal(s, shared) and torch.equal(_bits(q), _bits(quant.quantize_with_scale(t, shared, block)))
    with pytest.raises(ValueError, match="one scale over all rows"):
        chunked.quantize(x, (1, -1), scale=shared)


def test_chunks_really_are_smaller_than_the_tensor():
    """The row step for a 1000 x 64 weight with 640-element chunks is 10 rows (16 for 16-row blocks)."""
    assert chunked._row_step(1000, 64, (1, -1), 640) == 10
    assert chunked._row_step(1000, 64, (-1, -1), 640) == 10
    assert chunked._row_step(1000, 64, (16, 16), 640) == 16


@pytest.mark.parametrize("block", [(16, 16), (8, -1), (1, -1)])
def test_block_layouts_are_quantized_in_chunks(block, monkeypatch):
    """Row blocks and per-row scales go through quant.quantize a chunk of whole blocks at a time, never the whole
    weight (the bit-identity test cannot see whether it chunked)."""
    seen = []
    real = quant.quantize
    monkeypatch.setattr(quant, "quantize", lambda t, b: seen.append(t.shape[0]) or real(t, b))
    x = torch.randn(200, 64)
    q, s = chunked.quantize(x, block, chunk_numel=640)
    step = chunked._row_step(200, 64, block, 640)
    assert step < 200 and len(seen) == -(-200 // step) and max(seen) == step, (seen, step)
    q_ref, s_ref = real(x, block)
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


def test_count_nonfinite_of_a_transposed_view():
    """A non-contiguous weight (a transposed view) is counted right, one chunk of rows at a time."""
    x = torch.zeros(64, 300)
    x[5, 7], x[63, 299], x[0, 0] = float("nan"), float("inf"), float("-inf")
    assert chunked.count_nonfinite(x.t(), chunk_numel=100) == 3 and chunked.count_nonfinite(x[0, :10]) == 1
    assert chunked.count_nonfinite(torch.zeros(0, 5)) == 0 and chunked.count_nonfinite(torch.tensor(float('nan'))) == 1


def test_count_nonfinite_counts_fp8_nan_and_float_inf():
    x = torch.zeros(100, 10)
    x[3, 4], x[99, 9] = float("nan"), float("-inf")
    assert chunked.count_nonfinite(x, chunk_numel=7) == 2
    q = torch.zeros(50, 3, dtype=torch.float8_e4m3fn)
    q.view(torch.uint8)[10, 1] = 0xFF  # -NaN
    q.view(torch.uint8)[49, 2] = 0x7F  # +NaN
    q.view(torch.uint8)[0, 0] = 0x7E  # 448: finite
    assert chunked.count_nonfinite(q, chunk_numel=5) == 2


@pytest.mark.parametrize(
    "granularity,scale_name",
    [(PerRow(), "weight_scale"), (PerBlock(16, 16), "weight_scale_inv")],
)
def test_fused_per_channel_and_block_shards_load_exactly(granularity, scale_name):
    """Shards with their own per-channel / block scales land in their rows: the fused layer holds
    exactly the concatenation (no requantization)."""
    sizes, k = [32, 16, 16], 48
    config = Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=granularity)
    layer = nn.Linear(k, sum(sizes), bias=False, device="meta")
    method = Fp8LinearMethod(config)
    method.create_weights(layer, k, sizes, torch.bfloat16, device="cpu")
    shards = [quant.quantize(torch.randn(n, k) * (i + 1), granularity.block) for i, n in enumerate(sizes)]
    for i in (2, 0, 1):
        method.weight_loader(layer, "weight", shards[i][0], shard_id=i)
        method.weight_loader(layer, scale_name, shards[i][1], shard_id=i)
    method.process_weights_after_loading(layer)
    assert torch.equal(_bits(layer._parameters["weight"]), _bits(torch.cat([q for q, _ in shards])))
    assert torch.equal(layer._parameters[scale_name], torch.cat([s for _, s in shards]))


def test_fused_block_partitions_must_start_on_block_rows():
    layer = nn.Linear(32, 40, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[16, 16]))
    with pytest.raises(ValueError, match=r"partitions \[24, 16\].*multiple of block_n=16"):
        method.create_weights(layer, 32, [24, 16], torch.bfloat16, device="cpu")


def test_online_whole_weight_is_quantized_without_a_copy():
    """The online loader quantizes a whole weight in the layer's dtype where it lies (no bf16 receive
    buffer): the fp8 result is what quant.quantize gives, and no bf16 parameter remains."""
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    layer = nn.Linear(32, 64, bias=False, device="meta")
    method = Fp8LinearMethod(Fp8Config())
    method.create_weights(layer, 32, [64], torch.bfloat16, device="cpu")
    allocated = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.empty_like.default and args[0].dtype == torch.bfloat16:
                allocated.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        method.weight_loader(layer, "weight", w)
    assert allocated == []
    q, s = quant.quantize(w, [1, -1])
    assert torch.equal(_bits(layer._parameters["weight"]), _bits(q)) and torch.equal(layer.weight_scale, s)


def test_layer_scheme_reads_back_the_scheme():
    for config in (
        Fp8Config(),
        Fp8Config(weight_block_size=[16, 16]),
        Fp8Config(weight_granularity=PerTensor(), activation_granularity=PerTensor()),
    ):
        layer = nn.Linear(32, 32, bias=False, device="meta")
        method = Fp8LinearMethod(config)
        method.create_weights(layer, 32, [32], torch.bfloat16, device="cpu")
        method.weight_loader(layer, "weight", torch.randn(32, 32, dtype=torch.bfloat16))
        assert layer_scheme(layer) == config.scheme()


@pytest.mark.parametrize(
    "name,target",
    [
        ("model.layers.0.self_attn.k_scale", ("model.layers.0.self_attn", "k_scale")),
        ("model.layers.0.self_attn.attn.v_scale", ("model.layers.0.self_attn.attn", "v_scale")),
        ("model.layers.3.self_attn.k_proj.output_scale", ("model.layers.3.self_attn.attn", "k_scale")),
        ("model.layers.3.self_attn.q_proj.output_scale", ("model.layers.3.self_attn.attn", "q_scale")),
        ("model.layers.3.self_attn.prob_output_scale", ("model.layers.3.self_attn.attn", "prob_scale")),
        ("model.layers.2.self_attn.kv_scale", ("model.layers.2.self_attn", "k_scale")),  # legacy, as vLLM
        ("model.layers.2.self_attn.k_proj.k_scale", ("model.layers.2.self_attn.attn", "k_scale")),  # ModelOpt
        ("model.layers.2.self_attn.v_proj.v_scale", ("model.layers.2.self_attn.attn", "v_scale")),
        ("model.layers.2.self_attn.qkv_proj.k_scale", ("model.layers.2.self_attn.attn", "k_scale")),
        ("model.layers.2.self_attn.k_proj.v_scale", ("model.layers.2.self_attn.k_proj", "v_scale")),  # not vLLM's
        ("model.layers.0.self_attn.k_proj.weight_scale", None),
        ("k_scale", None),
    ],
)
def test_kv_scale_names(name, target):
    assert kv_cache.kv_scale_target(name) == target


class FakeAttention(nn.Module):
    pass


class FakeSelfAttention(nn.Module):
    pass


def test_attention_owner_strips_vllm_attn_child():
    modules = {"a.self_attn": FakeAttention(), "b.attn": FakeAttention(), "d.mlp": nn.Module(), "e.proj": nn.Linear(2, 2)}
    assert kv_cache.attention_owner("a.self_attn.attn", modules) == "a.self_attn"
    assert kv_cache.attention_owner("b.attn", modules) == "b.attn"
    assert kv_cache.attention_owner("c.attn", modules) is None
    # a scale addressed to something that is not an attention has no owner (the loader refuses it)
    assert kv_cache.attention_owner("d.mlp", modules) is None and kv_cache.attention_owner("e.proj", modules) is None


def test_outermost_attentions_skip_the_ones_inside_another():
    modules = {"enc.0.attention": FakeAttention(), "enc.0.attention.self": FakeSelfAttention(),
               "enc.0.attentionx": FakeAttention(), "enc.0.mlp": nn.Module()}
    assert kv_cache.outermost_attentions(modules) == ["enc.0.attention", "enc.0.attentionx"]


@pytest.mark.parametrize(
    "value,match",
    [
        (torch.tensor([0.5, 0.5]), r"^x\.k_scale: a KV-cache scale is one value, got shape \[2\]"),
        (torch.tensor(-0.5), r"^x\.k_scale=-0\.5: .* positive finite"),
        (torch.tensor(0.0), r"^x\.k_scale=0\.0: .* positive finite"),
        (torch.tensor(float("nan")), r"^x\.k_scale=nan"),
        (torch.tensor(float("inf")), r"^x\.k_scale=inf"),
        (torch.tensor(2, dtype=torch.int32), r"^x\.k_scale: dtype torch\.int32 is not a float"),
    ],
)
def test_check_kv_scale_rejects(value, match):
    with pytest.raises(ValueError, match=match):
        kv_cache.check_kv_scale("x.k_scale", value)


def test_check_and_attach_kv_scale():
    assert kv_cache.check_kv_scale("x", torch.tensor([0.25], dtype=torch.bfloat16)) == 0.25
    m = nn.Module()
    kv_cache.attach_kv_scales(m, {"k_scale": 0.5, "v_scale": 2.0})
    assert m.k_scale.shape == () and m.k_scale.dtype == torch.float32
    assert kv_cache.kv_scales(m) == {"k_scale": 0.5, "v_scale": 2.0}
    assert set(m.state_dict()) == {"k_scale", "v_scale"}
    with pytest.raises(ValueError, match="'kv_scale' is not a KV-cache scale"):
        kv_cache.attach_kv_scales(m, {"kv_scale": 1.0})
    # a name the module holds as something else: refused before any scale is attached
    m.q_scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"q_scale: Module already has an attribute 'q_scale' \(Parameter\)"):
        kv_cache.attach_kv_scales(m, {"prob_scale": 1.0, "q_scale": 1.0})
    assert "prob_scale" not in m._buffers
    # made apart from their assignment (load_checkpoint makes them before its commit, which only assigns): making
    # them checks the names (under the module's name) and leaves the module as it was
    with pytest.raises(ValueError, match=r"^attn\.q_scale: Module already has an attribute 'q_scale'"):
        kv_cache.make_kv_scales(m, {"q_scale": 1.0}, fqn="attn")
    made = kv_cache.make_kv_scales(m, {"prob_scale": 0.25})
    assert "prob_scale" not in m._buffers and made["prob_scale"].dtype == torch.float32
    kv_cache.assign_kv_scales(m, made)
    assert m.prob_scale is made["prob_scale"] and kv_cache.held_kv_scales(m) == {"k_scale", "v_scale", "prob_scale"}


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_load_state_dict_refuses_a_kv_scale_no_loader_takes(bad):
    """A NaN, 0, negative or infinite k_scale in a state dict loaded into a model with fp8fx's KV-cache scales: it
    loaded (the attention's outputs NaN or inf, silently), and save_checkpoint then refused the model. Refused,
    naming it, and the module keeps its own; v_scale, good, loads; the hook survives a deep copy and a pickle."""
    model = nn.Sequential(nn.Module(), nn.Linear(4, 4))
    kv_cache.attach_kv_scales(model[0], {"k_scale": 0.5, "v_scale": 2.0})
    kv_cache.attach_kv_scales(model[0], {"q_scale": 1.0})  # (again: one hook a module)
    assert len(model[0]._load_state_dict_pre_hooks) == 1
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    for m in (model, copy.deepcopy(model), torch.load(saved, weights_only=False)):
        state = {k: v.clone() for k, v in m.state_dict().items()}
        state["0.k_scale"].fill_(bad)
        state["0.v_scale"].fill_(4.0)
        with pytest.raises(RuntimeError, match=rf"0\.k_scale={bad}: a KV-cache scale must be a positive finite "
                                               r"float32.*\(this scale was not loaded\)"):
            m.load_state_dict(state)
        assert m[0].k_scale.item() == 0.5 and m[0].v_scale.item() == 4.0
        assert state["0.k_scale"].isnan().all() if bad != bad else state["0.k_scale"].item() == bad  # (not changed)
        state["0.k_scale"].fill_(0.25)
        m.load_state_dict(state)
        assert m[0].k_scale.item() == 0.25


def test_load_state_dict_with_assign_refuses_a_kv_scale_of_another_dtype():
    """``assign=True`` puts a state dict's tensor in as it is: a bf16 k_scale became the attention's (0.0123 ->
    0.01233, saved so), where an fp8 layer's scale of another dtype was refused (h154). Refused too, by the
    attention's hook and by a quantized model's check, the scale kept; float32 loads; without assign the value is
    copied into the float32 buffer."""
    for model in (nn.Sequential(nn.Module(), nn.Linear(64, 64)), fp8fx.quantize_(nn.Sequential(nn.Module(),
                                                                                                  nn.Linear(64, 64)))):
        kv_cache.attach_kv_scales(model[0], {"k_scale": 0.5})
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["0.k_scale"] = torch.tensor(0.0123, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=r"0\.k_scale: a torch\.bfloat16 KV-cache scale, where fp8fx's are "
                                               r"torch\.float32; load_state_dict\(assign=True\) puts it in as it is"):
            model.load_state_dict(state, assign=True)
        assert model[0].k_scale.dtype == torch.float32 and model[0].k_scale.item() == 0.5
        model.load_state_dict(state)  # (copied: float32)
        assert model[0].k_scale.dtype == torch.float32 and model[0].k_scale.item() == state["0.k_scale"].item()
        state["0.k_scale"] = torch.tensor(0.25)
        model.load_state_dict(state, assign=True)
        assert model[0].k_scale.dtype == torch.float32 and model[0].k_scale.item() == 0.25


def test_a_bad_kv_scale_in_a_quantized_models_state_dict_loads_nothing():
    """The attention's own hook refused a NaN k_scale, but only as torch gathered errors: the modules around it had
    loaded (an fp8 layer's changed weight_scale taken, h137). The quantized model's check refuses it before any
    module loads, as it refuses a bad input_scale."""
    model = nn.Sequential(nn.Module(), nn.Linear(64, 64))
    fp8fx.quantize_(model)
    kv_cache.attach_kv_scales(model[0], {"k_scale": 0.5, "v_scale": 2.0})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = {k: v.clone() for k, v in state.items()}
    state["0.k_scale"].fill_(float("nan"))
    state["1.weight_scale"] *= 2
    with pytest.raises(RuntimeError, match=r"0\.k_scale=nan: a KV-cache scale must be a positive finite float32.*"
                                           r"\n\(nothing was loaded\)$"):
        model.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    state["0.k_scale"].fill_(0.25)
    model.load_state_dict(state)
    assert model[0].k_scale.item() == 0.25 and torch.equal(model[1].weight_scale, state["1.weight_scale"])


def test_a_module_of_two_names_refused_alike_under_both_is_one_refusal():
    """An attention registered under two names (``m.a = attn; m.b = attn``), whose NaN k_scale torch loads under
    each: a quantized model's check listed ``a.k_scale=nan`` and ``b.k_scale=nan`` as two refusals, as if of two
    modules, and so an fp8 layer inside it. One line a module, under its first name, naming the other; refused
    otherwise under the other name (inf there), that is a line of its own; nothing loads."""
    torch.manual_seed(0)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

    model = nn.Module()
    model.a = model.b = Attention()
    model.lin = nn.Linear(64, 64)
    fp8fx.quantize_(model)
    kv_cache.attach_kv_scales(model.a, {"k_scale": 0.5, "v_scale": 2.0})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = {k: v.clone() for k, v in state.items()}
    for key in ("a.k_scale", "b.k_scale"):
        state[key].fill_(float("nan"))
    state["a.proj.weight"] = torch.randn(64, 64)
    state["b.proj.weight"] = state["a.proj.weight"].clone()
    with pytest.raises(RuntimeError) as e:
        model.load_state_dict(state)
    lines = str(e.value).splitlines()[1:]
    assert lines[0] == ("\ta.k_scale (also b.k_scale)=nan: a KV-cache scale must be a positive finite float32 of "
                        "normal range (at least 1.17549e-38: 1 / scale is taken); fix or drop the tensor (an absent "
                        "k_scale / v_scale takes the layer's other one, or 1.0)")
    assert lines[1].startswith("\ta.proj.weight (also b.proj.weight): a torch.float32 tensor for a module fp8fx "
                               "quantized")
    assert lines[2:] == ["(nothing was loaded)"], lines
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    state = {k: v.clone() for k, v in before.items()}
    state["a.k_scale"].fill_(float("nan"))
    state["b.k_scale"].fill_(float("inf"))
    with pytest.raises(RuntimeError, match=r"\n\ta\.k_scale=nan: .*\n\tb\.k_scale=inf: .*\n\(nothing was loaded\)$"):
        model.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_meta_state_dict_assigned_past_the_kv_scale_hook_is_taken():
    """``load_state_dict(meta_state, assign=True)`` into a module with fp8fx's KV-cache scales: the hook's check read
    the meta k_scale's value (``Tensor.item() cannot be called on meta tensors``); a meta scale is left to torch,
    which assigns it, as for a module without the hook."""
    m = nn.Module()
    kv_cache.attach_kv_scales(m, {"k_scale": 0.5, "v_scale": 2.0})
    meta = {k: torch.empty_like(v, device="meta") for k, v in m.state_dict().items()}
    assert str(m.load_state_dict(meta, assign=True)) == "<All keys matched successfully>"
    assert m.k_scale.is_meta and m.v_scale.is_meta
