"""nanoflow.io.tensorfile writes and reads ordinary safetensors files, without the copies."""

import pytest
import torch
from safetensors.torch import load, save

from nanoflow.io.tensorfile import TensorFileError, new_checksum, parse, tensor_chunks


def sample_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(5, 3, generator=g),
        "half": torch.randn(7, generator=g).to(torch.bfloat16),   # odd byte count before wider tensors
        "step": torch.tensor(12.0),                                  # 0-dim
        "empty": torch.zeros(0, 4),
        "bytes": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "flag": torch.tensor([True, False]),
    }


def written(tensors) -> bytearray:
    return bytearray(b"".join(bytes(chunk) for chunk in tensor_chunks(tensors)))


def test_our_files_are_read_by_the_safetensors_library():
    tensors = sample_tensors()
    loaded = load(bytes(written(tensors)))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


def test_we_read_files_written_by_the_safetensors_library():
    tensors = sample_tensors()
    parsed = parse(bytearray(save(tensors)))
    for name, t in tensors.items():
        assert parsed[name].dtype == t.dtype and torch.equal(parsed[name], t), name


def test_chunks_are_the_tensors_own_memory_and_the_checksum_is_of_the_bytes():
    tensor = torch.arange(1000, dtype=torch.float32)
    chunks = tensor_chunks({"t": tensor})
    assert chunks[1].nbytes == tensor.numel() * 4
    tensor[0] = 42.0                                  # no copy was made: the chunk sees the change
    assert parse(written({"t": tensor}))["t"][0] == 42.0
    a, b = new_checksum(), new_checksum()
    for chunk in chunks:
        a.update(chunk)
    b.update(bytes(written({"t": tensor})))
    assert a.hexdigest() == b.hexdigest()


def test_truncated_or_garbage_bytes_are_refused():
    data = written(sample_tensors())
    with pytest.raises(TensorFileError):
        parse(data[:4])
    with pytest.raises(TensorFileError):
        parse(data[: len(data) - 3])
    with pytest.raises(TensorFileError):
        parse(bytearray(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"))
