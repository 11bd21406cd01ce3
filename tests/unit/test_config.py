"""Fp8Config: vLLM ``Fp8Config`` semantics, granularity defaults and validation, name helpers."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8fx.config import (
    Fp8Config,
    LayerScheme,
    PerBlock,
    PerGroup,
    PerRow,
    PerTensor,
    granularity_from_block,
)

CONFIG_PY = os.path.join(os.path.dirname(importlib.util.find_spec("fp8fx").origin), "config.py")


# --- defaults and resolved granularities ----------------------------------------------------
def test_defaults():
    cfg = Fp8Config()
    assert cfg.is_checkpoint_fp8_serialized is False
    assert cfg.activation_scheme == "dynamic"
    assert cfg.ignored_layers is None
    assert cfg.weight_block_size is None
    assert cfg.weight_granularity is None and cfg.activation_granularity is None


def test_online_default_is_per_channel_weights_per_token_activations():
    cfg = Fp8Config()
    assert cfg.weight == PerRow()
    assert cfg.activation == PerRow()
    assert cfg.scheme() == LayerScheme(PerRow(), PerRow(), False)
    assert str(cfg.scheme()) == "w:per-channel a:per-token"


def test_serialized_without_block_is_per_tensor_weights():
    cfg = Fp8Config(is_checkpoint_fp8_serialized=True)
    assert cfg.weight == PerTensor()
    assert cfg.activation == PerRow()
    assert str(cfg.scheme()) == "w:per-tensor a:per-token"


@pytest.mark.parametrize("serialized", [False, True])
def test_block_size_gives_per_block_weights_per_group_activations(serialized):
    cfg = Fp8Config(is_checkpoint_fp8_serialized=serialized, weight_block_size=[128, 128])
    assert cfg.weight_block_size == (128, 128)  # normalized to a tuple
    assert cfg.weight == PerBlock(128, 128)
    assert cfg.activation == PerGroup(128)
    assert str(cfg.scheme()) == "w:per-block(128x128) a:per-group(1x128)"


def test_non_square_block_groups_follow_block_k():
    cfg = Fp8Config(weight_block_size=[64, 32])
    assert cfg.weight == PerBlock(64, 32)
    assert cfg.activation == PerGroup(32)
    assert str(cfg.scheme()) == "w:per-block(64x32) a:per-group(1x32)"


def test_static_scheme_is_per_tensor_activations():
    cfg = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
    assert cfg.activation == PerTensor()
    assert cfg.scheme().static_activation is True
    assert str(cfg.scheme()) == "w:per-tensor a:static per-tensor"
    # an explicit PerTensor() activation granularity is compatible with static
    cfg2 = Fp8Config(activation_scheme="static", activation_granularity=PerTensor())
    assert cfg2.activation == PerTensor()


def test_explicit_granularities_override_defaults():
    cfg = Fp8Config(weight_granularity=PerTensor(), activation_granularity=PerTensor())
    assert cfg.weight == PerTensor() and cfg.activation == PerTensor()
    assert str(cfg.scheme()) == "w:per-tensor a:per-tensor"
    cfg = Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=PerRow())
    assert cfg.weight == PerRow()
    cfg = Fp8Config(weight_granularity=PerBlock(128, 64))
    assert cfg.activation == PerGroup(64)
    cfg = Fp8Config(weight_block_size=[128, 128], weight_granularity=PerBlock(128, 128))
    assert cfg.weight == PerBlock(128, 128)


@pytest.mark.parametrize(
    "gran, block, text",
    [
        (PerTensor(), (-1, -1), "per-tensor"),
        (PerRow(), (1, -1), "per-row"),
        (PerGroup(128), (1, 128), "per-group(1x128)"),
        (PerGroup(4), (1, 4), "per-group(1x4)"),
        (PerBlock(128, 128), (128, 128), "per-block(128x128)"),
        (PerBlock(3, 5), (3, 5), "per-block(3x5)"),
    ],
)
def test_granularity_blocks_and_strings(gran, block, text):
    assert gran.block == block
    assert str(gran) == text
    assert granularity_from_block(block) == gran
    assert granularity_from_block(list(block)) == gran


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "128"])
def test_granularity_sizes_must_be_positive_ints(bad):
    """Each refusal names the field and the value (a bare ValueError passed here before, h185)."""
    for make, field in ((lambda: PerGroup(bad), "PerGroup.group_size"), (lambda: PerBlock(bad, 128), "PerBlock.block_n"),
                        (lambda: PerBlock(128, bad), "PerBlock.block_k")):
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}={re.escape(repr(bad))} must be a positive int$"):
            make()


# --- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["dyn", "Dynamic", "", "per-token", None])
def test_unsupported_activation_scheme(bad):
    with pytest.raises(ValueError) as exc:
        Fp8Config(activation_scheme=bad)
    assert "Unsupported activation scheme" in str(exc.value)
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("block", [[128, 128, 128], [128], []])
def test_block_size_must_have_two_dims(block):
    with pytest.raises(ValueError, match=r"must have 2 dimensions, but got %d" % len(block)):
        Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=block)


def test_block_size_needs_dynamic_activations():
    with pytest.raises(ValueError, match="only supports dynamic activation scheme"):
        Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static", weight_block_size=[128, 128])


@pytest.mark.parametrize("block", [[0, 128], [128, 0], [-128, 128], [128, -1], [128.0, 128], [128, True]])
def test_block_size_entries_must_be_positive_ints(block):
    with pytest.raises(ValueError, match="positive int"):
        Fp8Config(weight_block_size=block)


def test_ignored_layers_as_string_rejected():
    with pytest.raises(ValueError, match="is a string"):
        Fp8Config(ignored_layers="lm_head")


def test_ignored_layers_normalized_to_tuple():
    cfg = Fp8Config(ignored_layers=["lm_head", "model.layers.0"])
    assert cfg.ignored_layers == ("lm_head", "model.layers.0")
    assert cfg == Fp8Config(ignored_layers=("lm_head", "model.layers.0"))
    assert hash(cfg) == hash(Fp8Config(ignored_layers=("lm_head", "model.layers.0")))


def test_per_group_activations_need_block_weights():
    with pytest.raises(ValueError, match="needs block-scaled weights"):
        Fp8Config(activation_granularity=PerGroup(128))
    with pytest.raises(ValueError, match="needs block-scaled weights"):
        Fp8Config(is_checkpoint_fp8_serialized=True, activation_granularity=PerGroup(128))
    with pytest.raises(ValueError, match="needs block-scaled weights"):
        Fp8Config(weight_granularity=PerRow(), activation_granularity=PerGroup(64))


def test_per_group_size_must_match_block_k():
    with pytest.raises(ValueError, match="must match the weight's block_k=128"):
        Fp8Config(weight_block_size=[128, 128], activation_granularity=PerGroup(64))
    with pytest.raises(ValueError, match="block_k=64"):
        Fp8Config(weight_granularity=PerBlock(128, 64), activation_granularity=PerGroup(128))
    # matching sizes are fine
    assert Fp8Config(weight_block_size=[128, 64], activation_granularity=PerGroup(64)).activation == PerGroup(64)


def test_per_group_not_allowed_for_weights():
    with pytest.raises(ValueError, match="not supported for weights"):
        Fp8Config(weight_granularity=PerGroup(128))


def test_per_block_not_allowed_for_activations():
    with pytest.raises(ValueError, match="not supported for activations"):
        Fp8Config(weight_block_size=[128, 128], activation_granularity=PerBlock(128, 128))


@pytest.mark.parametrize("act", [PerRow(), PerGroup(128)])
def test_static_needs_per_tensor_activations(act):
    with pytest.raises(ValueError, match="needs activation_scheme='dynamic'"):
        Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static", activation_granularity=act)


def test_weight_granularity_contradicting_block_size():
    with pytest.raises(ValueError, match="contradicts"):
        Fp8Config(weight_block_size=[128, 128], weight_granularity=PerRow())
    with pytest.raises(ValueError, match="contradicts"):
        Fp8Config(weight_block_size=[128, 128], weight_granularity=PerBlock(64, 128))


# --- vLLM-compatible API --------------------------------------------------------------------
def test_get_name():
    assert Fp8Config.get_name() == "fp8"
    assert Fp8Config().get_name() == "fp8"


@pytest.mark.parametrize(
    "quant_method, serialized",
    [("fp8", True), ("modelopt_fp8", True), ("fp8_static", True), ("FP8", True), ("", False)],
)
def test_from_config_serialized_flag(quant_method, serialized):
    """vLLM's rule: "fp8" in quant_method means serialized (other methods are refused: the next tests)."""
    cfg = Fp8Config.from_config({"quant_method": quant_method, "activation_scheme": "dynamic"})
    assert cfg.is_checkpoint_fp8_serialized is serialized
    assert cfg.weight == (PerTensor() if serialized else PerRow())


