"""A whole HF MoE layer (router, top-k, experts, combine) compiled through fp8fx vs the same layer in
bf16 through Inductor, in one process on the GPU.

    python benchmarks/bench_moe_layer.py [--out DIR] [--tokens 16,4096] [--models qwen3_moe,mixtral]
    python benchmarks/bench_moe_layer.py --kernels ...  # and each layer's kernels in one CUDA-graph replay
    python benchmarks/bench_moe_layer.py --cpu-smoke   # tiny dims on CPU: the fp8fx path still works

The layer is the ``mlp`` of a one-layer transformers model with the real model's MoE dimensions
(Qwen3-30B-A3B: E=128, top-8, H=2048, I=768; Mixtral-8x7B: E=8, top-2, H=4096, I=14336; Llama-4 Scout: E=16,
top-1, H=5120, I=8192, dense experts and a shared expert; GPT-OSS-20B / 120B: E=32 / 128, top-4, H=I=2880,
biases, interleaved gate/up rows, a clamped SwiGLU; Nemotron-3-Nano-30B-A3B's shape: E=128, top-6, H=2688, I=1856,
ungated experts of squared ReLU and a shared expert), its experts
run with transformers' ``grouped_mm`` implementation. fp8fx: ``quantize_(Fp8Config())`` (per-channel experts,
per-token activations) + ``Fp8Backend()``; the MoE pass rewrites the experts into ``fp8fx.fused_moe``, the router stays
bf16, its linear runs as ``fp8fx.small_mm`` and its top-k as ``fp8fx.topk``, a softmax router's softmax and
normalization in the top-k's launch (``fp8fx.softmax_topk``); ``fp8fx_nopdl_ms`` times it with the experts' direct
path launched plainly (``fused_moe.DIRECT_PDL_TRIGGER = None``; the same launches where the layer takes the sorted path
or the GPU is not sm_90), ``fp8fx_unfused_routing_ms`` with the softmax and normalization left to Inductor
(``Fp8Backend(fuse_routing=False)``), ``fp8fx_torch_topk_ms`` with the router's top-k left to torch too
(``fast_topk=False``), ``fp8fx_torch_routing_ms`` its linear too (``fast_router=False``). Every row is
timed as CUDA-graph replays of the compiled layer (run 8 first timed 4096 tokens as plain calls: fp8fx's Python op
dispatch, not the GPU, set that number). Writes moe_layer.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8fx  # noqa: E402
from bench_moe import rel_err, time_ms  # noqa: E402  (run as a script: benchmarks/ is on sys.path)
from bench_linear import with_kernel_setting  # noqa: E402
from fp8fx.kernels import fused_moe as moe_kernel  # noqa: E402


MODELS = {  # transformers config class name, MoE dimensions
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                       num_experts_per_tok=8, norm_topk_prob=True, head_dim=128)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)),
    # Llama-4 Scout's MoE layer: every expert on every token (the dense form; fp8fx does not skip the zero rows), and
    # a shared expert; experts [E, H, 2I]
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_local_experts=16,
                    num_experts_per_tok=1, head_dim=128, interleave_moe_layer_step=1, no_rope_layers=[1])),
    # GPT-OSS-20B / 120B: experts [E, H, 2I] with gate and up rows interleaved, biases, a clamped SwiGLU
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                     head_dim=64)),
    "gpt_oss_120b": ("GptOssConfig", "GptOssForCausalLM",
                     dict(hidden_size=2880, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4,
                          head_dim=64)),
    # Nemotron-H's MoE layer (Nemotron-3-Nano-30B-A3B's dimensions): ungated experts, down(relu(up(x))^2), [E, I, H];
    # a shared expert of the same form
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(hidden_size=2688, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
                        n_routed_experts=128, num_experts_per_tok=6, n_group=1, topk_group=1, head_dim=128,
                        layers_block_type=["moe"])),
}
TINY = dict(hidden_size=128, moe_intermediate_size=64, intermediate_size=64, num_experts=8, num_local_experts=8,
            n_routed_experts=8, moe_shared_expert_intermediate_size=64)


def moe_layer(name: str, device: str, tiny: bool):
    import transformers

    config_name, model_name, dims = MODELS[name]
    dims = {**dims, **{k: v for k, v in TINY.items() if k in dims}} if tiny else dims
    layers = {} if "layers_block_type" in dims else dict(num_hidden_layers=1)  # (Nemotron-H: its block list)
    config = getattr(transformers, config_name)(vocab_size=128, num_attention_heads=16, num_key_value_heads=4,
                                                **layers, **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_name)(config).to(torch.bfloat16).eval()
    decoder = model.model.layers[0]
    if hasattr(decoder, "mlp") or hasattr(decoder, "mixer"):
        model.set_experts_implementation("grouped_mm")
    layer = getattr(decoder, "mlp", None) or getattr(decoder, "mixer", None) or decoder.feed_forward
    return layer, config.hidden_size


def _out(y):
    return y[0] if isinstance(y, tuple) else y  # (Llama-4's block: (output, router logits))


def graph_trace(fn, replays: int = 20) -> str:
    """The kernels of one CUDA-graph replay of ``fn()`` in launch order: each one's start after the first one's
    start and its GPU time (start to end; with programmatic dependent launch the time it waited included), medians
    of ``replays`` replays (torch.profiler); then the replay's span from the first start to the last end, and the
    kernels' summed time. The span less that sum is what the graph spends between kernels."""
    from torch.profiler import ProfilerActivity, profile

    from profile_mlp import per_call

    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()  # (replays apart: each one's kernels are one group)
    calls = per_call(prof, replays)
    if isinstance(calls, str):
        return calls
    per = len(calls[0])
    med = statistics.median
    starts = [med(c[i].time_range.start - c[0].time_range.start for c in calls) for i in range(per)]
    us = [med(c[i].time_range.elapsed_us() for c in calls) for i in range(per)]
    span = med(max(e.time_range.end for e in c) - c[0].time_range.start for c in calls)
    lines = [f"{s:8.2f} {t:8.2f} us  {e.name[:110]}" for s, t, e in zip(starts, us, calls[0])]
    return "\n".join(["   start     time"] + lines + [f"span {span:.2f} us, kernels {sum(us):.2f} us in {per}"])


