"""Horizontal fusion of fp8 GEMMs that share their input (q/k/v, gate/up)."""
import copy
import re
from unittest import mock

import pytest
import torch

import fp8fx
from tests.conftest import record_graphs_after_passes, rel_err
from tests.e2e.test_llama import expected_sites, tiny_llama


STATIC_SHARED = " (the input quantized once, at the largest of their static input scales)"


def _fused(scheme: str, names: str) -> bool:
    """The report's scheme says its layer was fused with ``names`` (a layer left unfused says "not fused with ...:
    shares a layer with fused(...)", which ends the same way); static layers say at which scale."""
    return scheme.removesuffix(STATIC_SHARED).endswith(f"fused({names})") and "not fused" not in scheme


def compile_llama(config, model=None, **options):
    model = model or tiny_llama()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    fp8fx.quantize_(model, config)
    backend = fp8fx.Fp8Backend(**options)
    codes = record_graphs_after_passes(backend)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(ids).logits.float()
    object.__setattr__(model, "compiled", compiled)  # not a submodule
    return backend.report, codes[0], out, model


@pytest.mark.parametrize(
    "config,compiler",
    [
        (fp8fx.Fp8Config(ignored_layers=["lm_head"]), "inductor"),
        (fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_granularity=fp8fx.PerTensor()), "eager"),
        (fp8fx.Fp8Config(ignored_layers=["lm_head"], weight_block_size=[128, 128]), "eager"),
    ],
    ids=["per-channel", "per-tensor", "block"],
)
def test_qkv_and_gate_up_fused(config, compiler):
    report, code, out, model = compile_llama(config, fuse_horizontal=True, compiler=compiler)
    torch._dynamo.reset()
    _, plain_code, plain, _ = compile_llama(config, compiler=compiler)
    # per layer: q/k/v -> 1 GEMM, gate/up -> 1, o and down alone: 4 instead of 7
    assert plain_code.count("fp8fx.scaled_mm.default") == 14
    assert code.count("fp8fx.scaled_mm.default") == 4 and code.count("fp8fx.scaled_mm_fused.default") == 4
    # the fused layers' parameters now are one tensor each: scaled_mm_fused runs one GEMM
    attn = model.model.layers[0].self_attn
    weights = [getattr(attn, p)._parameters["weight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert fp8fx.ops._adjacent(weights) is not None
    sites = {s.fqn: s for s in report.sites}
    assert {fqn for fqn, s in sites.items() if s.rewritten} == expected_sites(2)
    assert _fused(sites["model.layers.0.self_attn.k_proj"].scheme, "q_proj,k_proj,v_proj")
    assert _fused(sites["model.layers.1.mlp.up_proj"].scheme, "gate_proj,up_proj")
    assert "fused" not in sites["model.layers.0.self_attn.o_proj"].scheme
    if compiler == "inductor":  # each fused site names the one GEMM it runs in
        assert {sites[f"model.layers.0.self_attn.{p}"].kernel for p in ("q_proj", "k_proj", "v_proj")} == {
            "extern fp8fx.scaled_mm_fused"}
    # per-channel and block scales concatenate exactly, per-tensor shards keep theirs (a per-channel
    # vector of them): the same numbers up to fp32 summation order
    assert rel_err(out, plain) < 1e-3
    model = tiny_llama()
    with torch.no_grad():
        ref = model(torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))).logits.float()
    assert rel_err(out, ref) < 0.1 and rel_err(plain, ref) < 0.1


def test_the_dump_counts_each_fused_layer(tmp_path):
    """The fusion pass's count (the dump's header, the pass's log line) is of the layers it fused: 2 layers x (q, k, v
    and gate, up). No test read it: one short a group passed every test (h153)."""
    model = tiny_llama()
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    backend = fp8fx.Fp8Backend(fuse_horizontal=True, compiler="eager", dump_dir=str(tmp_path))
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randint(0, 512, (2, 16)))
    (dump,) = tmp_path.glob("graph000_1_*_after_HorizontalFusionPass.py")
    assert "after HorizontalFusionPass (10 rewrites)" in dump.read_text()
    assert sum("fused" in s.scheme for s in backend.report.sites) == 10


def test_replaced_parameter_still_correct():
    """A parameter replaced after compilation breaks the shared memory: one GEMM per weight, same result."""
    config = fp8fx.Fp8Config(ignored_layers=["lm_head"])
    _, _, out, model = compile_llama(config, fuse_horizontal=True, compiler="eager")
    k_proj = model.model.layers[0].self_attn.k_proj
    k_proj._parameters["weight"] = torch.nn.Parameter(k_proj._parameters["weight"].clone(), requires_grad=False)
    weights = [getattr(model.model.layers[0].self_attn, p)._parameters["weight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert fp8fx.ops._adjacent(weights) is None
    with torch.no_grad():
        again = model.compiled(torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))).logits.float()
    assert rel_err(again, out) < 1e-3
    # and the group is one GEMM again, as its report says (only a replaced first weight of the graph's first group
    # was looked for: a replaced k left q, k, v one GEMM each under rows that said fused)
    weights = [getattr(model.model.layers[0].self_attn, p)._parameters["weight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert fp8fx.ops._adjacent(weights) is not None and weights[1] is k_proj._parameters["weight"]


def test_a_group_whose_biases_differ_in_dtype_is_not_fused_and_keeps_them():
    """q/k/v of a float32 model under bf16 autocast, k's bias bf16: the fused bias (torch.cat promotes) made k's
    bias parameter a float32 view of it, so compiling changed the model's state_dict. The group is kept apart, the
    report says why, each bias keeps its dtype, the outputs are eager's within fp8 activations' error."""
    torch.manual_seed(0)
    model = fp8fx.quantize_(BiasedQKV())
    model.k_proj.bias.data = model.k_proj.bias.data.bfloat16()
    x = torch.randn(5, 64)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = model(x)
        schemes, got = compile_fused(model, x)
    assert model.k_proj.bias.dtype == torch.bfloat16 and model.q_proj.bias.dtype == torch.float32
    assert all(s.endswith("not fused with q_proj,k_proj,v_proj: their biases are of different dtypes (q_proj: "
                          "torch.float32, k_proj: torch.bfloat16, v_proj: torch.float32): one fused tensor of them "
                          "would cast a layer's parameter; give them one dtype") for s in schemes.values()), schemes
    assert all(rel_err(g.float(), w.float()) < 0.05 for g, w in zip(got, want))  # (fp8 activations: eager's aren't)


def test_without_the_option_nothing_is_fused():
    report, code, _, _ = compile_llama(fp8fx.Fp8Config(ignored_layers=["lm_head"]), compiler="eager")
    q = next(s for s in report.sites if s.fqn == "model.layers.0.self_attn.q_proj")
    assert q.rewritten and q.scheme == "w:per-channel a:per-token"
    assert code.count("fp8fx.scaled_mm.default") == 14 and "scaled_mm_fused" not in code


class BiasedQKV(torch.nn.Module):
    """q/k/v with biases (as in Qwen2) reading the same input."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, n) for n in (64, 32, 32))

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def plain_and_fused(model, granularity):
    """``model`` (seeded) quantized with ``granularity``, compiled without and with horizontal fusion, on one input:
    (the input, the unfused output, the fused output, the fused compile's backend)."""
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_granularity=granularity))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = torch.compile(model, backend=fp8fx.Fp8Backend(compiler="eager"))(x)
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
        fused = torch.compile(model, backend=backend)(x)
    return x, plain, fused, backend


@pytest.mark.parametrize("granularity", [fp8fx.PerRow(), fp8fx.PerTensor()])
def test_fused_with_biases(granularity):
    torch.manual_seed(0)
    model = BiasedQKV().to(torch.bfloat16)
    _, plain, fused, backend = plain_and_fused(model, granularity)
    assert all(_fused(s.scheme, "q_proj,k_proj,v_proj") for s in backend.report.sites)
    biases = [m.bias for m in (model.q_proj, model.k_proj, model.v_proj)]
    assert fp8fx.ops._adjacent(biases) is not None  # one tensor now
    for a, b in zip(fused, plain):  # per-tensor shards keep their own scales: exact as well
        assert rel_err(a.float(), b.float()) < 1e-3


@pytest.mark.parametrize("granularity", [fp8fx.PerRow(), fp8fx.PerTensor()])
def test_load_state_dict_after_fusion(granularity):
    """After fusion the parameters are views of one tensor; loading a checkpoint writes each shard's rows
    and each shard's own scale, and the compiled model computes with what was loaded."""
    torch.manual_seed(0)
    model = BiasedQKV().to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_granularity=granularity))
    other = BiasedQKV().to(torch.bfloat16)
    with torch.no_grad():
        other.q_proj.weight.mul_(0.05)  # q's scale far from k's and v's
    fp8fx.quantize_(other, fp8fx.Fp8Config(weight_granularity=granularity))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(x)  # fuses: the parameters become views of one tensor
        model.load_state_dict(other.state_dict())
        got = compiled(x)
        want = torch.compile(other, backend=fp8fx.Fp8Backend(compiler="eager"))(x)  # unfused, same quantization
    for a, b in zip(got, want):
        assert rel_err(a.float(), b.float()) < 1e-3