def test_a_misspelt_key_is_warned_about_naming_the_key_it_resembles(caplog):
    """An "activation_shceme": "static" was read as no activation_scheme (dynamic), in silence; other tools' keys
    (DeepSeek-V3's "fmt") and a misspelling next to the right key are let be."""
    import logging

    with caplog.at_level(logging.WARNING, logger="fp8fx"):
        cfg = Fp8Config.from_config({"quant_method": "fp8", "activation_shceme": "static", "weight_block_szie": [64, 64],
                                     "fmt": "e4m3", "ignored_layer": ["lm_head"], "ignored_layers": ["lm_head"]})
    assert cfg.activation_scheme == "dynamic" and cfg.weight_block_size is None
    assert ("quantization_config['activation_shceme']='static' is not a key fp8fx reads (did you mean "
            "'activation_scheme'?): it is ignored, and activation_scheme is left to its default") in caplog.text
    assert "quantization_config['weight_block_szie']=[64, 64] is not a key" in caplog.text
    assert "fmt" not in caplog.text and "ignored_layer'" not in caplog.text


def test_from_config_without_quant_method_is_online():
    cfg = Fp8Config.from_config({})
    assert cfg.is_checkpoint_fp8_serialized is False
    assert cfg.activation_scheme == "dynamic"
    assert cfg.ignored_layers is None and cfg.weight_block_size is None


