"""load_checkpoint on MoE experts of a tiny HF Mixtral / Qwen3-MoE: checkpoints written here (this file's own
float64 quantization, tests/unit/test_checkpoint_load.py) per expert (gate_proj/up_proj/down_proj or
w1/w3/w2) or fused; bad checkpoints raise a CheckpointError naming the tensor and leave the model unchanged."""
import pytest
import torch
from torch import nn

import fp8fx
from fp8fx.checkpoint import CheckpointError, load_checkpoint, meta_model
from fp8fx.weights import is_quantized_experts
from tests.unit.test_checkpoint_load import (
    FP8,
    quantization_config,
    ref_dequantize,
    ref_quantize,
    snapshot,
    write_checkpoint,
)

transformers = pytest.importorskip("transformers")

E, H, I = 4, 64, 32  # H != I and block_n != block_k: a swapped dim or block order must show
BLOCK = (16, 32)
EXPERTS = "model.layers.0.mlp.experts"
NAMING = {"hf": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def moe_config(name, layers=1):
    common = dict(vocab_size=128, hidden_size=H, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, max_position_embeddings=64)
    if name == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)
    return transformers.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=I, num_experts=E,
                                       num_experts_per_tok=2, norm_topk_prob=True)


def reference_model(cfg, dtype=torch.bfloat16):
    """Random weights, experts at differing magnitudes, decisive routers (tiny random routers are near-ties)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(10)
            layer.mlp.experts.gate_up_proj.mul_(torch.logspace(-1, 1, E).reshape(E, 1, 1).to(dtype))
    return model


def moe_checkpoint(state, granularity="tensor", *, naming="hf", static=False, ct=False, fused=False):
    """(tensors, quantization_config, deq) of an fp8 checkpoint of ``state``: attention projections and
    experts quantized, lm_head not; deq: float64 dequantized weights by state key (experts fused, 3-D; per-tensor
    w1 and w3 of an expert as they are once requantized to one scale, the max of theirs)."""
    tensors, deq = {}, {}
    scale_leaf = "weight_scale_inv" if granularity == "block" and not ct else "weight_scale"

    def quantize(prefix, w, act=0.01):
        q, s = ref_quantize(w, granularity, BLOCK)
        out = {f"{prefix}.weight": q, f"{prefix}.{scale_leaf}": s.reshape(()) if granularity == "tensor" else s}
        if static:
            out[f"{prefix}.input_scale"] = torch.tensor([act])
        return out, ref_dequantize(q, s, granularity, BLOCK)

    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if module.endswith("_proj") and "self_attn" in module:
            out, deq[name] = quantize(module, t)
            tensors.update(out)
        elif leaf in ("gate_up_proj", "down_proj") and not fused:
            parts = {"gate_up_proj": (0, 1), "down_proj": (2,)}[leaf]
            full = []
            for e in range(t.shape[0]):
                rows = t[e].chunk(len(parts))
                pieces = []
                for p, w in zip(parts, rows):
                    out, d = quantize(f"{module}.{e}.{NAMING[naming][p]}", w, act=0.01 * (1 + (e + p) % 3))
                    tensors.update(out)
                    pieces.append(d)
                if granularity == "tensor" and len(parts) == 2:  # what one scale per expert holds: w1, w3 at the max
                    top = max(tensors[f"{module}.{e}.{NAMING[naming][p]}.{scale_leaf}"].double() for p in parts)
                    pieces = [(d / top).clamp(-448, 448).to(FP8).double() * top for d in pieces]
                full.append(torch.cat(pieces))
            deq[name] = torch.stack(full)
        elif leaf in ("gate_up_proj", "down_proj"):  # fused, one scale per expert (w1 and w3 share it)
            qs = [ref_quantize(t[e], granularity, BLOCK) for e in range(t.shape[0])]
            tensors[name] = torch.stack([q for q, _ in qs])
            scales = torch.stack([s.reshape(()) if granularity == "tensor" else s for _, s in qs])
            tensors[f"{name}_{scale_leaf.replace('weight_', '')}"] = scales
            if static:
                tensors[f"{name}_input_scale"] = torch.tensor([0.02])
            deq[name] = torch.stack([ref_dequantize(q, s, granularity, BLOCK) for q, s in qs])
        else:
            tensors[name] = t
    return tensors, quantization_config(granularity, BLOCK, static, ct, ["lm_head"]), deq


def write_moe(path, cfg, tensors, qc, shards=2):
    return write_checkpoint(path, tensors, qc, shards=shards, extra_config=cfg.to_dict())


# --- layouts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_per_expert_per_tensor_scales_under_transformers_names(tmp_path, static):
    """transformers' per-tensor fp8 names (a one-value weight_scale_inv, activation_scale) loaded into linear layers
    but not into per-expert MoE projections: "experts.0.gate_proj.weight_scale is missing", or "an expert takes [...]
    not 'activation_scale'". Read as vLLM's names are, they load the same tensors."""
    cfg = moe_config("qwen3")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), "tensor", static=static)
    theirs = {k.replace(".weight_scale", ".weight_scale_inv").replace(".input_scale", ".activation_scale"): v
              for k, v in tensors.items()}
    assert any(".0.gate_proj.weight_scale_inv" in k for k in theirs)
    assert static == any(".0.gate_proj.activation_scale" in k for k in theirs)
    models = []
    for name, checkpoint in (("vllm", tensors), ("transformers", theirs)):
        path = write_moe(tmp_path / name, cfg, checkpoint, qc)
        models.append(meta_model(path))
        load_checkpoint(models[-1], path, progress=False)
    assert is_quantized_experts(models[1].get_submodule(EXPERTS))
    ours, loaded = (m.state_dict() for m in models)
    assert ours.keys() == loaded.keys()
    assert all(torch.equal(ours[k].view(torch.uint8) if ours[k].dtype == FP8 else ours[k],
                           loaded[k].view(torch.uint8) if loaded[k].dtype == FP8 else loaded[k]) for k in ours)


