"""The Triton fp8 GEMM (fp8fx.kernels.fp8_gemm) against the reference op.

On the GPU: odd shapes, every tile configuration, both scale schemes. On CPU (CI): the same kernel
under Triton's interpreter, in a subprocess because TRITON_INTERPRET must be set before Triton
compiles the kernel. The kernel only loads fp8 and runs tl.dot on it (exact in the interpreter); the
fp32 -> fp8 conversion that the interpreter gets wrong for ~3% of values (triton 3.6 and 3.9,
FACTS.md) happens outside, in torch.
"""
import re
import textwrap

import numpy as np

import pytest
import torch

import fp8fx
from fp8fx import quant
from tests.conftest import assert_graph_replays_equal, run_under_triton_interpreter


def reference(xq, xs, x_block, wq, ws, w_block, bias, dtype):
    return quant.scaled_mm_reference(xq.cpu(), xs.cpu(), x_block, wq.cpu(), ws.cpu(), w_block,
                                     None if bias is None else bias.cpu(), torch.float64)


def operands(m, n, k, x_block, w_block, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    xq, xs = quant.quantize(torch.randn(m, k, generator=g), x_block)
    wq, ws = quant.quantize(torch.randn(n, k, generator=g), w_block)
    bias = torch.randn(n, generator=g)
    return [t.to(device) for t in (xq, xs, wq, ws, bias)]


# (40, 200, 512): 17-64 rows with K a multiple of 16, where the default 64-row tile loads both operands by TMA
# (elsewhere the descriptors cannot address the rows and the kernel takes pointer loads); (40, 4096, 1100): the
# unsplit tile of K steps of 512 (run 32), the last one ragged
SHAPES = [(1, 96, 160), (7, 200, 300), (16, 4096, 512), (40, 200, 512), (40, 4096, 1100), (64, 130, 1000),
          (129, 257, 384)]
SCHEMES = [([1, -1], [1, -1]), ([-1, -1], [-1, -1]), ([1, -1], [-1, -1])]


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("x_block,w_block", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemm_cuda(m, n, k, x_block, w_block, dtype):
    from fp8fx.kernels.fp8_gemm import fp8_gemm, gemv_config, mma_tile_config

    xq, xs, wq, ws, bias = operands(m, n, k, x_block, w_block, "cuda")
    ref = reference(xq, xs, x_block, wq, ws, w_block, bias, dtype)
    # (the 64-row default loads both operands by TMA copies where the rows allow it; pointers64: the same tile with
    # pointer loads)
    pointers64 = mma_tile_config(64, n, k, transposed=False)
    configs = [mma_tile_config(cfg_m, n, k) for cfg_m in (1, 64, 4096)] + [{**mma_tile_config(1, n, k), "SPLIT_K": 3}]
    configs.append(pointers64)
    # the long-K (split) decode tiles; 17-63 rows: the weight alone by TMA (run 29)
    configs += [mma_tile_config(cfg_m, 4096, 14336) for cfg_m in (1, 32, 64)]
    configs.append(mma_tile_config(64, 4096, 4096))  # 64 rows of a weight with few N tiles: 32 wide, split K
    configs.append(mma_tile_config(32, 4096, 4096))  # the same at 17-63 rows: the weight alone by TMA
    configs.append({**configs[-1], "SPLIT_K": 4})
    # 17-32 rows: 32-row transposed tiles, the weight by TMA (run 33)
    configs += [mma_tile_config(24, cfg_n, cfg_k)
                for cfg_n, cfg_k in ((4096, 14336), (6144, 4096), (4096, 4096), (28672, 4096))]  # (gate_up: run 34)
    configs.append(mma_tile_config(48, 28672, 4096))  # 33-63 rows of gate_up: 64 rows, the weight alone by TMA
    configs.append(mma_tile_config(24, 4096, 14336, long_steps=False))  # (K steps of 128, 6 stages)
    # the weight alone by TMA copies (rows of K % 16 == 0 bytes)
    configs += [{**cfg, "TMA": True} for cfg in (configs[0], pointers64)]
    # the product transposed (wgmma with the weight tile on the left), split K or not, TMA or not
    configs += [{**mma_tile_config(1, n, k), "SWAP_AB": True, "SPLIT_K": split, "TMA": tma}
                for split in (1, 3) for tma in (False, True)]
    # the activations by TMA copies too (TMA_A; ragged M) in the transposed tile
    configs.append({**configs[-1], "TMA_A": True})
    if m == 1:  # the GEMV kernel: its tile, split K (ragged splits), a K step that leaves a ragged last one
        configs += [gemv_config(n, k), {**gemv_config(n, k), "SPLIT_K": 3}, {**gemv_config(n, k), "BLOCK_K": 128},
                    gemv_config(4096, 14336)]
    for cfg in configs:  # every tile configuration on every shape, split K, TMA, GEMV
        y = fp8_gemm(xq, wq, xs, ws, bias.to(dtype), dtype, config=cfg)
        assert y.dtype == dtype and y.shape == (m, n)
        err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (cfg, err)  # the output cast to bf16 is the only rounding left


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 64, 65, 2048])
def test_scaled_mm_op_cuda_matches_reference(m):
    """The CUDA op (Triton for m <= 64, cuBLAS above, fast accumulation on and off)."""
    n, k = 512, 1024
    xq, xs, wq, ws, bias = operands(m, n, k, [1, -1], [1, -1], "cuda")
    ref = reference(xq, xs, [1, -1], wq, ws, [1, -1], bias, torch.bfloat16)
    for fast in (False, True):
        y = torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, bias.bfloat16(), [1, -1], [1, -1], torch.bfloat16, fast)
        err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (fast, err)


