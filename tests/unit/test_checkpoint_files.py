"""Reading and writing safetensors checkpoints: agreement with the safetensors package, and files
that are truncated, corrupt, missing or pickled."""
import json
import os
import pickle

import pytest
import torch

from fp8fx.checkpoint import CheckpointError
from fp8fx.checkpoint.files import read_checkpoint, read_header, read_tensor, write_file

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w8": (torch.randn(5, 7, generator=g) * 50).to(torch.float8_e4m3fn),
        "w5": torch.randn(3, 2, generator=g).to(torch.float8_e5m2),
        "bf": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(6, generator=g).half(),
        "f32": torch.randn(2, 2, 2, generator=g),
        "scalar": torch.tensor(0.125),
        "ids": torch.arange(9, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
    }


def _same(a, b):
    if a.element_size() == 1 and a.dtype != torch.bool:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_reads_what_safetensors_writes(tmp_path):
    file = str(tmp_path / "x.safetensors")
    tensors = _tensors()
    save_file(tensors, file)
    entries = read_header(file)
    assert set(entries) == set(tensors)
    for name, t in tensors.items():
        assert _same(read_tensor(entries[name]), t), name


def test_safetensors_reads_what_fp8fx_writes(tmp_path):
    file = str(tmp_path / "x.safetensors")
    tensors = _tensors()
    write_file(file, tensors, metadata={"format": "pt"})
    with safe_open(file, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            assert _same(f.get_tensor(name), t), name


@pytest.mark.parametrize("keep", [0, 5, 40, -1])
def test_truncated_file_names_file_and_tensor(tmp_path, keep):
    file = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.randn(4, 4), "b.weight": torch.randn(64, 64)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    match = {0: "truncated safetensors file", 5: "truncated safetensors file", 40: "header length .* runs past the end"}
    last = r"b\.weight in .*model\.safetensors: its data ends at byte"
    with pytest.raises(CheckpointError, match=match.get(keep, last)):
        read_checkpoint(str(tmp_path))


def test_corrupt_header(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.randn(4, 4)}, str(file))
    data = bytearray(file.read_bytes())
    data[9] = ord("!")  # inside the JSON
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        read_checkpoint(str(tmp_path))


