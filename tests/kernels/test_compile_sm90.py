"""Every variant of fp8fx's Triton GEMM compiles for Hopper (sm_90), on a machine without a GPU.

Triton compiles ahead of time for a named target (its wheel ships ptxas), so the front end's rules
(e.g. no non-constexpr module globals inside a kernel, which the interpreter does not enforce) and
the NVIDIA back end are checked in CI, not first on the GPU.
"""
import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
import triton.language as tl  # noqa: E402

from fp8fx.kernels.fp8_gemm import QUANT_ROWS, QUANT_STATIC, QUANT_TENSOR, fp8_gemm_kernel, parts_block  # noqa: E402
from fp8fx.kernels.fp8_gemm import HOPPER_ONLY, fp8_gemv_kernel, gemv_config  # noqa: E402
from fp8fx.kernels.fp8_gemm import imprecise_k, mma_tile_config as tile_config, pipeline_stages  # noqa: E402
from fp8fx.kernels.gated_mlp import ACTIVATIONS, down_tile_config, gated_gemm_kernel, gated_tile_config  # noqa: E402
from fp8fx.kernels.gated_mlp import gated_prefill_kernel, prefill_tile_config, quantize_rows_kernel  # noqa: E402

POINTERS = ["a_ptr", "b_ptr", "y_ptr", "a_scale_ptr", "b_scale_ptr", "bias_ptr", "out_ptr", "tickets_ptr"]
# (fp8_gemm_kernel's b_desc and a_desc follow the pointers: a tensor descriptor type, or the constant None)
INTS = ["M", "N", "K", "stride_am", "stride_ak", "stride_bn", "stride_bk", "stride_ym", "stride_yn", "stride_ys",
        "stride_asm", "stride_ask", "stride_bsn", "stride_bsk"]
GATED_POINTERS = ["a_ptr", "w1_ptr", "w3_ptr", "a_scale_ptr", "s1_ptr", "s3_ptr", "h_ptr", "parts_ptr", "tickets_ptr"]
GATED_INTS = ["M", "N", "K", "n_tickets", "stride_am", "stride_ak", "stride_wn", "stride_wk", "stride_hm", "stride_pm"]
LAYOUTS = {  # (A_ROWWISE, A_GROUPED, B_ROWWISE, B_GROUPED)
    "per-tensor": (False, False, False, False),
    "per-row": (True, False, True, False),
    "blocks": (False, True, False, True),
}


# strides that are 1 in every real call (row-major operands, contiguous scales): Triton's JIT turns an int
# argument equal to 1 into a constant, and the kernel it compiles then loads those tiles with cp.async
# (pipelined) where one compiled with them as plain ints makes byte loads
UNIT = ["stride_ak", "stride_bk", "stride_yn", "stride_ask", "stride_bsk", "stride_wk"]


def compile_kernel(fn, types: dict, consts: dict, aligned: list, num_warps: int, num_stages: int, arch: int = 90):
    """``fn`` compiled for sm_90 as Triton's JIT compiles a real call: ``types`` (pointers and ints) and
    ``consts`` name every parameter of the kernel; the ``UNIT`` strides are the constant 1; ``aligned``: the
    arguments the JIT would see divisible by 16 (pointers, sizes, leading strides)."""
    # constants among the arguments: the unit strides, and any given as a value rather than a type string
    units = {name: 1 if name in UNIT else t for name, t in types.items() if name in UNIT or not isinstance(t, str)}
    names = list(fn.arg_names)
    assert set(names) == set(types) | set(consts), set(names) ^ (set(types) | set(consts))
    signature = {k: "constexpr" if k in units or k in consts else types[k] for k in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(k),): v for k, v in {**units, **consts}.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_for_hopper(a_dtype: str, layout: tuple, cfg: dict, fast_accum: bool = False, a_quant: int = 0,
                       pdl: bool = False, exact_codes: bool = True, arch: int = 90, budget: int = 200 * 1024,
                       b_bits: bool = False, trigger: bool = False):
    """``fp8_gemm_kernel`` compiled for sm_``arch`` at the tile ``cfg``, its stages as ``fp8_gemm`` sets them for a
    device of ``stage_budget`` ``budget``; ``b_bits``: the weight as bytes (``B_BITS``, weight-only before sm_89)."""
    y_type = "*fp32" if cfg.get("SPLIT_K", 1) > 1 else "*bf16"  # split-K writes float32 partials
    b_type = "*u8" if b_bits else "*fp8e4nv"
    types = dict(zip(POINTERS, [f"*{a_dtype}", b_type, y_type, "*fp32", "*fp32", "*bf16", "*bf16", "*i32"]))
    a_row, a_grp, b_row, b_grp = layout
    block_k = 128 if (a_grp or b_grp) else cfg["BLOCK_K"]
    types["b_desc"] = f"tensordesc<fp8e4nv[{cfg['BLOCK_N']}, {block_k}]>" if cfg.get("TMA") else None
    a_tma = cfg.get("TMA_A") and a_dtype == "fp8e4nv"
    types["a_desc"] = f"tensordesc<fp8e4nv[{cfg['BLOCK_M']}, {block_k}]>" if a_tma else None
    types.update({name: "i32" for name in INTS})
    promote = imprecise_k({"BLOCK_K": block_k}, fast_accum)
    consts = dict(A_ROWWISE=a_row, A_GROUPED=a_grp, B_ROWWISE=b_row, B_GROUPED=b_grp, B_BLOCK_N=128 if b_grp else 1,
                  HAS_BIAS=True, A_FP8=a_dtype == "fp8e4nv" or a_quant > 0, IMPRECISE_K=promote,
                  BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
                  SPLIT_K=cfg.get("SPLIT_K", 1), A_QUANT=a_quant, N_PARTS=448,
                  PARTS_BLOCK=parts_block(448, cfg["BLOCK_M"]), EPS=1e-12, FP8_MAX=448.0, PDL_WAIT=pdl,
                  B_DESC=bool(cfg.get("TMA")), EXACT_CODES=exact_codes, SWAP_AB=cfg.get("SWAP_AB", False),
                  A_DESC=bool(a_tma), B_BITS=b_bits, PDL_TRIGGER=trigger)
    aligned = POINTERS + ["N", "K", "stride_am", "stride_bn", "stride_ym"]
    stages = pipeline_stages({**cfg, "BLOCK_K": consts["BLOCK_K"]}, 1 if a_dtype == "fp8e4nv" else 2, budget)
    return compile_kernel(fp8_gemm_kernel, types, consts, aligned, cfg["num_warps"], stages, arch)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (1, 4096, 14336), (64, 4096, 4096), (4096, 28672, 4096)])
