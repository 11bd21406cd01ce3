"""The ``fp8fx`` command.

    fp8fx inspect MODEL [--ignore FQN] [--block-size N,K] [--activation-scheme S] [--config FILE] [--json]
    fp8fx bench [--cpu-smoke] [...]      benchmarks/bench_linear.py of a source checkout
    fp8fx convert SRC DST [--scheme S]   bf16 safetensors checkpoint -> fp8 checkpoint

``inspect`` builds MODEL on the meta device (no weights, no GPU), traces it with ``torch.compile`` and
says, for every linear site, whether fp8fx would rewrite it with the config, or why not. MODEL is a
folder with an HF ``config.json`` (or that file), or ``module:factory`` / ``path/to/file.py:factory``,
a function returning a model or ``(model, example_args)``; it is called under ``torch.device("meta")``.
Errors are one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect as pyinspect
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

import fp8fx
from fp8fx import quant
from fp8fx.checkpoint.experts import NAMINGS
from fp8fx.config import Fp8Config
from fp8fx.report import NOT_QUANTIZED, ROOT, first_line, human_size
from fp8fx.weights import moe
from fp8fx.weights.linear import check_no_in_place_rescale, foreign_linear_reason, target_classes
from fp8fx.weights.linear import is_linear, linear_weight
from fp8fx.weights.quantize import LinearDecider, check_ignored_layers, did_you_mean, ignoring_aliases

log = logging.getLogger("fp8fx")


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv[:1] == ["bench"]:  # every other argument belongs to the benchmark's own parser
        return _run(parser.prog + " bench", lambda: bench(argv[1:]))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    return _run(f"{parser.prog} {args.command}", lambda: args.func(args))


def _run(prog: str, command) -> int:
    try:
        return command() or 0
    except SystemExit as e:  # the benchmark's own argparse: --help, usage errors
        return int(e.code or 0)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fp8fx", description="FP8 inference through torch.compile: inspect a model, benchmark, "
                     "convert a checkpoint.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    p = sub.add_parser("inspect",
                       help="which linear layers of MODEL fp8fx would rewrite, and why not (no GPU, no weights)",
                       description=__doc__.split("\n\n")[2].replace("``", "`"))
    p.add_argument("model", metavar="MODEL", help="HF config folder / config.json, or module:factory / file.py:factory")
    p.add_argument("--config", metavar="FILE", help="JSON quantization config (a checkpoint's quantization_config, or "
                   "a config.json holding one); default: the model's own quantization_config, else Fp8Config()")
    p.add_argument("--ignore", metavar="FQN", action="append", default=[], help="add to ignored_layers (repeatable)")
    p.add_argument("--block-size", metavar="N,K", help="block-scaled weights, e.g. 128,128")
    p.add_argument("--activation-scheme", choices=["dynamic", "static"],
                   help="activation scales computed per call (dynamic) or calibrated (static, per tensor); default: "
                        "the config's")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the model's dtype (default bfloat16)")
    p.add_argument("--seq-len", type=int, help="tokens of the traced input of an HF config folder / config.json MODEL "
                   "(default 16)")
    p.add_argument("--input-shape", metavar="D0,D1,...",
                   help="shape of the float input of a module:factory MODEL whose factory returns a model only")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=inspect_command)

    sub.add_parser("bench", help="run benchmarks/bench_linear.py (fp8fx bench --help for its options)", add_help=False)

    p = sub.add_parser("convert", help="convert a bf16/fp16 safetensors checkpoint to fp8",
                       description="Convert the bf16/fp16 safetensors checkpoint in SRC (a folder with config.json) "
                       "into an FP8 one in DST, one file at a time (fp8fx.checkpoint.convert).")
    p.add_argument("src", metavar="SRC", help="folder with config.json and *.safetensors")
    p.add_argument("dst", metavar="DST", help="new or empty folder for the fp8 checkpoint")
    p.add_argument("--scheme", choices=list(SCHEMES), default="per-channel",
                   help="weight scales (default per-channel; activations are dynamic per-token, 1x128 groups for "
                   "block)")
    p.add_argument("--ignore", metavar="FQN", action="append", default=[], help="keep this layer in bf16 (repeatable)")
    p.add_argument("--format", choices=["fp8", "compressed-tensors"],
                   help="quantization_config format (default: fp8 where it can express the scheme)")
    p.add_argument("--rename", metavar="REGEX=REPLACEMENT", action="append",
                   help="how the checkpoint's names map to the model's, as from_pretrained(key_mapping=) takes it "
                   "(repeatable; added to the renames transformers applies to the model; the output keeps the "
                   "checkpoint's names)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the output embeddings too (vLLM loads lm_head in bf16 only: the checkpoint then "
                   "loads in fp8fx and transformers, not vLLM)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=convert_command)
    return parser


# -- inspect ------------------------------------------------------------------------------------------
def inspect_command(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    if args.seq_len is not None and args.seq_len < 1:
        raise UsageError(f"--seq-len {args.seq_len}: the traced input needs at least one token")
    # what the model's own code prints while it is built and traced goes to stderr: stdout is the table, or --json's
    # document, which a line before it made unreadable
    with contextlib.redirect_stdout(sys.stderr):
        model, call_args, call_kwargs, hf_quant = load_meta_model(args.model, dtype, args.seq_len, args.input_shape)
    hf_folder = _hf_folder(args.model) is not None
    checkpoint = _CheckpointNames(args.model, model)
    config, layer_config, config_format, ignores = make_config(args, hf_quant, checkpoint)
    try:  # as quantize_ would: an --ignore that names no module keeps nothing in bf16 (the checkpoint's names too,
        # as convert takes them)
        check_ignored_layers(Fp8Config(ignored_layers=tuple(args.ignore)),
                             [f for f, _ in model.named_modules(remove_duplicate=False)]
                             + (checkpoint.stored[0] if args.ignore else []),
                             f"this {type(model).__name__}" + (" or its checkpoint" if checkpoint.folder else ""),
                             "inspected")
    except ValueError as e:
        raise UsageError(f"--ignore: {e}") from None
    if args.config:  # the --config file's entries that name nothing: said, not refused, as a checkpoint's config
        # may name its own modules, which load_checkpoint maps to the model's
        names = [f for f, _ in model.named_modules(remove_duplicate=False) if f]
        unmatched = [n for n in ignores(model) if n not in args.ignore]
        if unmatched:
            log.warning("fp8fx inspect: --config %s: %s %s name no module of this %s%s; the layers they meant are "
                        "predicted below as the rest (a name of the checkpoint's own, which load_checkpoint maps, is "
                        "fine)", args.config, "ignore" if config_format == "compressed-tensors" else "ignored_layers",
                        unmatched, type(model).__name__, _ignore_hint(unmatched[0], names))
    with contextlib.redirect_stdout(sys.stderr):
        rows, others, graphs = predict(model, config, call_args, call_kwargs, layer_config, checkpoint.stored_high)
    towers = [n for n in ("vision_config", "audio_config") if getattr(getattr(model, "config", None), n, None)]
    untraced = [r["fqn"] for r in rows if r["reason"] == _UNTRACED]
    if hf_folder and towers and untraced:  # (a VLM's vision tower and projector: their rows blamed a graph break)
        log.warning("fp8fx inspect: %s was traced with input ids only, so its %s tower's layers ran in no graph: %d "
                    "rows say 'in no traced graph' (%s%s); pass a module:factory that returns (model, example_args) "
                    "with its images or audio to trace them", type(model).__name__,
                    " / ".join(t.split("_")[0] for t in towers), len(untraced), untraced[0],
                    ", ..." if len(untraced) > 1 else "")
    if args.json:
        print(json.dumps({"model": args.model, "config": config.to_dict(), "graphs": graphs, "sites": rows,
                          "other_weights": others}, indent=1))
    else:
        print(_table(args.model, type(model).__name__, config, rows, others, graphs))
    return 0


def _hf_folder(spec: str) -> Optional[Path]:
    """The HF model folder MODEL names (the folder, or its config.json's), or None (a module:factory)."""
    path = Path(spec)
    return path if path.is_dir() else path.parent if path.name == "config.json" else None


def load_meta_model(spec: str, dtype: torch.dtype, seq_len: Optional[int], input_shape: Optional[str]):
    """(model on the meta device, args, kwargs to call it with, the HF quantization_config or None). ``seq_len``
    (None: 16) is for an HF MODEL only, ``input_shape`` for a factory that returns a model only: given to another
    MODEL, either is refused (it would be ignored)."""
    path = Path(spec)
    if _hf_folder(spec) is not None:
        if input_shape is not None:
            raise UsageError(
                f"--input-shape {input_shape!r}: it applies to a MODEL given as module:factory (or file.py:factory) "
                f"whose factory returns a model only; {spec} is an HF config, traced with input ids of --seq-len "
                "tokens: drop --input-shape (--seq-len N sets the length)"
            )
        return _hf_model(path, dtype, 16 if seq_len is None else seq_len)
    if ":" not in spec or path.exists():
        raise UsageError(
            f"MODEL {spec!r} is neither a folder with a config.json, a config.json, nor module:factory "
            "(e.g. mypkg.models:make_model or models.py:make_model)"
        )
    if seq_len is not None:
        raise UsageError(
            f"--seq-len {seq_len}: it applies to a MODEL given as an HF config folder or config.json only; {spec} is "
            "a module:factory, traced with the example args it returns or a float input of --input-shape: drop "
            "--seq-len"
        )
    with _current_folder_on_path():  # the factory may import its own modules while it runs, too
        factory = _factory(spec)
        try:
            with torch.device("meta"):
                made = factory()
        except Exception as e:  # noqa: BLE001 - the user's code: say what failed, in one line
            raise UsageError(f"{spec}() failed: {type(e).__name__}: {_first_line(e)}") from e
    if isinstance(made, tuple) and len(made) != 2:
        raise UsageError(f"{spec} returned a tuple of {len(made)}; return a model or (model, example_args)")
    model, call_args = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec} returned {type(model).__name__}, not an nn.Module (or (module, example_args))")
    model = model.to(device="meta", dtype=dtype).eval()
    if call_args is not None and not isinstance(call_args, (tuple, list)):  # a bare tensor was iterated row by row
        raise UsageError(f"{spec} returned (model, {type(call_args).__name__}); the example args are a tuple or list "
                         "of the forward's arguments: return (model, (x,))")
    if call_args is not None and input_shape is not None:
        raise UsageError(
            f"--input-shape {input_shape!r}: it applies to a module:factory MODEL whose factory returns a model only; "
            f"{spec} returned (model, example_args), and those are traced: drop --input-shape, or return the model "
            "alone"
        )
    if call_args is None:
        if input_shape is None:
            raise UsageError(f"{spec} returned a model without example inputs; pass --input-shape (e.g. 4,256) or "
                             "return (model, example_args) from the factory")
        call_args = (torch.zeros(_ints(input_shape, "--input-shape"), dtype=dtype, device="meta"),)
    call_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in call_args)
    # (an HF model from a factory: its KV cache failed the trace, as the HF folder's did before it traced without one)
    return model, call_args, _no_kv_cache(model, call_args), None


