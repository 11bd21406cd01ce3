"""The fp8fx command: exit codes and output on bad paths, bad configs and good models."""
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import fp8fx
from fp8fx.checkpoint.files import write_file
from fp8fx.cli import main, predict
from tests.conftest import rel_err

transformers = pytest.importorskip("transformers")

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err, *parts):
    assert err.count("\n") == 1, err
    for part in parts:
        assert part in err, err


@pytest.fixture
def llama_dir(tmp_path):
    """A tiny Llama config.json (no weights) whose quantization_config asks for 128x128 blocks."""
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def test_inspect_hf_config_folder(capsys, llama_dir):
    code, out, err = run(capsys, "inspect", str(llama_dir), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["config"]["weight_block_size"] == [128, 128] and result["graphs"] == 1
    sites = {r["fqn"]: r for r in result["sites"]}
    expected = {f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS}
    assert {fqn for fqn, r in sites.items() if r["would_rewrite"]} == expected
    assert all(sites[f]["scheme"] == "w:per-block(128x128) a:per-group(1x128)" for f in expected)
    assert sites["lm_head"]["would_rewrite"] is False and sites["lm_head"]["reason"] == "in ignored_layers"
    assert sites["model.layers.0.mlp.down_proj"]["weight_shape"] == [256, 512]
    # bf16 [256, 512] -> fp8 + float32 scales [2, 4]
    assert sites["model.layers.0.mlp.down_proj"]["bytes_saved"] == 256 * 512 - 4 * 2 * 4
    assert result["other_weights"] == [
        {"name": "model.embed_tokens.weight", "shape": [512, 256], "dtype": "bfloat16", "module": "Embedding"}
    ]


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_inspect_builds_the_class_config_json_names(capsys, tmp_path, kind):
    """Found by a probe: inspect built AutoModelForCausalLM, not the class config.json's architectures names (as
    meta_model and convert do): a BertModel checkpoint was inspected as BertLMHeadModel (every name prefixed "bert.",
    a head the checkpoint has not, its --ignore names refused), and T5ForConditionalGeneration as a bare T5Model
    traced without the decoder's tokens ("You must specify exactly one of input_ids")."""
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=128)
        config.architectures = ["BertModel"]
    else:
        config = transformers.T5Config(vocab_size=64, d_model=64, d_kv=32, d_ff=128, num_layers=1, num_heads=2)
        config.architectures = ["T5ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    ignore = "encoder.layer.0.output.dense" if kind == "bert" else "decoder.block.0.layer.2.DenseReluDense.wi"
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json", "--ignore", ignore)
    assert code == 0, err
    sites = {r["fqn"]: r for r in json.loads(out)["sites"]}
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])._from_config(config)
    linears = {f for f, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(sites) == linears, set(sites) ^ linears
    assert sites[ignore]["reason"] == "in ignored_layers"


def test_inspect_reads_experts_ignored_one_by_one_as_the_load_does(capsys, tmp_path):
    """An ignore list that names an experts module's projections one by one (a checkpoint of per-expert tensors, as
    convert wrote them): load_checkpoint keeps those experts bf16, inspect predicted them fp8 (a probe's catch)."""
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [
        "lm_head", *(f"model.layers.0.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj",
                                                                                        "down_proj"))]}
    (tmp_path / "config.json").write_text(json.dumps(data))
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    rows = {r["fqn"]: r for r in json.loads(out)["sites"] if r["kind"] == "moe"}
    assert not rows["model.layers.0.mlp.experts"]["would_rewrite"], rows
    assert rows["model.layers.0.mlp.experts"]["reason"] == "in ignored_layers"
    assert rows["model.layers.1.mlp.experts"]["would_rewrite"], rows


def test_inspect_json_stays_readable_when_the_model_prints(capsys, tmp_path, monkeypatch):
    """A factory or forward that prints wrote before --json's document on stdout, which json.loads then refused."""
    (tmp_path / "printing.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Loud(nn.Linear):
            def forward(self, x):
                print("forward ran")
                return super().forward(x)

        def make():
            print("building")
            return Loud(64, 64), (torch.zeros(2, 64),)
    """))
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "inspect", "printing.py:make", "--json")
    assert code == 0, err
    assert json.loads(out)["sites"][0]["would_rewrite"] and "building" in err and "forward ran" in err


def test_inspect_of_an_fp8_checkpoint_predicts_ragged_blocks_as_loaded(capsys, llama_dir):
    """A DeepSeek-style checkpoint whose 64x96 blocks do not divide its layers: load_checkpoint loads each as stored
    (ragged last blocks), and inspect said no layer would be fp8 ("not divisible ...: use per-channel scales"). A
    block asked for by --block-size is a scheme to quantize with: there such layers stay bf16, as quantize_ keeps
    them."""
    data = json.loads((llama_dir / "config.json").read_text())
    data["quantization_config"]["weight_block_size"] = [64, 96]
    (llama_dir / "config.json").write_text(json.dumps(data))
    code, out, err = run(capsys, "inspect", str(llama_dir), "--json")
    assert code == 0, err
    sites = {r["fqn"]: r for r in json.loads(out)["sites"]}
    expected = {f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS}
    assert {fqn for fqn, r in sites.items() if r["would_rewrite"]} == expected
    # down_proj [256, 512]: blocks of [4, 6] (the last 96 wide: 32 columns)
    assert sites["model.layers.0.mlp.down_proj"]["bytes_saved"] == 256 * 512 - 4 * 4 * 6
    del data["quantization_config"]
    (llama_dir / "config.json").write_text(json.dumps(data))
    code, out, err = run(capsys, "inspect", str(llama_dir), "--json", "--block-size", "64,96")
    assert code == 0, err
    sites = {r["fqn"]: r for r in json.loads(out)["sites"]}
    assert not any(r["would_rewrite"] for r in sites.values())
    assert sites["model.layers.0.mlp.down_proj"]["reason"].startswith("weight [256, 512] is not divisible by the "
                                                                      "64x96 block")


def test_inspect_of_an_fp8_checkpoint_predicts_ragged_expert_blocks_as_loaded(capsys, tmp_path):
    """Experts of 96 (or 192) rows under 128x128 blocks: load_checkpoint refuses the checkpoint (a scale block of the
    stacked gate_up_proj would span gate and up, as vLLM's Fp8MoEMethod refuses it); inspect said the experts would
    be rewritten (a review's catch), and now gives the load's reason. 256 rows load."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      num_experts=4, num_experts_per_tok=2)
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    for rows in (96, 192, 256):
        cfg.moe_intermediate_size = rows
        cfg.save_pretrained(tmp_path)
        code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
        assert code == 0, err
        experts = {s["fqn"]: s for s in json.loads(out)["sites"]}["model.layers.0.mlp.experts"]
        if rows == 256:
            assert experts["would_rewrite"] and not experts["reason"]
            continue
        assert not experts["would_rewrite"] and experts["reason"] == (
            f"load_checkpoint refuses this checkpoint: intermediate_size={rows} is not divisible by weight_block_size "
            "block_n=128 (a scale block of gate_up_proj would span gate and up); use per-channel scales or a block_n "
            "dividing it"), experts
        with pytest.raises(ValueError, match=f"experts: intermediate_size={rows} is not divisible"):  # (the load's)
            fp8fx.Fp8MoEMethod(fp8fx.Fp8Config(weight_block_size=[128, 128])).create_weights(
                torch.nn.Module(), 4, 128, rows, torch.bfloat16, prefix="experts")


def test_inspect_of_a_checkpoint_with_a_scheme_per_part_predicts_its_experts_as_loaded(capsys, tmp_path):
    """A Qwen3-MoE quantized part by part (per tensor, then per channel), saved: its compressed-tensors groups name the
    experts one by one, as the checkpoint stores them, and inspect looked the experts module up by its own name: "not
    targeted by quantization_config", where load_checkpoint loads them fp8."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    fp8fx.quantize_(model.model.layers[0], fp8fx.Fp8Config(weight_granularity=fp8fx.PerTensor()),
                    prefix="model.layers.0")
    fp8fx.quantize_(model.model.layers[1], fp8fx.Fp8Config(), prefix="model.layers.1")
    fp8fx.save_checkpoint(model, tmp_path)
    loaded = fp8fx.checkpoint.meta_model(tmp_path)
    fp8fx.load_checkpoint(loaded, tmp_path, progress=False)
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    rows = {s["fqn"]: s for s in json.loads(out)["sites"]}
    for i, scheme in ((0, "w:per-tensor"), (1, "w:per-channel")):
        fqn = f"model.layers.{i}.mlp.experts"
        assert fp8fx.weights.is_quantized_experts(loaded.get_submodule(fqn))
        assert rows[fqn]["would_rewrite"] and rows[fqn]["scheme"].startswith(scheme), rows[fqn]


MODELS_PY = """
import torch
from torch import nn

def mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 100), nn.ReLU(), nn.Linear(100, 8))

def mlp_with_input():
    return mlp(), (torch.zeros(4, 256),)

class RowLinear(nn.Linear):
    pass

def row_linear():
    return nn.Sequential(RowLinear(256, 256), nn.Linear(256, 256)), (torch.zeros(4, 256),)

def not_a_model():
    return 3

def one_tuple():
    return (mlp(),)

def needs_arg(width):
    return mlp()

class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(256, 256)

    def forward(self, x):
        return self.a(self.a(x))

def twice():
    return Twice(), (torch.zeros(4, 256),)

class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)