def test_from_config_reads_fields():
    cfg = Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head", "model.layers.0.mlp"]}
    )
    assert cfg.is_checkpoint_fp8_serialized is True
    assert cfg.activation_scheme == "static"
    assert cfg.ignored_layers == ("lm_head", "model.layers.0.mlp")
    assert cfg.weight_block_size is None
    assert str(cfg.scheme()) == "w:per-tensor a:static per-tensor"


def test_from_config_block():
    # DeepSeek-V3 style quantization_config
    cfg = Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    )
    assert cfg.is_checkpoint_fp8_serialized is True
    assert cfg.weight_block_size == (128, 128)
    assert cfg.weight == PerBlock(128, 128) and cfg.activation == PerGroup(128)


@pytest.mark.parametrize("config", [
    Fp8Config(), Fp8Config(is_checkpoint_fp8_serialized=True, weight_granularity=PerRow()),
    Fp8Config(is_checkpoint_fp8_serialized=True, activation_granularity=PerTensor()),
    Fp8Config(weight_block_size=[64, 32]), Fp8Config(activation_scheme="static", ignored_layers=["lm_head"]),
])
def test_to_dict_reads_back_as_the_same_config(config):
    """from_config ignored the flag and the granularities to_dict writes: an online per-channel config came back
    serialized per-tensor."""
    back = Fp8Config.from_config(json.loads(json.dumps(config.to_dict())))
    assert (back.is_checkpoint_fp8_serialized, back.scheme(), back.ignored_layers) == (
        config.is_checkpoint_fp8_serialized, config.scheme(), config.ignored_layers)


def test_from_config_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match=r"weight_granularity=per-block\(64x64\) contradicts weight_block_size"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_granularity": "per-block(64x64)",
                               "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match=r"activation_granularity='per-chunk'; per-tensor, per-row"):
        Fp8Config.from_config({"quant_method": "fp8", "activation_granularity": "per-chunk"})
    with pytest.raises(ValueError, match=r"is_checkpoint_fp8_serialized='no'; true or false"):
        Fp8Config.from_config({"quant_method": "fp8", "is_checkpoint_fp8_serialized": "no"})


def test_from_config_modules_to_not_convert_fallback():
    cfg = Fp8Config.from_config({"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]})
    assert cfg.ignored_layers == ("lm_head",)
    assert cfg.is_ignored("lm_head")
    # ignored_layers wins when both are present
    cfg = Fp8Config.from_config(
        {"quant_method": "fp8", "ignored_layers": ["model.embed"], "modules_to_not_convert": ["lm_head"]}
    )
    assert cfg.ignored_layers == ("model.embed",)
    assert not cfg.is_ignored("lm_head")


def test_from_config_validates():
    with pytest.raises(ValueError, match="Unsupported activation scheme"):
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic_per_token"})
    with pytest.raises(ValueError, match="2 dimensions"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [1, 128, 128]})
    with pytest.raises(ValueError, match="dynamic activation scheme"):
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]})