def test_recompile_keeps_the_fused_parameters_where_they_are():
    """A second graph (another input shape) finds the parameters already fused: no new tensors, so graphs
    captured earlier (CUDA graphs) keep reading the parameters' memory."""
    torch.manual_seed(0)
    model = BiasedQKV().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        compiled(torch.randn(5, 64, dtype=torch.bfloat16))
        first = [model.q_proj.weight_scale.data_ptr(), model.q_proj._parameters["weight"].data_ptr()]
        compiled(torch.randn(3, 7, 64, dtype=torch.bfloat16))  # another rank: another graph
    assert backend.report.graphs == 2
    assert [model.q_proj.weight_scale.data_ptr(), model.q_proj._parameters["weight"].data_ptr()] == first


def test_a_shared_bias_is_named_as_the_tensor_the_layers_share():
    """q and k of their own weights sharing one bias (k.bias = q.bias) keep their group apart, and the report said
    the GEMMs share a weight tensor (a review's catch): it names the bias."""
    torch.manual_seed(0)
    model = BiasedQKV().to(torch.bfloat16)
    model.k_proj = torch.nn.Linear(64, 64).to(torch.bfloat16)
    model.k_proj.bias = model.q_proj.bias
    fp8fx.quantize_(model)
    schemes, _ = compile_fused(model, torch.randn(5, 64, dtype=torch.bfloat16))
    assert len(schemes) == 3 and all(s.endswith("not fused with q_proj,k_proj,v_proj: the GEMMs share a bias tensor")
                                     for s in schemes.values()), schemes


class SharedLayer(torch.nn.Module):
    """a(x), b(x), b(y), c(y): b belongs to two groups that read the same input."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(64, n, bias=False) for n in (64, 32, 48))

    def forward(self, x, y):
        return self.a(x), self.b(x), self.b(y), self.c(y)


def test_a_layer_in_two_groups_is_fused_with_one():
    """Both groups were fused: the report said a and b were one GEMM while they ran apart, a's fused tensor kept a
    stale copy of b, and every recompile moved b back and forth."""
    torch.manual_seed(0)
    model = SharedLayer().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    compiled = torch.compile(model, backend=backend)
    x, y = (torch.randn(5, 64, dtype=torch.bfloat16) for _ in range(2))

    def weights():
        return [getattr(model, n)._parameters["weight"] for n in "abc"]

    with torch.no_grad():
        ref = model(x, y)
        out = compiled(x, y)
        held = {w.untyped_storage().data_ptr(): w.untyped_storage().nbytes() for w in weights()}
        assert sum(held.values()) == sum(w.numel() for w in weights())  # one copy of every weight
        a, b, c = weights()
        assert fp8fx.ops._adjacent([a, b]) is not None  # a and b really are one tensor, one GEMM
        ptrs = [w.data_ptr() for w in weights()]
        compiled(torch.randn(2, 3, 64, dtype=torch.bfloat16), torch.randn(2, 3, 64, dtype=torch.bfloat16))
        assert [w.data_ptr() for w in weights()] == ptrs  # the recompile moved nothing
    for got, want in zip(out, ref):
        assert rel_err(got, want) < 0.05
    schemes = {s.fqn: s.scheme for s in backend.report.sites if s.graph == 0}
    assert _fused(schemes["a"], "a,b") and schemes["c"].endswith("not fused with b,c: shares a layer with "
                                                                          "fused(a,b)")
    # b(y) too (it had no note)
    assert [s.scheme.split(" ", 2)[2] for s in backend.report.sites if s.graph == 0 and s.fqn == "b"] == [
        "fused(a,b)", "not fused with b,c: shares a layer with fused(a,b)"]


class WhisperQKV(torch.nn.Module):
    """q/v with biases, k without (Whisper's attention), reading the same input; ``calls`` times with the same
    weights (ALBERT's shared layers)."""

    def __init__(self, calls=1):
        super().__init__()
        self.calls = calls
        self.q_proj, self.v_proj = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)
        self.k_proj = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        for _ in range(self.calls):
            x = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)[..., :64].tanh()
        return x


def compile_fused(model, x):
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
    return {(s.fqn, i): s.scheme for i, s in enumerate(backend.report.sites)}, out


def fused_against_float64(model, x):
    """The report's schemes of ``model``, quantized and compiled with fuse_horizontal, once its outputs are checked
    within 5% of the float64 model's (each read in the reference's shape)."""
    with torch.no_grad():
        want = [y.double() for y in copy.deepcopy(model).double()(x.double())]
    fp8fx.quantize_(model)
    schemes, out = compile_fused(model, x)
    errors = [rel_err(a.reshape(b.shape), b) for a, b in zip(out, want)]
    assert max(errors) < 0.05, errors
    return schemes


class ScaledQ(BiasedQKV):
    def forward(self, x):
        q = self.q_proj(x)
        q.mul_(0.125)  # (into the GEMM's output: it cannot reach x)
        return q, self.k_proj(x), self.v_proj(x)


def test_a_write_into_a_computed_tensor_keeps_a_graph_input_s_shards_fused():
    """q.mul_(scale) between q_proj(x) and k_proj(x), x the graph's input (an attention module compiled alone):
    any write was taken to reach an input, and q was left apart, "with an in-place write that may reach it". A
    tensor computed in the graph cannot share an input's memory: one GEMM, the same numbers; a write into x itself
    still keeps them apart."""
    torch.manual_seed(0)
    schemes = fused_against_float64(ScaledQ().to(torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16))
    assert all(_fused(scheme, "q_proj,k_proj,v_proj") for scheme in schemes.values()), schemes