def test_cublas_block_dispatch_rule():
    from fp8fx.ops import cublas_block_fits

    fits = lambda m, n, k: cublas_block_fits(m, n, k, [1, 128], [128, 128], torch.bfloat16)  # noqa: E731
    if not hasattr(torch.nn.functional, "scaled_mm"):
        pytest.skip("this torch has no F.scaled_mm")
    assert fits(80, 256, 512) and fits(2048, 28672, 4096) and fits(4096, 4096, 14336)
    assert not fits(1, 256, 512) and not fits(16, 256, 512) and not fits(64, 256, 512)  # decode: Triton
    assert not fits(2049, 256, 512)  # M not a multiple of 16
    assert not fits(80, 200, 512) and not fits(80, 256, 384)  # ragged blocks; K/128 = 3 (torch 2.11 refuses)
    assert not cublas_block_fits(80, 256, 512, [1, 128], [128, 128], torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("m,k", [(m, k) for m in (1, 3, 16, 80, 2048, 2049) for k in (384, 512)]
                         + [(3, 1024), (16, 1024), (3, 7168), (16, 7168)])
def test_block_scaled_op_cuda_matches_reference(m, k):
    """The CUDA op with 1x128 x 128x128 blocks: cuBLAS's block GEMM where ``cublas_block_fits`` (M > 64 and
    a multiple of 16, K/128 a multiple of 4 here), the Triton kernel elsewhere (at 2-16 rows and K >= 1024 its
    transposed, split tile, each K step's scales on the transposed accumulator); bias added either way."""
    n = 256
    xq, xs, wq, ws, bias = operands(m, n, k, [1, 128], [128, 128], "cuda")
    ref = reference(xq, xs, [1, 128], wq, ws, [128, 128], bias, torch.bfloat16)
    y = torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, bias.bfloat16(), [1, 128], [128, 128], torch.bfloat16)
    err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, (m, k, err)


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(16, 4096, 14336), (3, 6144, 4096)])
def test_transposed_tiles_with_fast_accumulation_cuda(m, n, k):
    """The 2-16-row tiles transposed since run 20 run wgmma, which with fast accumulation (the backend's default)
    sums each split's K (3584 of Llama-3-8B's down) without promoting to float32, where the mma.sync tiles summed in
    float32: against float64 on the same codes, within twice cuBLAS's error with fast accumulation."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm, tile_config

    assert tile_config(m, n, k).get("SWAP_AB")
    xq, xs, wq, ws, _ = operands(m, n, k, [1, -1], [1, -1], "cuda")
    ref = reference(xq, xs, [1, -1], wq, ws, [1, -1], None, torch.float32)
    err = lambda y: ((y.double().cpu() - ref).norm() / ref.norm()).item()  # noqa: E731
    ours = err(fp8_gemm(xq, wq, xs, ws, None, torch.float32, fast_accum=True))
    cublas = err(torch._scaled_mm(xq, wq.t(), scale_a=xs.reshape(-1, 1), scale_b=ws.reshape(1, -1),
                                  out_dtype=torch.float32, use_fast_accum=True))
    promoted = err(fp8_gemm(xq, wq, xs, ws, None, torch.float32, fast_accum=False))
    assert ours <= max(2 * cublas, 1e-6) and promoted <= 1.5 * ours + 1e-6, (ours, cublas, promoted)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg_m", [1, 64, 4096])
def test_fp8_gemm_cuda_addresses_past_2_31(cfg_m):
    """M * K = 300000 * 7168 > 2**31 elements of A: the rows past that point are only right with 64-bit
    tile bases; the kernel's 32-bit offsets stay inside a tile. (The output, M * N, stays under 2**31.)"""
    from fp8fx.kernels.fp8_gemm import fp8_gemm, mma_tile_config

    m, n, k = 300_000, 128, 7168
    g = torch.Generator(device="cuda").manual_seed(0)
    xq = (torch.rand(m, k, device="cuda", generator=g) * 2 - 1).to(quant.FP8_DTYPE)  # codes in [-1, 1]
    xs = torch.rand(m, 1, device="cuda", generator=g) + 0.5
    wq, ws = (t.cuda() for t in quant.quantize(torch.randn(n, k), [1, -1]))
    # pointer loads (transposed=False: no TMA copies; the 64-bit bases are what is tested) and the default tile
    for cfg in ({**mma_tile_config(cfg_m, n, k, transposed=False), "SPLIT_K": 2 if cfg_m == 1 else 1},
                mma_tile_config(cfg_m, n, k)):
        y = fp8_gemm(xq, wq, xs, ws, None, torch.float32, config=cfg)
        rows = torch.tensor([0, 1, m // 2, m - 2, m - 1])
        ref = reference(xq[rows], xs[rows], [1, -1], wq, ws, [1, -1], None, torch.float32)
        err = ((y[rows].double().cpu() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-3, (cfg, err)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["gemv", "mma"])
def test_split_k_cuda_graph_replays(kernel):
    """Split K sums in the kernel behind per-tile tickets: plain launches and replays of a captured graph
    (its tickets zeroed inside the graph) stay bit-equal, in the GEMV kernel and the tensor-core one."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm, gemv_config, mma_tile_config

    m, n, k = 1, 4096, 14336
    xq, xs, wq, ws, _ = operands(m, n, k, [1, -1], [1, -1], "cuda")
    cfg = {**gemv_config(n, k), "SPLIT_K": 7} if kernel == "gemv" else mma_tile_config(m, n, k)
    assert cfg["SPLIT_K"] > 1, cfg
    eager = [fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg) for _ in range(3)]
    assert all(torch.equal(e, eager[0]) for e in eager)
    ref = reference(xq, xs, [1, -1], wq, ws, [1, -1], None, torch.float64)
    assert ((eager[0].double().cpu() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert_graph_replays_equal(lambda: fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg), eager[0])


@pytest.mark.cuda
@pytest.mark.parametrize("m,n", [(1, 256), (2, 4096)])
def test_split_k_under_inductor_cudagraph_trees(m, n):
    """Decode GEMMs with split K (K=14336: the GEMV at one token of a 256-row weight, the tensor-core tile at two
    tokens) inside Fp8Backend(cudagraphs=True): the warm-up call runs in the trees' memory pool and later calls
    are replays; each call matches the plain compiled model's output."""
    from fp8fx.kernels.fp8_gemm import tile_config

    assert tile_config(m, n, 14336)["SPLIT_K"] > 1 and tile_config(m, n, 14336).get("GEMV", False) == (m == 1)
    torch.manual_seed(0)
    x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    model = torch.nn.Linear(14336, n, bias=False).cuda().to(torch.bfloat16)
    fp8fx.quantize_(model)
    with torch.no_grad():
        want = torch.compile(model, backend=fp8fx.Fp8Backend())(x).clone()
        torch._dynamo.reset()
        graphed = torch.compile(model, backend=fp8fx.Fp8Backend(cudagraphs=True))
        for _ in range(4):
            torch.testing.assert_close(graphed(x).clone(), want, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(1, 4096, 14336), (1, 96, 160), (7, 200, 304), (24, 6144, 4096), (24, 28672, 4096),
                                   (40, 4096, 1104), (64, 4096, 14336)])
def test_pdl_launches_and_trigger_cuda(m, n, k):
    """Launched as a programmatic dependent, with and without ``PDL_TRIGGER``, each default tile (the GEMV at one row,
    split K, K steps of 512 with a ragged last one, ragged N) gives the plain launch's bits; the GEMV's with its
    weight's first step loaded before the wait too (``PRE_WAIT``), and with its first 2 or 4 the same sums in
    another order."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm, for_device, tile_config

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    xq, xs, wq, ws, bias = operands(m, n, k, [1, -1], [1, -1], "cuda")
    cfg = for_device(tile_config(m, n, k), xq.device)
    plain = fp8_gemm(xq, wq, xs, ws, bias.bfloat16(), torch.bfloat16, config=cfg, pdl=False)
    pre_cfgs = [{**cfg, "PRE_WAIT": 1}, {**cfg, "PDL_TRIGGER": True, "PRE_WAIT": 1}] if cfg.get("GEMV") else []
    for pdl_cfg in (cfg, {**cfg, "PDL_TRIGGER": True}, *pre_cfgs):
        assert torch.equal(fp8_gemm(xq, wq, xs, ws, bias.bfloat16(), torch.bfloat16, config=pdl_cfg, pdl=True),
                           plain), pdl_cfg
    for steps in (2, 4) if cfg.get("GEMV") else ():
        early = fp8_gemm(xq, wq, xs, ws, bias.bfloat16(), torch.bfloat16, config={**cfg, "PRE_WAIT": steps}, pdl=True)
        torch.testing.assert_close(early, plain, rtol=1e-2, atol=1e-2 * plain.abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 64])
def test_pdl_chain_reads_what_the_launch_before_wrote_cuda(m):
    """A slow GEMM (a 14336 x 14336 weight), then two small ones, each reading the one before's bf16 output (quantized as
    loaded by a static scale), captured in a CUDA graph with every launch a programmatic dependent that lets the next
    one start once it has waited, the GEMV (one row) with its weight's first step loaded before (``PRE_WAIT``) or not:
    each replay on new x gives the plain launches' output for that x. A GEMM that read its input before the slow one
    had written it would give the last replay's (or a mix)."""
    from fp8fx.kernels.fp8_gemm import QUANT_STATIC, fp8_gemm, for_device, tile_config

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    g = torch.Generator().manual_seed(1)
    sizes = [(14336, 14336), (4096, 14336), (1024, 4096)]  # [N, K] of each GEMM, in turn
    weights = [quant.quantize(torch.randn(n, k, generator=g) / k**0.5, [1, -1]) for n, k in sizes]
    weights = [(w.cuda(), s.cuda()) for w, s in weights]
    static = torch.tensor([4.0 / 448], device="cuda")
    x = torch.empty(m, 14336, device="cuda", dtype=torch.bfloat16)

    def layers(pdl: bool, pre_wait: int = 0):
        h = x
        for (w, s), (n, k) in zip(weights, sizes):
            tile = for_device(tile_config(m, n, k, a_quant=True), x.device)
            tile = {**tile, "PDL_TRIGGER": True} if pdl else tile
            tile = {**tile, "PRE_WAIT": pre_wait} if pdl and tile.get("GEMV") else tile
            h = fp8_gemm(h, w, static, s, None, torch.bfloat16, config=tile, a_quant=QUANT_STATIC, pdl=pdl)
        return h

    for pre_wait in (0, 1):
        x.copy_(torch.randn(m, 14336, generator=g))
        assert torch.equal(layers(True, pre_wait), layers(False))  # (and compiled before the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layers(True, pre_wait)
        for _ in range(4):
            x.copy_(torch.randn(m, 14336, generator=g))
            want = layers(False)
            graph.replay()
            torch.cuda.synchronize()
            assert want.abs().max() > 0 and torch.equal(y, want), pre_wait


@pytest.mark.cuda
def test_decode_pdl_setting_cuda(monkeypatch):
    """``DECODE_PDL``: default launches of 1-64 rows (the GEMV, the 32-row transposed tile, split K) go as programmatic
    dependents - by default without keys, or with ``PDL_TRIGGER``, and ``PRE_WAIT`` (the GEMV's: the tensor-core
    tiles leave it) - and give the same bits as plain launches, called and as CUDA-graph replays; 65 rows and a given
    config go plainly."""
    from fp8fx.kernels import fp8_gemm as kernels

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("DECODE_PDL applies on sm_90 only, where it is timed")
    taken = []
    keys_of = kernels.decode_pdl_keys
    monkeypatch.setattr(kernels, "decode_pdl_keys",
                        lambda b, m, gemv=False: taken.append(keys_of(b, m, gemv=gemv)) or taken[-1])
    for m, n, k in ((1, 4096, 14336), (24, 6144, 4096), (64, 4096, 14336), (65, 256, 512)):
        xq, xs, wq, ws, _ = operands(m, n, k, [1, -1], [1, -1], "cuda")
        want = kernels.fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, pdl=False)
        run = lambda: kernels.fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16)  # noqa: E731
        for keys in ({}, {"PDL_TRIGGER": True}, {"PDL_TRIGGER": True, "PRE_WAIT": 1}):  # (PRE_WAIT: the GEMV's)
            monkeypatch.setattr(kernels, "DECODE_PDL", keys)
            taken.clear()
            assert torch.equal(run(), want), (m, n, k, keys)
            gemv_keys = keys if m == 1 else {key: v for key, v in keys.items() if key != "PRE_WAIT"}
            assert taken == [None if m > 64 else gemv_keys], (m, taken)
            assert_graph_replays_equal(run, want)
        taken.clear()
        kernels.fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=kernels.tile_config(m, n, k))
        assert taken == []