@pytest.mark.parametrize(
    "cfg",
    [
        Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]),
        Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[64, 32], ignored_layers=["lm_head"]),
    ],
)
def test_to_dict_round_trip_block(cfg):
    d = cfg.to_dict()
    assert d["quant_method"] == "fp8"
    assert d["weight_block_size"] == list(cfg.weight_block_size)
    assert d["weight_granularity"] == str(cfg.weight)
    assert d["activation_granularity"] == str(cfg.activation)
    back = Fp8Config.from_config(json.loads(json.dumps(d)))  # as a checkpoint would store it
    assert back == cfg
    assert back.scheme() == cfg.scheme()
    assert back.hash() == cfg.hash()


def test_to_dict_round_trip_static_per_tensor():
    cfg = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static", ignored_layers=["lm_head"])
    back = Fp8Config.from_config(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.hash() == cfg.hash()


def test_to_dict_contents():
    d = Fp8Config().to_dict()
    assert d == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "is_checkpoint_fp8_serialized": False,
        "weight_granularity": "per-row",
        "activation_granularity": "per-row",
    }


def test_hash_equal_configs():
    a = Fp8Config(weight_block_size=[128, 128], ignored_layers=["lm_head"])
    b = Fp8Config(weight_block_size=(128, 128), ignored_layers=("lm_head",))
    assert a.hash() == b.hash()
    assert a.hash() == a.hash()
    h = a.hash()
    assert isinstance(h, str) and len(h) == 64 and int(h, 16) >= 0


_DISTINCT = [
    Fp8Config(),
    Fp8Config(is_checkpoint_fp8_serialized=True),
    Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static"),
    Fp8Config(weight_block_size=[128, 128]),
    Fp8Config(weight_block_size=[128, 64]),
    Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]),
    Fp8Config(ignored_layers=["lm_head"]),
    Fp8Config(ignored_layers=["lm_head", "model.layers.0"]),
    Fp8Config(activation_granularity=PerTensor()),
    Fp8Config(weight_granularity=PerTensor()),
]


def test_hash_differs_for_different_configs():
    hashes = [c.hash() for c in _DISTINCT]
    assert len(set(hashes)) == len(hashes)


def test_hash_stable_across_processes():
    """config.py has no torch dependency: load it standalone in fresh interpreters with different
    PYTHONHASHSEEDs and check the hash does not depend on the process."""
    expected = Fp8Config(weight_block_size=[128, 128], ignored_layers=["lm_head", "model.layers.0"]).hash()
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cfg_standalone', {CONFIG_PY!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['cfg_standalone'] = m; spec.loader.exec_module(m)\n"
        "print(m.Fp8Config(weight_block_size=[128, 128], ignored_layers=['lm_head', 'model.layers.0']).hash())\n"
    )
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


# --- KV-cache scale names ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.0.self_attn.k_proj.output_scale", "model.layers.0.self_attn.attn.k_scale"),
        ("model.layers.0.self_attn.v_proj.output_scale", "model.layers.0.self_attn.attn.v_scale"),
        ("model.layers.0.self_attn.q_proj.output_scale", "model.layers.0.self_attn.attn.q_scale"),
        ("model.layers.0.self_attn.prob_output_scale", "model.layers.0.self_attn.attn.prob_scale"),
        ("model.layers.17.self_attn.k_proj.output_scale", "model.layers.17.self_attn.attn.k_scale"),
    ],
)
def test_get_cache_scale(name, expected):
    assert Fp8Config.get_cache_scale(name) == expected
    assert Fp8Config().get_cache_scale(name) == expected


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.o_proj.output_scale",
        "model.layers.0.self_attn.k_proj.weight_scale",
        "model.layers.0.self_attn.k_proj.input_scale",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.output_scale",
        "model.layers.0.self_attn.k_scale",
        "model.layers.0.mlp.prob_output_scale",
        "lm_head.weight",
        "",
    ],
)
def test_get_cache_scale_other_names(name):
    assert Fp8Config.get_cache_scale(name) is None