class AliasedQKV(BiasedQKV):
    """k / v read their input through ops that return it as it is; ``view`` reads it in another shape."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def forward(self, x):
        return self.q_proj(x), self.k_proj(self.read(x)), self.v_proj(x.detach())


@pytest.mark.parametrize("read", ["contiguous", "same dtype", "view"])
def test_shards_reading_their_input_through_a_no_op_are_fused(read):
    """q_proj(x), k_proj(x.contiguous()), v_proj(x.detach()): the one tensor, read through ops that return it as it
    is, was quantized once for each and the GEMMs left apart, saying nothing. They share one quantization and one
    GEMM; a view of another shape stays its own GEMM."""
    fn = {"contiguous": lambda x: x.contiguous(), "same dtype": lambda x: x.to(x.dtype),
          "view": lambda x: x.view(-1, 64)}[read]
    torch.manual_seed(0)
    schemes = fused_against_float64(AliasedQKV(fn).to(torch.bfloat16), torch.randn(2, 3, 64, dtype=torch.bfloat16))
    if read == "view":  # (and the report says why, where it said nothing)
        q, k = schemes[("q_proj", 0)], schemes[("k_proj", 1)]
        assert "w:per-channel a:per-token fused(q_proj,v_proj) (not with" in q and "fused(" not in k, schemes
        assert re.search(r"not fused horizontally: it reads \S+ reshaped \(view: \[6, 64\]\), where q_proj,v_proj "
                         r"read it through another node", schemes[("k_proj", 1)]), schemes
        assert "(not with k_proj, which reads" in schemes[("q_proj", 0)], schemes
    else:
        assert all(_fused(scheme, "q_proj,k_proj,v_proj") for scheme in schemes.values()), schemes


class ReshapedQKV(BiasedQKV):
    def forward(self, x):
        return self.q_proj(x.flatten(0, 1)), self.k_proj(x.view(-1, 64)), self.v_proj(x.reshape(6, 64))


def test_shards_reading_their_input_through_reshapes_of_one_layout_are_fused():
    """q_proj(x.flatten(0, 1)), k_proj(x.view(-1, 64)), v_proj(x.reshape(6, 64)): three nodes of the one tensor in
    one layout, each quantized apart and left unfused (the report said why). They share one quantization and one
    GEMM."""
    torch.manual_seed(0)
    schemes = fused_against_float64(ReshapedQKV().to(torch.bfloat16), torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert all(_fused(scheme, "q_proj,k_proj,v_proj") for scheme in schemes.values()), schemes


class ReshapedKV(BiasedQKV):
    def forward(self, x):
        return self.q_proj(x), self.k_proj(x.view(-1, 64)), self.v_proj(x.flatten(0, 1))


def test_shards_reading_their_input_through_reshapes_of_other_shapes_say_so():
    """q_proj(x) beside k_proj(x.view(-1, 64)) and v_proj(x.flatten(0, 1)): k and v, one layout, are fused; q_proj
    reads x in another shape, quantized apart, and the report says so."""
    torch.manual_seed(0)
    schemes = fused_against_float64(ReshapedKV().to(torch.bfloat16), torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert re.search(r"not fused horizontally: it reads \S+ as it is, where k_proj,v_proj read it through another "
                     r"node", schemes[("q_proj", 0)]), schemes
    for site in ("k_proj", "v_proj"):
        scheme = next(s for (f, _), s in schemes.items() if f == site)
        assert "w:per-channel a:per-token fused(k_proj,v_proj) (not with" in scheme, schemes
        assert re.search(r"\(not with q_proj, which reads \S+ through another reshape node\)", scheme), schemes


class WrittenBetweenReshapes(BiasedQKV):
    def __init__(self, copies: bool):
        super().__init__()
        self.copies = copies

    def forward(self, x):
        h = x * 1.0
        if self.copies:  # (not contiguous: each reshape copies)
            h = h.transpose(0, 1)
        k = self.k_proj(h.reshape(-1, 64))
        h.mul_(2)
        return self.q_proj(h.reshape(-1, 64)), k, self.v_proj(h.reshape(-1, 64))


@pytest.mark.parametrize("copies", [False, True], ids=["views", "copies"])
def test_reshapes_of_one_layout_do_not_share_a_quantization_across_a_write(copies):
    """k_proj(h.reshape(-1, 64)), h.mul_(2), then q_proj and v_proj of h.reshape(-1, 64) again: the reshapes after
    the write read other values, so they quantize h again, whether the reshapes are views of h or copies."""
    torch.manual_seed(0)
    model = WrittenBetweenReshapes(copies).to(torch.bfloat16)
    schemes = fused_against_float64(model, torch.randn(2, 3, 64, dtype=torch.bfloat16))
    schemes = {fqn: scheme for (fqn, _), scheme in schemes.items()}
    if copies:  # (each its own node, quantized apart)
        return
    assert schemes["k_proj"].endswith("not fused horizontally: q_proj,v_proj read the same input, quantized apart "
                                      "with an in-place write that may reach it in between"), schemes
    for site in ("q_proj", "v_proj"):
        assert schemes[site].endswith("fused(q_proj,v_proj) (not with k_proj, which reads the same input, quantized "
                                      "apart with an in-place write that may reach it in between)"), schemes


class _QK(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)


class StridedAfter(_QK):
    def forward(self, x):  # x: [4, 64]
        base = x * 1.0
        h, g = base[:2], base[2:]
        a, b = self.q_proj(h), self.k_proj(g)  # k_proj reads rows 2-3
        h.as_strided_((2, 64), (64, 1), 128)  # then h looks like g
        return a, b


class UnsqueezedAfter(_QK):
    def forward(self, x):  # x: [2, 3, 64]
        h = x * 1.0
        a, b = self.q_proj(h), self.k_proj(h.unsqueeze(0))  # b is [1, 2, 3, 32]
        h.unsqueeze_(0)  # then h looks like its unsqueeze
        return a, b


class StridedOverBase(_QK):
    def forward(self, x):  # x: [4, 64]
        base = x * 1.0
        h = base[:2]
        a, b = self.q_proj(h), self.k_proj(base)  # q_proj reads rows 0-1, k_proj all 4
        h.as_strided_((4, 64), (64, 1), 0)  # then h looks like base (and h[:] like h: _same_tensor's view)
        return a, b


class ViewedAfter(_QK):
    def forward(self, x):  # x: [2, 3, 64]
        h = x * 1.0
        a, b = self.q_proj(h), self.k_proj(h.view(1, 2, 3, 64))  # b is [1, 2, 3, 32]
        h.unsqueeze_(0)  # then h looks like its view
        return a, b


@pytest.mark.parametrize("cls,shape", [(StridedAfter, (4, 64)), (UnsqueezedAfter, (2, 3, 64)),
                                       (StridedOverBase, (4, 64)), (ViewedAfter, (2, 3, 64))])
@pytest.mark.parametrize("fuse", [False, True])
def test_a_layout_changed_in_place_later_is_not_taken_for_another_tensor(cls, shape, fuse):
    """Dynamo's fake value of a tensor whose layout an op changes in place (as_strided_, unsqueeze_) holds the new
    layout at every point of the graph: two tensors that were different when the linears read them looked like one,
    by their layouts or through an alias op (h.view of h's own shape), and shared one quantization (k_proj on
    q_proj's rows: 141% off; or of the wrong shape)."""
    torch.manual_seed(0)
    model = cls().to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    fp8fx.quantize_(model)
    with torch.no_grad():
        out = torch.compile(model, backend=fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=fuse))(x)
    assert [o.shape for o in out] == [w.shape for w in want]
    assert all(rel_err(o, w) < 0.05 for o, w in zip(out, want)), [rel_err(o, w) for o, w in zip(out, want)]


class SlicedAfterWrite(BiasedQKV):
    def forward(self, x):
        h = x * 1.0
        q = self.q_proj(h[..., :64])
        h.mul_(2)
        return q, self.k_proj(h[..., :64]), self.v_proj(h[..., :64])


def test_slices_of_one_layout_kept_apart_by_a_write_say_so():
    """q_proj(h[..., :64]), h.mul_(2), then k_proj and v_proj of h[..., :64] again: k and v share a quantization and a
    GEMM, q_proj (read before the write) stays apart, and said nothing of why."""
    torch.manual_seed(0)
    schemes = fused_against_float64(SlicedAfterWrite().to(torch.bfloat16), torch.randn(2, 3, 64, dtype=torch.bfloat16))
    schemes = {fqn: scheme for (fqn, _), scheme in schemes.items()}
    assert schemes["q_proj"].endswith("not fused horizontally: k_proj,v_proj read the same input, quantized apart "
                                      "with an in-place write that may reach it in between"), schemes
    for site in ("k_proj", "v_proj"):
        assert schemes[site].endswith("fused(k_proj,v_proj) (not with q_proj, which reads the same input, quantized "
                                      "apart with an in-place write that may reach it in between)"), schemes