def _transformers():
    """transformers, or a usage error saying how to get it (fp8fx does not depend on it: README's install)."""
    try:
        import transformers
    except ImportError:
        raise UsageError("this needs transformers to build the model from its config.json: pip install transformers "
                         "(or pass a model factory, module:function)") from None
    return transformers


def _hf_model(path: Path, dtype: torch.dtype, seq_len: int):
    transformers = _transformers()

    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file():
        raise UsageError(f"{folder} has no config.json; give an HF model folder or its config.json")
    try:  # (transformers' own errors for a bad field: a dataclass validation error, a ZeroDivisionError, ...)
        config = transformers.AutoConfig.from_pretrained(str(folder))
        quant_config = getattr(config, "quantization_config", None)
        if quant_config is not None:  # fp8fx applies it; transformers must not try its own quantizer
            del config.quantization_config
            quant_config = quant_config if isinstance(quant_config, dict) else quant_config.to_dict()
        # the class config.json names, as meta_model (convert) builds it: its module names are the checkpoint's
        # (a BertModel's inspected as BertLMHeadModel: every name prefixed "bert.", a head the checkpoint has not)
        named = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or ()]
        cls = next((c for c in named if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)
                    and isinstance(config, c.config_class)), None)
        with torch.device("meta"):
            if cls is not None:
                model = cls._from_config(config, dtype=dtype)
            else:
                try:
                    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
                except ValueError:  # not a causal LM: the bare model
                    model = transformers.AutoModel.from_config(config, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - named for the user, the original chained
        raise UsageError(f"{folder / 'config.json'} is not a config transformers can build a model from: "
                         f"{type(e).__name__}: {_first_line(e)}") from e
    if quant_config is None:  # ModelOpt's older exports: hf_quant_config.json beside it (as load_checkpoint reads it)
        from fp8fx.checkpoint import CheckpointError
        from fp8fx.checkpoint.files import read_config

        try:
            quant_config = read_config(str(folder)).get("quantization_config")
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    main = getattr(model, "main_input_name", "input_ids")
    if main != "input_ids":  # (a ViT's pixel_values, Whisper's input_features: it failed in the model's own code)
        raise UsageError(f"{type(model).__name__} takes {main}, and fp8fx inspect traces an HF folder's model with "
                         "input ids only: pass a module:factory that builds the model and returns (model, "
                         f"example_args), its {main} among them")
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    kwargs = _no_kv_cache(model)
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" in pyinspect.signature(
            model.forward).parameters:  # (T5, BART: the decoder's tokens too; it failed "specify input_ids")
        kwargs["decoder_input_ids"] = ids
    return model.eval(), (ids,), kwargs, quant_config