@pytest.mark.parametrize("granularity,naming,ct", [
    ("tensor", "mixtral", False), ("channel", "hf", True), ("block", "hf", False), ("block", "mixtral", True),
])
def test_per_expert_checkpoint_loads_its_scales(tmp_path, granularity, naming, ct):
    cfg = moe_config("mixtral")
    tensors, qc, deq = moe_checkpoint(reference_model(cfg).state_dict(), granularity, naming=naming, ct=ct)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    report = load_checkpoint(model, path, progress=False)
    experts = model.get_submodule(EXPERTS)
    assert is_quantized_experts(experts) and list(report.experts) == [EXPERTS]
    for base in ("gate_up_proj", "down_proj"):
        q = experts._parameters[base]
        assert q.dtype == FP8 and q._fp8fx_fqn == EXPERTS
        ref = deq[f"{EXPERTS}.{base}"]
        if granularity == "tensor" and base == "gate_up_proj":
            # w1 and w3 requantized to one scale per expert, the max of theirs
            w1, w3 = (torch.stack([tensors[f"{EXPERTS}.{e}.{p}.weight_scale"] for e in range(E)]) for p in NAMING[naming][:2])
            assert torch.equal(experts.gate_up_proj_scale, torch.maximum(w1, w3)) and (w1 != w3).any()
        assert torch.equal(getattr(experts, base), ref.to(torch.bfloat16)), base


def test_fused_checkpoint_with_per_expert_scales(tmp_path):
    cfg = moe_config("qwen3_moe")
    tensors, qc, deq = moe_checkpoint(reference_model(cfg).state_dict(), "tensor", fused=True, static=True)
    assert tensors[f"{EXPERTS}.gate_up_proj_scale"].shape == (E,)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    load_checkpoint(model, path, progress=False)
    experts = model.get_submodule(EXPERTS)
    assert torch.equal(experts.gate_up_proj_scale, tensors[f"{EXPERTS}.gate_up_proj_scale"])
    assert torch.equal(experts.down_proj_input_scale, torch.tensor([0.02]))
    for base in ("gate_up_proj", "down_proj"):
        assert torch.equal(experts._parameters[base].view(torch.uint8), tensors[f"{EXPERTS}.{base}"].view(torch.uint8))
        assert torch.equal(getattr(experts, base), deq[f"{EXPERTS}.{base}"].to(torch.bfloat16))