# --- ignored layers ---------------------------------------------------------------------------
def test_is_ignored_exact_and_prefix():
    cfg = Fp8Config(ignored_layers=["lm_head", "model.layers.0"])
    assert cfg.is_ignored("lm_head")
    assert cfg.is_ignored("model.layers.0")
    assert cfg.is_ignored("model.layers.0.mlp.up_proj")
    assert cfg.is_ignored("model.layers.0.self_attn.qkv_proj")
    assert not cfg.is_ignored("model.layers.01.x")
    assert not cfg.is_ignored("model.layers.01")
    assert not cfg.is_ignored("model.layers.1.mlp.up_proj")
    assert not cfg.is_ignored("model.layers")
    assert not cfg.is_ignored("lm_head_2")
    assert not cfg.is_ignored("model.lm_head")
    assert not cfg.is_ignored("")


def test_is_ignored_without_ignored_layers():
    assert not Fp8Config().is_ignored("lm_head")
    assert not Fp8Config(ignored_layers=[]).is_ignored("lm_head")


_ident = st.text(alphabet="abcdefghij_0123456789", min_size=1, max_size=6)
_fqn = st.lists(_ident, min_size=1, max_size=4).map(".".join)


@settings(max_examples=60, deadline=None)
@given(entry=_fqn, suffix=_fqn, junk=_ident)
def test_is_ignored_property(entry, suffix, junk):
    cfg = Fp8Config(ignored_layers=[entry])
    assert cfg.is_ignored(entry)
    assert cfg.is_ignored(entry + "." + suffix)
    # a sibling whose last component merely starts with the entry's is not covered
    assert not cfg.is_ignored(entry + junk)
    assert not cfg.is_ignored(entry + junk + "." + suffix)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "fp8", "ignored_layers": "lm_head"}, r"\['ignored_layers'\]='lm_head' must be a list .* \['lm_head'\]"),
    ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, r"\['modules_to_not_convert'\]='lm_head'"),
    ({"quant_method": "fp8", "ignored_layers": [1]}, r"must be a list of module names"),
])
def test_ignore_list_given_as_a_string_is_refused(qc, match):
    """``tuple("lm_head")`` would ignore the modules 'l', 'm', ...: nothing."""
    with pytest.raises(ValueError, match=match):
        Fp8Config.from_config(qc)


@pytest.mark.parametrize("qc,match", [
    ({"ignore": "lm_head"}, r"ignore='lm_head' must be a list of module names"),
    ({"config_groups": [{"targets": ["Linear"]}]}, r"config_groups=\[.*\] must map group names"),
    ({"config_groups": {"group_0": None}}, r"config_groups.group_0=None must be a mapping"),
])
def test_compressed_tensors_lists_and_groups_are_checked(qc, match):
    from fp8fx.checkpoint import CheckpointError
    from fp8fx.checkpoint.formats import parse

    group = {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
             "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}
    with pytest.raises(CheckpointError, match=match):
        parse({"quantization_config": {**config, **qc}})


def test_compressed_tensors_group_naming_the_layer_wins_over_its_class():
    from fp8fx.checkpoint.formats import parse

    def group(targets, act):
        return {"targets": targets, "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": act, "dynamic": True}}

    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g0": group(["Linear"], "token"), "g1": group(["re:.*down_proj$"], "tensor")}}
    fmt = parse({"quantization_config": qc})
    assert str(fmt.layer_config("model.layers.0.mlp.down_proj", ("Linear",)).scheme()).endswith("a:per-tensor")
    assert str(fmt.layer_config("model.layers.0.mlp.up_proj", ("Linear",)).scheme()).endswith("a:per-token")


@pytest.mark.parametrize("kwargs,match", [
    (dict(is_checkpoint_fp8_serialized="false"), r"is_checkpoint_fp8_serialized='false': True or False"),
    (dict(ignored_layers=["0", 1]), r"ignored_layers=\['0', 1\] must be a list of FQNs"),
    (dict(ignored_layers=5), r"ignored_layers=5 must be a list of FQNs"),
    (dict(weight_block_size=128), r"weight_block_size=128 must be \[block_n, block_k\]"),
])
def test_constructor_checks_types(kwargs, match):
    """Each of these was accepted ("false" read as true) or failed later with a bare TypeError."""
    with pytest.raises(ValueError, match=match):
        Fp8Config(**kwargs)