def test_fp8_gemm_compiles_for_sm90(layout, m, n, k):
    kernel = compile_for_hopper("fp8e4nv", LAYOUTS[layout], tile_config(m, n, k))
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("m", [16, 32, 64])
def test_down_gemm_of_h_groups_compiles_for_sm90(m):
    """The fused MLP's down GEMM with h in 1x128 groups (fp8 codes, [M, I / 128] scales, per-channel weight) at its
    default tile: no spill at 16 rows, nor at 64 rows (a [64, 64] accumulator per 4 warps since run 19, the weight
    by TMA copies; run 17's [64, 128] tile spilled 40 bytes a thread with triton 3.9)."""
    kernel = compile_for_hopper("fp8e4nv", (False, True, True, False), down_tile_config(m, 4096, 14336, h_group=128))
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    assert stack_bytes(kernel) == 0, stack_bytes(kernel)


@pytest.mark.parametrize("which", ["default 64 rows, down", "default 64 rows, qkv", "h groups 16 rows",
                                   "h groups 64 rows"])
def test_activation_tma_compiles_for_sm90(which):
    """``TMA_A=True``: fp8 activation tiles by TMA copies - the 64-row decode tiles' default (with the weight's,
    long K split in 2 and not), and opted into on the fused MLP's down GEMM of h in 1x128 groups (transposed at 16
    rows): every load of both operands a bulk copy, nothing spilled."""
    layout = LAYOUTS["per-row"]
    if which.startswith("default"):
        cfg = tile_config(64, *((4096, 14336) if which.endswith("down") else (6144, 4096)))
        assert cfg.get("TMA") and cfg.get("TMA_A"), cfg
    else:
        layout = (False, True, True, False)  # h's K groups, per-channel weight scales
        cfg = {**down_tile_config(16 if "16" in which else 64, 4096, 14336, h_group=128), "TMA_A": True}
    kernel = compile_for_hopper("fp8e4nv", layout, cfg)
    weight_only_tma = compile_for_hopper("fp8e4nv", layout, {**cfg, "TMA_A": False}).asm["ptx"]
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= 227 * 1024 and stack_bytes(kernel) == 0, stack_bytes(kernel)
    # twice the bulk copies of the tile with the weight alone by TMA (a's as many as b's), and none of the cp.async
    # copies that a's pointer loads pipeline through there
    assert ptx.count("cp.async.bulk.tensor") == 2 * weight_only_tma.count("cp.async.bulk.tensor") > 0
    assert "cp.async.cg" in weight_only_tma and "cp.async.cg" not in ptx and "cp.async.ca" not in ptx