def encoder():
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), (torch.zeros(2, 5, 64),)

def broken_blocks():
    return nn.Sequential(Broken(), Broken()), (torch.zeros(4, 256),)

def bare_example():
    return mlp(), torch.zeros(4, 256)

def root_linear():
    return nn.Linear(256, 64), (torch.zeros(4, 256),)

class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        return self.a(x)

def unused():
    return Unused(), (torch.zeros(4, 256),)

def three_names():
    from tests.unit.test_weights import ThreeNames  # (the CLI runs in pytest's process: the tests import)

    return ThreeNames(), (torch.zeros(2, 64),)
"""


@pytest.fixture
def models_py(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(textwrap.dedent(MODELS_PY))
    return str(path)


def test_inspect_factory_table(capsys, models_py):
    code, out, err = run(capsys, "inspect", f"{models_py}:mlp_with_input", "--block-size", "128,128", "--ignore", "4")
    assert code == 0, err
    lines = out.splitlines()
    assert "Sequential on the meta device, 1 graph(s) traced; config w:per-block(128x128)" in lines[0]
    rows = {line.split()[0]: line for line in lines[3:6]}
    assert rows["0"].split()[:4] == ["0", "linear", "512x256", "would"]
    # the reasons as the compile report and the README's troubleshooting table say them
    assert "no         not quantized: weight [100, 512] is not divisible by the 128x128 block" in rows["2"]
    assert rows["4"].split()[3:] == ["no", "not", "quantized:", "in", "ignored_layers"]
    assert lines[-1].startswith("1 of 3 linear sites would be rewritten")


@pytest.mark.parametrize("where", ["targets", "ignore"])
def test_inspect_matches_compressed_tensors_class_names_as_the_load_does(capsys, models_py, tmp_path, where):
    """A group's target or an ignore entry naming a layer's class (a subclass of nn.Linear): load_checkpoint matches
    the layer's own class and its bases; inspect took every layer for a plain "Linear" and predicted the opposite of
    the load for it (h156)."""
    args = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {"targets": ["RowLinear" if where == "targets" else "Linear"], "weights": {**args, "strategy": "channel",
             "dynamic": False}, "input_activations": {**args, "strategy": "token", "dynamic": True}}
    config = tmp_path / "qc.json"
    config.write_text(json.dumps({"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "ignore": ["RowLinear"] if where == "ignore" else [],
                                  "config_groups": {"g": group}}))
    code, out, err = run(capsys, "inspect", f"{models_py}:row_linear", "--config", str(config), "--json")
    assert code == 0, err
    rows = {r["fqn"]: r for r in json.loads(out)["sites"]}
    assert rows["0"]["would_rewrite"] is (where == "targets") and rows["1"]["would_rewrite"] is (where == "ignore")
    assert {r["reason"] for r in rows.values()} == {"", "not targeted by quantization_config" if where == "targets"
                                                    else "in ignored_layers"}, rows


def test_inspect_table_says_a_layer_it_did_not_trace_is_untraced_not_unquantized(capsys, models_py):
    """A layer the example never calls: quantize_ quantizes it all the same, so its row says it is in no traced
    graph, without the "not quantized: " of the layers kept in high precision (which would tell the user it stays
    bf16)."""
    code, out, err = run(capsys, "inspect", f"{models_py}:unused")
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[3:5]}
    assert rows["a"].split()[:4] == ["a", "linear", "256x256", "would"]
    assert rows["b"].split()[3:] == ["no", "in", "no", "traced", "graph", "(not", "called,", "or", "run", "uncompiled",
                                     "after", "a", "graph", "break)"], rows["b"]


def test_inspect_predicts_a_weight_on_the_left_as_the_compile_rewrites_it(capsys, tmp_path):
    """Mamba's ``dt_proj.weight @ x`` (Jamba's mamba layers): quantize_ and the compile rewrite it; inspect, tracing
    the bf16 model, found no site there (the pass took ``w @ x`` of a quantized weight only) and said "in no traced
    graph", its bytes left out of the total."""
    cfg = transformers.AutoConfig.for_model(
        "jamba", hidden_size=64, num_hidden_layers=2, vocab_size=128, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False,
        pad_token_id=0, bos_token_id=0, eos_token_id=0)
    cfg.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    predicted = {s["fqn"]: s for s in json.loads(out)["sites"]}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    fp8fx.quantize_(model)
    backend = fp8fx.Fp8Backend(compiler="eager")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randint(0, 128, (1, 8)))
    rewritten = {s.fqn for s in backend.report.sites if s.rewritten}
    assert "model.layers.0.mamba.dt_proj" in rewritten
    assert {f for f, s in predicted.items() if s["would_rewrite"]} == rewritten
    assert sum(s["bytes_saved"] for s in predicted.values()) == backend.report.bytes_saved


def test_inspect_of_vision_models_traces_what_input_ids_reach_and_says_what_they_do_not(capsys, tmp_path, caplog):
    """Llava's forward takes no use_cache and its top config has none (its text config has): a KV cache of real meta
    tensors failed the trace ("Please convert all Tensors to FakeTensors first"). Its vision tower, which input ids do
    not reach, is said so, not blamed on a graph break alone. A ViT (pixel values) failed in its own code."""
    text = dict(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=128, head_dim=16)
    vision = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128, image_size=32,
                  patch_size=8)
    cfg = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**vision),
                                   text_config=transformers.LlamaConfig(**text), image_token_index=120)
    cfg.architectures = ["LlavaForConditionalGeneration"]
    cfg.save_pretrained(tmp_path / "llava")
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        code, out, err = run(capsys, "inspect", str(tmp_path / "llava"), "--json")
    assert code == 0, err
    sites = {s["fqn"]: s for s in json.loads(out)["sites"]}
    assert sites["model.language_model.layers.0.self_attn.q_proj"]["would_rewrite"]
    assert "traced with input ids only, so its vision tower's layers ran in no graph" in caplog.text
    vit = transformers.ViTConfig(**vision)
    vit.architectures = ["ViTModel"]
    vit.save_pretrained(tmp_path / "vit")
    code, out, err = run(capsys, "inspect", str(tmp_path / "vit"))
    assert code == 2 and out == ""
    one_line_error(err, "ViTModel takes pixel_values", "input ids only", "module:factory", "(model, example_args)")


def test_inspect_counts_a_layer_called_twice_once(capsys, models_py):
    """Two sites of one layer: its saved bytes were summed twice (the table and the JSON rows)."""
    code, out, err = run(capsys, "inspect", f"{models_py}:twice", "--json")
    assert code == 0, err
    sites = json.loads(out)["sites"]
    assert [s["fqn"] for s in sites] == ["a", "a"]
    assert sum(s["bytes_saved"] for s in sites) == 256 * 256 - 256 * 4  # bf16 -> fp8, one fp32 scale per row
    code, out, err = run(capsys, "inspect", f"{models_py}:twice")
    # (the report's unit: it printed "0.0 MiB" for a small model)
    assert out.splitlines()[-1] == "2 of 2 linear sites would be rewritten; 63.0 KiB of weights saved"


