"""Run an FP8 checkpoint: the model is built on the meta device (no memory), ``fp8fx.load_checkpoint`` streams
its fp8 weights and scales in, and torch.compile with fp8fx runs it; the report says what runs in fp8.

    python examples/load_checkpoint.py       # CPU: writes a tiny fp8 Llama checkpoint first, then loads it
    python examples/load_checkpoint.py --device cuda --checkpoint PATH   # an fp8 / compressed-tensors HF folder

Without --checkpoint, the tiny checkpoint comes from a random bf16 Llama through quantize_ + save_checkpoint,
and the loaded model's logits are compared with those of the model that wrote it.
"""
import argparse
import tempfile

import torch
import transformers

import fp8fx
from fp8fx.checkpoint import meta_model


def write_tiny_checkpoint(path: str):
    """A random bf16 Llama, quantized and saved to ``path``; returns it (eager, fp8 weights)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()  # rotary in fp32
    fp8fx.quantize_(model, fp8fx.Fp8Config(ignored_layers=["lm_head"]))
    fp8fx.save_checkpoint(model, path)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoint", help="folder with config.json and *.safetensors (default: a tiny one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or tmp
        writer = None if args.checkpoint else write_tiny_checkpoint(path).to(args.device)
        model = meta_model(path)  # the HF model config.json describes, on the meta device
        print(fp8fx.load_checkpoint(model, path, device=args.device, progress=False))

    ids = torch.randint(0, model.config.vocab_size, (2, 16), device=args.device)
    backend = fp8fx.Fp8Backend()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(ids).logits.float()
        # the model that wrote the checkpoint, compiled the same way: the same fp8 weights, the same logits
        reference = torch.compile(writer, backend=fp8fx.Fp8Backend())(ids).logits.float() if writer else None
    print(backend.report)
    if reference is not None:
        err = ((logits - reference).norm() / reference.norm()).item()
        print(f"logits vs the model that wrote the checkpoint: relative error {err:.2e}")


if __name__ == "__main__":
    main()