def test_pdl_tile_keys_are_checked_before_a_launch(monkeypatch):
    """``PDL_TRIGGER`` in a config: sm_90 and newer only (the CPU is refused, naming the key). ``DECODE_PDL``: on by
    default without keys, ``PDL_TRIGGER`` and ``PRE_WAIT`` (the GEMV's alone, of 0, 1, 2, 4) its keys, on sm_90
    only, up to 64 rows; None turns it off."""
    from fp8fx.kernels import fp8_gemm as kernels

    xq, xs, wq, ws, _ = operands(2, 64, 256, [1, -1], [1, -1], "cpu")
    with pytest.raises(ValueError, match="PDL_TRIGGER=True needs a CUDA GPU of compute capability 9.0 or newer; a is "
                                         "on cpu"):
        kernels.fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16,
                         config={**kernels.tile_config(2, 64, 256), "PDL_TRIGGER": True})
    w = torch.empty(64, 256, dtype=torch.uint8)
    assert kernels.DECODE_PDL == {} and kernels.decode_pdl_keys(w, 1) is None  # (not on sm_90: the CPU)
    # (as on the H200)
    monkeypatch.setattr(kernels, "_hopper", lambda t, exactly=False: True)
    kernels._check_pdl_keys({"PDL_TRIGGER": True}, xq)
    assert kernels.decode_pdl_keys(w, 64) == {} and kernels.decode_pdl_keys(w, 65) is None
    keys = {"PDL_TRIGGER": True}
    monkeypatch.setattr(kernels, "DECODE_PDL", keys)
    assert kernels.decode_pdl_keys(w, 1) == keys and kernels.decode_pdl_keys(w, 1) is not keys
    monkeypatch.setattr(kernels, "DECODE_PDL", None)
    assert kernels.decode_pdl_keys(w, 1) is None
    for bad in ({"L2_PREFETCH": 4096}, {**keys, "BLOCK_N": 32}):
        monkeypatch.setattr(kernels, "DECODE_PDL", bad)
        with pytest.raises(ValueError, match=r"DECODE_PDL: keys \['(L2_PREFETCH|BLOCK_N)'\]; it takes "
                                             r"\['PDL_TRIGGER', 'PRE_WAIT'\]"):
            kernels.decode_pdl_keys(w, 1)
    # PRE_WAIT: the GEMV's (gemv=True) alone; a value it does not take refused at any launch, wherever it applies
    monkeypatch.setattr(kernels, "DECODE_PDL", {**keys, "PRE_WAIT": 2})
    assert kernels.decode_pdl_keys(w, 1, gemv=True) == {**keys, "PRE_WAIT": 2}
    assert kernels.decode_pdl_keys(w, 16) == kernels.decode_pdl_keys(w, 1) == keys
    for bad in (3, 2.0, True, "2"):
        monkeypatch.setattr(kernels, "DECODE_PDL", {"PRE_WAIT": bad})
        for m in (1, 65):
            with pytest.raises(ValueError, match=rf"DECODE_PDL: PRE_WAIT={bad!r}; it takes one of \[0, 1, 2, 4\]"):
                kernels.decode_pdl_keys(w, m, gemv=True)
    monkeypatch.setattr(kernels, "DECODE_PDL", keys)
    monkeypatch.setattr(kernels, "_hopper", lambda t, exactly=False: not exactly)  # (a GPU after sm_90: not timed)
    assert kernels.decode_pdl_keys(w, 1) is None


def test_25_to_64_rows_of_few_n_tiles_take_long_unsplit_k_steps():
    """tile_config at 25-64 rows: o 4096x4096 (128 32-wide N tiles, at most one an SM) one program a tile over the
    whole K in steps of 512 (H200 run 32); qkv 6144x4096 (192), K groups and 16-bit activations quantized in the
    kernel keep other tiles (the 32-row transposed one up to 32 rows, run 33), GPUs before Hopper (untransposed) the
    64-wide one, all in K steps of 128 or 256; 2-16 rows and the long K of down keep theirs."""
    from fp8fx.kernels.fp8_gemm import tile_config

    for m in (25, 32, 40, 64):
        assert tile_config(m, 4096, 4096) == dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, num_warps=4,
                                                  num_stages=4)
        for other in (tile_config(m, 6144, 4096), tile_config(m, 4096, 4096, k_groups=True),
                      tile_config(m, 4096, 4096, a_quant=True), tile_config(m, 4096, 4096, transposed=False)):
            assert other["BLOCK_K"] < 512, other
    assert tile_config(16, 4096, 4096)["BLOCK_K"] == 128 and tile_config(64, 4096, 14336)["BLOCK_K"] == 256


def test_17_to_32_rows_take_32_row_transposed_tiles():
    """tile_config at 17-32 rows of fp8 activations (H200 run 33, ``tune_gemm.py --rows32``): down 4096x14336 and
    qkv 6144x4096 transposed in 32-row tiles, 64 weight rows each, the weight by TMA - down's K split in 4, qkv's not
    (96 programs), in steps of 256 (128 and 6 stages with K groups or 16-bit activations); o 4096x4096 the same, K
    split in 2, up to 24 rows, where the long-step tile keeps 25-64; gate_up 28672x4096 (448 N tiles) unsplit in
    steps of 128, 4 stages (run 34). 16-bit activations on GPUs before Hopper (untransposed), 33-64 rows, gate
    14336x4096 (224 N tiles: the weight alone by TMA) and the fused MLP's down GEMM of h in 1 x 128 groups (the 32-row
    tile lost inside the op) keep their 64-row tiles (run 34)."""
    from fp8fx.kernels.fp8_gemm import tile_config
    from fp8fx.kernels.gated_mlp import down_tile_config

    row32 = dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=1, num_warps=4, SWAP_AB=True, TMA=True)
    for m in (17, 24, 32):
        assert tile_config(m, 4096, 14336) == dict(**row32, BLOCK_K=256, num_stages=4, SPLIT_K=4), m
        assert tile_config(m, 6144, 4096) == dict(**row32, BLOCK_K=256, num_stages=4, SPLIT_K=1), m
        assert tile_config(m, 4096, 14336, k_groups=True) == dict(**row32, BLOCK_K=128, num_stages=6, SPLIT_K=4)
        assert tile_config(m, 28672, 4096) == dict(**row32, BLOCK_K=128, num_stages=4), m  # (run 34)
        for other in (tile_config(m, 4096, 14336, transposed=False), tile_config(m, 28672, 4096, transposed=False),
                      tile_config(m + 32, 28672, 4096), tile_config(m, 14336, 4096)):
            assert other["BLOCK_M"] == 64 and not other.get("SWAP_AB"), other
        assert not tile_config(m, 14336, 4096)["TMA_A"]  # (gate: the weight alone by TMA, run 34)
    for m in (17, 24):
        assert tile_config(m, 4096, 4096) == dict(**row32, BLOCK_K=256, num_stages=4, SPLIT_K=2), m
    assert tile_config(25, 4096, 4096)["BLOCK_K"] == 512 and tile_config(25, 4096, 4096, k_groups=True)["BLOCK_M"] == 32
    for m in (33, 64):
        assert tile_config(m, 4096, 14336)["BLOCK_M"] == tile_config(m, 6144, 4096)["BLOCK_M"] == 64
    for m in (17, 32, 64):  # the fused MLP's down GEMM of h in groups: its 64-row tile (run 34: the 32-row one lost)
        assert down_tile_config(m, 4096, 14336, h_group=128)["BLOCK_M"] == 64


