"""Run 35 diagnosis: which decoder-layer variant's CUDA-graph replay faults when several live in one process."""
import sys, torch
sys.path.insert(0, "benchmarks")
import bench_decoder_layer as bd
from bench_linear import capture, l2_flushes

variants, m = sys.argv[1].split(","), int(sys.argv[2])
fresh = bd.layer_factory(bd.LLAMA3_8B, "cuda")
x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
graphs = {}
with torch.no_grad():
    for v in variants:
        layer = fresh(m, 1024)
        fn, _, _ = bd.compiled(v, layer)
        fn(x); torch.cuda.synchronize()
        graphs[v] = capture(fn, x); torch.cuda.synchronize()
        graphs[v].replay(); torch.cuda.synchronize()
        print(v, "captured, replayed", flush=True)
        for w, g in graphs.items():
            g.replay(); torch.cuda.synchronize()
            print("  after capturing", v, "replayed", w, flush=True)
    for r in range(2):
        for v, g in graphs.items():
            for i in range(50):
                l2_flushes()["clean"](); g.replay()
            torch.cuda.synchronize()
            print("round", r, v, "ok", flush=True)