def test_static_layers_reading_reshapes_of_one_layout_blame_no_write():
    """Static input scales: each layer quantizes the input with its own scale, so reshapes of one layout stay apart;
    the report said an in-place write in between kept them so, where the graph has none."""
    torch.manual_seed(0)
    model = ReshapedQKV().to(torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    config = fp8fx.Fp8Config(activation_scheme="static")
    fp8fx.quantize_(model, config, input_scales=fp8fx.calibrate(model, [x], config))
    schemes, _ = compile_fused(model, x)
    assert not any("in-place write" in scheme for scheme in schemes.values()), schemes
    assert all("read it through another node" in scheme for scheme in schemes.values()), schemes


def test_a_reshape_is_not_blamed_where_the_schemes_differ_too():
    """q_proj in 1x128 groups beside k_proj and v_proj per token, k_proj reading x.view: the report said the reshape
    kept k_proj from q_proj, which reading x itself it would not have joined either."""
    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(128, 128) for _ in range(3))

        def forward(self, x):
            return self.q_proj(x), self.k_proj(x.view(-1, 128)), self.v_proj(x)

    torch.manual_seed(0)
    model = Wide().to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_granularity=fp8fx.PerBlock(128, 128), ignored_layers=["k_proj",
                                                                                                        "v_proj"]))
    fp8fx.quantize_(model.k_proj, prefix="k_proj")
    fp8fx.quantize_(model.v_proj, prefix="v_proj")
    schemes, _ = compile_fused(model, torch.randn(2, 3, 128, dtype=torch.bfloat16))
    assert "reshaped" not in schemes[("q_proj", 0)], schemes
    assert re.search(r"it reads \S+ reshaped \(view(_\d+)?: \[6, 128\]\), where v_proj reads it through another "
                     r"node", schemes[("k_proj", 1)]), schemes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_under_autocast(dtype):
    """Under torch.autocast the compile failed: the concatenation of the shards' fp8 weights ran under it
    ("Unexpected floating ScalarType in at::autocast::prioritize")."""
    torch.manual_seed(0)
    model = BiasedQKV().to(dtype)
    fp8fx.quantize_(model)
    x = torch.randn(5, 64, dtype=dtype)
    ref = [y.float() for y in model.double()(x.double())]
    model.to(dtype)
    backend = fp8fx.Fp8Backend(fuse_horizontal=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(model, backend=backend)(x)
    assert all(_fused(s.scheme, "q_proj,k_proj,v_proj") for s in backend.report.sites), backend.report
    assert all(y.dtype == torch.bfloat16 and rel_err(y, r) < 0.05 for y, r in zip(out, ref))


@pytest.mark.parametrize("granularity", [fp8fx.PerRow(), fp8fx.PerTensor()])
def test_shards_with_and_without_a_bias_are_fused(granularity):
    """Whisper's k_proj has no bias where q_proj and v_proj have one: the three run as one GEMM whose bias holds
    zeros at k's rows (they ran as two GEMMs, k apart). After compilation q's and v's biases are views of one tensor
    with those zeros between them, and nothing else; a bias replaced afterwards still computes right."""
    torch.manual_seed(0)
    model = WhisperQKV().to(torch.bfloat16)
    x, plain, fused, backend = plain_and_fused(model, granularity)
    assert [s.scheme.split(" ", 2)[2] for s in backend.report.sites] == ["fused(q_proj,k_proj,v_proj)"] * 3
    assert rel_err(fused.float(), plain.float()) < 1e-3
    q_b, v_b = model.q_proj.bias, model.v_proj.bias
    assert q_b.untyped_storage().data_ptr() == v_b.untyped_storage().data_ptr()
    assert q_b.untyped_storage().nbytes() == 128 * q_b.element_size() and v_b.storage_offset() == 96
    whole = fp8fx.ops._bias_view([q_b, None, v_b], [64, 32, 32])
    assert whole is not None and torch.equal(whole[64:96], torch.zeros(32, dtype=torch.bfloat16))
    # the op: one GEMM with the gaps' zeros, the same as one GEMM per shard; a bias replaced afterwards (a tensor of
    # its own), or biases that lie in a tensor of the same layout whose gap holds another layer's rows (a model's
    # own [q; k; v] bias, untagged), are concatenated with zeros for k at each call
    xq, xs = torch.ops.fp8fx.quantize(x, [1, -1])
    layers = (model.q_proj, model.k_proj, model.v_proj)
    weights, scales = [m._parameters["weight"] for m in layers], [m._parameters["weight_scale"] for m in layers]
    block = [1, -1] if isinstance(granularity, fp8fx.PerRow) else [-1, -1]
    own = torch.randn(128, dtype=torch.bfloat16)
    for biases in ([q_b, None, v_b], [q_b.detach() + 1, None, v_b], [own[:64], None, own[96:]]):
        assert (fp8fx.ops._bias_view(biases, [64, 32, 32]) is None) == (biases[0] is not q_b)
        one = torch.ops.fp8fx.scaled_mm_fused(xq, xs, weights, scales, biases, [1, -1], block, torch.bfloat16, True)
        apart = torch.cat([torch.ops.fp8fx.scaled_mm(xq, xs, w, s, b, [1, -1], block, torch.bfloat16, True)
                           for w, s, b in zip(weights, scales, biases)], -1)
        assert rel_err(one.float(), apart.float()) < 1e-3
    # a cast (as a device move) gives each bias storage of its own: the tag of the zero-gapped tensor goes with it
    # (it named storage no bias lies in any more); the fp8 weight stays
    model.half()
    q_b, v_b = model.q_proj.bias, model.v_proj.bias
    assert q_b.dtype == torch.float16 and q_b.untyped_storage().data_ptr() != v_b.untyped_storage().data_ptr()
    assert not hasattr(q_b, fp8fx.ops.BIAS_GAPS) and not hasattr(v_b, fp8fx.ops.BIAS_GAPS)
    assert fp8fx.ops._bias_view([q_b, None, v_b], [64, 32, 32]) is None
    assert model.q_proj._parameters["weight"].dtype == fp8fx.quant.FP8_DTYPE


@pytest.mark.cuda
def test_shards_with_and_without_a_bias_fused_on_the_gpu():
    """Whisper's q/k/v (k without a bias) through Inductor on the GPU, as one GEMM of fp8fx's Triton kernel (5 rows)
    with the zero-gapped bias, against the unfused graph; and under CUDA graphs."""
    torch.manual_seed(0)
    model = WhisperQKV(calls=2).to(torch.bfloat16).cuda()
    fp8fx.quantize_(model)
    x = torch.randn(5, 64, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        plain = torch.compile(model, backend=fp8fx.Fp8Backend())(x)
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(fuse_horizontal=True, cudagraphs=True)
        compiled = torch.compile(model, backend=backend)
        found = []  # whether each call outside the graph replays found the zero-gapped bias (else: a concatenation)
        gaps = fp8fx.ops._adjacent_with_gaps
        with mock.patch.object(fp8fx.ops, "_adjacent_with_gaps", lambda b, n: found.append(gaps(b, n)) or found[-1]):
            outs = [compiled(x).clone() for _ in range(3)]
    # the first (warm-up) call runs before the parameters are moved (H200 run 20: a concatenation); the call the CUDA
    # graph records takes the zero-gapped bias
    assert len(found) >= 2 and found[-1] is not None, found
    assert all(_fused(s.scheme, "q_proj,k_proj,v_proj") for s in backend.report.sites)
    assert fp8fx.ops._bias_view([model.q_proj.bias, None, model.v_proj.bias], [64, 32, 32]) is not None
    assert all(torch.equal(o, outs[0]) for o in outs) and rel_err(outs[0].float(), plain.float()) < 1e-3


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 16])
def test_static_and_reused_frames_fused_on_the_gpu(tokens, device="cuda"):
    """Written without a GPU (run 56): static q/k/v quantizing x once with the largest scale, through Inductor on
    the GPU and under CUDA graphs, and a second block running the first's frame after a graph break, its weights
    moved at its first call: against the unfused graph of each layer at its block's largest scale."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(BrokenBlock(), BrokenBlock()).to(torch.bfloat16).to(device)
    x = torch.randn(tokens, 64, dtype=torch.bfloat16, device=device)
    scales = {k: v * (2 if k.endswith("k_proj") else 1) for k, v in fp8fx.calibrate(model, [x]).items()}
    top = {k: max(v for n, v in scales.items() if n[0] == k[0]) for k in scales}  # (per block)
    same = copy.deepcopy(model)
    fp8fx.quantize_(same, fp8fx.Fp8Config(activation_scheme="static"), input_scales=top)
    fp8fx.quantize_(model, fp8fx.Fp8Config(activation_scheme="static"), input_scales=scales)
    with torch.no_grad():
        plain = torch.compile(same, backend=fp8fx.Fp8Backend())(x)
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(fuse_horizontal=True, cudagraphs=device == "cuda")
        compiled = torch.compile(model, backend=backend)
        outs = [compiled(x).clone() for _ in range(3)]
    assert len(backend.report.sites) == 6
    assert all(_fused(s.scheme, "q_proj,k_proj,v_proj") for s in backend.report.sites), backend.report
    for block in model:
        assert fp8fx.ops._adjacent([getattr(block, p)._parameters["weight"] for p in ("q_proj", "k_proj", "v_proj")]) \
            is not None
    assert all(torch.equal(o, outs[0]) for o in outs) and rel_err(outs[0].float(), plain.float()) < 1e-3


class ViewedQK(torch.nn.Module):
    """q and k read the same input; their outputs are viewed (``.view``) as ``shape``."""

    def __init__(self, shape):
        super().__init__()
        self.q_proj, self.k_proj, self.shape = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32), shape

    def forward(self, x):
        return self.q_proj(x).view(*self.shape) * self.k_proj(x).view(*self.shape)


@pytest.mark.parametrize("shape,fused", [((-1,), False), ((5, 4, 8), True)])
def test_outputs_viewed_across_rows_are_not_fused(shape, fused):
    """``q(x).view(-1)`` holds for a linear's own output, not for a column slice of a fused one (its rows are the
    fused row's length apart): fused, the graph failed to compile. A view that splits the last dim still fuses."""
    torch.manual_seed(0)
    model = ViewedQK(shape).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    schemes, out = compile_fused(model, x)
    with torch.no_grad():
        ref = model(x)
    if fused:
        assert _fused(schemes[("q_proj", 0)], "q_proj,k_proj")
    else:
        assert schemes[("q_proj", 0)].endswith("not fused with q_proj,k_proj: q_proj's output is viewed (view) in a "
                                               "way that a column slice of one fused output cannot be (reshape "
                                               "instead of view to fuse them)"), schemes
    assert rel_err(out.float(), ref.float()) < 0.1