def _no_kv_cache(model: nn.Module, call_args: tuple = ()) -> dict:
    """The keyword arguments that keep a KV cache out of the trace of ``model`` called with ``call_args`` (an HF
    model's real meta tensors, which the fake-tensor trace refuses: "Please convert all Tensors to FakeTensors
    first"): use_cache=False where forward names use_cache and the arguments leave it unset, or takes **kwargs and
    the config has one (GraniteMoE's)."""
    try:
        signature = pyinspect.signature(model.forward)
        given = signature.bind_partial(*call_args).arguments
    except (TypeError, ValueError):  # (a forward whose signature Python cannot read, or arguments it does not take)
        return {}
    params = signature.parameters
    if "use_cache" in params:
        return {} if "use_cache" in given else {"use_cache": False}
    config = getattr(model, "config", None)
    # (a vision-language model's: its text config's, where the top config has none - Llava's)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    takes = any(p.kind is p.VAR_KEYWORD for p in params.values()) and any(
        getattr(c, "use_cache", None) is not None for c in (config, text))
    return {"use_cache": False} if takes else {}


@contextlib.contextmanager
def _current_folder_on_path():
    """The current folder first on sys.path while MODEL's factory is imported and called, as under python -m fp8fx
    (the installed fp8fx script puts its own folder there); sys.path is as it was afterwards."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        yield
    finally:  # the entry put there (by identity: the user's own entry for the folder, if any, stays)
        for i, entry in enumerate(sys.path):
            if entry is cwd:
                del sys.path[i]
                break


def _factory(spec: str):
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise UsageError(f"{module_name} does not exist (MODEL {spec!r})")
            name = Path(module_name).stem
            if name in sys.modules:  # (a module of that name already imported stays as it is)
                name = f"fp8fx_model_{name}"
            loader = importlib.util.spec_from_file_location(name, module_name)
            module = importlib.util.module_from_spec(loader)
            # in sys.modules as an import puts it: Dynamo looks a frame's module up by name where it resumes after a
            # graph break (a model of this file with one failed: "No module named 'models'")
            sys.modules[name] = module
            try:
                loader.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        else:
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - ImportError, a SyntaxError or whatever the module raises on import
        where = ""
        if isinstance(e, ModuleNotFoundError) and e.name and f"{module_name}.".startswith(f"{e.name}."):
            # MODEL's module itself (or its package) is nowhere, not a module it imports
            where = (f"; it is looked for in the current folder ({os.getcwd()}) and on sys.path: run fp8fx from the "
                     f"folder that holds it, install it, or give its file, {module_name.replace('.', '/')}.py:{attr}")
        raise UsageError(f"cannot import {module_name!r} (MODEL {spec!r}): {type(e).__name__}: {_first_line(e)}"
                         f"{where}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"{module_name} has no function {attr!r} (MODEL {spec!r})")
    return factory


def _ignore_hint(entry: str, names: Sequence[str]) -> str:
    """The closest module name to an ignore entry that names none; for a 're:' pattern (matched from the start of
    names: compressed-tensors uses re.match) the same pattern from anywhere in the name, where that matches."""
    if not entry.startswith("re:"):
        return did_you_mean(entry, names)
    try:
        found = sum(1 for n in names if re.match(".*" + entry[3:], n))
    except re.error:
        return ""
    return f" ('re:' patterns match from the start of a name: 're:.*{entry[3:]}' would match {found})" if found else ""


class _LayerConfigs:
    """``layer_config(fqn)``: a layer's config, or None where the quantization_config keeps it in high precision;
    ``why_not(fqn)`` says why as ``load_checkpoint``'s report does (inspect said "kept in high precision by the
    quantization_config (ignore / no matching group)" of a layer the load and the compile report call "in
    ignored_layers")."""

    def __init__(self, get: Callable[[str, tuple], Optional[Fp8Config]], ignored: Callable[[str, tuple], bool]):
        self.get, self.ignored = get, ignored

    def __call__(self, fqn: str, classes: tuple = ("Linear",)) -> Optional[Fp8Config]:
        return self.get(fqn, classes)

    def why_not(self, fqn: str, classes: tuple = ("Linear",)) -> str:
        return "in ignored_layers" if self.ignored(fqn, classes) else "not targeted by quantization_config"