def test_inspect_names_the_layers_of_blocks_broken_by_a_graph_break(capsys, models_py):
    """Dynamo traces a block with a graph break as a frame of its own, reused for the next block: its linears were
    named by their paths in the block (``a``), found no module and were all "not called"."""
    code, out, err = run(capsys, "inspect", f"{models_py}:broken_blocks", "--json")
    assert code == 0, err
    sites = json.loads(out)["sites"]
    assert sorted(s["fqn"] for s in sites) == ["0.a", "0.b", "1.a", "1.b"]
    assert all(s["would_rewrite"] for s in sites), sites


def test_inspect_gives_quantize_s_reason_for_a_layer_torch_reads_itself(capsys, models_py):
    """nn.MultiheadAttention's out_proj, which quantize_ keeps (F.multi_head_attention_forward reads it): its row said
    "not called"."""
    code, out, err = run(capsys, "inspect", f"{models_py}:encoder", "--json")
    assert code == 0, err
    sites = {s["fqn"]: s for s in json.loads(out)["sites"]}
    assert sites["layers.0.self_attn.out_proj"]["reason"].startswith("nn.MultiheadAttention's out_proj, which torch")
    assert sites["layers.0.linear1"]["would_rewrite"] and sites["layers.0.linear2"]["would_rewrite"]


def test_inspect_traces_a_model_that_takes_use_cache_through_kwargs(capsys, tmp_path):
    """GraniteMoE's forward takes use_cache through **kwargs: inspect passed none, a KV cache of real meta tensors
    entered the fake-tensor trace, and it failed ("Please convert all Tensors to FakeTensors first")."""
    config = transformers.GraniteMoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2)
    config.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    sites = {s["fqn"]: s for s in json.loads(out)["sites"]}
    assert sites["model.layers.0.self_attn.q_proj"]["would_rewrite"], sites


def test_inspect_gives_gpt2_s_conv1d_layers_a_row_each(capsys, tmp_path):
    """GPT-2's projections (transformers' Conv1D, no nn.Linear) were listed among the weights in no site; each is a
    site, which quantize_ and load_checkpoint quantize, its weight shape that of its codes, [out, in], as in the
    compile report. The weights keep no tag after the trace."""
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    config.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    result = json.loads(out)
    conv = {f"transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                 "mlp.c_proj")}
    sites = {s["fqn"]: s for s in result["sites"]}
    assert set(sites) == conv | {"lm_head"} and {f for f, s in sites.items() if s["would_rewrite"]} == conv
    assert sites["lm_head"]["reason"] == "weight tied to transformer.wte.weight"
    assert sites["transformer.h.0.mlp.c_fc"]["weight_shape"] == [256, 64]
    assert all(sites[f]["bytes_saved"] > 0 for f in conv)
    assert [w["module"] for w in result["other_weights"]] == ["Embedding", "Embedding"]
    model = transformers.GPT2LMHeadModel(config)
    predict(model, fp8fx.Fp8Config(), (torch.zeros(1, 4, dtype=torch.long),), {})
    assert not [n for n, p in model.named_parameters() if hasattr(p, "_fp8fx_skip_reason") or hasattr(p, "_fp8fx_fqn")]


def test_predict_removes_only_the_tags_it_set():
    """predict names a linear's weight for the trace and removed every tag of that weight after it, a skip reason it
    had not set among them."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model[0].weight._fp8fx_skip_reason = "set before"
    predict(model, fp8fx.Fp8Config(), (torch.zeros(2, 8),), {})
    assert model[0].weight._fp8fx_skip_reason == "set before" and not hasattr(model[0].weight, "_fp8fx_fqn")


def test_inspect_factory_with_input_shape(capsys, models_py):
    code, out, err = run(capsys, "inspect", f"{models_py}:mlp", "--input-shape", "2,256")
    assert code == 0, err
    assert out.splitlines()[-1].startswith("3 of 3 linear sites would be rewritten")


@pytest.mark.parametrize("argv, message", [
    (["inspect", "/no/such/folder"], "is neither a folder with a config.json, a config.json, nor module:factory"),
    (["inspect", "no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'"),
    (["inspect", "/no/such/file.py:make"], "/no/such/file.py does not exist"),
])
def test_bad_model_paths(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    one_line_error(err, "fp8fx inspect: error: ", message)


def test_folder_without_config_json(capsys, tmp_path):
    code, _, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2
    one_line_error(err, f"{tmp_path} has no config.json")


def test_bad_factories(capsys, models_py):
    code, _, err = run(capsys, "inspect", f"{models_py}:nope")
    assert code == 2
    one_line_error(err, "has no function 'nope'")
    code, _, err = run(capsys, "inspect", f"{models_py}:not_a_model")
    assert code == 2
    one_line_error(err, "returned int, not an nn.Module")
    code, _, err = run(capsys, "inspect", f"{models_py}:mlp")
    assert code == 2
    one_line_error(err, "pass --input-shape")
    code, _, err = run(capsys, "inspect", f"{models_py}:mlp", "--input-shape", "4,-1")
    assert code == 2
    one_line_error(err, "--input-shape '4,-1': every size must be a positive integer")
    code, _, err = run(capsys, "inspect", f"{models_py}:mlp", "--input-shape", "2,256", "--seq-len", "0")
    assert code == 2
    one_line_error(err, "--seq-len 0: the traced input needs at least one token")
    # these ended in a traceback, or in a wrapper's message with 19 lines of torch's logging before it
    for factory, message in (("one_tuple", "returned a tuple of 1; return a model or (model, example_args)"),
                             ("needs_arg", "needs_arg() failed: TypeError: needs_arg() missing 1 required")):
        code, _, err = run(capsys, "inspect", f"{models_py}:{factory}")
        assert code == 2
        one_line_error(err, message)
    code, _, err = run(capsys, "inspect", f"{models_py}:mlp", "--input-shape", "2,255")
    assert code == 2
    one_line_error(err, "tracing Sequential on the meta device failed: RuntimeError: a and b must have same reduction "
                        "dim, but got [2, 255]")
    code, _, err = run(capsys, "inspect", f"{models_py}:mlp", "--input-shape", "2,256", "--ignore", "typo")
    assert code == 2  # as quantize_ would refuse it: the layer meant to stay bf16 would not
    one_line_error(err, "--ignore: Fp8Config.ignored_layers: 'typo' names no module of this Sequential")
    bad = pathlib.Path(models_py).with_name("bad_syntax.py")
    bad.write_text("def make(:\n")
    code, _, err = run(capsys, "inspect", f"{bad}:make")
    assert code == 2
    one_line_error(err, f"cannot import '{bad}'", "SyntaxError")


def test_factory_examples_not_in_a_tuple_and_a_root_linear(capsys, models_py):
    """A bare example tensor was iterated row by row (traced with [256]-shaped rows, or a TypeError); a model that is
    itself a linear was listed twice, its site named after Dynamo's node ("linear") where named_modules says ""."""
    code, _, err = run(capsys, "inspect", f"{models_py}:bare_example")
    assert code == 2
    one_line_error(err, "bare_example returned (model, Tensor); the example args are a tuple or list", "(model, (x,))")
    code, out, err = run(capsys, "inspect", f"{models_py}:root_linear", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert [(s["fqn"], s["would_rewrite"]) for s in report["sites"]] == [("", True)] and not report["other_weights"]
    code, out, err = run(capsys, "inspect", f"{models_py}:root_linear")  # (the table's name for it, as the report's)
    assert out.splitlines()[3].split()[:3] == ["(root", "module)", "linear"], out


def test_a_config_transformers_cannot_build_from_is_one_line(capsys, llama_dir, tmp_path):
    """A bad field (0 attention heads: a ZeroDivisionError inside transformers) ended inspect and convert in a
    traceback."""
    data = json.loads((llama_dir / "config.json").read_text())
    data["num_attention_heads"] = 0
    (llama_dir / "config.json").write_text(json.dumps(data))
    code, _, err = run(capsys, "inspect", str(llama_dir))
    assert code == 2
    one_line_error(err, "config.json is not a config transformers can build a model from: ZeroDivisionError")
    del data["quantization_config"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(data))
    write_file(str(src / "model.safetensors"), {"lm_head.weight": torch.zeros(512, 256, dtype=torch.bfloat16)})
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "out"))
    assert code == 2 and not (tmp_path / "out").exists()
    one_line_error(err, "config.json: transformers cannot build the model it describes (ZeroDivisionError")