def test_fused_per_expert_input_scales_load_as_their_max(tmp_path, caplog):
    """Fused experts' static input scales one an expert, [E] (vLLM's w13_input_scale / w2_input_scale): refused with
    "an input_scale is one value, shape [] or [1] (fused: [1] or [E])", the shape it names as taken (the check held
    E itself, not the shape (E,)). They load as their max, with the loader's warning that they differ."""
    import logging

    cfg = moe_config("qwen3_moe")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), "tensor", fused=True, static=True)
    tensors[f"{EXPERTS}.gate_up_proj_input_scale"] = torch.tensor([0.01, 0.02, 0.09, 0.03])  # (E = 4)
    tensors[f"{EXPERTS}.down_proj_input_scale"] = torch.full((E,), 0.004)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        load_checkpoint(model, path, progress=False)
    experts = model.get_submodule(EXPERTS)
    assert experts.gate_up_proj_input_scale.tolist() == [pytest.approx(0.09)]
    assert experts.down_proj_input_scale.tolist() == [pytest.approx(0.004)]
    assert "gate_up_proj_input_scale: the experts' static input scales differ" in caplog.text


def test_static_input_scales_collapse_to_their_max_over_experts(tmp_path):
    cfg = moe_config("mixtral")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), "tensor", naming="mixtral", static=True)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    load_checkpoint(model, path, progress=False)
    experts = model.get_submodule(EXPERTS)
    for base, projs in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
        top = max(tensors[f"{EXPERTS}.{e}.{p}.input_scale"].item() for e in range(E) for p in projs)
        assert getattr(experts, f"{base}_input_scale").tolist() == [top]


def test_ignored_experts_stay_bf16_from_either_layout(tmp_path):
    """Also per expert in a compressed-tensors checkpoint whose ignore list names the experts module (vLLM's FusedMoE
    prefix): its entries match exactly, and the experts' own names were looked up alone, so the bf16 experts were
    refused as "declared float8_e4m3fn", with the fix "add the experts to its ignore list"."""
    cfg = moe_config("mixtral")
    state = reference_model(cfg).state_dict()
    for fused, ct in ((False, False), (True, False), (False, True)):
        tensors, qc, _ = moe_checkpoint(state, "tensor", fused=fused, ct=ct)
        for key in list(tensors):  # the experts in bf16, per expert or fused
            if key.startswith(EXPERTS + "."):
                del tensors[key]
        if fused:
            tensors.update({k: v for k, v in state.items() if k.startswith(EXPERTS + ".")})
        else:
            for e in range(E):
                gate, up = state[f"{EXPERTS}.gate_up_proj"][e].chunk(2)
                tensors.update({f"{EXPERTS}.{e}.gate_proj.weight": gate, f"{EXPERTS}.{e}.up_proj.weight": up,
                                f"{EXPERTS}.{e}.down_proj.weight": state[f"{EXPERTS}.down_proj"][e]})
        qc["ignore" if ct else "ignored_layers"].append(EXPERTS)
        path = write_moe(tmp_path / f"ckpt{fused}{ct}", cfg, tensors, qc)
        model = meta_model(path)
        report = load_checkpoint(model, path, progress=False)
        experts = model.get_submodule(EXPERTS)
        assert not is_quantized_experts(experts) and report.not_quantized[EXPERTS] == "in ignored_layers"
        assert experts.gate_up_proj._fp8fx_skip_reason == "in ignored_layers"
        for base in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(experts, base), state[f"{EXPERTS}.{base}"])


def test_bf16_experts_quantized_while_streaming_equal_quantize_(tmp_path):
    """Per-expert bf16 tensors in 3 files: each expert quantized once its gate and up arrived; the
    result is bit-identical to quantize_ on the built model."""
    cfg = moe_config("qwen3_moe")
    ref = reference_model(cfg)
    state = ref.state_dict()
    tensors = {k: v for k, v in state.items() if not k.startswith(EXPERTS + ".")}
    for e in range(E):
        gate, up = state[f"{EXPERTS}.gate_up_proj"][e].chunk(2)
        tensors.update({f"{EXPERTS}.{e}.gate_proj.weight": gate, f"{EXPERTS}.{e}.up_proj.weight": up,
                        f"{EXPERTS}.{e}.down_proj.weight": state[f"{EXPERTS}.down_proj"][e]})
    path = write_moe(tmp_path / "ckpt", cfg, tensors, None, shards=3)
    config = fp8fx.Fp8Config(ignored_layers=["lm_head"])
    model = meta_model(path)
    load_checkpoint(model, path, config, progress=False)
    fp8fx.quantize_(ref, config)
    loaded, expected = model.get_submodule(EXPERTS), ref.get_submodule(EXPERTS)
    assert loaded._fp8fx_staging == {}  # no bf16 expert left half-assembled
    for name, p in expected.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == p.dtype and torch.equal(got.view(torch.uint8) if p.dtype == FP8 else got,
                                                    p.view(torch.uint8) if p.dtype == FP8 else p), name