def make_config(args: argparse.Namespace, hf_quant: Optional[dict], named: Callable[[Any], Any] = lambda fmt: fmt):
    """The config file, else the model's quantization_config, else Fp8Config(); then the flags.
    Returns (the config to show, ``layer_config(fqn)``: a layer's config or None when the
    quantization_config keeps it in high precision — compressed-tensors configs are per layer, the format's
    name, ``ignores(model)``: the entries of its ignore list that match no module of ``model``). ``named(fmt)``:
    the format knowing the checkpoint's names of the model's modules (``_CheckpointNames``)."""
    base = hf_quant
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                base = json.load(f)
        except UnicodeDecodeError as e:  # (a safetensors file given for the config: a traceback, h135)
            raise UsageError(f"--config {args.config}: not a UTF-8 JSON file ({_first_line(e)}); give the "
                             "checkpoint's config.json or a quantization_config JSON") from e
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--config {args.config}: {_first_line(e)}") from e
        whole = base
        if not isinstance(whole, dict):
            raise UsageError(f"--config {args.config}: expected a JSON object, got {type(whole).__name__}")
        from fp8fx.checkpoint.files import quantization_config_of

        # (found where load_checkpoint and inspect FOLDER find it: an older compressed-tensors export's
        # compression_config, a VLM's text_config.quantization_config; a null one is none)
        key, found = quantization_config_of(whole)
        base = whole if key is None and "quantization_config" not in whole else found if key else {}
        if not isinstance(base, dict):
            raise UsageError(f"--config {args.config}: its {key} is a JSON {type(base).__name__}, where a "
                             "quantization_config is an object")
        if "quant_method" not in base and isinstance(base.get("quantization"), dict):  # ModelOpt's hf_quant_config
            base = {"quant_method": "modelopt", **base}  # (as files.read_config folds it in)
        if "quant_method" not in base and "model_type" in whole:  # a model's config.json of no quantization
            raise UsageError(f"--config {args.config}: a model's config.json without a quantization_config; pass a "
                             "quantization_config (a file holding one, or a checkpoint's config.json that has one), "
                             "or leave --config out for Fp8Config's defaults and the flags")
    from fp8fx.checkpoint import CheckpointError, formats

    try:
        fmt = formats.parse({"quantization_config": base}) if base else None
    except CheckpointError as e:  # an unknown quant_method, a malformed compressed-tensors config
        # (formats.parse names config.json, where a model's quantization_config is: --config's is in that file)
        where = _first_line(e).replace("config.json", f"--config {args.config}", 1) if args.config else _first_line(e)
        raise UsageError(f"bad config: {where}") from None
    fmt = named(fmt) if fmt is not None else None

    flag_ignores = tuple(args.ignore or ())
    sources = named.stored[1] if flag_ignores and isinstance(named, _CheckpointNames) else {}
    if sources:  # a checkpoint's name (a hub Mixtral's block_sparse_moe.experts): the model's module it loads into too
        from fp8fx.checkpoint.renames import with_stored_ignores

        modules = dict(named.model.named_modules(remove_duplicate=False))  # (sources name tensors' owners too)
        flag_ignores += tuple(n for n in with_stored_ignores(Fp8Config(ignored_layers=flag_ignores), sources)
                              .ignored_layers[len(flag_ignores):] if n in modules)

    def with_flags(config: Fp8Config) -> Fp8Config:
        changes: dict[str, Any] = {}
        if flag_ignores:
            changes["ignored_layers"] = tuple(config.ignored_layers or ()) + flag_ignores
        # a flag replaces what the config says of its part; the config's activation granularity stays where it goes
        # with the flags, else it goes back to the default for them (a compressed-tensors config spells it out:
        # per-group(1x128) of a 128x128 block, which a 64x64 block refuses; per-row, which static activations refuse)
        if args.block_size:  # the weights' scales: they replace the config's (a per-channel one too)
            changes["weight_block_size"] = _ints(args.block_size, "--block-size", count=2)
            changes["weight_granularity"] = None
        if args.activation_scheme:
            changes["activation_scheme"] = args.activation_scheme
        if args.config or args.block_size:  # a scheme to quantize with (quantize_, convert: a layer the block does
            # not divide stays bf16), not the model's own fp8 checkpoint (load_checkpoint: it loads as stored)
            changes["is_checkpoint_fp8_serialized"] = False
        try:
            return dataclasses.replace(config, **changes)
        except ValueError as e:  # the config's activations do not go with the flags: the flags' defaults, else the
            # error, naming the flags (it read "bad config: ...; use activation_scheme='dynamic'" of flags that
            # contradict each other or the checkpoint's config, where no config was written)
            if not (args.block_size or args.activation_scheme):
                raise
            error = e
        if config.activation_granularity is not None:
            try:
                return dataclasses.replace(config, **changes, activation_granularity=None)
            except ValueError as e:
                error = e
        flags = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("block_size", "activation_scheme")
                 if getattr(args, name)]
        over = (f" over --config {args.config}" if args.config else
                " over the checkpoint's quantization_config" if hf_quant else "")
        raise UsageError(f"{' with '.join(flags)}{over}: {_first_line(error)} (change or drop "
                         f"{'a flag' if len(flags) > 1 or over else 'the flag'})")

    def ignores(model: nn.Module) -> list[str]:
        if fmt is None:
            return []
        if fmt.name != "compressed-tensors":  # entries read as parts of names (transformers' modules_to_not_convert
            # reads them so: MiniMax-M2's "gate")
            names = [n for f, _ in model.named_modules(remove_duplicate=False) if f  # (a module's every name,
                     for n in fmt.names_of(f)]  # and the checkpoint's)
            return [n for n in fmt.config.ignored_layers or () if not any(n in f for f in names)]
        # exact names, 're:' patterns or class names (a "Linear" entry names nn.Linear's subclasses too)
        modules = [(n, target_classes(m)) for f, m in model.named_modules(remove_duplicate=False) if f
                   for n in fmt.names_of(f)]
        return [n for n in fmt.ignore if not any(formats.matches(f, classes, (n,)) for f, classes in modules)]

    try:
        config = with_flags(fmt.config if fmt else Fp8Config())
        name = fmt.name if fmt else "none"
        if name != "compressed-tensors":  # (transformers' modules_to_not_convert, ModelOpt's exclude list)
            # (the format's ignore list by the checkpoint's names too: a hub Mixtral's block_sparse_moe.experts)
            return config, _LayerConfigs(lambda fqn, _: None if fmt and fmt.is_ignored(fqn) else config,
                                         lambda fqn, _: True), name, ignores
        groups = {id(c): with_flags(c) for _, c in fmt.groups}
        # (the header's: its ignore list, and the config of the first group, whose ignored_layers are none)
        config = dataclasses.replace(config, ignored_layers=tuple(fmt.ignore) + flag_ignores)
        # (a layer's classes, as load_checkpoint matches a group's or the ignore list's class names: inspect took
        # every layer for a plain "Linear", h156)
        return (config, _LayerConfigs(
            lambda fqn, classes: (lambda c: None if c is None else groups[id(c)])(fmt.layer_config(fqn, classes)),
            lambda fqn, classes: fmt.is_ignored(fqn, classes)), name, ignores)
    except ValueError as e:
        raise UsageError(f"bad config: {e}") from e