def test_promotion_reaches_the_hopper_code():
    """Without fast accumulation the wgmma tile (M=4096 config) promotes its partial sums every K step:
    extra fp32 adds in the PTX, so a kernel that dropped ``max_num_imprecise_acc`` would fail here."""
    cfg = tile_config(4096, 4096, 4096)
    precise, fast = (compile_for_hopper("fp8e4nv", LAYOUTS["per-row"], cfg, f).asm["ptx"] for f in (False, True))
    assert "wgmma" in precise and "wgmma" in fast
    assert precise.count("add.f32") > fast.count("add.f32"), (precise.count("add.f32"), fast.count("add.f32"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_variant_compiles_for_sm90(layout, split_k):
    """Decode tiles with the K loop split (fp32 partials, summed by the tile's last split: its ticket is an
    acquire-release atomic and the partials are read from L2)."""
    cfg = {**tile_config(1, 4096, 14336), "SPLIT_K": split_k}
    kernel = compile_for_hopper("fp8e4nv", LAYOUTS[layout], cfg)
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    ptx = kernel.asm["ptx"]
    assert re.search(r"atom\.global\.(gpu\.)?acq_rel", ptx), "the ticket must be an acq_rel atomic"
    assert "ld.global.cg" in ptx, "the partials must be read past L1"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m", [16, 64, 4096])
def test_weight_only_variant_compiles_for_sm90(layout, m):
    """bf16 activations (their scale is a per-tensor 1.0), fp8 weight upcast in the kernel."""
    _, _, b_row, b_grp = LAYOUTS[layout]
    kernel = compile_for_hopper("bf16", (False, False, b_row, b_grp), tile_config(m, 4096, 4096, transposed=False))
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024


def cuobjdump(kernel, flag: str) -> str:
    """What cuobjdump (shipped with Triton) prints for the compiled kernel's cubin with ``flag``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def stack_bytes(kernel) -> int:
    """Per-thread stack of the compiled kernel (register spills)."""
    return int(re.search(r"STACK:(\d+)", cuobjdump(kernel, "-res-usage")).group(1))


def sass(kernel) -> str:
    """The compiled kernel's machine code (SASS)."""
    return cuobjdump(kernel, "-sass")


@pytest.mark.parametrize("layout", ["per-row", "blocks"])
@pytest.mark.parametrize("m,n,k,bound", [  # every tile_config branch
    (1, 28672, 4096, 0), (1, 6144, 4096, 0), (1, 4096, 14336, 0), (64, 6144, 4096, 16), (64, 4096, 4096, 0),
    (64, 4096, 14336, 0), (24, 4096, 4096, 0), (32, 6144, 4096, 0), (32, 4096, 14336, 0), (24, 28672, 4096, 0),
    (4096, 28672, 4096, 320),
])
def test_fp8_gemm_tiles_do_not_spill_much(layout, m, n, k, bound):
    """Registers (stack bytes per thread, triton 3.6 and 3.9): with [BM, BK] / [BK, BN] tensors of 64-bit
    addresses carried through the K loop the prefill tile spilled 592-808; with 32-bit offsets from
    64-bit tile bases 112-280. Decode tiles with BLOCK_K = 128 spill nothing (16 bytes: M=64, block scales,
    triton 3.9); M=64 with a long K (BLOCK_K = 256, 64-wide N tiles, K split in 2) spills nothing either."""
    # (the 64-row tiles also with pointer loads: their default takes TMA copies since run 21)
    for fast, transposed in ((False, True), (True, True), (False, False)):
        kernel = compile_for_hopper("fp8e4nv", LAYOUTS[layout], tile_config(m, n, k, transposed=transposed), fast)
        assert stack_bytes(kernel) <= bound, (fast, transposed, stack_bytes(kernel))


@pytest.mark.parametrize("a_quant", [QUANT_ROWS, QUANT_TENSOR, QUANT_STATIC])
@pytest.mark.parametrize("m", [1, 64])
def test_down_gemm_quantizing_bf16_activations_compiles_for_sm90(a_quant, m):
    """The gated MLP's down GEMM: bf16 h quantized per K tile in the loop, scales from partial maxima;
    split K at M=1 (Llama-3-8B down: 4096 x 14336)."""
    cfg = down_tile_config(m, 4096, 14336, gemv=False)
    kernel = compile_for_hopper("bf16", LAYOUTS["per-row"], cfg, a_quant=a_quant, pdl=True)
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    assert "cvt.rn.satfinite.e4m3x2.f32" in kernel.asm["ptx"], "h must reach the dot as fp8 codes"
    # each code the correctly rounded quotient (fp8_gemm._codes_of): two FMAs an element more than by the reciprocal
    by_reciprocal = compile_for_hopper("bf16", LAYOUTS["per-row"], cfg, a_quant=a_quant, pdl=True, exact_codes=False)
    assert kernel.asm["ptx"].count("fma.rn.f32") > by_reciprocal.asm["ptx"].count("fma.rn.f32")
    # a programmatic dependent launch: it waits for the first kernel before any global memory access (not one
    # hoisted above the wait, the pipelined prologue's cp.async loads included)
    ptx = kernel.asm["ptx"]
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert not re.search(r"\b(ld\.global|cp\.async|atom\.|red\.|st\.global)", before), before[-2000:]
    assert "cp.async" in ptx, "the weight tiles are loaded through the pipeline (as in a real call)"
    # M=1's tile (up to 16 rows: transposed, 64-wide N, split in 4, TMA) keeps 0-16 bytes on the stack (per tensor,
    # whose programs each reduce every row's maxima, 256 at a time: `parts_block`); M=64's per tensor 272
    assert stack_bytes(kernel) <= (16 if m == 1 else 0 if a_quant != QUANT_TENSOR else 272), stack_bytes(kernel)


def compile_gated(cfg: dict, h_type: str, **consts):
    """``gated_gemm_kernel`` compiled for sm_90 with the tile ``cfg``, h of ``h_type`` ("*bf16", or "*fp8e4nv" with
    H_GROUPS) and ``consts`` on top of the fixed ones (Llama-3-8B: I = 14336, K = 4096)."""
    types = dict(zip(GATED_POINTERS, ["*fp8e4nv", "*fp8e4nv", "*fp8e4nv", "*fp32", "*fp32", "*fp32", h_type,
                                      "*fp32", "*i32"]))
    types.update({name: "i32" for name in GATED_INTS})
    consts = {**dict(W_ROWWISE=True, ACT=0, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                     H_GROUPS=False, H_DTYPE=None, EPS=1e-12, FP8_MAX=448.0), **consts}
    stages = pipeline_stages({**cfg, "BLOCK_N": 2 * cfg["BLOCK_N"]}, 1)
    kernel = compile_kernel(gated_gemm_kernel, types, consts, GATED_POINTERS + ["N", "K", "stride_am", "stride_wn"],
                            cfg["num_warps"], stages)
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    return kernel


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("w_rowwise,act", [(False, "silu"), (True, "silu"), (True, "gelu"), (True, "gelu_tanh")])
def test_gated_gemm_compiles_for_sm90(m, w_rowwise, act):
    """Gate and up tiles against one x tile, act(g) * up in the epilogue (Llama-3-8B: I = 14336, K = 4096)."""
    kernel = compile_gated(gated_tile_config(m, 14336, 4096), "*bf16", A_ROWWISE=m > 1, W_ROWWISE=w_rowwise,
                           ACT=ACTIVATIONS[act], IMPRECISE_K=None, PDL_TRIGGER=True)
    assert stack_bytes(kernel) == 0, stack_bytes(kernel)
    assert "griddepcontrol.launch_dependents" in kernel.asm["ptx"]  # lets the down GEMM launch early


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("promote", [None, 128])
def test_gated_gemm_with_h_groups_compiles_for_sm90(m, promote):
    """h in 1x128 groups (Fp8Backend(mlp_h_group=128)): 128-wide gate and up tiles, fp8 codes and group scales out
    of the epilogue. Nothing spilled with fast accumulation (the backend's default); promoting the wgmma sums every
    K step (use_fast_accum=False, M > 16) holds a second pair of [64, 128] accumulators and spills 72 bytes a thread
    (triton 3.9), a case not timed."""
    kernel = compile_gated({**gated_tile_config(m, 14336, 4096, 128), "BLOCK_N": 128}, "*fp8e4nv", A_ROWWISE=m > 1,
                           IMPRECISE_K=promote, PDL_TRIGGER=True, H_GROUPS=True, H_DTYPE=tl.bfloat16)
    assert stack_bytes(kernel) <= (128 if promote and m > 16 else 0), stack_bytes(kernel)


@pytest.mark.parametrize("promote", [None, 128])
def test_gated_gemm_of_per_token_h_through_quantize_rows_compiles_for_sm90(promote):
    """Per-token h at 17-64 tokens (``ops.GATED_ROWS_MIN_M``, one tile for the whole range): the gate/up kernel in the
    tile of h in groups of 128 (64 x 128, 8 warps), h out 16-bit with its tile maxima for ``quantize_rows``, no PDL
    trigger. Nothing spilled with fast accumulation; the promoted sums' second pair of accumulators within the bound
    of h in groups."""
    from fp8fx import ops

    assert gated_tile_config(ops.GATED_ROWS_MIN_M, 14336, 4096, 128) == gated_tile_config(64, 14336, 4096, 128)
    kernel = compile_gated({**gated_tile_config(64, 14336, 4096, 128), "BLOCK_N": 128}, "*bf16", A_ROWWISE=True,
                           IMPRECISE_K=promote, PDL_TRIGGER=False, H_DTYPE=tl.bfloat16)
    assert stack_bytes(kernel) <= (128 if promote else 0), stack_bytes(kernel)


@pytest.mark.parametrize("promote", [None, 128])
@pytest.mark.parametrize("x_rowwise,act,epilogue,split", [
    (True, "silu", "float32", 1), (False, "gelu_tanh", "float32", 1), (True, "silu", "model rounding", 1),
    (True, "silu", "tanh silu", 1), (True, "silu", "tanh silu", 2)])
def test_gated_prefill_compiles_to_one_wide_wgmma_for_sm90(promote, x_rowwise, act, epilogue, split):
    """The prefill gate/up kernel at its default tile (Llama-3-8B, M = 4096): each K step is one m64n256k32 wgmma per
    warpgroup on the gate and up tiles loaded together (a [2, 128, 128] TMA copy seen as [256, 128] in shared
    memory), h stored by TMA copies; its stages fit in shared memory. Nothing spills with fast accumulation (the
    backend's default); promoting the sums every K step (use_fast_accum=False) spills 72 bytes a thread (triton 3.9;
    not timed). The epilogue's activation is the PTX one the GPU runs (``PTX_MATH``), with g, u and act(g) in float32
    and ex2 / rcp (the kernel's defaults; gelu-tanh's epilogue in ``gated_prefill``), rounded to bf16 as the model
    rounds them (``MODEL_ROUNDING``), or silu by tanh.approx (``TANH_SILU``, ``gated_prefill``'s for silu).
    With the last round in half tiles (``TAIL_SPLIT``, 4096 tokens' case) those 64 x 256 tiles run m64n128k32 on each
    warpgroup, in the same shared memory, and nothing more spills. The quantization of h compiles too."""
    cfg = prefill_tile_config(4096, 14336, 4096)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    types = {"x_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "w_desc": f"tensordesc<fp8e4nv[2, {bn}, {bk}]>",
             "h_desc": f"tensordesc<bf16[{bm}, {bn}]>", "a_scale_ptr": "*fp32", "s1_ptr": "*fp32", "s3_ptr": "*fp32",
             "parts_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_pm": "i32"}
    consts = dict(A_ROWWISE=x_rowwise, W_ROWWISE=True, ACT=ACTIVATIONS[act], IMPRECISE_K=promote, BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], PROGRAMS=132, UP_FIRST=False, PTX_MATH=True,
                  MODEL_ROUNDING=epilogue == "model rounding", TANH_SILU=epilogue == "tanh silu", TAIL_SPLIT=split)
    if split > 1:
        types.update(xt_desc=f"tensordesc<fp8e4nv[{bm // split}, {bk}]>",
                     ht_desc=f"tensordesc<bf16[{bm // split}, {bn}]>")
    else:
        consts.update(xt_desc=None, ht_desc=None)
    kernel = compile_kernel(gated_prefill_kernel, types, consts, ["a_scale_ptr", "s1_ptr", "s3_ptr", "parts_ptr", "N",
                                                                  "K"], cfg["num_warps"], cfg["num_stages"])
    ptx = kernel.asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)) == (
        {"m64n256k32"} if split == 1 else {"m64n256k32", "m64n128k32"})
    # the epilogue's 1 / (1 + e^x) as the GPU runs it (PTX_MATH): flush-to-zero ex2 and rcp, no division (or one
    # tanh.approx for silu); with the model's roundings, g, u and act(g) rounded to bf16 by Veltkamp's split
    # (unfused .rn multiply and adds), not by conversions: either way only h's conversion to bf16 is one, in pairs
    if epilogue == "tanh silu":
        assert "tanh.approx.f32" in ptx and "ex2.approx" not in ptx and "rcp.approx" not in ptx
    else:
        assert "rcp.approx.ftz.f32" in ptx and "ex2.approx.ftz.f32" in ptx and "tanh.approx" not in ptx
    assert not re.search(r"div\.\w+\.f32", ptx)
    assert ("mul.rn.f32" in ptx) == (epilogue == "model rounding")
    # h's conversions to bf16 in pairs, in the machine code: triton 3.9 writes pairs in the PTX (3.8 and the half
    # tiles' h, single conversions there), and ptxas pairs single ones - every bf16 conversion an
    # F2FP.BF16.F32.PACK_AB of two registers (64 of them; gelu-tanh's epilogue 48; 96 with half tiles), none with a
    # zero half, on 3.8 and 3.9
    code = sass(kernel)
    packs = re.findall(r"F2FP\.BF16\.F32\.PACK_AB R\d+, (\w+), (\w+) ;", code)
    assert len(packs) >= 48 and len(packs) == len(re.findall(r"F2F\S*BF16", code)), packs
    assert all("RZ" not in pair for pair in packs), packs
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
    assert stack_bytes(kernel) <= (72 if promote else 0), stack_bytes(kernel)
    types = dict(zip(["h_ptr", "parts_ptr", "q_ptr", "scale_ptr"], ["*bf16", "*fp32", "*fp8e4nv", "*fp32"]))
    types.update({name: "i32" for name in ("M", "N", "stride_hm", "stride_pm", "stride_qm")})
    quant_kernel = compile_kernel(quantize_rows_kernel, types, dict(N_PARTS=112, PARTS_BLOCK=128, BLOCK_M=8,
                                                                    BLOCK_N=512, EPS=1e-12, FP8_MAX=448.0),
                                  ["h_ptr", "parts_ptr", "q_ptr", "scale_ptr", "N", "stride_hm", "stride_qm"], 4, 1)
    assert quant_kernel.asm["cubin"] and stack_bytes(quant_kernel) == 0


