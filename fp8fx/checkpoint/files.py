"""The files of a checkpoint directory: ``config.json``, the safetensors index, the shards' headers,
reading one tensor at a time, writing a file.

fp8fx reads and writes safetensors itself (an 8-byte header length, a JSON header, raw little-endian
bytes; no dependency beyond torch) rather than through the ``safetensors`` package, because: every
header of every shard is read and checked (truncation, offsets, dtypes) before any parameter of the
model changes, with errors that name the file and the tensor; and a tensor is read straight into a
``torch.empty`` allocation, without mmap, so loading holds exactly the tensors it is working on, and
torch's allocator counts their bytes (the streaming memory test relies on it). Nothing is unpickled.
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import json
import math
import os
from typing import Any, Iterable, Mapping, Optional

import torch

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # (transformers' GenerationConfig: written by save_checkpoint too)
MODELOPT_CONFIG = "hf_quant_config.json"  # ModelOpt's quantization config of older exports (read_config)
INDEX_SUFFIX = ".safetensors.index.json"

DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# A static checkpoint (``activation_scheme: static``) without one quantized layer's (or experts module's) input scale:
# what to do, after where its scheme comes from (``CheckpointFormat.declared_by``)
STATIC_SCALE_MISSING = (
    "{} says static activations, which take one input scale a quantized layer: re-export the checkpoint with every "
    "layer's (fp8fx.calibrate gives them), or remove its input_scale tensors and load it with activation_scheme "
    "'dynamic' (the scales computed at run time)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or written; the message names the file or tensor, the
    offending value and the fix. Raised before the model changes."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in ``file``)."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int
    source: Optional[str] = None  # the name in the file, where a rename changed it (fp8fx.checkpoint.renames)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        stored = f" as {self.source}" if self.source else ""
        return f"{self.name} ({_dtype_name(self.dtype)} {list(self.shape)} in {os.path.basename(self.file)}{stored})"


def missing_name(name: str, siblings: Iterable[Entry]) -> str:
    """``name``, a tensor the model needs that the checkpoint lacks, for a "missing" error; where the checkpoint's
    names of the same module were renamed (``Entry.source``: fp8fx.checkpoint.renames, ``key_mapping``), with the
    name the file would hold it under, which is the one to look for (a hub Mixtral's ``block_sparse_moe.experts.3.w3``
    for the model's ``mlp.experts.3.w3``: the error named a tensor found nowhere, h149). A rename maps a head of the
    name to another and keeps the tail; a sibling whose tail this name shares gives the head."""
    parts = name.split(".")
    for entry in siblings:
        if not entry.source:
            continue
        new, old = entry.name.split("."), entry.source.split(".")
        tail = 0
        while tail < min(len(new), len(old)) and new[-1 - tail] == old[-1 - tail]:
            tail += 1
        head = new[:len(new) - tail]
        if head != old[:len(old) - tail] and parts[:len(head)] == head:
            return f"{name} (stored as {'.'.join(old[:len(old) - tail] + parts[len(head):])})"
    return name


def check_fp8_codes(w: Entry, what: str) -> None:
    """Refuses fp8 codes of another format than fp8fx's float8_e4m3fn (a checkpoint of e5m2 codes): read as any
    weight, they were refused as "declared float8_e4m3fn", with a fix (the ignore list) that does not load them."""
    if w.dtype == torch.float8_e5m2:
        raise CheckpointError(
            f"{w}: float8_e5m2 codes for {what}, and fp8fx reads float8_e4m3fn ones (the fp8 of vLLM's, "
            "DeepSeek's and compressed-tensors' checkpoints): load the model's bf16 checkpoint (with an online "
            "Fp8Config, or quantize_ it then fp8fx.save_checkpoint), or re-export this one with e4m3 codes")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def read_header(file: str) -> dict[str, Entry]:
    """All tensors of one safetensors file, checked against the file's size."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes); re-download or re-save it")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise CheckpointError(
                f"{file}: header length {n} runs past the end of the file ({size} bytes): the file is truncated "
                "or not safetensors; re-download or re-save it"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e}); re-download or re-save it") from None
    except KeyError as e:  # a name twice: json would keep the last silently
        raise CheckpointError(f"{file}: corrupt safetensors header: tensor {e.args[0]!r} is listed twice; "
                              "re-download or re-save it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start, entries = 8 + n, {}
    for name, info in header.items():
        stored = info.get("dtype") if isinstance(info, dict) else None
        if isinstance(stored, str) and stored not in DTYPES:
            # A valid entry (safetensors writes U16/U32/U64, F8_E8M0, F4, ...) that fp8fx has no reading for: not a
            # corrupt file. Refused here, for the whole checkpoint, even when the model would never use this tensor
            # (an unused tensor of a dtype fp8fx reads only draws an "unexpected" warning): every consumer of an
            # Entry (load.py's and convert's plans, the experts' checks) decides on entry.dtype, a torch dtype of
            # DTYPES, before anything is read or changed; deferring the refusal to when the tensor is needed would
            # need each of them to carry and refuse an unreadable entry, and a torch dtype for it (torch.uint32 ...)
            # would let them cast it as if it were a value fp8fx understands (a U32 or E8M0 scale read as a float).
            raise CheckpointError(
                f"{name} in {file}: dtype {stored} is not one fp8fx reads (it reads {', '.join(sorted(DTYPES))}); "
                "fp8fx checks every tensor's header before loading, so this refuses the checkpoint even where the "
                "model does not use the tensor: re-save the checkpoint with it in one of those dtypes, or without it"
            )
        try:
            dtype = DTYPES[info["dtype"]]
            shape, offsets = info["shape"], info["data_offsets"]
            # lists of ints, as safetensors writes and reads them (int() took "12" as (1, 2), 2.9 as 2, True as 1)
            if not all(isinstance(v, list) and all(type(d) is int for d in v) for v in (shape, offsets)):
                raise TypeError
            shape = tuple(shape)
            begin, end = offsets
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{name} in {file}: corrupt header entry {info!r}; expected dtype one of {sorted(DTYPES)}, "
                "shape and data_offsets"
            ) from None
        need = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != need:
            raise CheckpointError(
                f"{name} in {file}: data_offsets [{begin}, {end}] do not hold a {info['dtype']} tensor of shape "
                f"{list(shape)} ({need} bytes): corrupt file; re-download or re-save it"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{name} in {file}: its data ends at byte {data_start + end} but the file has {size} bytes: the "
                "file is truncated; re-download or re-save it"
            )
        entries[name] = Entry(name, file, dtype, shape, data_start + begin, data_start + end)
    # no two tensors share bytes (safetensors writes them back to back): one would be read as the other
    ordered = sorted(entries.values(), key=lambda e: (e.start, e.end))
    for before, after in zip(ordered, ordered[1:]):
        if after.start < before.end:
            raise CheckpointError(
                f"{after.name} in {file}: its data [{after.start - data_start}, {after.end - data_start}] overlaps "
                f"that of {before.name} [{before.start - data_start}, {before.end - data_start}]: corrupt file; "
                "re-download or re-save it"
            )
    return entries