class TailedQK(torch.nn.Module):
    """q and k read the same input; ``tail(q, k)`` is what the rest of the model does with their outputs."""

    def __init__(self, tail):
        super().__init__()
        self.q_proj, self.k_proj, self.tail = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32), tail

    def forward(self, x):
        return self.tail(self.q_proj(x), self.k_proj(x))


def _added_in_place_and_returned(q, k):
    q += 1  # (Dynamo: operator.iadd, which returns q)
    return q, k


LAYOUT_TAILS = {  # each valid on a linear's own (contiguous) output
    # Dynamo records q.stride(0) of the unfused output: on a column slice of the fused one it read k's columns
    "as_strided": (lambda q, k: torch.as_strided(q, (4, 2, 16), (q.stride(0), 16, 1)).sum(1) + k[:, :16],
                   "is given to as_strided"),
    # (Dynamo breaks the graph at resize_: q leaves the graph, fused, as a contiguous copy; wrong numbers before)
    "resize_": (lambda q, k: q.resize_(128).view(4, 32) + k, None),
    # a view reached through ops that may return the tensor itself, and a view by keyword: the compile failed
    "to().view": (lambda q, k: q.to(torch.bfloat16).view(-1) + k.view(-1), "is viewed"),
    "view(size=)": (lambda q, k: q.view(size=(128,)) + k.view(size=(128,)), "is viewed"),
    # ops that return the tensor itself (a cast to its own dtype, a view attribute): the compile failed
    "bfloat16().view": (lambda q, k: q.bfloat16().view(-1) + k.view(-1), "is viewed"),
    "mT.mT.view": (lambda q, k: q.mT.mT.view(-1) + k.view(-1), "is viewed"),
    # views made by other functions, then viewed across rows: fused, the compile failed with torch's own error
    "unflatten().view": (lambda q, k: torch.unflatten(q, -1, (2, 16)).view(-1) + k.view(-1), "is viewed"),
    "moveaxis().view": (lambda q, k: torch.moveaxis(q, 0, 0).view(-1) + k.view(-1), "is viewed"),
    "broadcast_to().view": (lambda q, k: torch.broadcast_to(q, q.shape).view(-1) + k.view(-1), "is viewed"),
    # a write through a view of the GEMM's own output that is a copy of a fused slice (or into q, read through such
    # a view): fused, the write was lost (wrong numbers, the report saying fused)
    "reshape().mul_": (lambda q, k: (q.reshape(-1).mul_(2), q * k)[1], "is made a view of the GEMM's own output but "
                       "a copy of a column slice of the fused one"),
    "contiguous().mul_": (lambda q, k: (q.contiguous().mul_(2), q * k)[1], "is made a view"),
    "flatten() then q.mul_": (lambda q, k: (lambda r: (q.mul_(2), r.view(4, 32) * k)[1])(q.flatten()),
                              "is made a view"),
    "reshape() read only": (lambda q, k: q.reshape(-1).view(4, 32) * k, None),
    # through ops that return their input (dropout in eval), or by an op taking a list: the write was lost too
    "dropout(reshape()).mul_": (lambda q, k: (torch.nn.functional.dropout(q.reshape(-1), 0.1, training=False)
                                             .mul_(2), q * k)[1], "is made a view"),
    "_foreach_mul_": (lambda q, k: (torch._foreach_mul_([q.reshape(-1)], 2.0), q * k)[1], "is made a view"),
    "dropout().view": (lambda q, k: torch.nn.functional.dropout(q, 0.1, training=False).view(-1) + k.view(-1),
                       "is viewed"),
    # through an in-place function (it returns its tensor), a view-returning function, an ATen op called directly
    "relu(inplace=True).reshape().mul_": (lambda q, k: (torch.nn.functional.relu(q, inplace=True).reshape(-1).mul_(2),
                                                        q * k)[1], "is made a view"),
    "relu(inplace=True).view": (lambda q, k: torch.nn.functional.relu(q, inplace=True).view(-1) + k.view(-1),
                                "is viewed"),
    "relu(input=, inplace=True).reshape().mul_": (lambda q, k: (torch.nn.functional.relu(input=q, inplace=True)
                                                                .reshape(-1).mul_(2), q * k)[1], "is made a view"),
    "mul(out=q).reshape().mul_": (lambda q, k: (torch.mul(k, 2, out=q).reshape(-1).mul_(3), q * k)[1],
                                  "is made a view"),
    "broadcast_tensors()[0].reshape().mul_": (lambda q, k: (torch.broadcast_tensors(q, k)[0].reshape(-1).mul_(2),
                                                            q * k)[1], "is made a view"),
    "aten.reshape().mul_": (lambda q, k: (torch.ops.aten.reshape.default(q, [-1]).mul_(2), q * k)[1],
                            "is made a view"),
    "aten.view": (lambda q, k: torch.ops.aten.view.default(q, [-1]) + k.view(-1), "is viewed"),
    # a write before the copy is taken, or after the copy's last read, reaches what each side reads: fused (these
    # were kept apart)
    "mul_ then contiguous()": (lambda q, k: (q.mul_(2), q.contiguous() * k)[1], None),
    "contiguous() read, then mul_": (lambda q, k: (lambda s: (q.mul_(2), q * k + s)[1])(q.contiguous().sum()), None),
    "returned": (lambda q, k: (q, k), None),
    # returned through them (an in-place op returns its tensor): the caller's view(-1) failed
    "returned bfloat16() / mul_": (lambda q, k: (q.bfloat16(), k.mul_(2)), None),
    "returned after +=": (_added_in_place_and_returned, None),
}


@pytest.mark.parametrize("tail", list(LAYOUT_TAILS))
def test_outputs_whose_layout_matters_are_kept_apart_or_copied(tail):
    """Fused, each GEMM's output is a column slice of one wider output, its rows the fused row's length apart. Where
    something depends on that layout - reached through any op that may return a view - the group stays apart, with
    the reason (as_strided: wrong numbers before; a view through .to or by keyword: a failed compile); an output the
    graph returns is fused and the caller gets a contiguous tensor of its own (its q.view(-1) failed; resize_ after a
    graph break: wrong numbers)."""
    fn, reason = LAYOUT_TAILS[tail]
    torch.manual_seed(0)
    model = TailedQK(fn).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
    schemes, out = compile_fused(model, x)
    if reason is None:
        assert _fused(schemes[("q_proj", 0)], "q_proj,k_proj"), schemes
    if tail.startswith("returned"):
        assert all(o.is_contiguous() and o.view(-1).numel() == 128 for o in out)
        out, ref = torch.cat(out, -1), torch.cat(ref, -1)
    if reason is not None:
        assert schemes[("q_proj", 0)].startswith("w:per-channel a:per-token not fused with q_proj,k_proj: q_proj's "
                                                 f"output {reason}"), schemes
    assert rel_err(out.double(), ref) < 0.05