def test_one_row_takes_the_gemv_kernel_where_it_was_measured_faster():
    """tile_config: the GEMV kernel at M=1 for the Llama-3-8B shapes it won on the H200 (run 16), the tensor-core
    tile for gate_up (28672x4096) and from 2 rows; fp8_gemm refuses a GEMV tile for more rows or for K groups a
    16-byte piece of a row would straddle."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm, gemv_config, mma_tile_config, tile_config

    for n, k in [(4096, 14336), (14336, 4096), (6144, 4096), (4096, 4096)]:
        assert tile_config(1, n, k) == gemv_config(n, k) and tile_config(1, n, k)["GEMV"], (n, k)
        assert tile_config(2, n, k) == mma_tile_config(2, n, k) and "GEMV" not in tile_config(2, n, k)
    assert tile_config(1, 28672, 4096) == mma_tile_config(1, 28672, 4096)
    assert tile_config(0, 4096, 4096) == mma_tile_config(0, 4096, 4096)  # an empty batch: no GEMV launch
    # run 19's pipelined tiles: 4 rows a program (8 where the GEMV quantizes a 16-bit a as it loads it, asked for
    # through tile_config as fp8_gemm asks when given no config), the K loop 3 stages deep at K of 8192 and more,
    # 4 below it (run 37: as programmatic dependents)
    assert [tile_config(1, 4096, 14336, a_quant=q)["BLOCK_N"] for q in (False, True)] == [4, 8]
    assert [tile_config(1, 4096, 14336, a_quant=q)["K_STAGES"] for q in (False, True)] == [3, 3]
    assert tile_config(1, 6144, 4096)["BLOCK_N"] == 4 and tile_config(1, 6144, 4096)["K_STAGES"] == 4
    assert tile_config(1, 4096, 4096)["K_STAGES"] == 4 and tile_config(1, 1024, 8192)["K_STAGES"] == 3
    # 2-16 rows of a weight of fewer 64-wide tiles than SMs, or of a long K: K split in 4, the product transposed
    # (64 weight rows on wgmma's left, run 20); weight-only keeps run 18's 32-wide mma.sync tiles; wide weights,
    # short K and more rows keep their tiles, not transposed
    for n, k, split in [(6144, 4096, 4), (4096, 4096, 4), (28672, 4096, 1), (4096, 14336, 4), (6144, 512, 1)]:
        cfg, wo = tile_config(16, n, k), tile_config(16, n, k, transposed=False)
        assert cfg.get("SPLIT_K", 1) == wo.get("SPLIT_K", 1) == split and cfg["BLOCK_N"] == 64, (n, k)
        assert cfg.get("SWAP_AB", False) == (split > 1) and not wo.get("SWAP_AB", False), (n, k)
        assert wo["BLOCK_N"] == (32 if k < 8192 and split > 1 else 64), (n, k)
    # 33-64 rows of fp8 activations: few 64-wide N tiles (qkv; o with K groups, its long unsplit steps apart: run
    # 32) -> 32 wide, K split in 2, the activations by TMA at 64 rows only (run 22); wide weights and weight-only
    # (16-bit activations) keep the unsplit 64-wide tile
    for m, n, block_n, split, tma_a in [(64, 6144, 32, 2, True), (64, 4096, 32, 2, True), (40, 4096, 32, 2, False),
                                        (33, 6144, 32, 2, False), (48, 28672, 64, 1, False),
                                        (64, 28672, 64, 1, True)]:
        cfg = tile_config(m, n, 4096, k_groups=n == 4096)
        assert (cfg["BLOCK_N"], cfg.get("SPLIT_K", 1), cfg["TMA_A"]) == (block_n, split, tma_a) and cfg["TMA"], cfg
    assert tile_config(64, 6144, 4096, transposed=False).get("SPLIT_K", 1) == 1
    assert "SWAP_AB" not in tile_config(64, 4096, 14336)
    # a long K (down 4096x14336) at 33-64 rows: 64-row tiles, K split in 2, the activation by TMA at 64 rows only
    # (run 29: the 64-row box over 32 rows cost the fused MLP's down GEMM 0.0232 ms against 0.0187); weight-only: no
    # TMA
    for m, tma_a in [(33, False), (48, False), (63, False), (64, True)]:
        cfg = tile_config(m, 4096, 14336)
        assert (cfg["BLOCK_M"], cfg["SPLIT_K"], cfg["TMA"], cfg["TMA_A"]) == (64, 2, True, tma_a), (m, cfg)
        assert "TMA" not in tile_config(m, 4096, 14336, transposed=False) and \
            "TMA_A" not in tile_config(m, 4096, 14336, transposed=False)
    xq, xs, wq, ws, _ = operands(2, 64, 96, [1, -1], [1, -1], "cpu")
    with pytest.raises(ValueError, match=r"GEMV kernel \(config GEMV=True\) takes one row .* got M=2"):
        fp8_gemm(xq, wq, xs, ws, None, torch.float32, config=gemv_config(64, 96))
    # K groups of 8: a 16-byte piece would span two groups (the ops send only groups of 32-256 to the kernels)
    xq, xs, wq, ws, _ = operands(1, 64, 96, [1, 8], [8, 8], "cpu")
    with pytest.raises(ValueError, match=r"K groups of a multiple of 16; got M=1, K groups \[8, 8\]"):
        fp8_gemm(xq, wq, xs, ws, None, torch.float32, config=gemv_config(64, 96), a_block=(1, 8), b_block=(8, 8))


def test_weight_only_takes_no_activation_blocks():
    from fp8fx.kernels.fp8_gemm import fp8_gemm

    wq, ws = quant.quantize(torch.randn(32, 64), [1, -1])
    with pytest.raises(ValueError, match=r"weight-only \(a_scale=None\).*a_block=\(1, 32\)"):
        fp8_gemm(torch.randn(2, 64).half(), wq, None, ws, None, torch.float32, a_block=(1, 32))


def test_scale_sizes_are_checked_before_the_kernel():
    """A scale of the wrong size would be read out of bounds by the kernel: refused, naming the operand."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm

    xq, xs, wq, ws, _ = operands(3, 64, 96, [1, -1], [1, -1], "cpu")
    with pytest.raises(ValueError, match=r"b_scale has 32 elements .* needs 64"):
        fp8_gemm(xq, wq, xs, ws[:32], None, torch.float32)
    with pytest.raises(ValueError, match=r"a_scale has 2 elements .* needs 3"):
        fp8_gemm(xq, wq, xs[:2], ws, None, torch.float32)
    xq, xs, wq, ws, _ = operands(3, 64, 96, [1, 32], [32, 32], "cpu")
    with pytest.raises(ValueError, match=r"b_scale has 3 elements .* block \[32, 32\] of a \[64, 96\] operand needs 6"):
        fp8_gemm(xq, wq, xs, ws.reshape(-1)[:3], None, torch.float32, a_block=(1, 32), b_block=(32, 32))
    with pytest.raises(ValueError, match=r"per token or per tensor along M, K groups per token \(\[1, G\]\); got "
                                         r"a_block=\(2, 32\)"):
        fp8_gemm(xq, wq, xs, ws, None, torch.float32, a_block=(2, 32), b_block=(32, 32))
    # one row of K groups for every row: the kernel indexes group scales by row (read past a [1, 3] scale)
    xs_shared = torch.ones(1, 3)
    with pytest.raises(ValueError, match=r"got a_block=\(-1, 32\)"):
        fp8_gemm(xq, wq, xs_shared, ws, None, torch.float32, a_block=(-1, 32), b_block=(32, 32))


def test_bias_shape_and_dtype_are_checked_before_the_kernel():
    """The kernels read bias[n] for every output column, unchecked: a bias of fewer than N values was read past its
    end, [N, 1] or [M, N] read as its first N values, an int bias cast; refused, naming it, for the GEMV and the
    tensor-core kernels alike."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm

    for m in (1, 3):
        xq, xs, wq, ws, bias = operands(m, 64, 96, [1, -1], [1, -1], "cpu")
        for bad in (bias[:10], bias[:, None], bias.expand(m, 64), torch.ones(65)):
            with pytest.raises(ValueError, match=re.escape(f"fp8_gemm: bias is torch.float32 {list(bad.shape)}; "
                                                           "it must be [64] (one per output column of b [64, 96])")):
                fp8_gemm(xq, wq, xs, ws, bad, torch.float32)
        with pytest.raises(ValueError, match=r"bias is torch.int64 \[64\]; it must be \[64\] .* bf16, fp16, fp32 or "
                                             r"fp64, or None"):
            fp8_gemm(xq, wq, xs, ws, bias.long(), torch.float32)


def test_split_k_tickets_are_checked_before_the_kernel():
    """A caller's split-K tickets are read as ``tickets_ptr + tile``: too few were read past their end, a strided view
    read counters it does not hold (zeroed in the view, not between its elements), tickets on another device
    failed inside Triton naming a pointer by position; refused, naming what they are and what the launch needs."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm

    xq, xs, wq, ws, _ = operands(3, 64, 96, [1, -1], [1, -1], "cpu")
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2, SPLIT_K=2)  # 2 tiles
    for bad, got in ((torch.zeros(1, dtype=torch.int32), "1 torch.int32 on cpu"),
                     (torch.zeros(2, dtype=torch.int64), "2 torch.int64 on cpu"),
                     (torch.zeros(4, dtype=torch.int32)[::2], r"2 torch.int32 on cpu, strides \(2,\)"),
                     (torch.zeros(2, dtype=torch.int32, device="meta"), "2 torch.int32 on meta")):
        with pytest.raises(ValueError, match=rf"fp8_gemm: split-K needs 2 contiguous int32 tickets on cpu; got {got}"):
            fp8_gemm(xq, wq, xs, ws, None, torch.float32, config=cfg, tickets=bad)