def test_commands_that_need_transformers_say_so(capsys, llama_dir, tmp_path, monkeypatch):
    """fp8fx does not depend on transformers (README's install): inspect of an HF folder and convert ended in a
    ModuleNotFoundError traceback, exit 1; each is a one-line error saying what to install, exit 2."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    for argv in (("inspect", str(llama_dir)), ("convert", str(llama_dir), str(tmp_path / "out"))):
        code, _, err = run(capsys, *argv)
        assert code == 2, argv
        one_line_error(err, f"fp8fx {argv[0]}: error: this needs transformers to build the model from its "
                            "config.json: pip install transformers")
    with pytest.raises(ImportError, match=r"meta_model \(convert's default model\) builds the model with "
                                          r"transformers: pip install transformers"):
        fp8fx.checkpoint.meta_model(llama_dir)


def test_bad_configs(capsys, llama_dir, tmp_path):
    code, _, err = run(capsys, "inspect", str(llama_dir), "--block-size", "128")
    assert code == 2
    # the flag's form of the fix (it passed on the config's "use [block_n, block_k]": h152)
    one_line_error(err, "fp8fx inspect: error: --block-size '128': 2 sizes separated by commas, got 1; e.g. "
                        "--block-size 128,128")
    code, _, err = run(capsys, "inspect", str(llama_dir), "--block-size", "64,64,64")
    assert code == 2
    one_line_error(err, "--block-size '64,64,64': 2 sizes separated by commas, got 3; e.g. --block-size 64,64")
    code, _, err = run(capsys, "inspect", str(llama_dir), "--block-size", "128,x")
    assert code == 2
    one_line_error(err, "--block-size '128,x': expected integers")
    bad = tmp_path / "quant.json"
    bad.write_text(json.dumps({"quant_method": "fp8", "activation_scheme": "sometimes"}))
    code, _, err = run(capsys, "inspect", str(llama_dir), "--config", str(bad))
    assert code == 2
    # (the file passed is named: it blamed config.json, a file the user had not passed)
    one_line_error(err, f"bad config: --config {bad} quantization_config (quant_method='fp8'): Unsupported activation "
                        "scheme 'sometimes'")
    bad.write_text("{not json")
    code, _, err = run(capsys, "inspect", str(llama_dir), "--config", str(bad))
    assert code == 2
    one_line_error(err, f"--config {bad}: ")
    bad.write_bytes(b"\xff\xfe{\x00}\x00")  # (UTF-16, or a safetensors file given for it: a traceback, h135)
    code, _, err = run(capsys, "inspect", str(llama_dir), "--config", str(bad))
    assert code == 2
    one_line_error(err, f"--config {bad}: not a UTF-8 JSON file")
    code, _, err = run(capsys, "inspect", str(llama_dir), "--activation-scheme", "sometimes")
    assert code == 2
    one_line_error(err, "invalid choice: 'sometimes'")
    # a model's own config.json (it said "quant_method=None is not a format fp8fx loads")
    plain = json.loads((llama_dir / "config.json").read_text())
    del plain["quantization_config"]
    bad.write_text(json.dumps(plain))
    code, _, err = run(capsys, "inspect", str(llama_dir), "--config", str(bad))
    assert code == 2
    one_line_error(err, "a model's config.json without a quantization_config; pass a quantization_config")
    plain["quantization_config"] = None  # (a null one is none: it said "expected a JSON object, got NoneType")
    bad.write_text(json.dumps(plain))
    code, _, err = run(capsys, "inspect", str(llama_dir), "--config", str(bad))
    assert code == 2
    one_line_error(err, "a model's config.json without a quantization_config; pass a quantization_config")
    plain["quantization_config"] = [1]
    bad.write_text(json.dumps(plain))
    code, _, err = run(capsys, "inspect", str(llama_dir), "--config", str(bad))
    assert code == 2
    one_line_error(err, f"--config {bad}: its quantization_config is a JSON list, where a quantization_config is an "
                        "object")


def test_flags_that_contradict_each_other_or_the_checkpoint_are_named(capsys, llama_dir, tmp_path):
    """--block-size with --activation-scheme static, or static over a checkpoint's block config: "bad config: ...",
    blaming a config the user never wrote. The flags, and what they go over, are named."""
    code, _, err = run(capsys, "inspect", str(llama_dir), "--activation-scheme", "static")
    assert code == 2
    one_line_error(err, "error: --activation-scheme static over the checkpoint's quantization_config: The block-wise "
                        "quantization only supports dynamic", "(change or drop a flag)")
    assert "bad config" not in err
    plain = json.loads((llama_dir / "config.json").read_text())
    del plain["quantization_config"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(plain))
    code, _, err = run(capsys, "inspect", str(tmp_path / "plain"), "--block-size", "128,128", "--activation-scheme",
                       "static")
    assert code == 2
    one_line_error(err, "error: --block-size 128,128 with --activation-scheme static: The block-wise",
                   "(change or drop a flag)")


@pytest.mark.parametrize("key", ["compression_config", "text_config.quantization_config"])
def test_config_flag_reads_the_quantization_config_where_load_checkpoint_does(capsys, llama_dir, tmp_path, key):
    """A config.json whose quantization config is an older compressed-tensors export's compression_config, or a
    VLM's text_config.quantization_config: the folder form and load_checkpoint read it, --config refused the file as
    "a model's config.json without a quantization_config"."""
    whole = json.loads((llama_dir / "config.json").read_text())
    del whole["quantization_config"]
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    whole.update({"compression_config": qc} if key == "compression_config" else {"text_config": {
        "quantization_config": qc}})
    given = tmp_path / "other" / "config.json"  # (llama_dir is tmp_path)
    given.parent.mkdir()
    given.write_text(json.dumps(whole))
    code, out, err = run(capsys, "inspect", str(llama_dir), "--config", str(given))
    assert code == 0, err
    assert "config w:per-block(128x128) a:per-group(1x128)" in out.splitlines()[0], out


def test_flags_over_a_compressed_tensors_config(capsys, llama_dir, tmp_path):
    """--block-size and --activation-scheme over a compressed-tensors config, which spells its activations'
    granularity out: they failed, blaming activation_granularity (which the user never set), where the same flags
    over the fp8 config of the same scheme worked. The granularities that follow from a flag go back to its
    defaults."""
    f8 = {"num_bits": 8, "type": "float", "symmetric": True}

    def ct(weights, activations):
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {**f8, "dynamic": False, **weights},
                                        "input_activations": {**f8, **activations}}}}

    cases = [
        (ct({"strategy": "block", "block_structure": [128, 128]}, {"strategy": "group", "group_size": 128,
                                                                    "dynamic": True}),
         ["--block-size", "64,64"], "w:per-block(64x64) a:per-group(1x64)"),
        (ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True}), ["--activation-scheme", "static"],
         "w:per-channel a:static per-tensor"),
        (ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True}), ["--activation-scheme", "dynamic"],
         "w:per-channel a:per-token"),  # the scheme it has: its granularity is kept
    ]
    for qc, flags, scheme in cases:
        path = tmp_path / "quant.json"
        path.write_text(json.dumps(qc))
        code, out, err = run(capsys, "inspect", str(llama_dir), "--config", str(path), *flags)
        assert code == 0, (flags, err)
        assert f"config {scheme}" in out, out


def test_modules_to_not_convert_is_read_as_transformers_reads_it(capsys, llama_dir):
    """transformers' FineGrainedFP8 configs list modules_to_not_convert entries matched as names, regexes or
    suffixes (MiniMax-M2: "gate"); read as prefixes, "down_proj" kept no layer, and inspect called every down
    projection fp8."""
    data = json.loads((llama_dir / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "modules_to_not_convert": ["down_proj", "lm_head"]}
    (llama_dir / "config.json").write_text(json.dumps(data))
    code, out, err = run(capsys, "inspect", str(llama_dir))
    assert code == 0, err
    rows = [line for line in out.splitlines() if "mlp.down_proj" in line]
    assert len(rows) == 2 and all("not quantized: in ignored_layers" in r for r in rows), out
    assert any("up_proj" in line and "would be" in line for line in out.splitlines()), out


def test_a_config_file_ignoring_no_module_is_said(capsys, llama_dir, tmp_path, caplog):
    """--ignore with a typo is refused, as quantize_ refuses it; the same typo in a --config file's ignored_layers
    went by in silence while the layer meant to stay bf16 showed as rewritten. It is said now (not refused: a
    checkpoint's config may name the checkpoint's modules, which load_checkpoint maps)."""
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"quant_method": "fp8", "activation_scheme": "dynamic",
                                "ignored_layers": ["lm_head", "model.layers.1.mlp.down_prj"]}))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        code, out, err = run(capsys, "inspect", str(llama_dir), "--config", str(path), "--json")
    assert code == 0, err
    assert (f"--config {path}: ignored_layers ['model.layers.1.mlp.down_prj'] name no module of this LlamaForCausalLM "
            "(did you mean 'model.layers.1.mlp.down_proj'?)") in caplog.text
    caplog.clear()  # an entry that is part of module names (transformers' modules_to_not_convert reads them so)
    path.write_text(json.dumps({"quant_method": "fp8", "activation_scheme": "dynamic",
                                "modules_to_not_convert": ["lm_head", "mlp.gate"]}))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        code, out, err = run(capsys, "inspect", str(llama_dir), "--config", str(path))
    assert code == 0 and "name no module" not in caplog.text, caplog.text
    # compressed-tensors' ignore list: exact names, 're:' patterns (re.match, from the start) and class names
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                     "strategy": "channel", "dynamic": False},
                                       "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                             "dynamic": True}}}}
    path.write_text(json.dumps({**ct, "ignore": ["lm_head", "re:.*o_proj", "LlamaMLP", "re:o_proj",
                                                 "model.layers.1.mlp.down_prj"]}))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        code, out, err = run(capsys, "inspect", str(llama_dir), "--config", str(path), "--json")
    assert code == 0, err
    assert (f"--config {path}: ignore ['re:o_proj', 'model.layers.1.mlp.down_prj'] name no module of this "
            "LlamaForCausalLM ('re:' patterns match from the start of a name: 're:.*o_proj' would match 2)") in caplog.text
    caplog.clear()
    path.write_text(json.dumps({**ct, "ignore": ["lm_head", "re:.*o_proj", "LlamaMLP"]}))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        code, out, err = run(capsys, "inspect", str(llama_dir), "--config", str(path))
    assert code == 0 and "name no module" not in caplog.text, caplog.text


def test_help(capsys):
    for argv in (["--help"], ["inspect", "--help"], ["convert", "--help"], ["bench", "--help"]):
        code, out, _ = run(capsys, *argv)
        assert code == 0 and out.startswith("usage:"), argv
    assert "MODEL" in run(capsys, "inspect", "--help")[1]
    assert "--cpu-smoke" in run(capsys, "bench", "--help")[1]


def test_convert_bad_input(capsys, tmp_path):
    code, out, err = run(capsys, "convert", str(tmp_path / "nowhere"), str(tmp_path / "out"))
    assert code == 2 and out == ""
    one_line_error(err, f"fp8fx convert: error: SRC {tmp_path / 'nowhere'} is not a folder")
    code, _, err = run(capsys, "convert", str(tmp_path), str(tmp_path / "out"), "--scheme", "int4")
    assert code == 2
    one_line_error(err, "invalid choice: 'int4'")


def test_inspect_ignore_takes_the_checkpoints_names_as_convert_does(capsys, tmp_path):
    """A bf16 Mixtral saved in the hub layout (block_sparse_moe.experts.N.w1): convert --ignore of the checkpoint's
    experts name was taken, inspect's refused ("names no module ... did you mean model.layers.0.mlp.experts", h135),
    so inspect could not preview the command. It takes it, predicts the model's experts module kept, and still
    refuses a name of neither."""
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                     num_experts_per_tok=1)
    src = tmp_path / "src"
    transformers.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    name = "model.layers.0.block_sparse_moe.experts"
    from fp8fx.checkpoint.files import read_checkpoint

    assert any(n.startswith(f"{name}.0.w1") for n in read_checkpoint(str(src))[1])  # (the hub layout)
    code, out, err = run(capsys, "inspect", str(src), "--ignore", name)
    assert code == 0, err
    assert re.search(r"model\.layers\.0\.mlp\.experts +moe .* no +not quantized: in ignored_layers", out), out
    code, _, err = run(capsys, "inspect", str(src), "--ignore", "model.layers.0.block_sparse_moe.expert")
    assert code == 2
    one_line_error(err, "names no module of this MixtralForCausalLM or its checkpoint")


def test_convert_names_the_file_a_full_disk_stopped(capsys, tmp_path, monkeypatch):
    """A write that the disk refused printed the OS error alone ("[Errno 28] No space left on device"): no file, no
    DST, no fix (h135). It names the file in DST, and nothing is left behind."""
    import errno

    from fp8fx.checkpoint import save
    from tests.e2e.test_checkpoint_llama import llama_config, reference_model
    from tests.unit.test_checkpoint_load import write_checkpoint

    cfg = llama_config()
    src = write_checkpoint(tmp_path / "src", reference_model(cfg).state_dict(), extra_config=cfg.to_dict())

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(save, "write_file", full)
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "dst"), "--no-progress")
    assert code == 2
    one_line_error(err, f"convert: writing {tmp_path / 'dst' / 'model.safetensors'} failed: No space left on device; "
                        "free space, or pick another directory where you can write (nothing was written)")
    assert "Errno" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    monkeypatch.undo()
    (src / "tokenizer.json").write_text("{}")

    def copy_full(source, dest, *args, **kwargs):  # (shutil's error names the source file, then the destination)
        raise OSError(errno.ENOSPC, "No space left on device", str(source), None, str(dest))

    monkeypatch.setattr(save.shutil, "copy2", copy_full)  # the side files, copied last: named as written, in DST
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "dst"), "--no-progress")
    assert code == 2
    one_line_error(err, f"convert: writing {tmp_path / 'dst' / 'tokenizer.json'} failed: No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    monkeypatch.undo()

    def no_memory(*args, **kwargs):  # the OS's own error, no file: its number stays (it printed the words alone)
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(save, "write_file", no_memory)
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "dst"), "--no-progress")
    assert code == 2
    one_line_error(err, f"[Errno {errno.ENOMEM}] {os.strerror(errno.ENOMEM)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # errors with no message, one that starts on its second line, a number no C int holds: one line each (an
    # IndexError, an empty error, an OverflowError before)
    for error, said in ((OSError(), "error: OSError"), (ValueError("\nthe cause"), "error: the cause"),
                        (OSError(2**40, "a library's own code"), "error: a library's own code")):
        monkeypatch.setattr(save, "write_file", lambda *args, error=error, **kwargs: (_ for _ in ()).throw(error))
        code, _, err = run(capsys, "convert", str(src), str(tmp_path / "dst"), "--no-progress")
        assert code == 2
        one_line_error(err, said)


def test_convert_out_of_memory_is_one_line(capsys, tmp_path, monkeypatch):
    """Memory running out on the way (a big tensor read or quantized: torch's CPU allocator's bare RuntimeError, a
    MemoryError, torch.OutOfMemoryError) printed a traceback with exit code 1; the README says every error of the
    command is one line and 2. It says so, what convert holds at a time and the fix; the staged files are gone.
    Another RuntimeError (a bug) keeps its traceback."""
    from fp8fx.checkpoint import save
    from tests.e2e.test_checkpoint_llama import llama_config, reference_model
    from tests.unit.test_checkpoint_load import write_checkpoint

    cfg = llama_config()
    src = write_checkpoint(tmp_path / "src", reference_model(cfg).state_dict(), shards=2,
                           extra_config=cfg.to_dict())
    real = save.chunked.quantize
    cpu = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 2199023255552 bytes. Error code 12 (Cannot allocate memory)")
    for error in (RuntimeError(cpu), MemoryError(), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate "
                                                                            "2.00 GiB")):
        calls = []

        def later(*args, error=error, calls=calls, **kwargs):  # (the files before it were written)
            calls.append(1)
            if len(calls) == 9:
                raise error
            return real(*args, **kwargs)

        monkeypatch.setattr(save.chunked, "quantize", later)
        code, _, err = run(capsys, "convert", str(src), str(tmp_path / "dst"), "--no-progress")
        assert code == 2 and len(calls) == 9
        one_line_error(err, f"fp8fx convert: error: convert ran out of memory ({str(error) or 'MemoryError'}): it "
                            "holds one output file (the fp8 of one of SRC's files) and the tensor it quantizes at a "
                            "time; free memory, or re-save SRC in smaller shards (nothing was written)")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    monkeypatch.setattr(save.chunked, "quantize", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["convert", str(src), str(tmp_path / "dst"), "--no-progress"])


def test_convert_fixes_are_spelled_as_flags_too(capsys, tmp_path):
    """convert's refusals said their fix in the Python API's spelling only ("use format='compressed-tensors'", "add
    '...' to ignored_layers"), which the command line cannot type (h135): the flag is named beside it."""
    from tests.e2e.test_checkpoint_llama import llama_config, reference_model
    from tests.unit.test_checkpoint_load import write_checkpoint

    cfg = llama_config()
    state = reference_model(cfg).state_dict()
    src = write_checkpoint(tmp_path / "src", state, extra_config=cfg.to_dict())
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "d1"), "--format", "fp8", "--no-progress")
    assert code == 2
    one_line_error(err, "use format='compressed-tensors' (--format compressed-tensors), which stores any mix")
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    src = write_checkpoint(tmp_path / "nan", state, extra_config=cfg.to_dict())
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "d2"), "--no-progress")
    assert code == 2
    one_line_error(err, "add 'model.layers.0.mlp.up_proj' to ignored_layers (--ignore model.layers.0.mlp.up_proj)")


