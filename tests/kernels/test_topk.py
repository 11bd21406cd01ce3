"""fp8fx.topk's kernel (``fp8fx.kernels.topk``) against torch.topk: under the Triton interpreter on CPU, on the GPU;
and the op around it."""
import textwrap

import pytest
import torch

from tests.conftest import run_under_triton_interpreter

# the same checks on either device: ``DEVICE`` is set before this runs
CHECKS = textwrap.dedent(
    """
    import torch
    from fp8fx.kernels import topk as kernel

    def same(x, k, largest=True):
        values, indices = kernel.topk(x, k, largest)
        ref = torch.topk(x.cpu().float(), k, largest=largest)  # (CPU float32: the reference's own ties aside)
        assert values.dtype == x.dtype and indices.dtype == torch.int64, (values.dtype, indices.dtype)
        assert values.shape == indices.shape == (*x.shape[:-1], k), (values.shape, indices.shape)
        # bit for bit torch's values, in torch's order (NaN where torch has NaN); each index at its value, distinct
        v = values.cpu().float()
        assert torch.equal(v.isnan(), ref.values.isnan()) and torch.equal(v.nan_to_num(), ref.values.nan_to_num()), \\
            (x.shape, k, largest, v, ref.values)
        picked = torch.gather(x, -1, indices)
        assert torch.equal(picked.isnan(), values.isnan()), (x.shape, k)
        assert torch.equal(picked.nan_to_num().view(torch.int16 if x.element_size() == 2 else torch.int32),
                           values.nan_to_num().view(torch.int16 if x.element_size() == 2 else torch.int32))
        assert (indices.sort(-1).values.diff(dim=-1) > 0).all(), "an index twice"
        return indices

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, n, k in ((1, 128, 8), (3, 32, 4), (5, 256, 8), (2, 8, 8), (4, 1000, 32), (2, 4096, 3), (7, 100, 1),
                           (1, 1, 1)):
            x = torch.randn(rows, n, generator=g).to(dtype).to(DEVICE)
            for largest in (True, False):
                indices = same(x, k, largest)
                if dtype == torch.float32:  # distinct values: torch's indices exactly
                    ref = torch.topk(x.cpu(), k, largest=largest).indices
                    assert torch.equal(indices.cpu(), ref), (n, k, largest)
    # ties go to the lower index; NaN above everything (largest) and below nothing (smallest); -0.0 below +0.0
    special = [1.0, float("nan"), 3.0, 3.0, -0.0, 0.0, float("-inf"), float("inf")]
    x = torch.tensor([special], device=DEVICE)
    values, indices = kernel.topk(x, 8)
    assert indices.tolist() == [[1, 7, 2, 3, 0, 5, 4, 6]], indices
    assert str(values[0, 6].item()) == "-0.0" and str(values[0, 5].item()) == "0.0"
    assert kernel.topk(x, 8, largest=False)[1].tolist() == [[6, 4, 5, 0, 2, 3, 7, 1]]
    assert kernel.topk(torch.full((2, 64), 0.5, device=DEVICE), 5)[1].tolist() == [[0, 1, 2, 3, 4]] * 2
    # bf16 subnormals rank as their values (not flushed to 0), signed zeros as floats' bits do
    tiny = torch.tensor([[0.0, 1e-40, -1e-40, -0.0, 2e-39]], dtype=torch.bfloat16, device=DEVICE)
    assert kernel.topk(tiny, 5)[1].tolist() == [[4, 1, 0, 3, 2]], kernel.topk(tiny, 5)
    for dtype in (torch.bfloat16, torch.float16):  # NaNs (either sign) first in 16-bit too
        mixed = torch.tensor([[1.0, float("nan"), 2.0, -float("nan"), float("inf")]], dtype=dtype, device=DEVICE)
        assert kernel.topk(mixed, 5)[1].tolist() == [[1, 3, 4, 2, 0]], (dtype, kernel.topk(mixed, 5))
        assert kernel.topk(mixed, 5, largest=False)[1].tolist() == [[0, 2, 4, 1, 3]], dtype
    if DEVICE == "cuda":  # a -NaN first, its bits kept (the interpreter's loads and stores of bf16 NaN change them)
        nan = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16, device=DEVICE)
        nan.view(torch.int16)[0, 0] = -64  # 0xFFC0: -NaN (torch makes every bf16 NaN 0x7FC0)
        got = kernel.topk(nan, 2)[0].view(torch.int16)
        assert got.tolist() == [[-64, nan.view(torch.int16)[0, 1].item()]], got
    # a router's probabilities in bf16 (many ties), leading dims, a strided row, no rows
    probs = torch.randn(6, 4, 128, generator=g).softmax(-1).to(torch.bfloat16).to(DEVICE)
    same(probs, 8)
    wide = torch.randn(3, 256, generator=g, device="cpu").to(DEVICE)[:, ::2]
    same(wide, 6)
    values, indices = kernel.topk(torch.empty(0, 16, device=DEVICE), 4)
    assert values.shape == indices.shape == (0, 4)
    print("topk ok")
    """
)