def _unique_keys(pairs: list) -> dict:
    """A JSON object's pairs as a dict; KeyError(name) for a name given twice."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise KeyError(key)
        out[key] = value
    return out


def read_tensor(entry: Entry) -> torch.Tensor:
    """The tensor's bytes read into a fresh CPU tensor."""
    out = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")  # (not a torch.device("meta") block's)
    if entry.nbytes:
        buf = (ctypes.c_char * entry.nbytes).from_address(out.data_ptr())
        with open(entry.file, "rb") as f:
            f.seek(entry.start)
            got = f.readinto(buf)
        if got != entry.nbytes:
            raise CheckpointError(
                f"{entry}: read {got} of {entry.nbytes} bytes: the file was truncated while loading"
            )
    return out


def write_file(file: str, tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``tensors`` (any device or layout) as one safetensors file, header padded to 8 bytes.
    Each tensor is copied to a contiguous CPU tensor only while it is written."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in names:  # e.g. a complex rotary table registered as a persistent buffer
            raise CheckpointError(
                f"{name}: dtype {t.dtype} is not one fp8fx writes to safetensors ({sorted(DTYPES)}); register it "
                "as a non-persistent buffer (it is rebuilt with the model) or store it in a supported dtype"
            )
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                t = t.detach().cpu().contiguous()
                f.write((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))


def read_config(path: str) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory ({} when there is none). Where it has no ``quantization_config``,
    ModelOpt's ``hf_quant_config.json`` beside it gives one (``quant_method`` "modelopt" and the file's
    ``quantization``), as vLLM reads such a checkpoint; before it, as vLLM too, ``compression_config`` (older
    compressed-tensors exports) and a VLM's ``text_config.quantization_config`` (such checkpoints were read as bf16
    and refused as holding fp8 codes with no quantization_config: h156)."""
    config = read_json(os.path.join(path, CONFIG))
    key, found = quantization_config_of(config)
    if key is not None:
        config = {**config, "quantization_config": found}
    modelopt = os.path.join(path, MODELOPT_CONFIG)
    if config.get("quantization_config") is None and os.path.exists(modelopt):
        config = {**config, "quantization_config": {"quant_method": "modelopt", **read_json(modelopt)}}
    return config


def quantization_config_of(config: Mapping[str, Any]) -> tuple[Optional[str], Any]:
    """(where, value) of config.json's quantization config, as vLLM looks for it: ``quantization_config``, else
    ``compression_config``, else ``text_config.quantization_config``; (None, None) where it has none."""
    text = config.get("text_config")
    for key, value in (("quantization_config", config.get("quantization_config")),
                       ("compression_config", config.get("compression_config")),
                       ("text_config.quantization_config",
                        text.get("quantization_config") if isinstance(text, Mapping) else None)):
        if value is not None:
            return key, value
    return None, None


def read_json(file: str) -> dict[str, Any]:
    """A JSON object file ({} when there is none)."""
    if not os.path.exists(file):
        return {}
    try:
        with open(file) as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return config


def index_file(path: str) -> Optional[str]:
    """The checkpoint's safetensors index, or None. transformers' own name for it is taken where there are several:
    Mistral's repositories hold ``consolidated.safetensors.index.json`` (its own format) beside it, and transformers
    and vLLM load the directory through ``model.safetensors.index.json``."""
    found = sorted(glob.glob(os.path.join(glob.escape(path), "*" + INDEX_SUFFIX)))
    standard = os.path.join(path, "model" + INDEX_SUFFIX)
    if len(found) > 1 and standard in found:
        return standard
    if len(found) > 1:
        raise CheckpointError(f"{path}: several safetensors indexes {found}, none of them model{INDEX_SUFFIX} "
                              "(which transformers and vLLM read); keep one")
    return found[0] if found else None


def read_checkpoint(path: str) -> tuple[list[str], dict[str, Entry]]:
    """The shard files of a checkpoint directory (in order) and every tensor in them, all headers
    checked. Sharded checkpoints are read through their ``*.safetensors.index.json``."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory; pass the checkpoint directory (config.json + *.safetensors)")
    index = index_file(path)
    if index is not None:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e!r}); it needs a 'weight_map' object") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        files = list(dict.fromkeys(weight_map.values()))
        outside = [f for f in files if os.path.basename(f) != f or f in (".", "..")]
        if outside:  # checked before any file is opened
            raise CheckpointError(
                f"{index} names shard {outside[0]!r}, a path outside the checkpoint directory; shards must be file "
                f"names in {path}"
            )
        for shard in files:
            if not os.path.isfile(os.path.join(path, shard)):  # ("" or a directory: a bare IsADirectoryError)
                first = next(n for n, f in weight_map.items() if f == shard)
                what = "a directory" if os.path.isdir(os.path.join(path, shard)) else "missing"
                raise CheckpointError(
                    f"{index} names shard {shard!r} (holding {first} and others), which is {what} in {path}; every "
                    "shard must be a file of it: download every shard, or fix the index"
                )
    else:
        files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not files:
            others = sorted(os.listdir(path))
            raise CheckpointError(
                f"{path}: no *.safetensors files (found {others[:5]}); fp8fx reads only safetensors and never "
                "unpickles .bin/.pt files: convert them with a tool you trust first"
            )
    entries: dict[str, Entry] = {}
    for shard in files:
        for name, entry in read_header(os.path.join(path, shard)).items():
            if name in entries:
                raise CheckpointError(f"{name} is in both {entries[name].file} and {entry.file}; keep one")
            entries[name] = entry
    if index is not None:
        for name, shard in weight_map.items():
            if name not in entries or os.path.basename(entries[name].file) != shard:
                raise CheckpointError(
                    f"{index} places {name} in {shard}, but that file does not hold it: corrupt index"
                )
    return [os.path.join(path, f) for f in files], entries