def test_bf16_experts_are_scanned_once(tmp_path, monkeypatch):
    """Each bf16 expert tensor quantized online is read once for NaN/Inf and range (the loader's pass), not a second
    time by Fp8MoEMethod.weight_loader's own NaN/Inf pass (an audit found every online expert scanned twice)."""
    from fp8fx.weights import chunked

    cfg = moe_config("qwen3_moe")
    state = reference_model(cfg).state_dict()
    path = write_moe(tmp_path / "ckpt", cfg, state, None, shards=2)
    scans, depth = [], [0]  # the passes over a tensor: calls not made from inside another counted call

    def counted(fn, real):
        def call(t, *args, **kwargs):
            if not depth[0]:
                scans.append((fn, t.shape))
            depth[0] += 1
            try:
                return real(t, *args, **kwargs)
            finally:
                depth[0] -= 1
        return call
    for fn in ("count_nonfinite", "count_unloadable"):
        monkeypatch.setattr(chunked, fn, counted(fn, getattr(chunked, fn)))
    load_checkpoint(meta_model(path), path, fp8fx.Fp8Config(ignored_layers=["lm_head"]), progress=False)
    expert_shapes = {tuple(state[f"{EXPERTS}.{b}"].shape) for b in ("gate_up_proj", "down_proj")}
    expert_scans = [(fn, tuple(shape)) for fn, shape in scans if tuple(shape) in expert_shapes]
    assert sorted(expert_scans) == sorted(("count_unloadable", shape) for shape in expert_shapes), scans


# --- bad checkpoints ----------------------------------------------------------------------------
def _drop(key):
    return lambda t, qc: t.pop(key)


def _set(key, value):
    return lambda t, qc: t.__setitem__(key, value(t) if callable(value) else value)