class _CheckpointNames:
    """``make_config``'s ``named``: for an HF folder with a safetensors checkpoint, ``named(fmt)`` is the format
    knowing the checkpoint's names of the model's modules, as ``load_checkpoint`` reads them (transformers' renames: a
    hub Mixtral's ignore list names ``block_sparse_moe.experts``, the model's module is ``mlp.experts``); for a config
    alone or a factory, the format as it is. ``stored_high``, once ``named`` has read the checkpoint: whether it holds
    a linear in high precision (``load.stored_in_high_precision``: an fp8 checkpoint's output embeddings, routers and
    kept layers load as stored), else None."""

    def __init__(self, spec: str, model: nn.Module):
        folder = _hf_folder(spec)
        has_files = folder is not None and (any(folder.glob("*.safetensors"))
                                            or any(folder.glob("*.safetensors.index.json")))
        self.folder, self.model = folder if has_files else None, model
        self.stored_high: Optional[Callable[[str], bool]] = None

    @functools.cached_property
    def _entries(self) -> tuple[Optional[dict], Optional[Exception]]:
        """(the checkpoint's entries, None) - read once for ``stored`` and ``named`` -, or (None, why not): inspect
        needs no weights (a download in part: an index and no shard yet; a stray file, which load_checkpoint
        refuses)."""
        from fp8fx.checkpoint import CheckpointError
        from fp8fx.checkpoint.files import read_checkpoint

        try:
            return read_checkpoint(str(self.folder))[1], None
        except (CheckpointError, OSError) as e:
            return None, e

    @functools.cached_property
    def stored(self) -> tuple[list[str], dict[str, tuple[str, ...]]]:
        """(the checkpoint's module names, as stored and as renamed onto the model's; model module -> the stored
        modules renamed onto it): what ``--ignore`` may name, as ``convert`` takes it (h135: inspect refused a hub
        Mixtral's ``block_sparse_moe.experts``, which convert of the same folder took); none where there is no
        checkpoint or it cannot be read (said)."""
        from fp8fx.checkpoint import CheckpointError, renames

        if self.folder is None:
            return [], {}
        entries, error = self._entries
        if entries is not None:
            try:
                entries, sources = renames.apply(entries, renames.resolve(self.model, None, "inspect", entries),
                                                 str(self.folder))
            except (CheckpointError, OSError) as e:
                error = e
        if error is not None:
            log.warning("fp8fx inspect: the checkpoint's tensor names were not read (%s): --ignore is matched with "
                        "the model's names only", _first_line(error))
            return [], {}
        names = [n.rpartition(".")[0] for n in entries] + [e.source.rpartition(".")[0] for e in entries.values()
                                                            if e.source]
        return names, sources

    def __call__(self, fmt):
        from fp8fx.checkpoint import CheckpointError
        from fp8fx.checkpoint.load import named_as_model, stored_in_high_precision

        if self.folder is None:
            return fmt
        entries, e = self._entries
        if entries is None:
            log.warning("fp8fx inspect: the checkpoint's tensor names were not read (%s): its ignore list is matched "
                        "with the model's names only", _first_line(e))
            return fmt
        try:
            entries, fmt = named_as_model(self.model, entries, fmt, str(self.folder), None, "inspect")
        except CheckpointError as e:  # (load_checkpoint refuses such a checkpoint so: two tensors renamed onto one)
            log.warning("fp8fx inspect: the checkpoint's tensor names do not map to the model's (%s): its ignore list "
                        "is matched with the model's names only", _first_line(e))
            return fmt
        self.stored_high = functools.partial(stored_in_high_precision, entries)
        return fmt