def test_convert_block_checkpoint_loads_back(capsys, tmp_path):
    """bf16 checkpoint -> `fp8fx convert --scheme block` -> load_checkpoint: 128x128 block scales, close to bf16."""
    from tests.e2e.test_checkpoint_llama import llama_config, reference_model
    from tests.unit.test_checkpoint_load import write_checkpoint

    cfg = llama_config()
    model = reference_model(cfg)
    src = write_checkpoint(tmp_path / "src", model.state_dict(), shards=2, extra_config=cfg.to_dict())
    code, out, err = run(capsys, "convert", str(src), str(tmp_path / "dst"), "--scheme", "block", "--no-progress")
    assert code == 0, err
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    # lm_head stays bf16 by default: vLLM loads it so (an fp8 one made a checkpoint vLLM does not load)
    assert qc["weight_block_size"] == [128, 128] and qc["ignored_layers"] == ["lm_head"]
    assert re.search(r"not quantized +lm_head +the output embeddings: vLLM loads lm_head in bf16", out)
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "head"), "--scheme", "block", "--quantize-lm-head",
                       "--no-progress")
    assert code == 0, err
    qc = json.loads((tmp_path / "head" / "config.json").read_text())["quantization_config"]
    from fp8fx.checkpoint.files import read_checkpoint

    assert qc["ignored_layers"] == [] and "lm_head.weight_scale_inv" in read_checkpoint(tmp_path / "head")[1]
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "dst")
    fp8fx.load_checkpoint(loaded, tmp_path / "dst")
    assert loaded.model.layers[0].mlp.down_proj.weight_scale_inv.shape == (2, 4)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        assert rel_err(loaded(ids).logits.float(), model(ids).logits.float()) < 0.1