P = f"{EXPERTS}.3"
BAD = {
    "missing expert": ("tensor", {}, _drop(f"{P}.up_proj.weight"),
                       rf"{P}\.up_proj\.weight is missing from the checkpoint; {EXPERTS} has 4 experts"),
    "missing scale": ("tensor", {}, _drop(f"{P}.down_proj.weight_scale"),
                      rf"{P}\.down_proj\.weight_scale is missing from the checkpoint \(per-tensor\)"),
    "expert out of range": ("tensor", {}, _set(f"{EXPERTS}.4.gate_proj.weight", lambda t: t[f"{P}.gate_proj.weight"].clone()),
                            rf"{EXPERTS}\.4\.gate_proj\.weight .*expert index 4 is out of range: {EXPERTS} has 4"),
    "per-tensor scale shape": ("tensor", {}, _set(f"{P}.gate_proj.weight_scale", torch.ones(2)),
                               rf"{P}\.gate_proj\.weight_scale \(float32 \[2\].*needs one value"),
    "block scale shape": ("block", {}, _set(f"{P}.gate_proj.weight_scale_inv", torch.ones(2, 1)),
                          rf"{P}\.gate_proj\.weight_scale_inv .*needs shape \[2, 2\] = ceil\(\[32, 64\] / \[16, 32\]\)"),
    "channel scale shape": ("channel", dict(ct=True), _set(f"{P}.down_proj.weight_scale", torch.ones(1, 64)),
                            rf"{P}\.down_proj\.weight_scale .*needs shape \[64, 1\] \(one per output channel\)"),
    "bf16 weight in fp8": ("tensor", {}, _set(f"{P}.up_proj.weight", lambda t: t[f"{P}.up_proj.weight"].bfloat16()),
                           rf"{P}\.up_proj\.weight \(bfloat16.*declared float8_e4m3fn .*ignore list"),
    "e5m2 weight": ("tensor", {}, _set(f"{P}.up_proj.weight", lambda t: t[f"{P}.up_proj.weight"].float().to(
        torch.float8_e5m2)), rf"{P}\.up_proj\.weight \(float8_e5m2.*float8_e5m2 codes for the experts of {EXPERTS}, "
        r"and fp8fx reads float8_e4m3fn ones"),
    "wrong weight shape": ("tensor", {}, _set(f"{P}.down_proj.weight", lambda t: t[f"{P}.down_proj.weight"][:32]),
                           rf"{P}\.down_proj\.weight .*is \[64, 32\] \(E, H, I = \[4, 64, 32\]\)"),
    "mixed naming": ("tensor", {}, lambda t, qc: t.__setitem__(f"{P}.w2.weight", t.pop(f"{P}.down_proj.weight")),
                     "mixes (gate_proj/up_proj/down_proj and w1/w3/w2|w1/w3/w2 and gate_proj/up_proj/down_proj) expert names"),
    "fused and per expert": ("tensor", {}, _set(f"{EXPERTS}.down_proj", torch.zeros(4, 64, 64, dtype=FP8)),
                             "holds its experts both per expert .* and fused"),
    "static scale missing": ("tensor", dict(static=True), _drop(f"{P}.gate_proj.input_scale"),
                             rf"{P}\.gate_proj\.input_scale is missing .*activation_scheme static.*: its "
                             r"quantization_config says static activations, .*re-export the checkpoint with every "
                             r"layer's"),
    "fused static scale missing": ("tensor", dict(fused=True, static=True), _drop(f"{EXPERTS}.down_proj_input_scale"),
                                   rf"{EXPERTS}\.down_proj_input_scale is missing .*; its quantization_config says "
                                   r"static activations, .*re-export the checkpoint with every layer's"),
    "stray input scale": ("tensor", {}, _set(f"{P}.gate_proj.input_scale", torch.ones(1)),
                          rf"{P}\.gate_proj\.input_scale .*says dynamic activations"),
    "zero scale (while streaming)": ("tensor", {}, _set(f"{P}.gate_proj.weight_scale", torch.tensor(0.0)),
                                     rf"{P}\.gate_proj\.weight_scale .*not positive finite"),
    "fused scale shape": ("tensor", dict(fused=True), _set(f"{EXPERTS}.down_proj_scale", torch.ones(4, 2)),
                          rf"{EXPERTS}\.down_proj_scale .*needs shape \[4\] \(one per expert\)"),
    "fused scale missing": ("block", dict(fused=True), _drop(f"{EXPERTS}.gate_up_proj_scale_inv"),
                            rf"{EXPERTS}\.gate_up_proj_scale_inv is missing .*blocks 16x32"),
    "expert index twice": ("tensor", {}, _set(f"{EXPERTS}.03.gate_proj.weight",  # one of the two was dropped
                                              lambda t: t[f"{P}.gate_proj.weight"].clone()),
                           rf"{EXPERTS}\.0?3\.gate_proj\.weight .*expert 3's gate_proj\.weight of {EXPERTS} is also "
                           rf"given as {EXPERTS}\.0?3\.gate_proj\.weight; keep one"),
    "unknown expert tensor": ("tensor", {}, _set("model.layers.0.mlp.experts.0.gate_proj.weight_scale_x",
                                                             torch.ones(1)), r"an expert takes .*not 'weight_scale_x'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_moe_checkpoint_raises_and_changes_nothing(tmp_path, case, state=[]):
    granularity, kw, mutate, match = BAD[case]
    cfg = moe_config("mixtral")
    if not state:  # one reference model for every case
        state.append(reference_model(cfg).state_dict())
    tensors, qc, _ = moe_checkpoint(state[0], granularity, **kw)
    mutate(tensors, qc)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)
    assert snapshot(model) == snap and not hasattr(model, "_fp8fx_source")
    assert all(p.is_meta for p in model.parameters())


def refused_unchanged(tmp_path, cfg, tensors, qc, match):
    """Loading the checkpoint raises a CheckpointError matching ``match`` and leaves the model as it was."""
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, progress=False)
    assert snapshot(model) == snap