def test_from_config_takes_fp8_configs_only():
    """Another quant_method (awq, compressed-tensors) came back as an online per-channel config, its ignore list and
    groups dropped; transformers' FineGrainedFP8Config (its quant_method an enum) read as not serialized."""
    for method in ("awq", "compressed-tensors", "bitsandbytes"):
        with pytest.raises(ValueError, match=f"quant_method={method!r} is not fp8"):
            Fp8Config.from_config({"quant_method": method, "ignore": ["lm_head"]})
    with pytest.raises(ValueError, match=r"quantization_config\['ignored_layers'\]=5 must be a list"):
        Fp8Config.from_config({"quant_method": "fp8", "ignored_layers": 5})
    with pytest.raises(ValueError, match=r"weight_block_size=128 must be"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": 128})
    # fp8 methods of other schemes: FBGEMM's per-channel weights read as per-tensor ones, with no error
    for method in ("fbgemm_fp8", "ptpc_fp8"):
        with pytest.raises(ValueError, match=rf"quant_method={method!r}: .*weight_granularity=fp8fx\.PerRow\(\)"):
            Fp8Config.from_config({"quant_method": method, "modules_to_not_convert": ["lm_head"]})
    # and fp8 methods vLLM gives config classes of their own (MXFP8's 1x32 E8M0 scales; online block or per-channel
    # schemes): read as per-tensor fp8 checkpoints, silently
    for method, fix in [("mxfp8", "no scheme of fp8fx's"), ("modelopt_mxfp8", "no scheme of fp8fx's"),
                        ("fp8_per_block", r"weight_block_size=\(128, 128\)"), ("fp8_per_channel", r"PerRow\(\)"),
                        ("fp8_per_tensor", r"PerTensor\(\)"), ("deepseek_v4_fp8", "a config class of its own")]:
        with pytest.raises(ValueError, match=rf"quant_method={method!r}: .*{fix}"):
            Fp8Config.from_config({"quant_method": method})
    transformers = pytest.importorskip("transformers")
    config = Fp8Config.from_config(transformers.FineGrainedFP8Config())
    assert config.is_checkpoint_fp8_serialized and config.weight_block_size == (128, 128)


@pytest.mark.parametrize("value", [["embed_tokens"], ("mlp",), "embed_tokens"])
def test_from_config_refuses_modules_to_convert(value):
    """transformers' FineGrainedFP8Config(modules_to_convert=[...]) stores the embedding tables it names in fp8
    (FP8Embedding), which fp8fx does not read: from_config dropped the field, claimed a plain fp8 config, and the load
    failed later blaming the layer's dtype ("add the layer to its ignore list")."""
    with pytest.raises(ValueError, match=r"quantization_config\['modules_to_convert'\]=.* fp8fx .* re-export"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [32, 32], "modules_to_convert": value})
    for empty in (None, []):  # what FineGrainedFP8Config().to_dict() writes: nothing to convert beyond the linears
        config = Fp8Config.from_config({"quant_method": "fp8", "modules_to_convert": empty})
        assert config.is_checkpoint_fp8_serialized and config.ignored_layers is None
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"modules_to_convert'\]=\['embed_tokens'\]"):
        Fp8Config.from_config(transformers.FineGrainedFP8Config(modules_to_convert=["embed_tokens"]))


def test_from_config_refuses_fp4_experts_and_reads_ue8m0_scale_format():
    """FineGrainedFP8Config's FP4-packed experts (expert_dtype="fp4") were dropped and the config claimed fp8 ones.
    scale_fmt="ue8m0" reads as any fp8 config: DeepSeek-V3.1 declares it over float32 power-of-two scales (scales
    stored as E8M0 are refused by their tensors' dtype, fp8fx.checkpoint.files)."""
    with pytest.raises(ValueError, match=r"quantization_config\['expert_dtype'\]='fp4': fp8fx reads fp8 experts"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"})
    deepseek_v31 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                    "weight_block_size": [128, 128]}
    assert Fp8Config.from_config(deepseek_v31).weight_block_size == (128, 128)
    transformers = pytest.importorskip("transformers")
    if "expert_dtype" in transformers.FineGrainedFP8Config().to_dict():  # transformers 5.24 (5.17 has neither field)
        with pytest.raises(ValueError, match=r"quantization_config\['expert_dtype'\]='fp4'"):
            Fp8Config.from_config(transformers.FineGrainedFP8Config(expert_dtype="fp4"))
        assert Fp8Config.from_config(transformers.FineGrainedFP8Config(scale_fmt="ue8m0")).is_checkpoint_fp8_serialized