def test_convert_builds_the_class_the_config_names(capsys, tmp_path):
    """A BertModel checkpoint: convert built every checkpoint as a causal LM (a BertLMHeadModel, whose names are under
    "bert.") and refused it with advice to --rename; it builds config.json's architectures class now."""
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    code, out, err = run(capsys, "convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--no-progress")
    assert code == 0, err
    loaded = fp8fx.checkpoint.meta_model(tmp_path / "dst")
    assert type(loaded) is transformers.BertModel
    report = fp8fx.load_checkpoint(loaded, tmp_path / "dst", progress=False)
    assert len(report.quantized) == 2 * 6 + 1  # q, k, v, attention and intermediate/output dense, and the pooler
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        want = model.to(torch.bfloat16)(ids).last_hidden_state.float()
        assert rel_err(loaded(ids).last_hidden_state.float(), want) < 0.1


def test_convert_rename(capsys, tmp_path):
    """--rename maps the checkpoint's names to the model's (the output keeps the checkpoint's); a bad one is one line."""
    from tests.e2e.test_checkpoint_llama import llama_config, reference_model
    from tests.unit.test_checkpoint_load import write_checkpoint

    cfg = llama_config()
    state = {k.replace(".mlp.", ".ffn."): v for k, v in reference_model(cfg).state_dict().items()}
    src = write_checkpoint(tmp_path / "src", state, extra_config=cfg.to_dict())
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "bad"), "--rename", "ffn")
    assert code == 2
    one_line_error(err, "fp8fx convert: error: --rename 'ffn': give REGEX=REPLACEMENT")
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "bad"), "--rename", "(=x")
    assert code == 2
    one_line_error(err, "fp8fx convert: error: convert: key_mapping pattern '(' is not a regex")
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "bad"), "--rename", r"\.ffn\.=.mlp.", "--rename",
                       r"\.ffn\.=.feed.")  # (the last one was kept, unsaid)
    assert code == 2 and not (tmp_path / "bad").exists()
    one_line_error(err, r"fp8fx convert: error: --rename '\\.ffn\\.' is given twice, ='.mlp.' and ='.feed.': a regex "
                        "renames to one replacement; keep one")
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "dst"), "--rename", r"\.ffn\.=.mlp.", "--no-progress")
    assert code == 0, err
    names = fp8fx.checkpoint.files.read_checkpoint(tmp_path / "dst")[1]
    assert names["model.layers.0.ffn.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert not any(".mlp." in n for n in names)


def test_bench_cpu_smoke(capsys):
    code, out, _ = run(capsys, "bench", "--cpu-smoke")
    assert code == 0
    assert "3 of 3 sites rewritten" in out and "cpu smoke: mlp rel err vs bf16" in out


def test_bench_compile_time_variants(capsys):
    """--compile-time times one of the variants it knows (the fp8fx block, unfused or with its fused MLP); others are a
    one-line error before anything needs a GPU."""
    for variants in ("bf16_inductor", "fp8fx,fp8fx_fused_mlp"):
        code, _, err = run(capsys, "bench", "--compile-time", "--variants", variants)
        assert code == 2
        one_line_error(err, f"--compile-time --variants {variants}: one of fp8fx, fp8fx_fused_mlp")


def test_installed_command():
    """pyproject declares the command, and the process exits 2 with one line on stderr."""
    with open(pathlib.Path(__file__).parents[2] / "pyproject.toml") as f:
        scripts = f.read().split("[project.scripts]")[1].split("[")[0]
    assert scripts.strip() == 'fp8fx = "fp8fx.cli:main"'
    for module in ("fp8fx.cli", "fp8fx"):  # python -m fp8fx too
        proc = subprocess.run([sys.executable, "-m", module, "inspect", "/no/such/folder"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == ""
        one_line_error(proc.stderr, "fp8fx inspect: error: MODEL '/no/such/folder'")


def test_bench_usage_error_is_one_line(capsys, tmp_path, monkeypatch):
    code, _, err = run(capsys, "bench", "--bogus")
    assert code == 2
    one_line_error(err, "fp8fx bench: error: unrecognized arguments: --bogus (see fp8fx bench --help)")
    # a bad --ms and, on a machine without CUDA, a timing run: one line each (they were tracebacks), no folder made
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "bench", "--ms", "1,x")
    assert code == 2
    one_line_error(err, "fp8fx bench: error: --ms '1,x': token counts separated by commas")
    if not torch.cuda.is_available():
        code, _, err = run(capsys, "bench", "--skip-mlp", "--skip-gemms")
        assert code == 2
        one_line_error(err, "fp8fx bench: error: the benchmark times CUDA kernels and needs a CUDA GPU")
    assert not (tmp_path / "bench_out").exists()


def test_inspect_reads_compressed_tensors_and_moe(capsys, tmp_path):
    """A compressed-tensors quantization_config is read per layer (its ignore list and its groups'
    schemes), an unknown quant_method is an error, and MoE experts get rows of their own."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      num_experts=4, num_experts_per_tok=2)
    cfg.quantization_config = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "re:.*o_proj"],
        "config_groups": {"g0": {"targets": ["Linear"],
                                 "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                                 "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
    }
    cfg.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    sites = {s["fqn"]: s for s in json.loads(out)["sites"]}
    q, o = sites["model.layers.0.self_attn.q_proj"], sites["model.layers.0.self_attn.o_proj"]
    assert q["would_rewrite"] and q["scheme"] == "w:per-tensor a:static per-tensor"
    # (as load_checkpoint's report and the compile report say it: it said "kept in high precision by the
    # quantization_config (ignore / no matching group)")
    assert not o["would_rewrite"] and o["reason"] == "in ignored_layers"
    assert not sites["lm_head"]["would_rewrite"] and sites["lm_head"]["reason"] == "in ignored_layers"
    experts = sites["model.layers.0.mlp.experts"]
    assert experts["kind"] == "moe" and experts["weight_shape"] == [4, 128, 128]
    code, out, err = run(capsys, "inspect", str(tmp_path))  # the header said ignored_layers=[]
    assert code == 0, err
    assert out.splitlines()[0].endswith("config w:per-tensor a:static per-tensor, ignored_layers=['lm_head', "
                                        "'re:.*o_proj']"), out
    cfg.quantization_config = {"quant_method": "gptq", "bits": 4}
    cfg.save_pretrained(tmp_path)
    code, _, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2
    one_line_error(err, "bad config: config.json: quantization_config.quant_method='gptq' is not a format fp8fx loads")
    del cfg.quantization_config  # the default config: experts quantized, their bytes counted (it said 0)
    cfg.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    experts = {s["fqn"]: s for s in json.loads(out)["sites"]}["model.layers.0.mlp.experts"]
    # w13 [4, 128, 128] and w2 [4, 128, 64], bf16 -> fp8 and float32 scales [rows, 1] per expert
    assert experts["would_rewrite"]
    assert experts["bytes_saved"] == 4 * (128 * 128 - 4 * 128) + 4 * (128 * 64 - 4 * 128)
    code, out, err = run(capsys, "inspect", str(tmp_path))  # the count names the experts rows too
    assert out.splitlines()[-1].startswith("6 of 7 sites (linears and experts modules) would be rewritten"), out


def test_block_size_flag_replaces_a_configs_per_channel_weights(capsys, models_py, tmp_path):
    """--block-size over a compressed-tensors config with per-channel weights: the flag says the weights' scales
    (it failed, blaming weight_granularity=per-row, which the user never set)."""
    config = tmp_path / "ct.json"
    group = {"targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                   "symmetric": True}}
    config.write_text(json.dumps({"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "config_groups": {"g": group}}))
    code, out, err = run(capsys, "inspect", f"{models_py}:mlp_with_input", "--config", str(config),
                         "--block-size", "128,128")
    assert code == 0, err
    assert "config w:per-block(128x128) a:per-token" in out and "512x256  would be   w:per-block(128x128)" in out


def test_inspect_predicts_tied_weights_and_routers_as_quantize_(capsys, tmp_path):
    """A tied lm_head and Qwen2-MoE's shared_expert_gate (an nn.Linear router) stay in high precision under
    quantize_; inspect said they "would be" rewritten. Every linear's prediction is now quantize_'s own, reason text
    included."""
    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    cfg.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    sites = {s["fqn"]: s for s in json.loads(out)["sites"]}
    assert sites["lm_head"]["reason"] == "weight tied to model.embed_tokens.weight"
    assert sites["model.layers.0.mlp.shared_expert_gate"]["reason"].startswith(
        "gates the shared expert beside model.layers.0.mlp.experts (an MoE router or gate")
    # transformers 5's router module (no nn.Linear) too: it said "not an nn.Linear weight"
    assert sites["model.layers.0.mlp.gate"]["reason"].startswith("routes tokens to model.layers.0.mlp.experts")
    model = transformers.Qwen2MoeForCausalLM(cfg).to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config())
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(fqn in sites for fqn, _ in linears)
    for fqn, module in linears:
        reason = getattr(module.weight, "_fp8fx_skip_reason", None)  # set by quantize_ on the layers it skips
        assert (sites[fqn]["would_rewrite"], sites[fqn]["reason"]) == (reason is None, reason or ""), fqn
    # an fp8 checkpoint's config alone: its nn.Linear router taken as stored in high precision, as fp8 checkpoints
    # store it (load_checkpoint loads it as stored: test_inspect_of_an_fp8_checkpoint_reads_how_it_stores_...)
    cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    cfg.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
    assert code == 0, err
    sites = {s["fqn"]: s for s in json.loads(out)["sites"]}
    assert sites["model.layers.0.mlp.shared_expert_gate"]["reason"].startswith("gates the shared expert")
    assert sites["model.layers.0.mlp.gate"]["reason"].startswith("routes tokens to model.layers.0.mlp.experts")


def test_inspect_of_an_fp8_checkpoint_reads_how_it_stores_the_head_and_routers(capsys, tmp_path):
    """An fp8 checkpoint keeps its lm_head and routers in high precision whatever its ignore list says (Qwen's list
    none of them); load_checkpoint loads them as stored. inspect predicted both rewritten (and bytes saved), while
    get_quant_method(model=) kept them; one stored in fp8 anyway loads as fp8, and inspect says so too."""
    from safetensors.torch import load_file, save_file

    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=64, architectures=["Qwen2MoeForCausalLM"])
    model = transformers.Qwen2MoeForCausalLM(cfg).to(torch.bfloat16)
    fp8fx.quantize_(model, fp8fx.Fp8Config(weight_block_size=(32, 32), ignored_layers=["lm_head"]))
    fp8fx.save_checkpoint(model, tmp_path, format="fp8")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = config["quantization_config"]["modules_to_not_convert"] = []
    (tmp_path / "config.json").write_text(json.dumps(config))
    head, gate = "lm_head", "model.layers.0.mlp.shared_expert_gate"

    def outcomes():
        code, out, err = run(capsys, "inspect", str(tmp_path), "--json")
        assert code == 0, err
        sites = {s["fqn"]: s for s in json.loads(out)["sites"]}
        loaded = fp8fx.checkpoint.meta_model(str(tmp_path))
        report = fp8fx.load_checkpoint(loaded, str(tmp_path), progress=False)
        fp8 = fp8fx.Fp8Config.from_config(config["quantization_config"])
        return {fqn: (sites[fqn]["would_rewrite"], sites[fqn]["reason"], sites[fqn]["bytes_saved"] > 0,
                      fqn in report.quantized, report.not_quantized.get(fqn, ""),
                      fp8.get_quant_method(loaded.get_submodule(fqn), fqn, model=loaded) is not None)
                for fqn in (head, gate)}

    found = outcomes()
    assert found[head] == (False, "output embeddings stored in high precision", False, False,
                           "output embeddings stored in high precision", False)
    assert found[gate][:4] == (False, found[gate][4], False, False) and found[gate][4].startswith(
        "gates the shared expert") and not found[gate][5]
    # the gate stored in fp8 with its block scale: loaded, and predicted, as stored
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    weight = tensors[f"{gate}.weight"].float()  # [1, 64]: two 32-wide blocks of one ragged row
    scale = weight.reshape(1, 2, 32).abs().amax(dim=-1).clamp(min=1e-12) / 448
    codes = (weight.reshape(1, 2, 32) / scale[..., None]).reshape(1, 64).to(torch.float8_e4m3fn)
    tensors[f"{gate}.weight"], tensors[f"{gate}.weight_scale_inv"] = codes, scale
    save_file(tensors, file, metadata={"format": "pt"})
    found = outcomes()
    assert found[gate][:5] == (True, "", True, True, "")
    assert not found[gate][5]  # get_quant_method does not see the checkpoint: documented (README, its docstring)
    assert found[head][0] is False and found[head][3] is False


def test_inspect_refuses_options_its_model_does_not_use(capsys, llama_dir, models_py):
    """--input-shape of an HF folder or of a factory that returns example args, --seq-len of a factory: accepted,
    ignored, exit code 0."""
    code, out, err = run(capsys, "inspect", str(llama_dir), "--input-shape", "4,4096")
    assert code == 2 and out == ""
    one_line_error(err, "--input-shape '4,4096'", "module:factory", "returns a model only", "HF config",
                   "--seq-len")
    code, out, err = run(capsys, "inspect", f"{models_py}:mlp_with_input", "--input-shape", "7,7,7")
    assert code == 2 and out == ""
    one_line_error(err, "--input-shape '7,7,7'", "mlp_with_input returned (model, example_args)",
                   "returns a model only")
    for factory in ("mlp_with_input", "mlp"):
        code, out, err = run(capsys, "inspect", f"{models_py}:{factory}", "--input-shape", "2,256", "--seq-len", "99")
        assert code == 2 and out == ""
        one_line_error(err, "--seq-len 99", "HF config folder or config.json", "module:factory")
    code, out, err = run(capsys, "inspect", str(llama_dir), "--seq-len", "8", "--json")  # where they apply: as before
    assert code == 0, err


MODULE_IN_CWD = """
import torch

def make():
    from fp8fx_cwd_layers import layers  # a module of the same folder, imported as the factory runs
    return layers(), (torch.zeros(2, 256),)
"""
LAYERS_IN_CWD = """
from torch import nn

def layers():
    return nn.Sequential(nn.Linear(256, 128))
"""


def test_factory_module_in_the_current_folder(capsys, tmp_path, monkeypatch):
    """The installed fp8fx script does not put the current folder on sys.path (python -m fp8fx does): MODEL
    mod:factory of a mod.py in the current folder failed to import. It imports now, and so do the modules of that folder
    the factory imports as it runs; sys.path is left as it was."""
    (tmp_path / "fp8fx_cwd_models.py").write_text(textwrap.dedent(MODULE_IN_CWD))
    (tmp_path / "fp8fx_cwd_layers.py").write_text(textwrap.dedent(LAYERS_IN_CWD))
    bin_dir = tmp_path / "bin"  # as a console script runs: sys.path[0] is the script's folder, not the current one
    bin_dir.mkdir()
    (bin_dir / "fp8fx_script.py").write_text("import sys\nfrom fp8fx.cli import main\nsys.exit(main())\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, str(bin_dir / "fp8fx_script.py"), "inspect", "fp8fx_cwd_models:make"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("1 of 1 linear sites would be rewritten")
    # in this process: the same, with the current folder off sys.path, and sys.path as it was afterwards
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "fp8fx_cwd_models", raising=False)
    monkeypatch.delitem(sys.modules, "fp8fx_cwd_layers", raising=False)
    before = list(sys.path)
    code, out, err = run(capsys, "inspect", "fp8fx_cwd_models:make")
    sys.modules.pop("fp8fx_cwd_models", None)
    sys.modules.pop("fp8fx_cwd_layers", None)
    assert code == 0, err
    assert sys.path == before
    code, _, err = run(capsys, "inspect", "fp8fx_no_such_module:make")
    assert code == 2 and sys.path == before
    one_line_error(err, "cannot import 'fp8fx_no_such_module'", f"the current folder ({tmp_path})")


@pytest.mark.parametrize("entry", ["b", "seq", "seq.0"])
def test_inspect_ignores_a_module_by_any_of_its_names(capsys, models_py, entry, tmp_path, caplog):
    """One linear registered as a, b and seq.0: --ignore b was refused as naming no module, and --ignore seq predicted
    the layer rewritten, where quantize_ keeps it; in a --config file, "b" was warned about as naming no module."""
    code, out, err = run(capsys, "inspect", f"{models_py}:three_names", "--ignore", entry, "--json")
    assert code == 0, err
    sites = json.loads(out)["sites"]
    assert {s["fqn"]: s["would_rewrite"] for s in sites} == {"a": False, "c": True}, sites
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"quant_method": "fp8", "ignored_layers": [entry]}))
    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        code, out, err = run(capsys, "inspect", f"{models_py}:three_names", "--config", str(config), "--json")
    assert code == 0, err
    assert {s["fqn"]: s["would_rewrite"] for s in json.loads(out)["sites"]} == {"a": False, "c": True}
    assert "name no module" not in caplog.text


def test_inspect_reads_a_modelopt_hf_quant_config_json(capsys, llama_dir):
    """ModelOpt's older exports hold their config in hf_quant_config.json, which load_checkpoint reads: inspect
    predicted per-channel online quantization of every layer, lm_head and the excluded layer 0 too."""
    data = json.loads((llama_dir / "config.json").read_text())
    del data["quantization_config"]
    (llama_dir / "config.json").write_text(json.dumps(data))
    (llama_dir / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "exclude_modules": ["lm_head", "model.layers.0*"]}}))
    # the folder's (the checkpoint's scheme), or the file given as --config (a scheme to quantize with: per channel)
    for argv, weights in (((), "per-tensor"), (("--config", str(llama_dir / "hf_quant_config.json")), "per-channel")):
        code, out, err = run(capsys, "inspect", str(llama_dir), "--json", *argv)
        assert code == 0, err
        sites = {s["fqn"]: s for s in json.loads(out)["sites"]}
        assert {f for f, s in sites.items() if s["would_rewrite"]} == {f"model.layers.1.{p}" for p in PROJECTIONS}
        assert sites["model.layers.1.mlp.up_proj"]["scheme"] == f"w:{weights} a:static per-tensor"


def test_inspect_refuses_a_model_quantize_refuses(capsys, tmp_path):
    """transformers' RWKV with rescale_every > 0 (it divides its weights in place at its first eval forward, which fp8
    layers cannot take): quantize_ and load_checkpoint refuse it, but inspect said all 15 sites "would be" rewritten.
    It refuses it too, with their reason and fix; with rescale_every = 0 it predicts the sites."""
    cfg = transformers.RwkvConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                                  intermediate_size=128, context_length=32, architectures=["RwkvForCausalLM"])
    cfg.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2 and not out
    one_line_error(err, "quantize_ and load_checkpoint would refuse this model: rwkv (RwkvModel) divides its blocks'",
                   "set model.config.rescale_every = 0 first, which turns both off (nothing was inspected)")
    cfg.rescale_every = 0
    cfg.save_pretrained(tmp_path)
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert code == 0, err
    assert out.splitlines()[-1].startswith("15 of 15 linear sites would be rewritten"), out


def test_inspect_factory_of_an_hf_causal_lm(capsys, tmp_path):
    """A factory returning an HF causal LM and its input ids: its KV cache's meta tensors failed the fake-tensor
    trace ("Please convert all Tensors to FakeTensors first"), where an HF folder traces without a cache; and with
    static activations the bytes saved count each layer's float32 input scale, as the compile report does."""
    path = tmp_path / "hf_factory.py"
    path.write_text(textwrap.dedent("""
        import torch, transformers
        def make():
            cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
            return transformers.LlamaForCausalLM(cfg), (torch.zeros(1, 8, dtype=torch.long),)
    """))
    code, out, err = run(capsys, "inspect", f"{path}:make", "--json")
    assert code == 0, err
    dynamic = json.loads(out)
    assert sum(s["would_rewrite"] for s in dynamic["sites"]) == 15  # 7 a layer and the head
    code, out, err = run(capsys, "inspect", f"{path}:make", "--json", "--activation-scheme", "static")
    assert code == 0, err
    static = {s["fqn"]: s["bytes_saved"] for s in json.loads(out)["sites"]}
    assert all(static[s["fqn"]] == s["bytes_saved"] - 4 for s in dynamic["sites"] if s["would_rewrite"])


def test_inspect_factory_whose_args_give_use_cache(capsys, tmp_path):
    """A factory's example args that give use_cache themselves, by position: use_cache=False is not added again
    ("got multiple values for argument 'use_cache'")."""
    path = tmp_path / "own_cache.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        class Decoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(64, 64)
            def forward(self, x, use_cache=True):
                return self.proj(x)
        def make():
            return Decoder(), (torch.zeros(4, 64), False)
    """))
    code, out, err = run(capsys, "inspect", f"{path}:make")
    assert code == 0, err
    assert "1 of 1 linear sites would be rewritten" in out, out