def predict(model: nn.Module, config: Fp8Config, call_args: tuple, call_kwargs: dict, layer_config=None,
            stored_high=None):
    """Trace ``model`` (unquantized, on meta) with the fp8fx passes and decide each site by the rules of
    ``quantize_`` (its own ``LinearDecider``: ignored, skip_reason, tied weights, routers; experts modules by the
    MoE rules): (site rows, rows of weights no site covers, number of graphs). ``layer_config(fqn)``: a layer's
    config, None to keep it as it is; ``stored_high``: the decider's, from the checkpoint (``_CheckpointNames``)."""
    try:  # a model quantize_ and load_checkpoint refuse: inspect said its sites "would be" rewritten
        check_no_in_place_rescale(model, "quantize_ and load_checkpoint would refuse this model", "inspected")
    except ValueError as e:
        raise UsageError(str(e)) from None
    given = layer_config or (lambda fqn, classes: config)
    why = getattr(given, "why_not", lambda fqn, classes: "in ignored_layers")  # (a layer its config keeps as it is)
    widened: dict[Fp8Config, Fp8Config] = {}  # a config -> it with the other names of the modules it ignores
    every = dict(model.named_modules(remove_duplicate=False))

    def classes(fqn: str) -> tuple:  # a linear's own and its bases' (target_classes); an experts module's "Linear"
        module = every.get(fqn)
        return target_classes(module) if module is not None and is_linear(module) else ("Linear",)

    def why_not(fqn: str) -> str:
        return why(fqn, classes(fqn))

    def layer_config(fqn: str) -> Optional[Fp8Config]:  # (quantize_'s: ignoring_aliases)
        cfg = given(fqn, classes(fqn))
        if cfg is not None and cfg not in widened:
            widened[cfg] = ignoring_aliases(cfg, model, "")
        return None if cfg is None else widened[cfg]

    backend = fp8fx.Fp8Backend(compiler="eager")
    # every site of an unquantized model is "not fp8": not news here; torch logs a traced op's failure at length
    loggers = {name: logging.getLogger(name) for name in ("fp8fx", "torch")}
    levels = {name: lg.level for name, lg in loggers.items()}
    loggers["fp8fx"].setLevel(logging.ERROR)
    loggers["torch"].setLevel(logging.CRITICAL)
    named: list[tuple[torch.Tensor, tuple[str, ...]]] = []
    try:
        decide = LinearDecider(model, stored_high=stored_high)
        named = _name_weights(model, decide)
        with torch.no_grad():
            torch.compile(model, backend=backend)(*call_args, **call_kwargs)
    except Exception as e:  # noqa: BLE001 - any model code can fail on meta tensors; say which and how
        cause = e
        while (cause.__cause__ or cause.__context__) is not None:  # Dynamo wraps the op's own error, twice
            cause = cause.__cause__ or cause.__context__
        raise UsageError(f"tracing {type(model).__name__} on the meta device failed: {type(cause).__name__}: "
                         f"{_first_line(cause)} (an HF folder's model is called with input ids only; for a model "
                         "that needs other inputs, pass a module:factory that returns (model, example_args))") from e
    finally:
        for name, lg in loggers.items():
            lg.setLevel(levels[name])
        for weight, tags in named:
            for tag in tags:
                delattr(weight, tag)

    modules = dict(model.named_modules())
    rows = []
    counted: set[str] = set()  # a layer called more than once is several sites, its bytes saved once
    for site in backend.report.sites:
        module = modules.get(site.fqn)
        cfg = layer_config(site.fqn)
        if cfg is None:
            reason = why_not(site.fqn)
        elif is_linear(module):  # (nn.Linear, and transformers' Conv1D: GPT-2's)
            reason = decide(site.fqn, module, cfg)[0]
        elif site.fqn in decide.routers:  # a router that is no nn.Linear (transformers 5's MoE gates)
            reason = decide.routers[site.fqn]
        else:
            reason = "not an nn.Linear weight (quantize_ quantizes nn.Linear layers)"
        first = reason is None and site.fqn not in counted
        counted.add(site.fqn)
        rows.append({"graph": site.graph, "kind": site.kind, "fqn": site.fqn, "weight_shape": list(site.weight_shape),
                     "would_rewrite": reason is None, "scheme": str(cfg.scheme()) if reason is None else "",
                     "reason": reason or "",
                     "bytes_saved": _saved(site.weight_shape, module.weight.element_size(), cfg) if first else 0})
    seen = {s.fqn for s in backend.report.sites}
    for fqn, module in modules.items():  # experts: the MoE pass rewrites what quantize_ quantizes
        if moe.is_any_experts(module) and fqn not in seen:
            cfg = layer_config(fqn)
            if cfg is None and why_not(fqn) != "in ignored_layers":  # a config naming experts one by one (a
                # compressed-tensors group per layer's names: a checkpoint of per-expert projections), read as
                # load_checkpoint reads it, by the first expert's projections
                cfg = next((c for c in (layer_config(f"{fqn}.0.{p}") for names in NAMINGS for p in names)
                            if c is not None), None)
            # (an ignore list naming the experts one by one, as a checkpoint of per-expert projections may: the load
            # keeps them all bf16 where it names any, and so said here; they read as fp8 before)
            by_expert = cfg is not None and any(
                cfg.is_ignored(n) or layer_config(n) is None and why_not(n) == "in ignored_layers"
                for n in (f"{fqn}.0.{p}" for names in NAMINGS for p in names))
            reason = ("in ignored_layers" if by_expert else why_not(fqn) if cfg is None
                      # (an fp8 checkpoint's: load_checkpoint loads its experts as stored, but refuses the whole
                      # checkpoint where a scale block would span gate and up, as Fp8MoEMethod does)
                      else ("in ignored_layers" if cfg.is_ignored(fqn) else _refused_blocks(module, cfg))
                      if cfg.is_checkpoint_fp8_serialized else moe.skip_reason(module, fqn, cfg))
            w13, w2 = module._parameters[moe.w13_name(module)], module._parameters[moe.W2]
            saved = sum(_saved(list(w.shape), w.element_size(), cfg) for w in (w13, w2)) if reason is None else 0
            rows.append({"graph": None, "kind": "moe", "fqn": fqn, "weight_shape": list(w13.shape),
                         "would_rewrite": reason is None, "scheme": str(cfg.scheme()) if reason is None else "",
                         "reason": reason or "", "bytes_saved": saved})
            seen.add(fqn)
    for fqn, module in modules.items():
        if is_linear(module) and fqn not in seen:
            cfg = layer_config(fqn)  # (quantize_'s reason where it keeps the layer: nn.MultiheadAttention's out_proj)
            reason = decide(fqn, module, cfg)[0] if cfg is not None else None
            rows.append({"graph": None, "kind": "linear", "fqn": fqn, "weight_shape": list(linear_weight(module).shape),
                         "would_rewrite": False, "scheme": "",
                         "reason": reason or _UNTRACED,
                         "bytes_saved": 0})
    covered = tuple(r["fqn"] + "." for r in rows if r["kind"] == "moe")
    others = [{"name": name, "shape": list(shape), "dtype": dtype, "module": cls}
              for name, shape, dtype, cls in backend.report.unhandled_weights(model) if not name.startswith(covered)
              and not is_linear(modules[name.rpartition(".")[0]])]  # the linears are rows above
    return rows, others, backend.report.graphs