@pytest.mark.parametrize("which", ["qkv", "down", "fused down", "fused down, h groups"])
def test_transposed_tiles_run_wgmma_on_sm90(which):
    """The tiles of 2-16 rows that compute the product transposed (``SWAP_AB``, run 20): the weight tile is the
    left operand of Hopper's wgmma (fp8 from shared memory), not mma.sync on a weight tile converted in registers;
    nothing spills. (Before, every 16-row tile compiled to mma.sync.)"""
    layout, a_dtype, a_quant = LAYOUTS["per-row"], "fp8e4nv", 0
    if which == "qkv":
        cfg = tile_config(16, 6144, 4096)
    elif which == "down":
        cfg = tile_config(16, 4096, 14336)
    elif which == "fused down":
        cfg, a_dtype, a_quant = down_tile_config(16, 4096, 14336), "bf16", QUANT_ROWS
    else:  # h in 1x128 groups: fp8 codes with per-K-step scales (the blocks layout, per-row weight scales aside)
        cfg, layout = down_tile_config(16, 4096, 14336, h_group=128), LAYOUTS["blocks"]
    assert cfg.get("SWAP_AB"), cfg
    kernel = compile_for_hopper(a_dtype, layout, cfg, a_quant=a_quant)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx, which
    assert kernel.metadata.shared <= 227 * 1024 and stack_bytes(kernel) == 0, stack_bytes(kernel)
    plain = compile_for_hopper(a_dtype, layout, {**cfg, "SWAP_AB": False}, a_quant=a_quant)
    assert "mma.sync" in plain.asm["ptx"] and "wgmma" not in plain.asm["ptx"]  # the 16-row tile untransposed