def test_nan_in_a_bf16_expert_names_it(tmp_path):
    cfg = moe_config("mixtral")
    state = reference_model(cfg).state_dict()
    state[f"{EXPERTS}.down_proj"][1, 2, 3] = float("nan")
    refused_unchanged(tmp_path, cfg, state, None, rf"{EXPERTS}\.down_proj \(bfloat16 \[4, 64, 32\].* has 1 NaN/Inf")


def test_nan_in_an_fp8_expert_names_it(tmp_path):
    """fp8 expert weights as stored (0x7F is e4m3 NaN) are checked as fp8 linear weights are."""
    cfg = moe_config("mixtral")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), "tensor", naming="mixtral", ct=False)
    tensors[f"{EXPERTS}.1.w1.weight"].view(torch.uint8)[0, :5] = 0x7F
    refused_unchanged(tmp_path, cfg, tensors, qc, rf"{EXPERTS}\.1\.w1\.weight \(float8_e4m3fn.* has 5 NaN/Inf")


def _scales_reshaped(tensors, suffixes, shape):
    for name in list(tensors):
        if name.startswith(EXPERTS) and name.endswith(suffixes):
            tensors[name] = tensors[name].reshape(shape(tensors[name]))


@pytest.mark.parametrize("granularity,fused,static,suffixes,shape", [
    ("channel", True, False, ("_scale",), lambda t: (t.shape[0], -1)),  # fused per-channel scales as [E, rows]
    ("tensor", False, False, ("weight_scale", "input_scale"), lambda t: (1, 1)),  # per-expert scalars as [1, 1]
    ("tensor", False, True, ("weight_scale", "input_scale"), lambda t: (1, 1)),
])
def test_expert_scales_in_the_shapes_checkpoints_store(tmp_path, granularity, fused, static, suffixes, shape):
    """Scales with trailing 1-dims dropped or added load as the canonical layout (the loaders refuse only
    what does not fit, e.g. a transposed tensor)."""
    cfg = moe_config("qwen3_moe")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), granularity, fused=fused, static=static,
                                    ct=granularity == "channel")
    canonical = write_moe(tmp_path / "canonical", cfg, dict(tensors), qc)
    _scales_reshaped(tensors, suffixes, shape)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    load_checkpoint(model, path, progress=False)
    assert is_quantized_experts(model.get_submodule(EXPERTS))
    ref = meta_model(canonical)  # the same scales in the layout the loaders keep: every expert tensor bit-equal
    load_checkpoint(ref, canonical, progress=False)
    bits = {k: v.view(torch.uint8) if v.element_size() == 1 else v for k, v in
            model.get_submodule(EXPERTS).state_dict().items()}
    expected = ref.get_submodule(EXPERTS).state_dict()
    assert bits.keys() == expected.keys()
    assert all(torch.equal(bits[k], v.view(torch.uint8) if v.element_size() == 1 else v) for k, v in expected.items())


# --- a float16 model and values beyond its range ------------------------------------------------
def _float16_refused(tmp_path, cfg, tensors, qc, match, config=None):
    """Loading into a float16 model raises a CheckpointError matching ``match``, the model unchanged; a bfloat16
    model loads the same checkpoint with finite experts."""
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path, torch.float16)
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path, config, progress=False)
    assert snapshot(model) == snap and not hasattr(model, "_fp8fx_source")
    assert all(p.is_meta for p in model.parameters())
    model = meta_model(path, torch.bfloat16)  # bfloat16 holds it
    load_checkpoint(model, path, config, progress=False)
    experts = model.get_submodule(EXPERTS)
    assert torch.isfinite(experts.gate_up_proj).all() and torch.isfinite(experts.down_proj).all()
    return path


def _per_expert_bf16(state):
    tensors = {k: v for k, v in state.items() if not k.startswith(EXPERTS + ".")}
    for e in range(E):
        gate, up = state[f"{EXPERTS}.gate_up_proj"][e].chunk(2)
        tensors.update({f"{EXPERTS}.{e}.gate_proj.weight": gate.clone(), f"{EXPERTS}.{e}.up_proj.weight": up.clone(),
                        f"{EXPERTS}.{e}.down_proj.weight": state[f"{EXPERTS}.down_proj"][e].clone()})
    return tensors