_CT_BLOCK = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "block",
             "block_structure": [128, 64]}


def _ct_group_acts(**kw):
    return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group", **kw}


@pytest.mark.parametrize("weights,acts,match", [
    (_CT_BLOCK, _ct_group_acts(), r"config_groups\.group_0\.input_activations\.group_size=None: strategy 'group' "
     r"needs the weights' block_k, 64 \(config_groups\.group_0\.weights\.block_structure=\[128, 64\]\)"),
    (_CT_BLOCK, _ct_group_acts(group_size=128), r"config_groups\.group_0\.input_activations\.group_size=128 must "
     r"match .*block_structure=\[128, 64\]\): set it to 64"),
    (_CT_BLOCK, _ct_group_acts(group_size="64"), r"input_activations\.group_size='64': .* set it to 64"),
    ({**_CT_BLOCK, "strategy": "channel", "block_structure": None}, _ct_group_acts(group_size=64),
     r"config_groups\.group_0\.input_activations\.strategy='group' needs block-scaled weights "
     r"\(config_groups\.group_0\.weights\.strategy='block'\), not 'channel'; use strategy 'token'"),
    ({**_CT_BLOCK, "block_structure": [128, 0]}, _ct_group_acts(group_size=64),
     r"config_groups\.group_0\.weights\.block_structure=\[128, 0\] must be \[block_n, block_k\] of positive ints"),
    (_CT_BLOCK, {**_ct_group_acts(), "dynamic": False, "strategy": "tensor"},
     r"config_groups\.group_0\.input_activations\.dynamic=false .* block-scaled weights take dynamic activations"),
])
def test_compressed_tensors_group_activations_name_the_config_field(weights, acts, match):
    """compressed-tensors block weights with group activations: a missing or mismatched group_size was reported as
    Python objects ('PerGroup.group_size=None must be a positive int', 'use PerGroup(128)'), not as config.json's
    field and the value it needs."""
    from fp8fx.checkpoint import CheckpointError
    from fp8fx.checkpoint.formats import parse

    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}
    with pytest.raises(CheckpointError, match=match) as e:
        parse({"quantization_config": qc})
    assert "PerGroup" not in str(e.value) and "PerBlock" not in str(e.value) and "Fp8Config" not in str(e.value)
    good = parse({"quantization_config": {**qc, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": _CT_BLOCK, "input_activations": _ct_group_acts(group_size=64)}}}})
    assert str(good.config.scheme()) == "w:per-block(128x64) a:per-group(1x64)"


def test_modules_to_not_convert_round_trips_and_feeds_the_hash():
    """Fp8Config.modules_to_not_convert (transformers' reading of the entries) set by a caller: to_dict dropped it, so
    from_config(to_dict()) quantized the modules it keeps and the hash was a plain config's; a renamed module's
    stored name then failed on ignored_layers None."""
    from fp8fx.checkpoint.renames import with_stored_ignores

    gate = "model.layers.0.mlp.gate"
    for config in (Fp8Config(modules_to_not_convert=["gate"]),
                   Fp8Config(ignored_layers=["lm_head"], modules_to_not_convert=["gate"]),
                   Fp8Config.from_config({"quant_method": "fp8", "modules_to_not_convert": ["lm_head", "gate"]})):
        back = Fp8Config.from_config(config.to_dict())
        assert config.is_ignored(gate) and back.is_ignored(gate), config.to_dict()
        assert back.is_ignored("lm_head") == config.is_ignored("lm_head")
        assert not back.is_ignored("model.layers.0.mlp.down_proj")
        assert config.hash() != Fp8Config(ignored_layers=config.ignored_layers).hash()
    assert back == config  # (from_config's own: both fields from one list, and back again)
    renamed = with_stored_ignores(Fp8Config(is_checkpoint_fp8_serialized=True, modules_to_not_convert=["gate"]),
                                  {"model.router": ("model.gate",)})
    assert renamed.ignored_layers == ("model.router",) and renamed.is_ignored("model.router")