@torch.library.custom_op("fp8fx_test::rowsum_of_rows", mutates_args=())
def _rowsum_of_rows(x: torch.Tensor) -> torch.Tensor:
    """Stands in for another library's kernel that walks its input as contiguous rows (as C++ / Triton kernels do
    with a linear's output)."""
    return torch.as_strided(x, (x.numel(),), (1,), x.storage_offset()).view(x.shape).sum(-1)


@_rowsum_of_rows.register_fake
def _(x):
    return x.new_empty(x.shape[:-1])


OPAQUE_TAILS = {
    "custom op": lambda q, k: (_rowsum_of_rows(q), k),
    "torch.cond": lambda q, k: (torch.cond(k.sum() > -1e9, lambda t: t.view(-1) * 2, lambda t: t.view(-1) + 1,
                                           (q,)), k),
}


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("tail", list(OPAQUE_TAILS))
def test_an_op_that_may_read_the_layout_gets_a_contiguous_copy(tail, compiler):
    """A fused output given to an op whose body the pass cannot see (another library's custom op, a higher-order op:
    both were traced with the GEMM's own contiguous output) gets a contiguous copy of its columns. The custom op read
    the fused output's rows, wrong numbers; torch.cond's view(-1) failed to compile."""
    torch.manual_seed(0)
    model = TailedQK(OPAQUE_TAILS[tail]).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = torch.compile(model, backend=fp8fx.Fp8Backend(compiler=compiler))(x)
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(compiler=compiler, fuse_horizontal=True)
        out = torch.compile(model, backend=backend)(x)
    assert _fused(backend.report.sites[0].scheme, "q_proj,k_proj"), backend.report.sites[0].scheme
    for a, b in zip(out, plain):  # the same GEMMs' values, fused or not
        assert rel_err(a.float(), b.float()) < 0.01


def test_a_gemm_left_out_only_for_its_weight_scales_gets_that_reason_alone():
    """w reads the same quantized input as k and v (all per-token) and is kept apart by its per-tensor weight scales
    only; a note that its input was "quantized otherwise" than q's (whose 1x128 groups quantize it apart) came first,
    and was wrong."""

    class Four(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(256, 256), torch.nn.Linear(256, 128)
            self.v, self.w = torch.nn.Linear(256, 128), torch.nn.Linear(256, 128)

        def forward(self, x):
            return torch.cat([self.q(x), self.k(x), self.v(x), self.w(x)], -1)

    torch.manual_seed(0)
    model = Four().to(torch.bfloat16)
    fp8fx.quantize_(model.q, fp8fx.Fp8Config(weight_block_size=[128, 128]), prefix="q")
    for name in "kv":
        fp8fx.quantize_(getattr(model, name), fp8fx.Fp8Config(), prefix=name)
    per_tensor = fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor(), activation_granularity=fp8fx.PerRow())
    fp8fx.quantize_(model.w, per_tensor, prefix="w")
    schemes, _ = compile_fused(model, torch.randn(3, 256, dtype=torch.bfloat16))
    assert schemes[("w", 3)] == ("w:per-tensor a:per-token not fused horizontally: per-tensor weight scales where k,v "
                                 "have per-channel")


def test_a_gemm_left_out_of_its_group_says_why():
    """One shard per tensor among per-channel ones: the odd one out had no note."""
    torch.manual_seed(0)
    model = BiasedQKV().to(torch.bfloat16)
    for name in ("q_proj", "k_proj", "v_proj"):
        granularity = fp8fx.PerTensor() if name == "k_proj" else fp8fx.PerRow()
        fp8fx.quantize_(getattr(model, name), fp8fx.Fp8Config(weight_granularity=granularity), prefix=name)
    schemes, _ = compile_fused(model, torch.randn(5, 64, dtype=torch.bfloat16))
    # (per-channel, as the sites' own schemes say: it said per-row)
    assert schemes[("k_proj", 1)].endswith(
        "not fused horizontally: per-tensor weight scales where q_proj,v_proj have per-channel")
    assert _fused(schemes[("v_proj", 2)], "q_proj,v_proj")


class BrokenBlock(torch.nn.Module):
    """q/k/v after a graph break: Dynamo compiles the rest of the forward once, for the first block, and runs that
    code again for the second."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, n) for n in (64, 32, 32))

    def forward(self, x):
        x = x * 2
        torch._dynamo.graph_break()
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)[..., :64] + x


def test_fused_groups_of_modules_that_run_another_modules_graph_are_moved_too():
    """The second block (and a second model of the class, on the same backend) ran the first block's graph with its
    own q/k/v weights, which were never moved into one tensor: its scaled_mm_fused ran one GEMM per layer, under a
    report that said fused."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(BrokenBlock(), BrokenBlock()).to(torch.bfloat16) for _ in range(2)]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    refs = []
    for model in models:
        fp8fx.quantize_(model)
        with torch.no_grad():
            refs.append(torch.compile(model, backend=fp8fx.Fp8Backend(compiler="eager"))(x))
        torch._dynamo.reset()
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    with torch.no_grad():
        outs = [torch.compile(model, backend=backend)(x) for model in models]
    for model, out, ref in zip(models, outs, refs):
        for block in model:
            weights = [getattr(block, p)._parameters["weight"] for p in ("q_proj", "k_proj", "v_proj")]
            assert fp8fx.ops._adjacent(weights) is not None
        assert rel_err(out, ref) < 1e-3
    # each model's six layers, the second model's too (the report had left it out: its layers' names are the
    # first's, and Dynamo ran the first's graph for it)
    assert sorted(s.fqn for s in backend.report.sites) == sorted(
        [f"{b}.{p}" for b in "01" for p in ("q_proj", "k_proj", "v_proj")] * 2)
    assert all(_fused(s.scheme, "q_proj,k_proj,v_proj") for s in backend.report.sites)
    assert not backend.report.unhandled_weights(models[1])


def test_layers_quantized_one_by_one_keep_their_names():
    """quantize_(layer) without prefix= tags the layer's weight with the name "": every site of the model was named
    "", and the fusion wrote fused(,). Each site is named by its path in the compiled model."""
    torch.manual_seed(0)
    model = BiasedQKV().to(torch.bfloat16)
    for name in ("q_proj", "k_proj", "v_proj"):
        granularity = fp8fx.PerTensor() if name == "k_proj" else fp8fx.PerRow()
        fp8fx.quantize_(getattr(model, name), fp8fx.Fp8Config(weight_granularity=granularity))
    schemes, _ = compile_fused(model, torch.randn(5, 64, dtype=torch.bfloat16))
    assert [fqn for fqn, _ in schemes] == ["q_proj", "k_proj", "v_proj"]
    assert _fused(schemes[("q_proj", 0)], "q_proj,v_proj")
    assert schemes[("k_proj", 1)].endswith("per-tensor weight scales where q_proj,v_proj have per-channel")
    # a weight that something else reads too: the note on its site (a second site named "" was added)

    class AlsoSummed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(64, 32)

        def forward(self, x):
            return self.q_proj(x) + self.q_proj.weight.sum()

    model = AlsoSummed().to(torch.bfloat16)
    fp8fx.quantize_(model.q_proj)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(5, 64, dtype=torch.bfloat16))
    (site,) = backend.report.sites
    assert site.fqn == "q_proj" and site.rewritten and "; also read by sum" in site.scheme
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)  # compiled on its own, the root: its name is ""
    fp8fx.quantize_(layer)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(layer, backend=backend)(torch.randn(5, 64, dtype=torch.bfloat16))
    assert [s.fqn for s in backend.report.sites] == [""]


def test_layers_called_again_with_the_same_weights_are_fused_at_every_call():
    """Only the first call was fused; the others ran apart with no note."""
    torch.manual_seed(0)
    model = WhisperQKV(calls=3).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = torch.compile(model, backend=fp8fx.Fp8Backend(compiler="eager"))(x)
        torch._dynamo.reset()
    schemes, out = compile_fused(model, x)
    assert len(schemes) == 9 and all(_fused(s, "q_proj,k_proj,v_proj") for s in schemes.values()), schemes
    assert rel_err(out.float(), plain.float()) < 1e-3


