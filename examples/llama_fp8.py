"""An HF Llama with online FP8 weights: bf16 model -> fp8fx.quantize_ -> torch.compile with fp8fx -> the report,
and how far the logits moved from the bf16 model's.

    python examples/llama_fp8.py                                        # CPU: a tiny random Llama, seconds
    python examples/llama_fp8.py --device cuda --preset llama3-8b       # GPU: Llama-3-8B's shapes, random weights
    python examples/llama_fp8.py --device cuda --model meta-llama/Llama-3.1-8B-Instruct   # real weights

Random weights keep the example free of downloads; --layers (default 2) keeps the preset's compile short.
"""
import argparse

import torch
import transformers

import fp8fx
import fp8fx.testing

PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, rope_theta=500000.0),
}
PROMPT = "The capital of France is Paris. The capital of Italy is"


def load(args):
    """(bf16 model, input ids) from --model, or a --preset with random weights."""
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        try:
            ids = transformers.AutoTokenizer.from_pretrained(args.model)(PROMPT, return_tensors="pt").input_ids
        except (OSError, ValueError) as e:  # a folder of weights only (save_pretrained's, fp8fx convert's)
            print(f"no tokenizer in {args.model} ({type(e).__name__}): random token ids instead")
            ids = torch.randint(0, model.config.vocab_size, (2, 32))
        return model.to(args.device).eval(), ids.to(args.device)
    config = transformers.LlamaConfig(**PRESETS[args.preset], num_hidden_layers=args.layers)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        ids = torch.randint(0, config.vocab_size, (2, 32))
    return model.eval(), ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of a preset")
    parser.add_argument("--model", help="an HF model id or folder (real weights) instead of a preset")
    args = parser.parse_args()

    torch.manual_seed(0)
    model, ids = load(args)
    with torch.no_grad():
        reference = model(ids).logits.float()
        fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))  # fp8 weights, layer by layer
        backend = fp8fx.Fp8Backend()
        logits = torch.compile(model, backend=backend)(ids).logits.float()

    print(backend.report)
    fp8fx.testing.assert_rewritten(backend, "model.layers.*")  # every projection of every layer runs in fp8
    fp8fx.testing.assert_not_rewritten(backend, "lm_head")
    err = ((logits - reference).norm() / reference.norm()).item()
    same = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"logits vs bf16: relative error {err:.4f}, same next token at {same:.0%} of positions")


if __name__ == "__main__":
    main()