def test_dtypes_are_checked_before_the_kernel():
    """Operands of dtypes the kernels do not compute with failed deep in Triton's dot ("Unsupported lhs dtype
    fp8e4nv"), and an integer or fp8 out_dtype took the float32 result cast to it (truncated, or rounded to fp8),
    unsaid: refused, naming the argument, its dtype and what it takes."""
    from fp8fx.kernels.fp8_gemm import QUANT_ROWS, fp8_gemm

    xq, xs, wq, ws, _ = operands(3, 64, 96, [1, -1], [1, -1], "cpu")
    for out_dtype in (torch.int32, quant.FP8_DTYPE, torch.float64):
        with pytest.raises(ValueError, match=rf"fp8_gemm: out_dtype={out_dtype}; the result is bf16, fp16 or fp32"):
            fp8_gemm(xq, wq, xs, ws, None, out_dtype)
    with pytest.raises(ValueError, match=r"fp8_gemm: b is torch.bfloat16; the weight must be torch.float8_e4m3fn"):
        fp8_gemm(xq, wq.bfloat16(), xs, ws, None, torch.float32)
    for a in (xq.bfloat16(), xq.to(torch.float8_e5m2)):
        with pytest.raises(ValueError, match=rf"fp8_gemm: a is {a.dtype} with an a_scale; it takes "
                                             r"torch.float8_e4m3fn codes \(for 16-bit activations without scales, "
                                             r"pass a_scale=None: weight-only\)"):
            fp8_gemm(a, wq, xs, ws, None, torch.float32)
    with pytest.raises(ValueError, match=r"fp8_gemm: a is torch.float8_e4m3fn; weight-only \(a_scale=None\) takes "
                                         r"torch.bfloat16, torch.float16 activations"):
        fp8_gemm(xq, wq, None, ws, None, torch.float32)
    with pytest.raises(ValueError, match=r"fp8_gemm: a is torch.float8_e4m3fn; a_quant=1 takes torch.bfloat16, "
                                         r"torch.float16, torch.float32 activations"):
        fp8_gemm(xq, wq, torch.ones(3, 2), ws, None, torch.float32, a_quant=QUANT_ROWS)
    with pytest.raises(ValueError, match=r"fp8_gemm: a_quant=1 with a_scale=None; it takes NO_QUANT"):
        fp8_gemm(xq.float(), wq, None, ws, None, torch.float32, a_quant=QUANT_ROWS)
    with pytest.raises(ValueError, match=r"fp8_gemm: a_quant=7 with a_scale=a tensor"):
        fp8_gemm(xq.float(), wq, xs, ws, None, torch.float32, a_quant=7)
    with pytest.raises(ValueError, match=r"fp8_gemm: b_scale is torch.int32; scales are float32"):
        fp8_gemm(xq, wq, xs, ws.int(), None, torch.float32)
    with pytest.raises(ValueError, match=r"fp8_gemm: a is \[1, 3, 96\] and b \[64, 96\]; it takes matrices"):
        fp8_gemm(xq[None], wq, xs, ws, None, torch.float32)


def test_configs_are_checked_before_the_kernel():
    """A config key the picked kernel does not read (a typo, a GEMV key in a tensor-core tile) was dropped by
    Triton's launch unsaid, ``SPLIT_K=0`` launched no program and returned ``torch.empty``'s memory, a missing
    key failed as a KeyError and a tile that is not a power of 2 deep in Triton: refused, naming the key and
    value."""
    from fp8fx.kernels.fp8_gemm import fp8_gemm, gemv_config, mma_tile_config

    xq, xs, wq, ws, _ = operands(3, 64, 96, [1, -1], [1, -1], "cpu")
    mma = mma_tile_config(3, 64, 96)
    for extra, unknown in (({"SPLITK": 2}, "SPLITK"), ({"K_STAGES": 3}, "K_STAGES"), ({"HAS_BIAS": True}, "HAS_BIAS")):
        with pytest.raises(ValueError, match=rf"fp8_gemm: config keys \['{unknown}'\] are not the tensor-core "
                                             r"kernel's; it takes \['BLOCK_M', .*tile_config gives the default tile"):
            fp8_gemm(xq, wq, xs, ws, None, torch.float32, config={**mma, **extra})
    with pytest.raises(ValueError, match=r"config keys \['GROUP_M'\] are not the GEMV kernel \(GEMV=True\)'s"):
        fp8_gemm(xq[:1], wq, xs[:1], ws, None, torch.float32, config={**gemv_config(64, 96), "GROUP_M": 8})
    with pytest.raises(ValueError, match=r"has no \['GROUP_M', 'num_stages', 'BLOCK_K'\]; the tensor-core kernel "
                                         r"needs \['BLOCK_M', 'BLOCK_N', 'GROUP_M', 'num_stages', 'BLOCK_K'\]"):
        fp8_gemm(xq, wq, xs, ws, None, torch.float32, config={"BLOCK_M": 16, "BLOCK_N": 64})
    # (a numpy int: 16 is a power of 2, its type is what the kernels do not take, and the message says so)
    for key, v, takes in (("SPLIT_K", 0, "; it takes an int of at least 1"),
                          ("GROUP_M", 1.5, " is a float; it takes an int of at least 1"),
                          ("BLOCK_N", 48, "; it takes an int, a power of 2 of at least 16"),
                          ("BLOCK_M", 16.0, " is a float; it takes an int, a power of 2"),
                          ("BLOCK_M", np.int64(16), " is a int64; it takes an int, a power of 2"),
                          ("BLOCK_K", 8, "; it takes an int, a power of 2 of at least 32"),
                          # (an fp8 dot's K tile: BLOCK_K=16 ran in the interpreter, failed to compile for sm_90)
                          ("BLOCK_K", 16, "; it takes an int, a power of 2 of at least 32"),
                          ("num_warps", 3, "; it takes an int, a power of 2 of at least 1"),
                          ("SWAP_AB", "yes", "; it takes True or False")):
        with pytest.raises(ValueError, match=re.escape(f"fp8_gemm: config {key}={v!r}{takes}")):
            fp8_gemm(xq, wq, xs, ws, None, torch.float32, config={**mma, key: v})
    # K groups of 16 on fp8 activations in the tensor-core kernel, whose K step is a group (one row of them takes the
    # GEMV kernel, and weight-only K steps of 16: the interpreter check runs both)
    xg, xgs, wg, wgs, _ = operands(3, 64, 96, [1, 16], [16, 16], "cpu")
    with pytest.raises(ValueError, match=re.escape("fp8_gemm: K groups of 16 with fp8 activations on the tensor-core "
                                                   "kernel, whose K step is a group: an fp8 dot takes K steps of 32 "
                                                   "or more on sm_90; quantize in groups of 32-256")):
        fp8_gemm(xg, wg, xgs, wgs, None, torch.float32, a_block=(1, 16), b_block=(16, 16))
    # the GEMV: tiles of fewer rows than a tensor-core dot's 16 (its own BLOCK_M may be left out), K_STAGES its own
    with pytest.raises(ValueError, match=re.escape("fp8_gemm: config K_STAGES=0; it takes an int of at least 1")):
        fp8_gemm(xq[:1], wq, xs[:1], ws, None, torch.float32, config={**gemv_config(64, 96), "K_STAGES": 0})
    with pytest.raises(ValueError, match=re.escape("fp8_gemm: config BLOCK_N=3; it takes an int, a power of 2 of at "
                                                   "least 1")):
        fp8_gemm(xq[:1], wq, xs[:1], ws, None, torch.float32, config={**gemv_config(64, 96), "BLOCK_N": 3})


BLOCK_SHAPES = [(1, 200, 300), (3, 256, 384), (64, 130, 1000), (65, 384, 256), (2049, 257, 640)]


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", BLOCK_SHAPES)
def test_block_scaled_gemm_cuda(m, n, k):
    """128x128 weight blocks with 1x128 activation groups, ragged last blocks, through the CUDA op."""
    xq, xs, wq, ws, bias = operands(m, n, k, [1, 128], [128, 128], "cuda")
    ref = reference(xq, xs, [1, 128], wq, ws, [128, 128], bias, torch.bfloat16)
    y = torch.ops.fp8fx.scaled_mm(xq, xs, wq, ws, bias.bfloat16(), [1, 128], [128, 128], torch.bfloat16)
    err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 64, 65, 2049])