def test_static_activations_fuse_with_the_largest_input_scale():
    """Each layer quantized the shared input with its own input_scale, and the report said they could not fuse: they
    quantize it once, with the largest of the scales (vLLM's fused static QKV), taken in the graph at each call. One
    calibration gives q/k/v one scale: the fused output is the unfused one."""
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    config = fp8fx.Fp8Config(activation_scheme="static")
    for factors in ((1, 1, 1), (1, 2, 0.5)):
        model = BiasedQKV().to(torch.bfloat16)
        scales = fp8fx.calibrate(model, [x])
        assert len(set(scales.values())) == 1
        scales = {k: v * f for (k, v), f in zip(scales.items(), factors)}
        same = copy.deepcopy(model)  # each layer at the largest scale: what the fused GEMM computes
        fp8fx.quantize_(same, config, input_scales=dict.fromkeys(scales, max(scales.values())))
        fp8fx.quantize_(model, config, input_scales=scales)
        with torch.no_grad():
            plain = torch.compile(same, backend=fp8fx.Fp8Backend(compiler="eager"))(x)
        torch._dynamo.reset()
        backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
        codes = record_graphs_after_passes(backend)
        with torch.no_grad():
            out = torch.compile(model, backend=backend)(x)
        torch._dynamo.reset()
        assert all(s.scheme.endswith(f"fused(q_proj,k_proj,v_proj){STATIC_SHARED}") for s in backend.report.sites), (
            backend.report)  # (each said its own scale, 2x under the one it ran with)
        assert codes[0].count("fp8fx.quantize_static.default(") == 1, codes[0]
        assert all(rel_err(a.float(), b.float()) < 1e-3 for a, b in zip(out, plain))
        # the parameters hold each layer's own scale (a checkpoint saved now writes them), the max is the graph's
        assert [m.input_scale.item() for m in (model.q_proj, model.k_proj, model.v_proj)] == [
            torch.tensor(v).item() for v in scales.values()]


@pytest.mark.parametrize("write", ["a buffer (the cache)", "h"])
def test_static_layers_fuse_only_between_in_place_writes_into_their_input(write):
    """Shared, one static quantization of h taken before ``h.mul_(3)`` would feed v the unwritten h: v stays apart,
    and says why; a cache write cannot reach h, and q/k/v fuse across it."""
    from tests.passes.test_linear_pass import WRITES, WriteBetween

    torch.manual_seed(0)
    model = WriteBetween(WRITES[write][0]).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    scales = fp8fx.calibrate(copy.deepcopy(model), [x])
    ref = copy.deepcopy(model)
    fp8fx.quantize_(model, fp8fx.Fp8Config(activation_scheme="static"), input_scales=scales)
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    with torch.no_grad():
        want, out = ref(x), torch.compile(model, backend=backend)(x)
    assert all(rel_err(a, b) < 0.05 for a, b in zip(out, want))  # (v of the written h: 3x)
    sites = {s.fqn: s.scheme for s in backend.report.sites}
    if write == "h":
        assert _fused(sites["q"], "q,k") and _fused(sites["k"], "q,k"), sites
        assert sites["v"].endswith("not fused horizontally: q,k read the same input, quantized apart with an in-place "
                                   "write that may reach it in between"), sites
    else:
        assert all(_fused(scheme, "q,k,v") for scheme in sites.values()), sites


def test_a_static_layer_among_dynamic_ones_says_why_it_is_not_fused():
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    config = fp8fx.Fp8Config(activation_scheme="static")
    # one static layer among dynamic ones: k and v fuse, q said nothing
    model = BiasedQKV().to(torch.bfloat16)
    scales = fp8fx.calibrate(model, [x])
    fp8fx.quantize_(model.q_proj, config, prefix="q_proj", input_scales={"q_proj": scales["q_proj"]})
    for name in ("k_proj", "v_proj"):
        fp8fx.quantize_(getattr(model, name), prefix=name)
    schemes, _ = compile_fused(model, x)
    assert schemes[("q_proj", 0)].endswith("not fused horizontally: it quantizes the input with its own static "
                                           "input_scale, where k_proj,v_proj quantize it dynamically"), schemes
    for site in (("k_proj", 1), ("v_proj", 2)):  # (and the dynamic ones say why q_proj is not with them)
        assert schemes[site].endswith("fused(k_proj,v_proj) (not with q_proj, which takes a static input_scale where "
                                      "these quantize the input dynamically)"), schemes
    # two static layers fused with each other, among a dynamic one: their rows said "fused(q_proj,k_proj) not fused
    # horizontally: it quantizes ... with its own static input_scale"
    torch._dynamo.reset()
    model = BiasedQKV().to(torch.bfloat16)
    for name in ("q_proj", "k_proj"):
        fp8fx.quantize_(getattr(model, name), config, prefix=name, input_scales={name: scales[name]})
    fp8fx.quantize_(model.v_proj, prefix="v_proj")
    schemes, _ = compile_fused(model, x)
    for site in (("q_proj", 0), ("k_proj", 1)):
        assert f"fused(q_proj,k_proj){STATIC_SHARED} (not with" in schemes[site] and "not fused" not in schemes[site], (
            schemes)
        assert schemes[site].endswith("(not with v_proj, which quantizes the input dynamically where these take "
                                      "their static input_scale)"), schemes
    # the dynamic layer kept out of them said nothing
    assert schemes[("v_proj", 2)].endswith("not fused horizontally: it quantizes the input dynamically, where "
                                           "q_proj,k_proj take a static input_scale"), schemes


@pytest.mark.parametrize("write", ["a buffer (the cache)", "h"])
def test_qkv_fused_across_a_cache_write_and_kept_apart_across_a_write_into_their_input(write):
    """A decoder layer that writes k into its cache before v's projection still runs q/k/v as one GEMM (the linear pass
    keeps h's one quantization across a write that cannot reach h); a write into h in between leaves v apart, and
    the report says why."""
    from tests.passes.test_linear_pass import compile_write_between

    backend, code = compile_write_between(write, fuse_horizontal=True)  # (outputs checked there)
    sites = {s.fqn: s.scheme for s in backend.report.sites}
    if write == "h":
        assert code.count("fp8fx.scaled_mm_fused.default(") == 1 and code.count("fp8fx.scaled_mm.default(") == 1
        for site in ("q", "k"):  # (the fused pair says too which reader of its input the write kept out)
            assert sites[site].endswith("fused(q,k) (not with v, which reads the same input, quantized apart with an "
                                        "in-place write that may reach it in between)"), sites
        assert sites["v"].endswith("not fused horizontally: q,k read the same input, quantized apart with an in-place "
                                   "write that may reach it in between"), sites
    else:
        assert code.count("fp8fx.scaled_mm_fused.default(") == 1 and "scaled_mm.default(" not in code
        assert all(_fused(scheme, "q,k,v") for scheme in sites.values()), sites


def test_a_layer_quantizing_its_input_otherwise_says_so():
    """k's own activation granularity (per tensor where q and v take per token): q and v fuse, k's site says why it
    stays apart - not an in-place write, which there is none of."""
    from tests.passes.test_linear_pass import WriteBetween

    torch.manual_seed(0)
    model = WriteBetween(lambda m, h, k: None).to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["k"]))
    fp8fx.quantize_(model.k, fp8fx.Fp8Config(activation_granularity=fp8fx.PerTensor()), prefix="k")
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(4, 64, dtype=torch.bfloat16))
    sites = {s.fqn: s.scheme for s in backend.report.sites}
    assert _fused(sites["q"], "q,v") and _fused(sites["v"], "q,v"), sites
    assert sites["k"].endswith("not fused horizontally: its input is quantized per-tensor, where q,v read it "
                               "quantized otherwise"), sites


def test_a_group_across_layers_is_named_in_full():
    """Every layer's cross-attention k/v read the same encoder output: one GEMM across layers. Its note named them by
    their last part only, fused(k_proj,v_proj,k_proj,v_proj); it names them in full."""

    class CrossAttn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.k_proj, self.v_proj = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)

        def forward(self, x, enc):
            return x + self.k_proj(enc).sum(0) * self.v_proj(enc).sum(0)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([CrossAttn(), CrossAttn()])

        def forward(self, x, enc):
            for layer in self.layers:
                x = layer(x, enc)
            return x

    torch.manual_seed(0)
    model = Decoder().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(3, 32, dtype=torch.bfloat16),
                                              torch.randn(5, 64, dtype=torch.bfloat16))
    names = "layers.0.k_proj,layers.0.v_proj,layers.1.k_proj,layers.1.v_proj"
    assert [s.scheme for s in backend.report.sites] == [f"w:per-channel a:per-token fused({names})"] * 4