@pytest.mark.parametrize("m,n,k", [(1, 4096, 14336), (1, 28672, 4096), (16, 4096, 14336), (64, 6144, 4096)])
@pytest.mark.parametrize("a_quant", [0, QUANT_ROWS])
def test_tma_weight_loads_compile_for_sm90(m, n, k, a_quant):
    """``TMA=True`` (opt-in, for tune_gemm.py to time): the weight tiles arrive by bulk tensor copies, pipelined,
    and nothing spills, fp8 or 16-bit (the gated MLP's down GEMM) activations."""
    cfg = {**(down_tile_config(m, n, k, gemv=False) if a_quant else tile_config(m, n, k)), "TMA": True}
    kernel = compile_for_hopper("bf16" if a_quant else "fp8e4nv", LAYOUTS["per-row"], cfg, a_quant=a_quant)
    ptx = kernel.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor") >= 2, "the weight loads must be TMA copies, more than one in flight"
    assert kernel.metadata.shared <= 227 * 1024 and stack_bytes(kernel) == 0, stack_bytes(kernel)


@pytest.mark.parametrize("arch", [80, 86])
@pytest.mark.parametrize("layout", ["per-row", "blocks"])
def test_weight_only_compiles_before_sm89_with_the_weight_as_bytes(arch, layout):
    """Weight-only is the route of GPUs without fp8 tensor cores (compute capability < 8.9), where Triton has no
    fp8e4nv type: the kernels compiled with an fp8 weight do not build there (which is the bug ``B_BITS`` mends);
    with the weight as bytes, decoded by integer operations, the tensor-core tile and the GEMV build, on mma.sync,
    the decode tiles without spills (the prefill tile within what it spills on sm_90: 56 bytes with block scales)."""
    from fp8fx.kernels.fp8_gemm import tile_config as full_tile_config

    b_row, b_grp = LAYOUTS[layout][2:]
    with pytest.raises(Exception, match="fp8e4nv not supported"):
        compile_for_hopper("bf16", (False, False, b_row, b_grp), tile_config(16, 4096, 4096, transposed=False),
                           arch=arch)
    for m in (16, 64, 4096):
        cfg = tile_config(m, 4096, 4096, transposed=False)
        kernel = compile_for_hopper("bf16", (False, False, b_row, b_grp), cfg, arch=arch, b_bits=True,
                                    budget=(163 if arch == 80 else 99) * 1024 - 1024)
        spill = stack_bytes(kernel)
        assert "mma.sync" in kernel.asm["ptx"] and spill <= (320 if m > 64 else 0), (m, spill)
    gemv = compile_gemv("bf16", full_tile_config(1, 4096, 14336), b_rowwise=b_row, blocks=b_grp, arch=arch,
                        b_bits=True)
    assert gemv.asm["cubin"] and stack_bytes(gemv) == 0


