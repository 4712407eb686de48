"""Our safetensors reader (`io/safetensors_mmap.py`) against the `safetensors` package's `safe_open`: the same keys,
shapes, dtypes and values on valid files; on damaged headers both refuse, ours with one error naming the file and
the tensor."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mtp.io.safetensors_mmap import CheckpointError, SafetensorsFile


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 2, 2, generator=g).bfloat16(),
        "f64": torch.randn(4, generator=g).double(),
        "i64": torch.arange(6).view(2, 3),
        "i32": torch.arange(5, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.tensor([255, 1, 2], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "f8_e4m3": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(4, generator=g).to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    return out


@pytest.fixture
def valid(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(tensors(), path, metadata={"format": "pt", "note": "x"})
    return path


def test_valid_file_reads_as_safe_open_reads_it(valid):
    ours = SafetensorsFile(valid)
    with safe_open(valid, framework="pt") as ref:
        assert sorted(ours.keys()) == sorted(ref.keys())
        assert ours.metadata == ref.metadata()
        for k in ref.keys():
            t = ref.get_tensor(k)
            assert ours.shape(k) == tuple(t.shape) and ours.dtype(k) == t.dtype, k
            assert torch.equal(ours.tensor(k).reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k  # bit-exact
            assert ours.nbytes(k) == t.numel() * t.element_size()


def split(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write(path, header, data: bytes) -> None:
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def first(header) -> str:
    """The tensor whose data comes first in the file."""
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def entry(fn):
    """An edit replacing the first tensor's header entry by fn(entry)."""
    def edit(h, data):
        h[first(h)] = fn(h[first(h)])
        return h, data
    return edit


def edit_first(key, value):
    return entry(lambda e: {**e, key: value})


def shift_first(delta: int):
    def edit(h, data):
        s, e = h[first(h)]["data_offsets"]
        h[first(h)]["data_offsets"] = [s + delta, e + delta]
        return h, data
    return edit


def overlap(h, data):
    # the second tensor in the file starts 4 bytes early: its first bytes are also the first tensor's last
    second = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])[1]
    s, e = h[second]["data_offsets"]
    h[second]["data_offsets"] = [s - 4, e - 4]
    return h, data


def drop_tensor_keep_bytes(h, data):
    del h["u8"]  # its bytes stay in the file: a gap
    return h, data


CASES = {
    # what is damaged: (edit of (header, data), what our message must say)
    "negative offsets": (shift_first(-8), "data_offsets \\[-8"),
    "offsets reversed": (entry(lambda e: {**e, "data_offsets": e["data_offsets"][::-1]}), "0 <= start <= end"),
    "end past the data": (lambda h, d: (h, d[:-3]), "truncated: tensor"),
    "header is a list": (lambda h, d: ([1, 2, 3], d), "a JSON list, not an object"),
    "no data_offsets": (entry(lambda e: {"dtype": e["dtype"], "shape": e["shape"]}), "lacks 'data_offsets'"),
    "entry not an object": (entry(lambda e: [1, 2]), "is a JSON list, not an object"),
    "string shape": (edit_first("shape", ["3", 5]), "has shape \\['3', 5\\]"),
    "negative shape": (edit_first("shape", [-3, -5]), "has shape \\[-3, -5\\]"),
    "float offsets": (edit_first("data_offsets", [0.0, 1.5]), "data_offsets"),
    "unknown dtype": (edit_first("dtype", "Q7"), "unsupported dtype 'Q7'"),
    "shape does not match the bytes": (edit_first("shape", [1]), "bytes but shape \\[1\\]"),
    "overlap": (overlap, "overlap"),
    "gap": (drop_tensor_keep_bytes, "belong to no tensor"),
    "trailing bytes": (lambda h, d: (h, d + b"\0" * 16), "at the end belong to no tensor"),
    "metadata not strings": (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d), "__metadata__"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_headers_are_refused_by_both_readers_and_named_by_ours(valid, tmp_path, case):
    edit, message = CASES[case]
    header, data = split(valid)
    header, data = edit(header, data)
    bad = tmp_path / "bad.safetensors"
    write(bad, header, data)
    with pytest.raises(CheckpointError, match=message) as e:
        SafetensorsFile(bad)
    assert str(e.value).startswith(str(bad)) and "\n" not in str(e.value)
    with pytest.raises((SafetensorError, OSError, ValueError)):  # the reference refuses the file too
        with safe_open(bad, framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)


def test_extra_entry_keys_are_ignored_as_safe_open_ignores_them(valid, tmp_path):
    header, data = split(valid)
    header[first(header)]["comment"] = "written by some other tool"
    write(tmp_path / "extra.safetensors", header, data)
    with safe_open(tmp_path / "extra.safetensors", framework="pt") as ref:
        k = first(header)
        assert torch.equal(SafetensorsFile(tmp_path / "extra.safetensors").tensor(k), ref.get_tensor(k))


def test_duplicate_tensor_names_and_oversized_headers_are_refused(valid, tmp_path):
    header, data = split(valid)
    text = json.dumps(header)
    dup = text[:-1] + ', "f32": ' + json.dumps(header["f32"]) + "}"
    write(tmp_path / "dup.safetensors", dup.encode(), data)
    with pytest.raises(CheckpointError, match="key 'f32' appears twice"):
        SafetensorsFile(tmp_path / "dup.safetensors")
    (tmp_path / "long.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CheckpointError, match="header of 1099511627776 bytes in a file of 10"):
        SafetensorsFile(tmp_path / "long.safetensors")


def test_negative_offsets_never_read_header_bytes_as_weights(tmp_path):
    """The issue's case: offsets shifted before the data used to load silently, the header's bytes read as weights."""
    save_file({"w": torch.ones(16)}, tmp_path / "m.safetensors")
    header, data = split(tmp_path / "m.safetensors")
    header["w"]["data_offsets"] = [-32, 32]
    write(tmp_path / "m.safetensors", header, data)
    with pytest.raises(CheckpointError, match="m.safetensors: corrupt safetensors header: tensor 'w' has data_offsets"):
        SafetensorsFile(tmp_path / "m.safetensors")
