"""The loader's safetensors reader (``SafetensorsFile``: plain reads, no memory map, so the
file's pages never count as the process's resident memory) against the safetensors
library itself: every dtype and shape it reads, and a damaged file is a clear error."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tidal.models.loader import CheckpointError, SafetensorsFile


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(3, 64, generator=g).bfloat16(),
        "f16": torch.randn(9, generator=g).half(),
        "i64": torch.arange(-4, 11, dtype=torch.int64).reshape(3, 5),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(200, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def test_reads_what_safetensors_reads(checkpoint):
    path, tensors = checkpoint
    with SafetensorsFile(str(path)) as ours, safe_open(str(path), "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys()) == sorted(tensors)
        for name in tensors:
            got, want = ours.get_tensor(name), theirs.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), name
            assert ours.get_slice(name).get_shape() == list(want.shape)


def test_damaged_files_are_clear_errors(checkpoint, tmp_path):
    path, _ = checkpoint
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-16])  # the last tensor's bytes are short
    with SafetensorsFile(str(cut)) as f:
        last = max(f.keys(), key=lambda n: f._header[n]["data_offsets"][1])
        with pytest.raises(CheckpointError, match="truncated"):
            f.get_tensor(last)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        SafetensorsFile(str(junk))