# softmax_topk: the experts of the k largest logits; their softmax (over the row, or the k) against float64
SOFTMAX_CHECKS = textwrap.dedent(
    """
    import torch
    from fp8fx.kernels import topk as kernel

    if DEVICE == "cpu":  # the interpreter's float32 -> bf16 truncates; the GPU rounds to nearest
        from tests.triton_rounding import round_to_nearest
        round_to_nearest()

    def reference(x, ids, renormalize):
        probs = torch.gather(torch.softmax(x.cpu().double(), -1), -1, ids.cpu())
        return probs / probs.sum(-1, keepdim=True) if renormalize else probs

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, n, k in ((1, 128, 8), (3, 32, 4), (2, 4096, 3), (4, 100, 32), (5, 8, 8), (1, 1, 1)):
            x = (torch.randn(rows, n, generator=g) * 4).to(dtype).to(DEVICE)
            for renormalize in (False, True):
                for out_dtype in (torch.float32, torch.bfloat16):
                    weights, ids = kernel.softmax_topk(x, k, renormalize, out_dtype)
                    assert weights.dtype == out_dtype and ids.dtype == torch.int64 and ids.shape == (rows, k)
                    values, want_ids = kernel.topk(x, k)  # (the plain kernel: ties to the lower index)
                    assert torch.equal(ids, want_ids), (dtype, n, k)
                    ref = reference(x, ids, renormalize)
                    # float32: the exponentials' rounding (the GPU's tl.exp is ex2.approx of x * log2(e), the
                    # product's rounding 2^-24 of |x - max| < 40 here: 2.4e-6 relative, twice in a ratio);
                    # bf16: one rounding, 2^-8 relative, besides
                    bound = 8e-6 if out_dtype == torch.float32 else 2 ** -8 + 8e-6
                    err = ((weights.cpu().double() - ref).abs() / ref).max().item()
                    assert err <= bound, (dtype, rows, n, k, renormalize, out_dtype, err)
    # rows of -inf and NaN: -inf logits weigh 0; a NaN anywhere in the softmax makes the row's weights NaN, as torch's
    x = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")], [0.0, float("nan"), 1.0, 2.0],
                      [float("-inf")] * 4], device=DEVICE)
    for renormalize in (False, True):
        weights, ids = kernel.softmax_topk(x, 3, renormalize, torch.float32)
        assert ids[0].tolist() == [2, 0, 1], ids  # (the two -inf: the lower index)
        want = torch.tensor([1.0, 0.0, float("-inf")]).exp() / (1 + torch.tensor(1.0).exp())  # e/(1+e), 1/(1+e), 0
        assert torch.allclose(weights[0].cpu(), want, rtol=2e-6, atol=0), weights
        assert ids[1, 0].item() == 1 and weights[1:].isnan().all(), (renormalize, ids, weights)
    weights, ids = kernel.softmax_topk(torch.empty(0, 16, device=DEVICE), 4, True, torch.bfloat16)
    assert weights.shape == ids.shape == (0, 4)
    print("softmax_topk ok")
    """
)