@pytest.mark.parametrize("layout", ["per expert", "fused", "per expert, ignored"])
@pytest.mark.parametrize("base", ["gate_up_proj", "down_proj"])
def test_float16_model_refuses_bf16_experts_beyond_its_range(tmp_path, layout, base, state=[]):
    """bf16 experts loaded into a float16 model, one expert weight 1e5: quantized online, gate/up was assembled in a
    float16 buffer as inf (its scale inf) and gate_up_proj / down_proj views held inf; left in high precision
    (ignored), the float16 expert tensor held inf: outputs NaN, silently. Refused while streaming, model unchanged."""
    cfg = moe_config("mixtral")
    if not state:
        state.append(reference_model(cfg).state_dict())
    s = {k: v.clone() for k, v in state[0].items()}
    s[f"{EXPERTS}.{base}"][1, 3, 5] = 1e5  # gate_up_proj row 3: expert 1's gate_proj
    tensors = s if layout == "fused" else _per_expert_bf16(s)
    proj = "gate_proj" if base == "gate_up_proj" else "down_proj"
    name = rf"{EXPERTS}\.{base}" if layout == "fused" else rf"{EXPERTS}\.1\.{proj}\.weight"
    ignored = ["lm_head"] + ([EXPERTS] if "ignored" in layout else [])
    online = "" if "ignored" in layout else (r", quantized online into torch\.float16 experts \(scale or "
                                             r"dequantized weight inf, outputs NaN\)")
    match = (rf"^{name} \(bfloat16 .*\): 1 of its torch\.bfloat16 values are beyond torch\.float16's range "
             rf"\(at most 65504; the largest is 99840\) and would load as inf{online}; build the model in bfloat16 or "
             r"float32$")
    _float16_refused(tmp_path, cfg, tensors, None, match, fp8fx.Fp8Config(ignored_layers=ignored))


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("base", ["gate_up_proj", "down_proj"])
def test_float16_model_refuses_fp8_expert_scales_beyond_its_range(tmp_path, granularity, fused, base, state=[]):
    """An fp8 checkpoint whose expert 1's gate_proj or down_proj reaches 1e5 (scale 1e5 / 448) loaded into a float16
    model: the dequantized float16 gate_up_proj / down_proj view held inf and the outputs were NaN, silently (per
    tensor, gate's scale also became the one of its up rows). Refused, the model unchanged; a scale that large over
    fp8 values small enough to stay finite loads."""
    cfg = moe_config("qwen3_moe")
    if not state:
        state.append(reference_model(cfg).state_dict())
    s = {k: v.clone() for k, v in state[0].items()}
    s[f"{EXPERTS}.{base}"][1, 3, 5] = 1e5  # gate_up_proj row 3: gate_proj
    ct = granularity == "channel"
    tensors, qc, _ = moe_checkpoint(s, granularity, fused=fused, ct=ct)
    leaf = "scale_inv" if granularity == "block" else "scale"
    proj = "gate_proj" if base == "gate_up_proj" else "down_proj"
    scale = rf"{EXPERTS}\.{base}_{leaf}" if fused else rf"{EXPERTS}\.1\.{proj}\.weight_{leaf}"
    match = (rf"^{scale} \(float32 .*\): a scale of 222\.857 times fp8 values up to 448 is beyond torch\.float16's "
             rf"range \(at most 65504\): 1 values of {EXPERTS}\.{base}'s dequantized weight would be inf "
             r"\(outputs NaN\); build the model in bfloat16 or float32$")
    _float16_refused(tmp_path, cfg, tensors, qc, match)
    # a large scale whose fp8 values stay below 65504 / scale: no value is inf, it loads
    weight = f"{EXPERTS}.{base}" if fused else f"{EXPERTS}.1.{proj}.weight"
    tensors[weight] = tensors[weight].float().clamp(-64, 64).to(FP8)
    path = write_moe(tmp_path / "small", cfg, tensors, qc)
    model = meta_model(path, torch.float16)
    load_checkpoint(model, path, progress=False)
    experts = model.get_submodule(EXPERTS)
    assert is_quantized_experts(experts) and torch.isfinite(getattr(experts, base)).all()