def _name_weights(model: nn.Module, decide: LinearDecider) -> list[torch.Tensor]:
    """Tags the weights of ``model``'s linears and routers with their modules' names, as ``quantize_`` does (the
    report names a site by its weight's tag): the linears of a block Dynamo traces as a frame of its own, after a
    graph break, were named by their paths in that block (``a``, not ``layers.0.a``) and found no module. A weight
    several modules share keeps no tag (the site is named by the module that runs it). A linear-like module that
    is no linear (``is_foreign_linear``) is tagged with quantize_'s reason too, for the site the linear pass gives it.
    (A bf16 ``Conv1D``'s ``addmm(b, x, w)`` is no linear site, but the pass gives it a row of its own, which
    ``predict`` then fills with what quantize_ decides for it.) Returns the weights tagged here, each with the tags
    it got, which ``predict`` removes after the trace."""
    named = []
    for fqn, module in model.named_modules():
        weight = module._parameters.get("weight")
        # (a linear-like module's reason, as quantize_ tags it, unless its weight has one already)
        has_reason = fqn in decide.routers or hasattr(weight, "_fp8fx_skip_reason")
        foreign = None if has_reason else foreign_linear_reason(module)
        if (is_linear(module) or fqn in decide.routers or foreign) and isinstance(weight, torch.Tensor) \
                and len(decide.owners.get(id(weight), {})) == 1 and not hasattr(weight, "_fp8fx_fqn"):
            weight._fp8fx_fqn = fqn
            if foreign:
                weight._fp8fx_skip_reason = foreign
            named.append((weight, ("_fp8fx_fqn", "_fp8fx_skip_reason") if foreign else ("_fp8fx_fqn",)))
    return named


def _refused_blocks(experts: nn.Module, cfg) -> Optional[str]:
    """Why ``load_checkpoint`` refuses an fp8 checkpoint of block-scaled ``experts`` (``moe.block_error``), or None."""
    why = moe.block_error(cfg.scheme(), moe.sizes(experts)[2], gated=moe.is_experts(experts))
    return None if why is None else f"load_checkpoint refuses this checkpoint: {why}"


def _saved(shape: Sequence[int], element_size: int, config: Fp8Config) -> int:
    """Bytes saved by an [N, K] weight (or [E, N, K] experts, a scale set each) of ``element_size`` bytes stored as
    fp8 with float32 scales, and for static activations the float32 input scale the layer (or experts weight) holds,
    as the compile report counts them."""
    if len(shape) not in (2, 3):
        return 0
    *experts, n, k = shape
    scales = quant.scale_shape((n, k), config.weight.block)
    static = 4 if config.activation_scheme == "static" else 0
    return math.prod(experts) * (n * k * element_size - n * k - 4 * scales[0] * scales[1]) - static


_UNTRACED = "in no traced graph (not called, or run uncompiled after a graph break)"