SMALL_SHARED = 101376  # what one program may take on sm_86 and sm_89 (99 KiB)


@pytest.mark.parametrize("arch,a_dtype", [(89, "fp8e4nv"), (86, "bf16")])
@pytest.mark.parametrize("m", [1, 16, 24, 32, 64, 4096])
def test_tiles_fit_the_shared_memory_of_smaller_gpus(arch, a_dtype, m):
    """GPUs of 99 KiB a program: sm_89 (fp8 tensor cores: the tiles untransposed, pointer loads, ``for_device``) and
    sm_86 (weight-only, bf16 activations). Every decode and prefill tile at Llama-3-8B's shapes fits with the stages
    ``fp8_gemm`` gives it there (``stage_budget``); with the H200's 200 KiB budget o's long-step tile (fp8, 25-64 rows)
    and the weight-only down and prefill tiles took 144 KiB."""
    over = []
    for n, k in [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]:
        cfg = tile_config(m, n, k, transposed=a_dtype == "fp8e4nv")  # (mma_tile_config's: the GEMV apart)
        cfg = {key: v for key, v in cfg.items() if key not in HOPPER_ONLY}  # (as for_device before sm_90)
        bits = dict(arch=arch, b_bits=arch < 89)  # (sm_86: the weight as bytes, B_BITS)
        kernel = compile_for_hopper(a_dtype, LAYOUTS["per-row"], cfg, budget=SMALL_SHARED - 1024, **bits)
        assert kernel.metadata.shared <= SMALL_SHARED, (n, k, cfg, kernel.metadata.shared)
        h200_stages = compile_for_hopper(a_dtype, LAYOUTS["per-row"], cfg, **bits)
        over += [(n, k)] if h200_stages.metadata.shared > SMALL_SHARED else []
    want = {(89, 32): [(4096, 4096)], (89, 64): [(4096, 4096)], (86, 24): [(4096, 14336)],
            (86, 32): [(4096, 14336)], (86, 64): [(4096, 14336)],
            (86, 4096): [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]}
    assert over == want.get((arch, m), []), over


@pytest.mark.parametrize("arch,shared", [(100, 232448), (120, SMALL_SHARED)])
@pytest.mark.parametrize("m", [1, 16, 32, 64, 4096])
def test_hopper_tiles_build_for_blackwell(arch, shared, m):
    """GPUs after Hopper keep the H200's tiles (``for_device``: compute capability >= 9.0): the transposed tiles and
    TMA copies compile for sm_100 (B200, 227 KiB a program) and sm_120 (consumer Blackwell, 99 KiB) - Triton lowers
    the dot there without wgmma - and fit the shared memory with the stages ``fp8_gemm`` gives them there
    (``stage_budget``). Compiled only: no such GPU was lent, none of it timed."""
    for n, k in [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]:
        cfg = tile_config(m, n, k, transposed=True)
        kernel = compile_for_hopper("fp8e4nv", LAYOUTS["per-row"], cfg, arch=arch, budget=min(200 * 1024,
                                                                                                shared - 1024))
        assert kernel.asm["cubin"] and kernel.metadata.shared <= shared, (n, k, cfg, kernel.metadata.shared)
    if m == 1:
        from fp8fx.kernels.fp8_gemm import tile_config as full_tile_config

        gemv = compile_gemv("bf16", full_tile_config(1, 4096, 14336, a_quant=True), a_quant=1, arch=arch)
        assert gemv.asm["cubin"] and gemv.metadata.shared <= shared


GEMV_POINTERS = POINTERS
GEMV_INTS = ["N", "K", "stride_ak", "stride_bn", "stride_yn", "stride_ys", "stride_ask", "stride_bsn", "stride_bsk"]


def compile_gemv(a_dtype: str, cfg: dict, a_quant: int = 0, b_rowwise: bool = True, pdl: bool = False,
                 blocks: bool = False, arch: int = 90, b_bits: bool = False, trigger: bool = False,
                 pre_wait: int = 0):
    """``blocks``: 1x128 activation groups and 128x128 weight blocks; ``b_bits``: the weight as bytes (``B_BITS``)."""
    cfg = {k: v for k, v in cfg.items() if k not in ("GEMV", "BLOCK_M")}
    y_type = "*fp32" if cfg["SPLIT_K"] > 1 else "*bf16"
    b_type = "*u8" if b_bits else "*fp8e4nv"
    types = dict(zip(GEMV_POINTERS, [f"*{a_dtype}", b_type, y_type, "*fp32", "*fp32", "*bf16", "*bf16", "*i32"]))
    types.update({name: "i32" for name in GEMV_INTS})
    consts = dict(A_FP8=a_dtype == "fp8e4nv" or a_quant > 0, A_GROUPED=blocks, B_ROWWISE=b_rowwise and not blocks,
                  B_GROUPED=blocks, B_BLOCK_N=128 if blocks else 1, GROUP_K=128 if blocks else 1, HAS_BIAS=True,
                  BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=cfg["SPLIT_K"], EVEN_K=True, A_QUANT=a_quant,
                  N_PARTS=448, PARTS_BLOCK=parts_block(448, 1), EPS=1e-12, FP8_MAX=448.0, PDL_WAIT=pdl,
                  K_STAGES=cfg.get("K_STAGES", 1), B_BITS=b_bits, PDL_TRIGGER=trigger, PRE_WAIT=pre_wait)
    return compile_kernel(fp8_gemv_kernel, types, consts, GEMV_POINTERS + ["N", "K", "stride_bn"], cfg["num_warps"],
                          cfg["num_stages"], arch)