def run(name: str, tokens: list[int], device: str, tiny: bool, kernels: bool = False) -> list[dict]:
    """``kernels``: also each compiled layer's kernels in one CUDA-graph replay (``graph_trace``), printed."""
    layer, hidden = moe_layer(name, device, tiny)
    xs = {t: torch.randn(1, t, hidden, device=device, dtype=torch.bfloat16) for t in tokens}
    bf16 = torch.compile(layer, dynamic=False)
    with torch.no_grad():
        refs = {t: _out(bf16(x)) for t, x in xs.items()}
        times = {t: time_ms(lambda x=x: bf16(x), graph=True) for t, x in xs.items()} if device == "cuda" else {}
        if kernels and device == "cuda":
            for t, x in xs.items():
                print(f"{name} {t} tokens, bf16 Inductor:\n{graph_trace(lambda x=x: bf16(x))}", flush=True)
        torch._dynamo.reset()
        fp8fx.quantize_(layer, fp8fx.Fp8Config())  # (the router is found and kept in bf16)
        backend = fp8fx.Fp8Backend()
        fp8 = torch.compile(layer, backend=backend, dynamic=False)
        # the routing's steps given back one by one, each compiled apart: the softmax and normalization to Inductor,
        # the top-k to torch, the router's linear to torch
        variants = {name: torch.compile(layer, backend=fp8fx.Fp8Backend(**options), dynamic=False) for name, options in
                    (("unfused_routing", dict(fuse_routing=False)), ("torch_topk", dict(fast_topk=False)),
                     ("torch_routing", dict(fast_topk=False, fast_router=False)))}
        rows = []
        for t, x in xs.items():
            out = _out(fp8(x))
            row = dict(model=name, tokens=t, err_vs_bf16=rel_err(out, refs[t]))
            for variant, fn in variants.items():
                row[f"err_{variant}_vs_bf16"] = rel_err(_out(fn(x)), refs[t])
            if device == "cuda":
                row["bf16_inductor_ms"] = times[t]
                # and the experts' direct path with its GEMMs launched plainly (``*_nopdl``), the two interleaved
                # twice, the faster of each kept
                plain = with_kernel_setting(lambda x=x: fp8(x), "DIRECT_PDL_TRIGGER", None, moe_kernel)
                for _ in range(2):
                    for key, fn in (("fp8fx_ms", lambda x=x: fp8(x)), ("fp8fx_nopdl_ms", plain)):
                        ms = time_ms(fn, graph=True)
                        row[key] = min(ms, row.get(key, ms))
                row["vs_bf16"] = row["bf16_inductor_ms"] / row["fp8fx_ms"]
                row["nopdl_vs_bf16"] = row["bf16_inductor_ms"] / row["fp8fx_nopdl_ms"]
                for variant, fn in variants.items():
                    row[f"fp8fx_{variant}_ms"] = time_ms(lambda x=x, fn=fn: fn(x), graph=True)
                    row[f"{variant}_vs_bf16"] = row["bf16_inductor_ms"] / row[f"fp8fx_{variant}_ms"]
                if kernels:
                    print(f"{name} {t} tokens, fp8fx:\n{graph_trace(lambda x=x: fp8(x))}", flush=True)
            rows.append(row)
        if name == "llama4":  # the dense rewrite alone (routing off): what fp8 gains before routing does
            torch._dynamo.reset()
            routed = fp8fx.passes.moe._route_dense
            fp8fx.passes.moe._route_dense = lambda graph, fused: False
            try:
                dense = torch.compile(layer, backend=fp8fx.Fp8Backend(), dynamic=False)
                for row, x in zip(rows, xs.values()):
                    row["err_dense_vs_bf16"] = rel_err(_out(dense(x)), refs[row["tokens"]])
                    if device == "cuda":
                        row["fp8fx_dense_ms"] = time_ms(lambda x=x: dense(x), graph=True)
                        row["dense_vs_bf16"] = row["bf16_inductor_ms"] / row["fp8fx_dense_ms"]
            finally:
                fp8fx.passes.moe._route_dense = routed
    print(backend.report)
    moe_sites = [s for s in backend.report.sites if s.kind == "moe"]
    for row in rows:  # one graph per token count (dynamic=False): its one MoE site, rewritten or not
        row["moe_sites_rewritten"] = sum(s.rewritten for s in moe_sites) / max(backend.report.graphs, 1)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--tokens", default="16,4096")
    p.add_argument("--models", default="qwen3_moe,mixtral")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--kernels", action="store_true", help="each layer's kernels in one CUDA-graph replay, timed")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu_smoke else "cuda"
    tokens = [5] if args.cpu_smoke else [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.models.split(","):
        start = time.perf_counter()
        rows += run(name, tokens, device, args.cpu_smoke, args.kernels)
        print(f"{name}: {time.perf_counter() - start:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_layer.json"), "w") as f:
        json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
    ok = all(r["moe_sites_rewritten"] == 1 and r["err_vs_bf16"] < 0.1 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