# grouped_topk: a sigmoid router's (DeepSeek-V3's) experts and weights, against the op's torch code
GROUPED_CHECKS = textwrap.dedent(
    """
    import torch
    from fp8fx.kernels import topk as kernel

    g = torch.Generator().manual_seed(3)
    inf = float("inf")
    # (rows, E, groups, topk_group, k, renormalize, scale, fill, bias dtype): DeepSeek-V3's router (256 experts, 8
    # groups, 4 kept, top 8, x2.5), Nemotron-3-Nano's (128, one group, top 6), a masked fill of 0.0, a bf16 bias,
    # every group kept, one expert a group pair; expert counts not powers of 2 where no group is dropped
    cases = [(3, 256, 8, 4, 8, True, 2.5, -inf, torch.float32), (2, 128, 1, 1, 6, True, 1.0, -inf, torch.float32),
             (4, 64, 4, 1, 4, False, 1.0, 0.0, torch.float32), (5, 32, 8, 3, 5, True, 1.5, -inf, torch.bfloat16),
             (1, 16, 4, 4, 3, True, 1.0, -inf, torch.float32), (2, 16, 8, 2, 4, True, 1.0, -inf, torch.float32),
             (2, 160, 1, 1, 8, True, 2.5, -inf, torch.float32), (3, 384, 1, 1, 8, True, 2.827, -inf, torch.float32),
             (2, 96, 4, 4, 6, False, 1.0, -inf, torch.float32)]  # (GLM-4.5's 160, Kimi-K2's 384: one group)
    for rows, e, groups, topk_group, k, renormalize, scale, fill, bias_dtype in cases:
        x = (torch.randn(rows, e, generator=g) * 2).to(DEVICE)
        bias = (torch.randn(e, generator=g) * 0.5).to(bias_dtype).to(DEVICE)
        assert kernel.grouped_reason(x, k, groups, topk_group) == ""
        weights, ids = kernel.grouped_topk(x, bias, k, groups, topk_group, renormalize, 1e-20, scale, fill)
        want_w, want_ids = torch.ops.fp8fx.grouped_topk(x.cpu(), bias.cpu(), k, groups, topk_group, renormalize,
                                                        1e-20, scale, fill)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (rows, k)
        assert torch.equal(ids.cpu(), want_ids), (rows, e, groups, topk_group, k, ids, want_ids)
        # float32: the sigmoids' and the sum's rounding (a lost renormalization or scale is off by far more)
        assert torch.allclose(weights.cpu(), want_w, rtol=4e-6, atol=0), (rows, e, groups, weights, want_w)
        if fill == -inf:  # only experts of the kept groups (k fits in them here)
            for row in (ids.cpu() // (e // groups)).tolist():
                assert len(set(row)) <= topk_group, (e, groups, topk_group, row)
    # a 0.0 fill where the kept groups' choices are negative (the masked experts win, by index), -inf past the kept
    # groups' experts (k 6 of 2 groups of 2), a NaN logit (its group and expert first, the row's weights NaN): as the
    # op's torch code
    x = torch.randn(3, 16, generator=g).to(DEVICE)
    x[2, 5] = float("nan")
    for bias, k, fill in ((torch.full((16,), -3.0), 4, 0.0), (torch.zeros(16), 6, -inf), (torch.zeros(16), 3, -inf)):
        got = kernel.grouped_topk(x, bias.to(DEVICE), k, 8, 2, True, 1e-20, 1.0, fill)
        want = torch.ops.fp8fx.grouped_topk(x.cpu(), bias, k, 8, 2, True, 1e-20, 1.0, fill)
        assert torch.equal(got[1].cpu(), want[1]), (fill, k, got[1], want[1])
        assert torch.allclose(got[0].cpu(), want[0], rtol=4e-6, atol=0, equal_nan=True), (fill, k, got[0], want[0])
        assert got[0][2].isnan().all() and got[1][2, 0].item() == 5
    # ties: equal logits and bias rank by index, groups too
    weights, ids = kernel.grouped_topk(torch.zeros(1, 16, device=DEVICE), torch.zeros(16, device=DEVICE), 3, 4, 2,
                                       True, 1e-20, 1.0, -inf)
    assert ids.tolist() == [[0, 1, 2]] and torch.allclose(weights.cpu(), torch.full((1, 3), 1 / 3)), (ids, weights)
    # what the kernel does not take, said
    assert "logits of torch.bfloat16" in kernel.grouped_reason(torch.empty(1, 64, dtype=torch.bfloat16), 4, 1, 1)
    assert "160 experts in 8 groups, 3 kept" in kernel.grouped_reason(torch.empty(1, 160), 6, 8, 3)
    assert kernel.grouped_reason(torch.empty(1, 160), 6, 1, 1) == ""
    assert "5000 experts" in kernel.grouped_reason(torch.empty(1, 5000), 6, 1, 1)
    assert "k=40" in kernel.grouped_reason(torch.empty(1, 64), 40, 1, 1)
    print("grouped_topk ok")
    """
)


