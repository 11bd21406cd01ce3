"""An HF MoE model (Qwen3-MoE) through fp8fx, and what the report says about it: the attention projections and
the experts (rewritten by the MoE pass into ``fp8fx.fused_moe``) run on fp8 weights; the router stays bf16 and
is listed as not rewritten, with the reason.

    python examples/moe_report.py                                        # CPU: a tiny random Qwen3-MoE
    python examples/moe_report.py --static                               # static activation scales: calibrate
    python examples/moe_report.py --device cuda --preset qwen3-30b-a3b   # GPU: Qwen3-30B-A3B's shapes, 2 layers
    python examples/moe_report.py --device cuda --model Qwen/Qwen3-30B-A3B   # real weights
"""
import argparse

import torch
import transformers

import fp8fx

PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8),
}


def load(args):
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        return model.to(args.device).eval()
    config = transformers.Qwen3MoeConfig(**PRESETS[args.preset], num_hidden_layers=args.layers)
    with torch.device(args.device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of a preset")
    parser.add_argument("--model", help="an HF MoE model id or folder (real weights) instead of a preset")
    parser.add_argument("--static", action="store_true",
                        help="static activation scales from fp8fx.calibrate (the experts' two inputs included)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = load(args)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device=args.device)
    with torch.no_grad():
        reference = model(ids).logits.float()
        config = fp8fx.Fp8Config(ignored_layers=["lm_head"], activation_scheme="static" if args.static else "dynamic")
        # calibration batches: here the input itself; in practice a few hundred samples of the model's data
        scales = fp8fx.calibrate(model, [ids], config) if args.static else None
        fp8fx.quantize_(model, config, input_scales=scales)
        backend = fp8fx.Fp8Backend()
        logits = torch.compile(model, backend=backend)(ids).logits.float()

    print(backend.report)
    print("\nthe experts:")
    sites = {s.fqn: s for s in backend.report.sites}
    unhandled = backend.report.unhandled_weights(model)
    for fqn, module in model.named_modules():
        if type(module).__name__.endswith("Experts"):
            site = sites.get(fqn)
            if site is None:
                status = "not rewritten: in no site (no pass matched how it computes its experts)"
            else:
                status = "rewritten" if site.rewritten else f"not rewritten: {site.reason}"
            weights = [f"{n.rpartition('.')[2]} {'x'.join(map(str, shape))} {dtype}"
                       for n, shape, dtype, _ in unhandled if n.startswith(fqn + ".")]
            print(f"  {fqn}: {status}" + (f"; {', '.join(weights)}" if weights else ""))
    err = ((logits - reference).norm() / reference.norm()).item()
    print(f"\nlogits vs bf16: relative error {err:.4f}")


if __name__ == "__main__":
    main()
