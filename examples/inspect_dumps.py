"""Reading what the compiler did: compile a small model with ``Fp8Backend(dump_dir=...)``, then walk the folder
in name order, which is the order things happened.

    python examples/inspect_dumps.py [--dump-dir DIR] [--device cuda] [--size 4096]

It writes a dump of its own small model (default: a fresh temporary folder, kept and printed; a ``--dump-dir`` it
is given loses the graph and report files an earlier dump left there, as ``Fp8Backend(dump_dir=...)`` does).
"""
import argparse
import json
import os
import re
import tempfile

import torch
from torch import nn

import fp8fx

WHAT = {  # file name (after graphNNN_) -> what it holds
    "0_dynamo_graph.py": "the graph Dynamo captured: dequantize(w8, scale) -> linear, as the model wrote it",
    "2_inductor_output_code.py": "the code Inductor generated: its kernels and the wrapper that calls them",
    "3_report.json": "this graph's sites as JSON (rewritten or why not, weight, kernel, bytes saved)",
    "3_report.txt": "the same as a table",
    "4_dynamo_bytecode": "how Python calls the compiled graph (__compiled_fn_*), decompiled by depyf",
}


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


PASSES = {"LinearPass": ": linear -> quantize(x) + scaled_mm"}  # what a pass's file shows, where it says more


def describe(name: str) -> str:
    short = re.sub(r"^graph\d+_", "", name)
    after = re.fullmatch(r"1_\d+_after_(\w+)\.py", short)
    if after:  # one file after each fp8fx pass, in pass order
        return f"the graph after {after[1]}{PASSES.get(after[1], '')}"
    return next((text for prefix, text in WHAT.items() if short.startswith(prefix)), "every graph so far")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump-dir", default=None, help="where to dump (default: a new temporary folder)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=256, help="model width (multiple of 128)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP(args.size).to(args.device, torch.bfloat16)
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(dump_dir=args.dump_dir or tempfile.mkdtemp(prefix="fp8fx_dump_"))
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(8, args.size, device=args.device, dtype=torch.bfloat16))

    dump_dir = backend.dump_dir  # args.dump_dir, or a subfolder of it where another live backend writes there
    names = sorted(os.listdir(dump_dir))
    print(f"{dump_dir}/")
    for name in names:
        print(f"  {name:44s} {describe(name)}")

    after = next(n for n in names if n.startswith("graph000_1_") and n.endswith("_after_LinearPass.py"))
    print(f"\nthe fp8 ops in {after}:")
    with open(os.path.join(dump_dir, after)) as f:
        for line in f:
            if "torch.ops.fp8fx." in line:
                print("  " + line.strip().split(";")[0][:150])

    with open(os.path.join(dump_dir, "graph000_3_report.json")) as f:
        sites = json.load(f)["sites"]
    print("\nthe kernel Inductor chose for each site (graph000_3_report.json):")
    for site in sites:
        print(f"  {site['fqn']:10s} {site['kernel']}")
    print(f"\n{backend.report}")


if __name__ == "__main__":
    main()