def test_offsets_that_do_not_match_the_shape(tmp_path):
    header = json.dumps({"a.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    match = r"a\.weight in .*data_offsets \[0, 60\] do not hold a F32 tensor of shape \[4, 4\]"
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(str(tmp_path))


def _write_raw_header(file, header: bytes, data: bytes):
    header += b" " * (-len(header) % 8)
    file.write_bytes(len(header).to_bytes(8, "little") + header + data)


def test_tensors_sharing_bytes_or_a_name(tmp_path):
    """Two tensors over the same bytes would each read the other's; a repeated name kept the last entry. The
    safetensors library refuses both."""
    file = tmp_path / "model.safetensors"
    header = {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    _write_raw_header(file, json.dumps(header).encode(), bytes(16))
    with pytest.raises(CheckpointError, match=r"y in .*: its data \[8, 16\] overlaps that of x \[0, 16\]: corrupt"):
        read_checkpoint(str(tmp_path))
    raw = b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    _write_raw_header(file, raw, bytes(16))
    with pytest.raises(CheckpointError, match=r"corrupt safetensors header: tensor 'x' is listed twice"):
        read_checkpoint(str(tmp_path))
    empty = {"e": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]}, **header}  # a 0-size tensor at the end
    empty["y"]["data_offsets"] = [16, 24]
    _write_raw_header(file, json.dumps(empty).encode(), bytes(24))
    assert sorted(read_checkpoint(str(tmp_path))[1]) == ["e", "x", "y"]


def test_unknown_dtype(tmp_path):
    header = json.dumps({"a.weight": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(1))
    with pytest.raises(CheckpointError, match=r"a\.weight in .*model\.safetensors: dtype F4 is not one fp8fx reads"):
        read_checkpoint(str(tmp_path))
    # shapes safetensors refuses: int() read "12" as (1, 2), 2.9 as 2, True as 1
    shapes = [{"dtype": "U8", "shape": s, "data_offsets": [0, 2]} for s in ("12", [2.9], [True, 2], [2, None])]
    for bad in ({"shape": [2], "data_offsets": [0, 1]}, {"dtype": 4, "shape": [2], "data_offsets": [0, 1]}, "F32",
                *shapes, {"dtype": "U8", "shape": [2], "data_offsets": "02"}):
        header = json.dumps({"a.weight": bad}).encode()
        (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(1))
        with pytest.raises(CheckpointError, match=r"a\.weight in .*corrupt header entry"):
            read_checkpoint(str(tmp_path))


@pytest.mark.parametrize("dtype,name", [(torch.uint32, "U32"), (torch.float8_e8m0fnu, "F8_E8M0")])
def test_valid_file_with_a_dtype_fp8fx_does_not_read(tmp_path, dtype, name):
    """safetensors writes (and reads) these; the error called the file corrupt and said to re-download it."""
    file = str(tmp_path / "model.safetensors")
    save_file({"a.weight": torch.zeros(2, 2), "a.weight_scale": torch.ones(2, 1).to(dtype)}, file)
    with pytest.raises(CheckpointError) as e:
        read_header(file)
    msg = str(e.value)
    assert msg.startswith(f"a.weight_scale in {file}: dtype {name} is not one fp8fx reads (it reads BF16, ")
    assert "corrupt" not in msg and "re-download" not in msg and "re-save" in msg


def _sharded(tmp_path):
    save_file({"a.weight": torch.randn(2, 2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.randn(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {"total_size": 28},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_through_its_index(tmp_path):
    _sharded(tmp_path)
    files, entries = read_checkpoint(str(tmp_path))
    assert [os.path.basename(f) for f in files] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    ]
    assert entries["b.weight"].shape == (3,) and entries["b.weight"].file == files[1]


def test_a_second_index_beside_transformers_one_is_not_read(tmp_path):
    """Mistral's repositories hold its own consolidated.safetensors.index.json beside model.safetensors.index.json:
    the directory loads through the latter, as in transformers and vLLM (it was refused as "several indexes");
    two indexes neither of which is transformers' are refused, naming them."""
    _sharded(tmp_path)
    save_file({"w": torch.ones(2)}, str(tmp_path / "consolidated.safetensors"))
    (tmp_path / "consolidated.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "consolidated.safetensors"}}))
    files, entries = read_checkpoint(str(tmp_path))
    assert len(files) == 2 and "w" not in entries and "b.weight" in entries
    os.rename(tmp_path / "model.safetensors.index.json", tmp_path / "other.safetensors.index.json")
    with pytest.raises(CheckpointError, match=r"several safetensors indexes .*, none of them "
                                              r"model\.safetensors\.index\.json \(which transformers and vLLM read\)"):
        read_checkpoint(str(tmp_path))


def test_index_naming_a_missing_shard(tmp_path):
    _sharded(tmp_path)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"names shard 'model-00002-of-00002.safetensors' \(holding b\.weight and others\), which is missing",
    ):
        read_checkpoint(str(tmp_path))


def test_index_naming_a_shard_that_is_no_file(tmp_path):
    """"" or a subdirectory as a shard: a bare IsADirectoryError that named no index entry."""
    _sharded(tmp_path)
    (tmp_path / "sub").mkdir()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for shard in ("", "sub"):
        index["weight_map"]["b.weight"] = shard
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=rf"names shard '{shard}' \(holding b\.weight and others\), which is "
                                                  r"a directory in .*; every shard must be a file of it"):
            read_checkpoint(str(tmp_path))


def test_index_placing_a_tensor_in_the_wrong_shard(tmp_path):
    _sharded(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["c.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    match = r"places c\.weight in model-00001-of-00002\.safetensors, but that file does not hold it"
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(str(tmp_path))


class _Boom:
    def __reduce__(self):
        return (os.mkdir, ("PWNED_BY_PICKLE",))


def test_pickles_are_never_read(tmp_path, monkeypatch):
    """A directory with only a pytorch_model.bin whose unpickling would create a directory: an error
    says fp8fx reads only safetensors, and nothing was unpickled."""
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": _Boom()}, f)
    match = r"no \*\.safetensors files \(found \['pytorch_model\.bin'\]\); fp8fx reads only safetensors"
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(str(tmp_path))
    assert not (tmp_path / "PWNED_BY_PICKLE").exists()


def test_same_tensor_in_two_files(tmp_path):
    save_file({"a.weight": torch.randn(2)}, str(tmp_path / "one.safetensors"))
    save_file({"a.weight": torch.randn(2)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(CheckpointError, match=r"a\.weight is in both .*one\.safetensors and .*two\.safetensors"):
        read_checkpoint(str(tmp_path))


@pytest.mark.parametrize("shard", ["../model-00001-of-00002.safetensors", "/tmp/x.safetensors", ".."])
def test_index_naming_a_path_outside_the_checkpoint(tmp_path, shard):
    _sharded(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["b.weight"] = shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"a path outside the checkpoint directory"):
        read_checkpoint(str(tmp_path))


def test_index_whose_weight_map_is_not_a_mapping(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a.weight"]}))
    with pytest.raises(CheckpointError, match="'weight_map' must map tensor names to shard file names"):
        read_checkpoint(str(tmp_path))