def _table(spec: str, cls: str, config: Fp8Config, rows: list[dict], others: list[dict], graphs: int) -> str:
    ignored = list(config.ignored_layers or [])
    schemes = sorted({r["scheme"] for r in rows if r["scheme"]}) or [str(config.scheme())]  # (compressed-tensors: a
    # scheme per group)
    lines = [f"{spec}: {cls} on the meta device, {graphs} graph(s) traced; config {'; '.join(schemes)}, "
             f"ignored_layers={ignored}", ""]
    table = [("site", "kind", "weight", "rewritten", "scheme / reason")]
    for r in rows:
        # (a layer kept in high precision says so as the compile report does, whose wording the README quotes)
        why = r["reason"] if r["reason"] == _UNTRACED else f"{NOT_QUANTIZED}{r['reason']}"
        table.append((r["fqn"] or ROOT, r["kind"], "x".join(map(str, r["weight_shape"])) or "-",
                      "would be" if r["would_rewrite"] else "no", r["scheme"] or why))
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[4] for t in table]
    if others:
        lines += ["", "weights in no site (no fp8fx pass rewrites their computation):"]
        width = max(len(o["name"]) for o in others)
        lines += [f"{o['name'].ljust(width)}  {'x'.join(map(str, o['shape']))}  {o['dtype']}  ({o['module']})"
                  for o in others]
    done = [r for r in rows if r["would_rewrite"]]
    saved = sum(r["bytes_saved"] for r in done)
    what = "linear sites" if all(r["kind"] == "linear" for r in rows) else "sites (linears and experts modules)"
    lines += ["", f"{len(done)} of {len(rows)} {what} would be rewritten; {human_size(saved)} of weights saved"]
    return "\n".join(lines)


def _ints(text: str, flag: str, count: Optional[int] = None) -> list[int]:
    """``text``'s comma-separated sizes; ``count``: exactly so many (--block-size: the flag's form in the error;
    the config's own said ``[block_n, block_k]``, the Python form, to a user of the command line: h152)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected integers separated by commas, e.g. 128,128") from None
    if any(v < 1 for v in values):
        raise UsageError(f"{flag} {text!r}: every size must be a positive integer, e.g. 128,128")
    if count is not None and len(values) != count:
        raise UsageError(f"{flag} {text!r}: {count} sizes separated by commas, got {len(values)}; e.g. "
                         f"{flag} {','.join([str(values[0])] * count)}")
    return values


def _first_line(e: BaseException) -> str:
    return first_line(e) or type(e).__name__


# -- bench, convert ----------------------------------------------------------------------------------
def bench(argv: list[str]) -> int:
    """benchmarks/bench_linear.py's main(argv), from the source checkout fp8fx is installed from."""
    script = Path(fp8fx.__file__).resolve().parent.parent / "benchmarks" / "bench_linear.py"
    if not script.is_file():
        raise UsageError(f"{script} not found: fp8fx bench runs the benchmark of a source checkout; "
                         "git clone the fp8fx repository and pip install -e . from it")
    spec = importlib.util.spec_from_file_location("fp8fx_bench_linear", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv, parser_class=_Parser, prog="fp8fx bench")


SCHEMES = {
    "per-channel": {},
    "per-tensor": {"weight_granularity": fp8fx.PerTensor()},
    "block": {"weight_block_size": [128, 128]},
}


def convert_command(args: argparse.Namespace) -> int:
    from fp8fx.checkpoint import CheckpointError, convert

    config = fp8fx.Fp8Config(ignored_layers=args.ignore or None, **SCHEMES[args.scheme])
    if not os.path.isdir(args.src):
        raise UsageError(f"SRC {args.src} is not a folder; pass the folder holding config.json and *.safetensors")
    key_mapping = None
    if args.rename is not None:
        bad = [r for r in args.rename if "=" not in r]
        if bad:
            raise UsageError(f"--rename {bad[0]!r}: give REGEX=REPLACEMENT, e.g. "
                             "--rename '\\.block_sparse_moe\\.=.mlp.'")
        pairs = [tuple(r.rsplit("=", 1)) for r in args.rename]
        key_mapping = dict(pairs)
        twice = next((p for p in pairs if key_mapping[p[0]] != p[1]), None)
        if twice is not None:  # (the last one was kept, unsaid)
            raise UsageError(f"--rename {twice[0]!r} is given twice, ={twice[1]!r} and ={key_mapping[twice[0]]!r}: "
                             "a regex renames to one replacement; keep one")
    _transformers()  # (convert builds the model from src's config.json to tell the linear weights apart)
    try:
        report = convert(args.src, args.dst, config, format=args.format, key_mapping=key_mapping,
                         quantize_lm_head=args.quantize_lm_head, progress=not args.no_progress)
    except (CheckpointError, ValueError, OSError) as e:
        # (an OS error fp8fx worded - no file name, a message other than the OS's own for its errno -: its message
        # alone, without "[Errno 27] "; the OS's own keeps its number, which alone said "Cannot allocate memory")
        worded = (isinstance(e, OSError) and isinstance(e.strerror, str) and e.strerror and e.filename is None
                  and e.strerror != _os_wording(e.errno))
        said = e.strerror if worded else str(e)
        # (the first line that says something; an empty message - OSError() - names the error's type)
        raise UsageError(next((line for line in said.splitlines() if line.strip()), type(e).__name__)) from None
    except (MemoryError, RuntimeError) as e:
        # out of memory (torch's CPU allocator raises a bare RuntimeError, c10's "DefaultCPUAllocator: can't allocate
        # memory"): a traceback and exit code 1, where every other error is one line and 2; convert removed what it
        # wrote. Any other RuntimeError is a bug, and keeps its traceback
        if not (isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)):
            raise
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UsageError(f"convert ran out of memory ({first}): it holds one output file (the fp8 of one of SRC's "
                         "files) and the tensor it quantizes at a time; free memory, or re-save SRC in smaller "
                         "shards (nothing was written)") from None
    print(report)
    return 0


def _os_wording(number) -> Optional[str]:
    """The OS's message for the error number ``number``; None for no number, or one no C int holds."""
    try:
        return os.strerror(number) if type(number) is int else None
    except (OverflowError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