def ptx_loops(ptx: str) -> list[str]:
    """The bodies of the PTX's loops (a label up to the branch back to it)."""
    lines = ptx.splitlines()
    labels = {line.strip().split(":")[0]: i for i, line in enumerate(lines) if re.match(r"\s*\$L__BB\d+_\d+:", line)}
    loops = []
    for i, line in enumerate(lines):
        target = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if target and labels.get(target.group(1), i) < i:
            loops.append("\n".join(lines[labels[target.group(1)]:i + 1]))
    return loops


@pytest.mark.parametrize("pipelined", [True, False], ids=["k_stages", "registers"])
@pytest.mark.parametrize("n,k", [(4096, 14336), (28672, 4096), (6144, 4096)])
@pytest.mark.parametrize("a_dtype,a_quant,blocks", [
    ("fp8e4nv", 0, False), ("bf16", 0, False), ("bf16", QUANT_ROWS, False), ("bf16", QUANT_TENSOR, False),
    ("bf16", QUANT_STATIC, False), ("fp8e4nv", 0, True), ("bf16", 0, True)])
def test_gemv_compiles_for_sm90(n, k, a_dtype, a_quant, blocks, pipelined):
    """The one-row kernel at its Llama-3-8B tiles: fp8 codes, weight-only bf16, and the fused MLP's down GEMM (bf16
    h quantized as loaded, a programmatic dependent launch). Nothing spills. As configured (``K_STAGES`` > 1) the
    weight arrives in 16-byte asynchronous copies to shared memory (cp.async, the loop pipelined), BLOCK_N of them
    a thread and step, read back 16 bytes at a time; with ``K_STAGES=1`` in 16-byte loads straight to registers,
    and with fp8 codes the step's K loop then exchanges nothing through shared memory (the warps split K: each
    thread multiplies the a slice it loaded). With 128x128 weight blocks (and 1x128 activation groups), the scales
    of a thread's 16 bytes of a row are one load, not 16."""
    cfg = gemv_config(n, k, a_quant=a_quant > 0)
    cfg = cfg if pipelined else {**cfg, "K_STAGES": 1}
    pdl = a_quant > 0
    kernel = compile_gemv(a_dtype, cfg, a_quant, pdl=pdl, blocks=blocks)
    assert stack_bytes(kernel) == 0, stack_bytes(kernel)
    (loop,) = ptx_loops(kernel.asm["ptx"])
    if pipelined:
        copies = len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", loop))
        assert copies >= cfg["BLOCK_N"], copies
        assert loop.count("ld.shared.v4.b32") >= cfg["BLOCK_N"], loop.count("ld.shared.v4.b32")
        assert "ld.global.v4" not in loop
    else:
        assert loop.count("ld.global.v4.b32") >= cfg["BLOCK_N"], loop.count("ld.global.v4.b32")
        assert "cp.async" not in loop
    if blocks:  # BLOCK_N weight rows' scales and a's: one (scalar) load or 4-byte copy each per thread and step
        scalar = len(re.findall(r"ld\.global(\.[a-z]+)*\.b32 |cp\.async\.ca\.shared\.global .*, 0x4", loop))
        assert scalar <= cfg["BLOCK_N"] + 1, scalar
    if a_dtype == "fp8e4nv" and not blocks and not pipelined:  # (with block scales at 2 warps, triton 3.6 - not
        # 3.9 - moves the spread of a piece's scales through shared memory; that kernel still beat the tensor-core
        # tile, run 16)
        assert "bar.sync" not in loop and ".shared" not in loop, "a's slice must not go through shared memory"
    if a_quant:
        assert "cvt.rn.satfinite.e4m3x2.f32" in loop, "h must be rounded to fp8 codes"
        ptx = kernel.asm["ptx"]
        before = ptx[:ptx.index("griddepcontrol.wait")]
        assert not re.search(r"\b(ld\.global|cp\.async|atom\.|red\.|st\.global)", before), before[-2000:]


@pytest.mark.parametrize("m,n,k", [(1, 4096, 14336), (1, 6144, 4096), (24, 28672, 4096), (24, 6144, 4096),
                                   (32, 4096, 4096), (64, 4096, 14336), (16, 4096, 4096)])
def test_pdl_trigger_compiles_for_sm90(m, n, k):
    """``PDL_TRIGGER`` at the decode tiles (the GEMV at one row: down; qkv's tensor-core tile, ``gemv_fits``): each
    program reads or writes no memory before ``griddepcontrol.wait`` and lets the next kernel launch after it (not
    before: a kernel launched after it may take every kernel before it as finished). Nothing more spills than
    without it."""
    from fp8fx.kernels.fp8_gemm import gemv_fits

    cfg = tile_config(m, n, k)
    if m == 1 and gemv_fits(m, n, k):
        cfg = gemv_config(n, k)
        plain, kernel = (compile_gemv("fp8e4nv", cfg, pdl=True, **kw) for kw in ({}, dict(trigger=True)))
    else:
        plain, kernel = (compile_for_hopper("fp8e4nv", LAYOUTS["per-row"], cfg, pdl=True, **kw)
                         for kw in ({}, dict(trigger=True)))
    ptx = kernel.asm["ptx"]
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert "griddepcontrol.launch_dependents" not in before
    assert "griddepcontrol.launch_dependents" in ptx[ptx.index("griddepcontrol.wait"):]
    memory = r"\b(ld\.global|cp\.async\.(ca|cg)|cp\.async\.bulk\.tensor|atom\.|red\.|st\.global)"
    assert not re.search(memory, before), before[-2000:]
    assert "griddepcontrol" not in plain.asm["ptx"].replace("griddepcontrol.wait", "")
    # and so in the machine code: the wait (ACQBULK), then the trigger (PREEXIT)
    code = sass(kernel)
    order = [code.find(op) for op in ("ACQBULK", "PREEXIT")]
    assert -1 < order[0] < order[1], order
    assert stack_bytes(kernel) <= stack_bytes(plain), (stack_bytes(kernel), stack_bytes(plain))


