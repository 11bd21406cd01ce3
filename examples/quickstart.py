"""fp8fx quickstart: a small bf16 model -> FP8 weights -> torch.compile with fp8fx -> what was rewritten,
and the error against the bf16 model. Runs on CPU (reference kernels) or, with --device cuda, on a GPU.

    python examples/quickstart.py [--device cuda] [--size 4096]
"""
import argparse

import torch
from torch import nn

import fp8fx


class Block(nn.Module):
    """RMSNorm -> gated MLP -> residual, as in Llama."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyModel(nn.Module):
    def __init__(self, dim: int = 256, layers: int = 2, vocab: int = 1000):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, 2 * dim) for _ in range(layers))
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=256, help="model width (multiple of 128)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyModel(args.size).to(args.device, torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (4, 32), device=args.device)
    with torch.no_grad():
        reference = model(ids).float()

        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
        backend = fp8fx.Fp8Backend()
        logits = torch.compile(model, backend=backend)(ids).float()

    print(backend.report)
    err = ((logits - reference).norm() / reference.norm()).item()
    print(f"relative error of the logits vs the bf16 model: {err:.4f}")


if __name__ == "__main__":
    main()