def test_fp8_experts_into_a_module_flagged_transposed_of_other_shapes_are_refused_naming_it(tmp_path):
    """An experts module HF flags is_transposed whose weights are not [E, H, 2I] / [E, I, H]: an fp8 checkpoint was
    read as [E, 2I, H], accepted and failing in forward. It is refused naming the layout, the model unchanged."""
    cfg = moe_config("mixtral")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), "channel", naming="hf", ct=True)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    model = meta_model(path)
    model.get_submodule(EXPERTS).is_transposed = True
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match=rf"^{EXPERTS}: the checkpoint's fp8 experts would load into a "
                                              r"MixtralExperts whose gate_up_proj \[4, 64, 64\] and down_proj "
                                              r"\[4, 64, 32\] are not \[E, H, 2I\] and \[E, I, H\] \(is_transposed\)"):
        load_checkpoint(model, path, progress=False)
    assert snapshot(model) == snap


@pytest.mark.parametrize("granularity,fused", [("tensor", False), ("block", True)])
def test_fp8_experts_into_a_module_stored_transposed(tmp_path, granularity, fused):
    """Experts HF flags is_transposed hold [E, H, 2I] / [E, I, H] (Aria; the model computes x @ w): an fp8
    checkpoint's experts (per expert, as linear layers, or fused in fused_moe's layout, as fp8fx writes them) load
    into fused_moe's layout,
    and the model reads transposed views of exactly what a module of the usual layout holds."""
    from torch import nn

    cfg = moe_config("mixtral")
    tensors, qc, _ = moe_checkpoint(reference_model(cfg).state_dict(), granularity, fused=fused)
    path = write_moe(tmp_path / "ckpt", cfg, tensors, qc)
    usual = meta_model(path)
    load_checkpoint(usual, path, progress=False)
    model = meta_model(path)
    experts = model.get_submodule(EXPERTS)
    experts.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I, device="meta", dtype=torch.bfloat16))
    experts.down_proj = nn.Parameter(torch.empty(E, I, H, device="meta", dtype=torch.bfloat16))
    experts.is_transposed = True  # (Llama-4's, with no flag: tests/e2e/test_moe_models.py)
    load_checkpoint(model, path, progress=False)
    assert is_quantized_experts(experts) and experts._fp8fx_transposed
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(experts, name), getattr(usual.get_submodule(EXPERTS), name).transpose(1, 2))


def test_bf16_per_expert_checkpoint_into_transposed_experts_left_unquantized(tmp_path):
    """A bf16 checkpoint's experts as linear layers (gate_proj / up_proj [I, H], down_proj [H, I]) into experts stored
    transposed and kept high precision (in ignored_layers): each expert's tensors were copied untransposed (down_proj
    failed on its shape; gate_up_proj, square with H == 2I, took w1 and w3 into the wrong rows); the module holds the
    transposes of the checkpoint's fused weights."""
    cfg = moe_config("qwen3_moe")
    assert H == 2 * I  # (gate_up_proj [E, H, 2I] square per expert: a missed transpose fits)
    state = reference_model(cfg).state_dict()
    tensors = {k: v for k, v in state.items() if not k.startswith(EXPERTS + ".")}
    for e in range(E):
        gate, up = state[f"{EXPERTS}.gate_up_proj"][e].chunk(2)
        tensors.update({f"{EXPERTS}.{e}.gate_proj.weight": gate, f"{EXPERTS}.{e}.up_proj.weight": up,
                        f"{EXPERTS}.{e}.down_proj.weight": state[f"{EXPERTS}.down_proj"][e]})
    path = write_moe(tmp_path / "ckpt", cfg, tensors, None)
    model = meta_model(path)
    experts = model.get_submodule(EXPERTS)
    experts.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I, device="meta", dtype=torch.bfloat16))
    experts.down_proj = nn.Parameter(torch.empty(E, I, H, device="meta", dtype=torch.bfloat16))
    experts.is_transposed = True
    load_checkpoint(model, path, fp8fx.Fp8Config(ignored_layers=[EXPERTS, "lm_head"]), progress=False)
    assert not is_quantized_experts(experts) and experts.gate_up_proj.dtype == torch.bfloat16
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(experts, name), state[f"{EXPERTS}.{name}"].transpose(1, 2)), name