@pytest.mark.parametrize("w_block", [[1, -1], [-1, -1], [128, 128]])
@pytest.mark.parametrize("k", [384, 1024])  # 1024 at 3 rows: K split in 4 (mma_tile_config's narrow-weight tile)
def test_weight_only_cuda(m, w_block, k):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).bfloat16()
    wq, ws = quant.quantize(torch.randn(200, k, generator=g), w_block)
    ref = x.double() @ quant.dequantize(wq, ws, w_block, torch.float64).t()
    y = torch.ops.fp8fx.weight_only_mm(x.cuda(), wq.cuda(), ws.cuda(), None, w_block)
    err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert y.dtype == torch.bfloat16 and err < 1e-2, err
    # the weight as bytes (``B_BITS``, the route before sm_89) forced here: the same bits, the GEMV's and the tile's
    from fp8fx.kernels.fp8_gemm import fp8_gemm, tile_config

    blocks = dict(b_block=tuple(w_block))
    cfg = tile_config(m, 200, k, transposed=False)
    fp8 = fp8_gemm(x.cuda(), wq.cuda(), None, ws.cuda(), None, torch.bfloat16, config=cfg, **blocks)
    bits = fp8_gemm(x.cuda(), wq.cuda(), None, ws.cuda(), None, torch.bfloat16, config={**cfg, "B_BITS": True},
                    **blocks)
    assert torch.equal(fp8, bits), cfg


INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from fp8fx import quant
    from fp8fx.kernels.fp8_gemm import fp8_gemm
    from tests.kernels.test_fp8_gemm import operands, reference
    for (m, n, k), (xb, wb) in [((1, 40, 96), ([1, -1], [1, -1])), ((17, 33, 70), ([-1, -1], [-1, -1])),
                                ((5, 64, 64), ([1, -1], [-1, -1]))]:
        xq, xs, wq, ws, bias = operands(m, n, k, xb, wb, "cpu")
        ref = reference(xq, xs, xb, wq, ws, wb, bias, torch.float32)
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
        y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config=cfg)
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (m, n, k, err)
        for split_k in (2, 3):  # split K (3 K steps of 32 for k=96: one split has 1, ragged K too)
            y_split = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config={**cfg, "SPLIT_K": split_k})
            assert ((y_split.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k, split_k)
            # a second launch sums in the same order: bit-equal
            again = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config={**cfg, "SPLIT_K": split_k})
            assert torch.equal(again, y_split), (m, n, k, split_k)
            y_bf16 = fp8_gemm(xq, wq, xs, ws, bias, torch.bfloat16, config={**cfg, "SPLIT_K": split_k})
            # the last split casts: within one bf16 ulp (the interpreter may truncate)
            assert y_bf16.dtype == torch.bfloat16, y_bf16.dtype
            torch.testing.assert_close(y_bf16.float(), y_split, rtol=2**-7, atol=1e-6)
        # column-major operands (made row-major for the kernel's 32-bit offsets): the same result
        y_cols = fp8_gemm(xq.t().contiguous().t(), wq.t().contiguous().t(), xs, ws, bias, torch.float32, config=cfg)
        assert torch.equal(y_cols, y), (m, n, k)
        # a wrong scale must show: drop the weight scale
        y_bad = fp8_gemm(xq, wq, xs, torch.ones_like(ws), bias, torch.float32, config=cfg)
        assert ((y_bad.double() - ref).abs().max() / ref.abs().max()).item() > 0.1
        # the product transposed (SWAP_AB: y.T = w @ x.T, the accumulator transposed back), split K or not
        for split_k in (1, 3):
            y_swap = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config={**cfg, "SPLIT_K": split_k, "SWAP_AB": True})
            assert ((y_swap.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k, split_k)
    # K-varying scales: 1x32 activation groups with 32x32 weight blocks, ragged N and K
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    for m, n, k in [(3, 40, 70), (17, 64, 96)]:
        xq, xs, wq, ws, bias = operands(m, n, k, [1, 32], [32, 32], "cpu")
        ref = reference(xq, xs, [1, 32], wq, ws, [32, 32], bias, torch.float32)
        y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config=cfg, a_block=(1, 32), b_block=(32, 32))
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k)
        # transposed: each K step's activation scales along the accumulator's columns, the weight's along its rows
        y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config={**cfg, "SWAP_AB": True}, a_block=(1, 32),
                     b_block=(32, 32))
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k, "swap")
        y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config={**cfg, "SPLIT_K": 2}, a_block=(1, 32),
                     b_block=(32, 32))  # per-K-step scales indexed by the absolute K step in every split
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k, "split")
        ws_bad = ws.clone(); ws_bad[-1, -1] *= 2  # one ragged corner block wrong must show
        y_bad = fp8_gemm(xq, wq, xs, ws_bad, bias, torch.float32, config=cfg, a_block=(1, 32), b_block=(32, 32))
        assert ((y_bad.double() - ref).abs().max() / ref.abs().max()).item() > 1e-3
    # each K step's scales (loaded a step ahead) for every mix of K groups: activation groups with per-channel or
    # per-tensor weights (the fused MLP's h in groups), per-token activations with weight blocks, weight blocks of
    # fewer rows than the N tile (a scale per row of it) and of more; direct, transposed, split in 2 and 3 (a split
    # of one step); the last K group's scale of one row or block wrong must show
    for (m, n, k), (xb, wb) in [((5, 40, 96), ([1, 32], [1, -1])), ((5, 40, 96), ([1, 32], [-1, -1])),
                                ((5, 40, 96), ([1, -1], [32, 32])), ((5, 40, 96), ([1, 32], [8, 32])),
                                ((18, 72, 128), ([1, 32], [64, 32])), ((3, 33, 70), ([1, -1], [8, 32]))]:
        xq, xs, wq, ws, bias = operands(m, n, k, xb, wb, "cpu")
        ref = reference(xq, xs, xb, wq, ws, wb, bias, torch.float32)
        blocks = dict(a_block=tuple(xb), b_block=tuple(wb))
        for extra in ({}, {"SWAP_AB": True}, {"SPLIT_K": 2}, {"SPLIT_K": 3, "SWAP_AB": True}):
            y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config={**cfg, **extra}, **blocks)
            assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k, xb, wb, extra)
        xs_bad, ws_bad = xs.clone(), ws.clone()
        (xs_bad if xb[1] != -1 else ws_bad)[-1, -1] *= 2  # the last row's (weight block's) last K group
        y_bad = fp8_gemm(xq, wq, xs_bad, ws_bad, bias, torch.float32, config=cfg, **blocks)
        assert ((y_bad.double() - ref).abs().max() / ref.abs().max()).item() > 1e-3, (m, n, k, xb, wb)
    # an empty weight or batch above 64 rows, where K groups take TMA copies (a descriptor of zero rows is refused:
    # pointer loads, an empty output)
    for m, n in [(80, 0), (0, 40)]:
        y = fp8_gemm(torch.zeros(m, 64).to(quant.FP8_DTYPE), torch.zeros(n, 64).to(quant.FP8_DTYPE),
                     torch.ones(m, 2), torch.ones(-(-n // 32), 2), None, torch.float32, a_block=(1, 32),
                     b_block=(32, 32))
        assert tuple(y.shape) == (m, n), (m, n, y.shape)
    # weight-only: fp16 activations, fp8 weight upcast in the kernel
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g).half()
    for wb in [(1, -1), (32, 32), (-1, 32)]:  # (-1, 32): one scale row for all N rows
        wq, ws = quant.quantize(torch.randn(48, 96, generator=g), wb)
        ref = x.double() @ quant.dequantize(wq, ws, wb, torch.float64).t()
        y = fp8_gemm(x, wq, None, ws, None, torch.float32, config=cfg, b_block=wb)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-3, wb
        y = fp8_gemm(x, wq, None, ws, None, torch.float32, config={**cfg, "SWAP_AB": True}, b_block=wb)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-3, (wb, "swap")
        if wb[1] == -1:  # K steps of 16: a 16-bit dot's least (an fp8 dot's is 32, FP8_DOT_MIN_K)
            y = fp8_gemm(x, wq, None, ws, None, torch.float32, config={**cfg, "BLOCK_K": 16}, b_block=wb)
            assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-3, (wb, "steps of 16")
    # the GEMV kernel (one row): ragged N and K, K split evenly and not (96 in 6 steps of 16 over 4 splits: the
    # last split has none), K steps that leave a ragged last one; weight-only with row blocks of the weight scale
    for (n, k), (xb, wb) in [((40, 96), ([1, -1], [1, -1])), ((33, 70), ([-1, -1], [-1, -1])),
                             ((64, 64), ([1, -1], [-1, -1]))]:
        xq, xs, wq, ws, bias = operands(1, n, k, xb, wb, "cpu")
        ref = reference(xq, xs, xb, wq, ws, wb, bias, torch.float32)
        for split, bk in [(1, 32), (2, 32), (3, 32), (1, 64), (2, 64), (4, 16)]:
            gemv = dict(GEMV=True, BLOCK_M=1, BLOCK_N=16, BLOCK_K=bk, num_warps=4, num_stages=1, SPLIT_K=split)
            y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config=gemv)
            assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (n, k, split, bk)
        y_bad = fp8_gemm(xq, wq, xs * 2, ws, bias, torch.float32, config=gemv)  # the activation scale must count
        assert ((y_bad.double() - ref).abs().max() / ref.abs().max()).item() > 0.1
    # with K groups (1x32 / 32x32 and others), ragged, split: each 16-byte piece scaled by its group's scales
    for (n, k), (xb, wb), bk, split in [((40, 96), ([1, 32], [32, 32]), 64, 1), ((33, 70), ([1, 32], [32, 32]), 32, 2),
                                       ((64, 200), ([1, -1], [16, 64]), 128, 1), ((48, 256), ([1, 64], [-1, 64]), 128, 3),
                                       ((40, 96), ([1, 16], [1, 16]), 32, 1)]:
        xq, xs, wq, ws, bias = operands(1, n, k, xb, wb, "cpu")
        ref = reference(xq, xs, xb, wq, ws, wb, bias, torch.float32)
        gemv = dict(GEMV=True, BLOCK_M=1, BLOCK_N=4, BLOCK_K=bk, num_warps=1, num_stages=1, SPLIT_K=split)
        blocks = dict(a_block=tuple(xb), b_block=tuple(wb))
        y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32, config=gemv, **blocks)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (n, k, xb, wb)
        ws_bad = ws.clone(); ws_bad.view(-1)[-1] *= 2  # the last (ragged) group of the last rows wrong must show
        y_bad = fp8_gemm(xq, wq, xs, ws_bad, bias, torch.float32, config=gemv, **blocks)
        assert ((y_bad.double() - ref).abs().max() / ref.abs().max()).item() > 1e-3, (n, k, xb, wb)
    x = torch.randn(1, 96, generator=g).half()
    for wb in [(1, -1), (-1, -1), (32, -1), (16, 32)]:
        wq, ws = quant.quantize(torch.randn(48, 96, generator=g), wb)
        ref = x.double() @ quant.dequantize(wq, ws, wb, torch.float64).t()
        y = fp8_gemm(x, wq, None, ws, None, torch.float32, config={**gemv, "BLOCK_K": 32, "SPLIT_K": 2}, b_block=wb)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-3, wb
    # the default tile at few rows of a narrow weight (K split in 4, 32-wide N tiles; ragged N), weight-only
    x = torch.randn(3, 1024, generator=g).half()
    wq, ws = quant.quantize(torch.randn(40, 1024, generator=g), (1, -1))
    ref = x.double() @ quant.dequantize(wq, ws, (1, -1), torch.float64).t()
    y = fp8_gemm(x, wq, None, ws, None, torch.float32, b_block=(1, -1))
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-3
    # the same with fp8 activations: the default tile is transposed (SWAP_AB, K split in 4; ragged N)
    from fp8fx.kernels.fp8_gemm import tile_config
    assert tile_config(3, 40, 1024).get("SWAP_AB")
    xq, xs, wq, ws, bias = operands(3, 40, 1024, [1, -1], [1, -1], "cpu")
    ref = reference(xq, xs, [1, -1], wq, ws, [1, -1], bias, torch.float32)
    y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # 17-24 rows of a weight of few N tiles: the 32-row transposed tile, K split in 2, the weight by TMA (ragged M,
    # N, K: 1040 = 4 steps of 256 and 16); of a long K: split in 4 (8200: 32 steps of 256 and 8, by pointer loads)
    for m, n, k in [(24, 200, 1040), (20, 72, 8200)]:
        cfg = tile_config(m, n, k)
        assert cfg["BLOCK_M"] == 32 and cfg["SWAP_AB"] and cfg["SPLIT_K"] == (4 if k > 8192 else 2), cfg
        xq, xs, wq, ws, bias = operands(m, n, k, [1, -1], [1, -1], "cpu")
        ref = reference(xq, xs, [1, -1], wq, ws, [1, -1], bias, torch.float32)
        y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k)
    # 25-64 rows of a weight of few 32-wide N tiles: one program a tile over the whole K, steps of 512 (ragged N, K)
    assert tile_config(40, 200, 1100)["BLOCK_K"] == 512 and tile_config(40, 200, 1100).get("SPLIT_K", 1) == 1
    xq, xs, wq, ws, bias = operands(40, 200, 1100, [1, -1], [1, -1], "cpu")
    ref = reference(xq, xs, [1, -1], wq, ws, [1, -1], bias, torch.float32)
    y = fp8_gemm(xq, wq, xs, ws, bias, torch.float32)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    print("interpreter ok")
    """
)


def test_fp8_gemm_under_triton_interpreter():
    assert "interpreter ok" in run_under_triton_interpreter(["-c", INTERPRETER_CHECK])


TMA_CHECK = textwrap.dedent(
    """
    import torch
    from fp8fx import quant
    from fp8fx.kernels.fp8_gemm import fp8_gemm, mma_tile_config as tile_config

    # the weight (TMA=True) or the fp8 activations (TMA_A=True) through a tensor descriptor give the pointer loads'
    # bits: ragged M and N, K a multiple of 16 but not of BLOCK_K (the last K tile zero-filled), split K, per-row
    # and 128x128 blocks, weight-only (16-bit activations: TMA_A leaves them to pointer loads)
    g = torch.Generator().manual_seed(0)
    for m, n, k, x_block, w_block, split in [(1, 200, 304, [1, -1], [1, -1], 1), (7, 130, 1008, [1, -1], [-1, -1], 3),
                                             (3, 257, 384, [1, 128], [128, 128], 2)]:
        xq, xs = quant.quantize(torch.randn(m, k, generator=g), x_block)
        wq, ws = quant.quantize(torch.randn(n, k, generator=g), w_block)
        blocks = dict(a_block=tuple(x_block), b_block=tuple(w_block)) if w_block[1] != -1 else {}
        cfg = {**tile_config(1, n, k), "SPLIT_K": split}
        plain = fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config=cfg, **blocks)
        # the weight, the activations (TMA_A: ragged M too), or both by TMA; transposed (SWAP_AB) or not
        for extra in ({"TMA": True}, {"TMA_A": True}, {"TMA": True, "TMA_A": True},
                      {"TMA": True, "TMA_A": True, "SWAP_AB": not cfg.get("SWAP_AB", False), "BLOCK_N": 64}):
            tma = fp8_gemm(xq, wq, xs, ws, None, torch.bfloat16, config={**cfg, **extra}, **blocks)
            assert torch.equal(plain, tma), (m, n, k, extra, (plain.float() - tma.float()).abs().max())
    x = torch.randn(5, 304, generator=g).to(torch.bfloat16)
    wq, ws = quant.quantize(torch.randn(100, 304, generator=g), [1, -1])
    cfg = tile_config(1, 100, 304)
    assert torch.equal(fp8_gemm(x, wq, None, ws, None, torch.bfloat16, config=cfg),
                       fp8_gemm(x, wq, None, ws, None, torch.bfloat16, config={**cfg, "TMA": True, "TMA_A": True}))
    print("tma ok")
    """
)


def test_tma_loads_under_triton_interpreter():
    """The opt-in TMA loads (``TMA=True``: the weight, ``TMA_A=True``: fp8 activations, in a tile configuration)
    against the pointer loads, bit for bit
    (the interpreter's descriptors: triton 3.8 and 3.9; 3.6's interpreter cannot run them)."""
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"triton {triton.__version__}'s interpreter does not run tensor descriptors (3.8 and 3.9 do)")
    assert "tma ok" in run_under_triton_interpreter(["-c", TMA_CHECK])


PRE_WAIT_CHECK = textwrap.dedent(
    """
    import torch
    from fp8fx import quant
    from fp8fx.kernels.fp8_gemm import QUANT_ROWS, fp8_gemm, gemv_config, mma_tile_config

    # the GEMV's first 1, 2 or 4 K steps of the weight loaded before the (PDL) wait and multiplied after it, the rest
    # in the loop: ragged N (70 rows, 4 a program) and K (EVEN_K off), split K with splits shorter than PRE_WAIT and
    # one of no step at all, per-row scales, 1 x 32 / 8 x 32 K groups, 16-bit activations quantized as loaded,
    # weight-only (the weight as fp8 and as bytes)
    g = torch.Generator().manual_seed(0)
    checked = 0
    for n, k, x_block, w_block in [(70, 1040, [1, -1], [1, -1]), (40, 288, [1, 32], [8, 32])]:
        xq, xs = quant.quantize(torch.randn(1, k, generator=g), x_block)
        wq, ws = quant.quantize(torch.randn(n, k, generator=g), w_block)
        grouped = w_block[1] != -1
        blocks = dict(a_block=tuple(x_block), b_block=tuple(w_block)) if grouped else {}
        ref = quant.scaled_mm_reference(xq, xs, x_block, wq, ws, w_block, None, torch.float64)
        runs = [("fp8", lambda cfg: fp8_gemm(xq, wq, xs, ws, None, torch.float32, config=cfg, **blocks), ref)]
        if not grouped:  # 16-bit activations: quantized per row as loaded; weight-only
            x16 = torch.randn(1, k, generator=g)
            parts = x16.abs().reshape(1, -1, 16).amax(-1)
            runs.append(("a_quant", lambda cfg: fp8_gemm(x16, wq, parts, ws, None, torch.float32, config=cfg,
                                                          a_quant=QUANT_ROWS), None))
            x16h = x16.half()
            wo_ref = x16h.double() @ quant.dequantize(wq, ws, w_block, torch.float64).t()
            runs.append(("weight-only", lambda cfg: fp8_gemm(x16h, wq, None, ws, None, torch.float32, config=cfg),
                         wo_ref))
            # (the weight as bytes, decoded in the kernel: B_BITS, GPUs before sm_89)
            runs.append(("weight-only", lambda cfg: fp8_gemm(x16h, wq, None, ws, None, torch.float32,
                                                              config={**cfg, "B_BITS": True}), wo_ref))
        # 9 K steps (the last ragged): unsplit; split in 2 (5 and 4 steps); in 4 (3, 3, 3 and none)
        gemv = {**gemv_config(n, k), "BLOCK_K": 32 if grouped else 128}
        for cfg in (gemv, {**gemv, "SPLIT_K": 2}, {**gemv, "SPLIT_K": 4}):
            for pre in (1, 2, 4):
                for label, run, want in runs:
                    plain, early = run(cfg), run({**cfg, "PRE_WAIT": pre})
                    if pre == 1:  # the same products summed in the same order
                        assert torch.equal(plain, early), (label, n, k, cfg, (plain - early).abs().max())
                    else:
                        err = (plain.double() - early.double()).abs().max() / plain.abs().max()
                        assert 0 < plain.abs().max() and err < 1e-6, (label, n, k, cfg, pre, err)
                    if want is not None:
                        err = (early.double() - want).abs().max() / want.abs().max()
                        assert err < (1e-3 if label == "weight-only" else 1e-5), (label, n, k, cfg, pre, err)
                    checked += 1
    # (a PRE_WAIT the GEMV does not take; the tensor-core tiles take none)
    for cfg, msg in [({**gemv, "PRE_WAIT": 3}, "config PRE_WAIT=3; it takes one of [0, 1, 2, 4]"),
                     ({**mma_tile_config(2, n, k), "PRE_WAIT": 1}, "config PRE_WAIT=1 is the GEMV kernel's")]:
        try:
            fp8_gemm(xq, wq, xs, ws, None, torch.float32, config=cfg, **blocks)
            raise AssertionError(f"{cfg} accepted")
        except ValueError as e:
            assert msg in str(e), e
    print("pre-wait ok", checked)
    """
)


def test_weight_loaded_before_the_wait_under_triton_interpreter():
    """``PRE_WAIT`` (the GEMV's first K steps of the weight loaded before the PDL wait, multiplied after it) gives
    the plain loop's bits with one step and the same products summed in another order with 2 or 4, in every scheme
    the GEMV takes; the tensor-core kernel refuses it."""
    out = run_under_triton_interpreter(["-c", PRE_WAIT_CHECK])
    assert "pre-wait ok" in out and int(out.split("pre-wait ok")[1].split()[0]) == 45, out


BITS_CHECK = textwrap.dedent(
    """
    import torch
    import triton
    import triton.language as tl
    from fp8fx import quant
    from fp8fx.kernels.fp8_gemm import _e4m3_from_bits, fp8_gemm, gemv_config, mma_tile_config

    @triton.jit
    def decode(bits_ptr, out_ptr, BF16: tl.constexpr):
        offs = tl.arange(0, 256)
        bits = tl.load(bits_ptr + offs)
        tl.store(out_ptr + offs, _e4m3_from_bits(bits, tl.bfloat16 if BF16 else tl.float32))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()  # every code, subnormals, +-0, NaN (0x7F, 0xFF)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(256, dtype=dtype)
        decode[(1,)](codes, out, BF16=dtype == torch.bfloat16)
        assert torch.equal(out.float().isnan(), want.isnan()) and want.isnan().sum() == 2
        ok = ~want.isnan()
        assert torch.equal(out.float()[ok], want[ok]) and torch.equal(out.float()[ok].signbit(), want[ok].signbit())
    # weight-only GEMMs with the weight as bytes give the fp8 weight's bits: the tensor-core tile (ragged M, N, K,
    # split K, per-row weight scales and 128x128 blocks) and the GEMV (one row, split K); fp16 activations: with bf16
    # ones the interpreter's weight-only tile is off by orders of magnitude, the fp8 weight's as much (triton 3.9;
    # the GPU's is right, test_weight_only_cuda)
    g = torch.Generator().manual_seed(0)
    for m, n, k, w_block in [(5, 100, 304, [1, -1]), (3, 257, 384, [128, 128]), (1, 200, 512, [1, -1])]:
        x = torch.randn(m, k, generator=g).half()
        wq, ws = quant.quantize(torch.randn(n, k, generator=g), w_block)
        blocks = dict(b_block=tuple(w_block)) if w_block[1] != -1 else {}
        tile = mma_tile_config(m, n, k, transposed=False)
        cfgs = [tile, {**tile, "SPLIT_K": 3}]
        cfgs += [gemv_config(n, k), {**gemv_config(n, k), "SPLIT_K": 2}] if m == 1 else []
        for cfg in cfgs:
            fp8 = fp8_gemm(x, wq, None, ws, None, torch.float32, config=cfg, **blocks)
            bits = fp8_gemm(x, wq, None, ws, None, torch.float32, config={**cfg, "B_BITS": True}, **blocks)
            assert torch.equal(fp8, bits), (m, n, k, cfg)
            ref = x.double() @ quant.dequantize(wq, ws, w_block, torch.float64).t()
            assert ((bits.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, n, k, cfg)
    print("bits ok")
    """
)


def test_weight_as_bytes_under_triton_interpreter():
    """``B_BITS`` (weight-only on GPUs before sm_89, where Triton has no fp8e4nv type): ``_e4m3_from_bits`` gives
    torch's value of each of the 256 e4m3fn codes, NaN and signed zeros included, and the weight-only GEMMs - the
    tensor-core tile and the GEMV - the bits they give on the fp8 weight."""
    assert "bits ok" in run_under_triton_interpreter(["-c", BITS_CHECK])


def test_stage_budget_follows_the_gpu(monkeypatch):
    """``fp8_gemm``'s pipeline stages fit the GPU's shared memory a program: the H200's tiles on sm_90 (200 KiB of
    227), fewer stages on GPUs of 163 (sm_80) or 99 KiB (sm_86, sm_89), the H200's on the CPU's interpreter."""
    from fp8fx.kernels import fp8_gemm as K

    assert K.stage_budget(torch.device("cpu")) == 200 * 1024
    for optin, want in ((232448, 200 * 1024), (166912, 165888), (101376, 100352)):
        monkeypatch.setattr(K, "shared_memory", lambda device, optin=optin: optin)
        assert K.stage_budget(torch.device("cuda", 0)) == want
    cfg = K.tile_config(32, 4096, 4096)  # o's long-step tile: 48 KiB a stage
    assert K.pipeline_stages(cfg, 1) == 4 and K.pipeline_stages(cfg, 1, 100352) == 2


def test_weight_as_bytes_only_for_weight_only():
    from fp8fx.kernels.fp8_gemm import fp8_gemm, mma_tile_config

    xq, xs, wq, ws, _ = operands(2, 64, 96, [1, -1], [1, -1], "cpu")
    with pytest.raises(ValueError, match=r"B_BITS .* weight-only variant's; got fp8 activations"):
        fp8_gemm(xq, wq, xs, ws, None, torch.float32, config={**mma_tile_config(2, 64, 96), "B_BITS": True})


def test_in_kernel_codes_equal_the_ieee_quotients_under_triton_interpreter():
    """``_codes_of`` (reciprocal + two FMAs): the codes of fp8fx.quant's division on 200k values across six decades,
    a rounding tie, inf, NaN, -0, an out-of-range quotient and an inf scale; the plain product by the reciprocal
    misses the tie; the same codes through the GEMV and the tensor-core GEMM that quantize as they load
    (``tests/kernels/codes_check.py``)."""
    assert "codes ok" in run_under_triton_interpreter(["-m", "tests.kernels.codes_check", "cpu"])


@pytest.mark.cuda
def test_in_kernel_codes_equal_the_ieee_quotients_cuda():
    from tests.kernels.codes_check import check, check_gemms

    check("cuda")
    check_gemms("cuda")
