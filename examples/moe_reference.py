"""A plain Mixture-of-Experts layer in a few lines of torch (no HF), and fp8fx running its experts in fp8.

``Experts`` is the reference form of the computation ``fp8fx.fused_moe`` replaces: every expert, in a loop,
on every token, weighted by the routing weight the token gave it (0 when it did not pick it). Dynamo unrolls
the loop; the MoE pass recognises the unrolled experts and rewrites them into one ``fused_moe`` op. The
weights use the HF transformers 5 layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), so
``fp8fx.quantize_`` quantizes them like an HF experts module's.

    python examples/moe_reference.py                  # CPU: a small random 2-layer stack
    python examples/moe_reference.py --device cuda
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import fp8fx


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, intermediate) / intermediate**0.5)

    def forward(self, x, top_k_index, top_k_weights):  # x: [T, H]; top_k_*: [T, K]
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(self.num_experts):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)  # [T, 1]: 0 unless e was picked
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)  # [T, I] each
            out = out + weight * F.linear(F.silu(gate) * up, self.down_proj[e])
        return out.to(x.dtype)


class MoE(nn.Module):
    """Top-k routing (softmax, renormalised over the k picked experts) in front of ``Experts``."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)

    def forward(self, x):  # x: [B, S, H]
        h = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(h).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(h, index, weights).reshape(x.shape)


class Stack(nn.Module):
    def __init__(self, layers=2, num_experts=8, top_k=2, hidden=256, intermediate=128):
        super().__init__()
        self.layers = nn.ModuleList(MoE(num_experts, top_k, hidden, intermediate) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Stack().to(args.device, torch.bfloat16).eval()
    x = torch.randn(2, 16, 256, device=args.device, dtype=torch.bfloat16)
    with torch.no_grad():
        reference = model(x).float()
        # quantize_ keeps the routers in bf16 on its own (as vLLM does), so fp8 rounding does not change which experts
        # the tokens pick; the report says so
        fp8fx.quantize_(model, fp8fx.Fp8Config())
        backend = fp8fx.Fp8Backend()
        out = torch.compile(model, backend=backend)(x).float()
    print(backend.report)
    err = ((out - reference).norm() / reference.norm()).item()
    print(f"\noutput vs bf16: relative error {err:.4f}")


if __name__ == "__main__":
    main()