class MatmulAttention(torch.nn.Module):
    def __init__(self, h=64):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(h, h, bias=False) for _ in range(3))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return torch.softmax(q @ k.transpose(-1, -2) / 8, -1) @ v


def test_fused_sites_name_their_gemm_not_the_matmul_their_slices_feed():
    """q's slice of the fused GEMM carries q's origin (its meta), and where it feeds q @ k.T Inductor lists it in
    the bmm's group: the report named "extern bmm" as q's, k's and v's kernel. fp8fx's op comes first now."""
    model = MatmulAttention().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(fuse_horizontal=True)
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert [(s.fqn, s.kernel) for s in backend.report.sites] == [
        (p, "extern fp8fx.scaled_mm_fused") for p in ("q", "k", "v")]


class RaggedQKV(torch.nn.Module):
    """q of 48 rows: a checkpoint's 32x32 weight blocks end it in half a block (DeepSeek-V3's weight_scale_inv is
    ceil-sized), which fused above k and v would put k's first rows in q's last block of scales."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, n, bias=False) for n in (48, 32, 32))

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def test_block_scaled_shards_that_end_inside_a_block_are_not_fused(tmp_path):
    """Loaded with 32x32 blocks, q (48 rows) ends inside a block: q/k/v are not fused, each site saying why, and
    every output stays within fp8's error of the float64 reference of the stored weights (fused, k's and v's scale
    rows would have been read one block off)."""
    from tests.unit.test_checkpoint_load import quantization_config, ref_dequantize, ref_quantize, write_checkpoint

    torch.manual_seed(0)
    state = {k: v.bfloat16() for k, v in RaggedQKV().state_dict().items()}
    tensors, deq = {}, {}
    for name, w in state.items():
        tensors[name], tensors[name + "_scale_inv"] = ref_quantize(w, "block")
        deq[name] = ref_dequantize(tensors[name], tensors[name + "_scale_inv"], "block")
    path = write_checkpoint(tmp_path, tensors, quantization_config("block", (32, 32), False, False, []))
    with torch.device("meta"):
        model = RaggedQKV().bfloat16()
    fp8fx.load_checkpoint(model, path, progress=False)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    schemes, out = compile_fused(model, x)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        assert schemes[(name, i)] == ("w:per-block(32x32) a:per-group(1x32) not fused with q_proj,k_proj,v_proj: "
                                      "output sizes [48, 32] are not multiples of the 32-row weight blocks")
    for got, name in zip(out, ("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        assert rel_err(got.float(), x.double() @ deq[name].T) < 0.05


def test_layers_of_no_input_features_are_not_fused():
    """in_features 0 with 128x128 blocks (quantize_ takes them: 0 divides by 128): fusing them reshaped [n, 0] block
    scales to [-1, 0] and failed the compile; unfused they compute their biases."""
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(0, 128), torch.nn.Linear(0, 128)

        def forward(self, x):
            return torch.cat([self.q(x), self.k(x)], -1)

    model = Pair().to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=[128, 128]))
    x = torch.randn(3, 0, dtype=torch.bfloat16)
    torch._dynamo.reset()
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend=backend)(x), model(x))
    assert all(s.rewritten and "not fused with q,k: in_features is 0" in s.scheme for s in backend.report.sites), \
        backend.report


class _EitherOrder(torch.nn.Module):
    """q then k, or (``q_first`` False) k then q, k read before q_proj is called where ``read_k_first``."""

    def __init__(self, read_k_first=False):
        super().__init__()
        self.q_proj, self.k_proj, self.q_first = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32), True
        self.read_k_first = read_k_first

    def forward(self, x):
        if self.q_first:
            q = self.q_proj(x)
            k = self.k_proj(x)
        else:
            k = self.k_proj(x)
            k = k.sin() if self.read_k_first else k
            q = self.q_proj(x)
        return torch.cat([q, k], -1)


def test_a_graph_calling_fused_layers_in_another_order_keeps_their_tensor():
    """A second graph calling k before q fused them as [k; q], moving the weights into a new tensor: the first graph's
    [q; k] then ran as one GEMM per weight while its report said fused (found by a probe). The group takes the order
    the weights are stored in."""
    torch.manual_seed(0)
    model = _EitherOrder().to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        first = compiled(x)
        params = dict(model.named_parameters())
        stored = params["q_proj.weight"].untyped_storage().data_ptr()
        model.q_first = False
        second = compiled(x)
        ref = model(x)
    params = dict(model.named_parameters())
    assert params["q_proj.weight"].untyped_storage().data_ptr() == stored  # (not moved again)
    assert fp8fx.ops._adjacent([params["q_proj.weight"], params["k_proj.weight"]]) is not None
    assert backend.report.graphs == 2 and all(_fused(s.scheme, "q_proj,k_proj") for s in backend.report.sites), \
        backend.report
    assert torch.equal(first, second) and rel_err(second.float(), ref.float()) < 0.05


def test_a_group_fused_in_stored_order_goes_before_its_first_reader():
    """Fused in the order an earlier graph stored the weights (q, k), the GEMM went before q's node: after k's
    reader, which the compile then refused (found by review)."""
    torch.manual_seed(0)
    model = _EitherOrder(read_k_first=True).to(torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        compiled(x)
        model.q_first = False
        out = compiled(x)
        ref = model(x)
    assert backend.report.graphs == 2 and all(_fused(s.scheme, "q_proj,k_proj") for s in backend.report.sites)
    assert rel_err(out.float(), ref.float()) < 0.1


@torch.library.custom_op("fp8fx_test::halved", mutates_args=())
def _halved(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


@_halved.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_called_by_its_packet_reads_a_fused_output():
    """``torch.ops.ns.op(q)``: Dynamo keeps the packet, which has no namespace; the fused compile failed with
    AttributeError (found by review). The op gets a contiguous copy, as one called by its overload."""
    torch.manual_seed(0)
    model = TailedQK(lambda q, k: torch.ops.fp8fx_test.halved(q) + k[:, :1]).to(torch.bfloat16)
    fp8fx.quantize_(model)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    schemes, out = compile_fused(model, x)
    assert _fused(schemes[("q_proj", 0)], "q_proj,k_proj"), schemes
    assert rel_err(out.float(), ref.float()) < 0.1  # (fp8 activations' error, ~0.05; a layout read wrong: ~1)


def test_a_model_quantized_under_inference_mode_fuses():
    """quantize_ under torch.inference_mode makes the parameters inference tensors; the fused tensor made outside it
    replaced them, and every view of them failed ("Inference tensors do not track version counter"): the compile,
    and the model's own eager forward after it (found by a probe)."""
    torch.manual_seed(0)
    model = TailedQK(lambda q, k: torch.cat([q, k], -1)).to(torch.bfloat16)
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        fp8fx.quantize_(model)
        ref = model(x)
        backend = fp8fx.Fp8Backend(compiler="eager", fuse_horizontal=True)
        torch._dynamo.reset()
        out = torch.compile(model, backend=backend)(x)
        again = model(x)
    assert all(_fused(s.scheme, "q_proj,k_proj") for s in backend.report.sites), backend.report
    params = dict(model.named_parameters())
    assert params["q_proj.weight"].is_inference()
    assert fp8fx.ops._adjacent([params["q_proj.weight"], params["k_proj.weight"]]) is not None
    assert torch.equal(again, ref) and rel_err(out.float(), ref.float()) < 0.1



def test_layers_quantized_in_and_outside_inference_mode_are_kept_apart():
    """One layer's parameters inference tensors, the other's not: the fused tensor replaced some of them, the compile
    failed and the eager model after it too (found by review). The group stays apart, saying why."""
    torch.manual_seed(0)
    model = TailedQK(lambda q, k: torch.cat([q, k], -1)).to(torch.bfloat16)
    fp8fx.quantize_(model.q_proj)
    with torch.inference_mode():
        fp8fx.quantize_(model.k_proj)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        schemes, out = compile_fused(model, x)
        again = model(x)
    assert "some of their parameters are inference tensors" in schemes[("q_proj", 0)], schemes
    assert torch.equal(again, ref) and rel_err(out.float(), ref.float()) < 0.1