def test_topk_kernel_under_triton_interpreter():
    """Values bit for bit torch.topk's in every dtype, largest and smallest, rows of 1-4096 and k of 1-32; indices
    torch's where values are distinct, the lower one of a tie; NaN, +-inf and signed zeros in torch's order."""
    out = run_under_triton_interpreter(["-c", "DEVICE = 'cpu'\n" + CHECKS])
    assert "topk ok" in out


@pytest.mark.cuda
def test_topk_kernel_cuda():
    exec(compile("DEVICE = 'cuda'\n" + CHECKS, "topk_checks", "exec"), {})


def test_softmax_topk_kernel_under_triton_interpreter():
    """The experts of the k largest logits (the plain kernel's, ties to the lower index), their softmax over the row
    or renormalized over the k within float32's rounding of the float64 softmax or one bf16 rounding, in float32,
    bf16 and fp16 rows of 1-4096 and k of 1-32; -inf logits weigh 0, a NaN makes its row's weights NaN."""
    out = run_under_triton_interpreter(["-c", "DEVICE = 'cpu'\n" + SOFTMAX_CHECKS])
    assert "softmax_topk ok" in out


@pytest.mark.cuda
def test_softmax_topk_kernel_cuda():
    exec(compile("DEVICE = 'cuda'\n" + SOFTMAX_CHECKS, "softmax_topk_checks", "exec"), {})


def test_grouped_topk_kernel_under_triton_interpreter():
    """A sigmoid router's grouped top-k in one launch: the op's torch code's experts exactly, its weights within
    float32 rounding, at DeepSeek-V3's and Nemotron-3-Nano's shapes, a 0.0 fill, a bf16 bias, ties to the lower
    index; what the kernel does not take, said."""
    out = run_under_triton_interpreter(["-c", "DEVICE = 'cpu'\n" + GROUPED_CHECKS])
    assert "grouped_topk ok" in out


@pytest.mark.cuda
def test_grouped_topk_kernel_cuda():
    exec(compile("DEVICE = 'cuda'\n" + GROUPED_CHECKS, "grouped_topk_checks", "exec"), {})


def test_grouped_topk_op_is_hf_deepseek_routing_on_cpu():
    """``fp8fx.grouped_topk`` off CUDA against DeepSeek-V3's routing as transformers 5 writes it (zeros_like,
    scatter_, masked_fill, unsorted top-ks): the same experts (as sets) and weights; bad shapes refused, naming them."""
    g = torch.Generator().manual_seed(4)
    x, bias = torch.randn(5, 64, generator=g) * 2, torch.randn(64, generator=g) * 0.3
    groups, topk_group, k, scale = 8, 3, 6, 2.5
    scores = x.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, groups, 64 // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    mask = group_mask.unsqueeze(-1).expand(-1, groups, 64 // groups).reshape(-1, 64)
    ids = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale
    got_w, got_ids = torch.ops.fp8fx.grouped_topk(x, bias, k, groups, topk_group, True, 1e-20, scale, float("-inf"))
    order, got_order = ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(order.values, got_order.values)
    assert torch.allclose(weights.gather(1, order.indices), got_w.gather(1, got_order.indices), rtol=1e-6, atol=0)
    # an eps that is not negligible is the model's own: it divides with it
    got_w, _ = torch.ops.fp8fx.grouped_topk(x, bias, k, groups, topk_group, True, 1.0, scale, float("-inf"))
    want = scores.gather(1, ids) / (scores.gather(1, ids).sum(dim=-1, keepdim=True) + 1.0) * scale
    assert torch.allclose(want.gather(1, order.indices), got_w.gather(1, got_order.indices), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"fp8fx.grouped_topk: k=6, 3 of 7 groups of 64 experts"):
        torch.ops.fp8fx.grouped_topk(x, bias, 6, 7, 3, True, 1e-20, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"logits \(5, 64\) torch.bfloat16"):
        torch.ops.fp8fx.grouped_topk(x.bfloat16(), bias, 6, 8, 3, True, 1e-20, 1.0, 0.0)