@pytest.mark.parametrize("n,k,pre", [(4096, 14336, 1), (4096, 14336, 2), (6144, 4096, 2), (6144, 4096, 4),
                                     (4096, 4096, 4)])
@pytest.mark.parametrize("a_quant", [0, QUANT_ROWS])
def test_weight_loaded_before_the_wait_compiles_for_sm90(n, k, pre, a_quant):
    """``PRE_WAIT`` at the GEMV's decode tiles (fp8 codes; bf16 h quantized as loaded, the fused MLP's down GEMM):
    before ``griddepcontrol.wait`` each program loads - the weight's first steps, 16 bytes at a time - and writes
    nothing (no store, no atomic, no asynchronous copy); the rest of the weight still streams through the one
    pipelined loop. Nothing spills at these tiles. (4 steps of the fused MLP's one-token down GEMM - 8 rows of K
    14336 a program, h quantized as loaded - spill 376 bytes a thread with triton 3.8: 32 KB of weight a program
    held in 2 warps' registers.)"""
    cfg = gemv_config(n, k, a_quant=a_quant > 0)
    a_dtype = "bf16" if a_quant else "fp8e4nv"
    plain, kernel = (compile_gemv(a_dtype, cfg, a_quant, pdl=True, pre_wait=p) for p in (0, pre))
    ptx = kernel.asm["ptx"]
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert len(re.findall(r"\bld\.global(\.[a-z0-9]+)*\.v4\.b32\b", before)) >= pre * cfg["BLOCK_N"], before[-2000:]
    assert not re.search(r"\b(atom\.|red\.|st\.global|cp\.async)", before), before[-2000:]
    plain_ptx = plain.asm["ptx"]
    assert "ld.global" not in plain_ptx[:plain_ptx.index("griddepcontrol.wait")]
    assert len(ptx_loops(ptx)) == len(ptx_loops(plain_ptx)) == 1
    assert stack_bytes(kernel) == 0, stack_bytes(kernel)


@pytest.mark.parametrize("rows,split,fast", [(16, 1, False), (64, 2, True)])
def test_gluon_decode_study_compiles_for_sm90(rows, split, fast):
    """benchmarks/gluon_decode.py (H200 run 39, a study outside fp8fx) keeps compiling for sm_90 on CI's Triton: its
    point, the weight's TMA copies issued before ``griddepcontrol.wait`` and the activation's after, is in the PTX."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    try:
        import gluon_decode
    finally:
        sys.path.pop(0)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gluon_decode.decode_kernel
    names = list(fn.arg_names)
    layouts = {r: gl.NVMMASharedLayout.get_default_for([r, 128], gl.float8e4nv) for r in (64, rows)}
    types = dict(w_desc=f"tensordesc<fp8e4nv[64, 128],{layouts[64]!r}>",
                 x_desc=f"tensordesc<fp8e4nv[{rows}, 128],{layouts[rows]!r}>", xs_ptr="*fp32", ws_ptr="*fp32",
                 y_ptr="*fp32" if split > 1 else "*bf16", out_ptr="*bf16", ticket_ptr="*i32", M="i32", N="i32",
                 K="i32")
    consts = dict(BN=64, MT=rows, KSUB=2, STAGES=4, SPLIT=split, PDL=True, TRIGGER=True, FAST=fast)
    src = GluonASTSource(fn=fn, signature={k: "constexpr" if k in consts else types[k] for k in names},
                         constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(names.index(k),): [["tt.divisibility", 16]]
                                for k in ["xs_ptr", "ws_ptr", "y_ptr", "out_ptr", "ticket_ptr", "N", "K"]})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    copies = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor", ptx)]
    # the ring's 4 stages of 2 weight boxes before the wait, the activation's 8 after it (and the loop's refills)
    assert sum(c < wait for c in copies) == 8 and sum(c > wait for c in copies) >= 8
    assert "wgmma.mma_async" in ptx and ".local" not in ptx


def test_least_k_step_of_each_dot_compiles_for_sm90():
    """``fp8_gemm``'s config check takes BLOCK_K of 16 for weight-only (a 16-bit dot) and of ``FP8_DOT_MIN_K`` for
    fp8 activations: both compile for sm_90, and an fp8 dot of K 16 - which the interpreter runs - does not (so the
    floor is the compiler's, not a guess)."""
    from fp8fx.kernels.fp8_gemm import FP8_DOT_MIN_K

    cfg = dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=3)
    assert compile_for_hopper("bf16", LAYOUTS["per-row"], {**cfg, "BLOCK_K": 16}).asm["cubin"]
    assert compile_for_hopper("fp8e4nv", LAYOUTS["per-row"], {**cfg, "BLOCK_K": FP8_DOT_MIN_K}).asm["cubin"]
    with pytest.raises(Exception, match="K >= 32"):
        compile_for_hopper("fp8e4nv", LAYOUTS["per-row"], {**cfg, "BLOCK_K": FP8_DOT_MIN_K // 2})