def test_softmax_topk_op_on_cpu():
    """``fp8fx.softmax_topk`` off CUDA: torch's top-k of the logits, their softmax (renormalized: over the k) in
    ``out_dtype``; its fake impl's shapes and dtypes; bad k and dtypes refused, naming them."""
    x = torch.randn(3, 5, 40, dtype=torch.bfloat16)
    for renormalize in (False, True):
        weights, ids = torch.ops.fp8fx.softmax_topk(x, 6, renormalize, torch.float32)
        assert torch.equal(ids, torch.topk(x, 6).indices)
        probs = torch.gather(torch.softmax(x.double(), -1), -1, ids)
        want = probs / probs.sum(-1, keepdim=True) if renormalize else probs
        assert torch.allclose(weights.double(), want, rtol=1e-6, atol=0)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        weights, ids = torch.ops.fp8fx.softmax_topk(torch.empty(2, 9, dtype=torch.float32), 4, True, torch.bfloat16)
    assert weights.shape == ids.shape == (2, 4) and weights.dtype == torch.bfloat16 and ids.dtype == torch.int64
    with pytest.raises(RuntimeError, match=r"fp8fx.softmax_topk: k=41 of a last dim of \(40,\)"):
        torch.ops.fp8fx.softmax_topk(x, 41, True, torch.float32)
    with pytest.raises(ValueError, match=r"fp8fx.softmax_topk: logits torch.float64, out_dtype torch.float32"):
        torch.ops.fp8fx.softmax_topk(x.double(), 4, True, torch.float32)
    with pytest.raises(ValueError, match=r"logits torch.bfloat16, out_dtype torch.int32"):
        torch.ops.fp8fx.softmax_topk(x, 4, True, torch.int32)


def test_topk_op_is_torch_topk_on_cpu():
    """``fp8fx.topk`` off CUDA is torch's, sorted; its fake impl's shapes; bad k is refused, naming it."""
    x = torch.randn(3, 5, 40)
    for largest in (True, False):
        got = torch.ops.fp8fx.topk(x, 7, largest)
        want = torch.topk(x, 7, largest=largest)
        assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        values, indices = torch.ops.fp8fx.topk(torch.empty(2, 9, dtype=torch.bfloat16), 4, True)
    assert values.shape == indices.shape == (2, 4) and values.dtype == torch.bfloat16 and indices.dtype == torch.int64
    with pytest.raises(RuntimeError, match=r"fp8fx.topk: k=41 of a last dim of \(40,\)"):
        torch.ops.fp8fx.topk(x, 41, True)
    with pytest.raises(RuntimeError, match=r"k=1 of a last dim of \(a 0-d tensor\)"):
        torch.ops.fp8fx.topk(torch.tensor(1.0), 1, True)


def test_topk_kernel_reason():
    """What the kernel does not take, said with the value."""
    from fp8fx.kernels.topk import reason

    assert reason(torch.empty(2, 128), 8) == ""
    assert "dtype torch.float64" in reason(torch.empty(2, 128, dtype=torch.float64), 8)
    assert "k=33" in reason(torch.empty(2, 128), 33) and "k=0" in reason(torch.empty(2, 128), 0)
    assert "a row of 4097 elements" in reason(torch.empty(1, 4097), 8)
    assert "a row of 4 elements" in reason(torch.empty(1, 4), 8)


def test_routing_ops_pass_opcheck():
    """torch.library.opcheck on the routing ops (CPU): the fake impls' shapes, dtypes and strides are the real ones'
    (a sliced sort's indices once were not: Inductor's code asserted the fake's strides)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=g)
    torch.library.opcheck(torch.ops.fp8fx.softmax_topk.default, (x.bfloat16(), 4, True, torch.bfloat16))
    torch.library.opcheck(torch.ops.fp8fx.topk.default, (x, 4, True))
    for groups, topk_group in ((4, 2), (1, 1)):
        torch.library.opcheck(torch.ops.fp8fx.grouped_topk.default,
                              (x, torch.randn(32, generator=g), 4, groups, topk_group, True, 1e-20, 2.5, float("-inf")))
