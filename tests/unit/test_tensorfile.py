"""nanoflow.io.tensorfile writes and reads ordinary safetensors files, without the copies."""

import pytest
import torch
from safetensors.torch import load, save

from nanoflow.io.tensorfile import (
    TensorFileError,
    header_length,
    new_checksum,
    parse,
    parse_header,
    tensor_at,
    tensor_chunks,
)


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
    header, data = tensor_chunks(tensors)
    return bytearray(b"".join(bytes(chunk) for chunk in [header, *data.values()]))


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
    header, data = tensor_chunks({"t": tensor})
    assert data["t"].nbytes == tensor.numel() * 4
    tensor[0] = 42.0                                  # no copy was made: the chunk sees the change
    assert parse(written({"t": tensor}))["t"][0] == 42.0
    a, b = new_checksum(), new_checksum()
    for chunk in [header, *data.values()]:
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


def test_one_tensor_is_read_from_the_header_and_its_own_byte_range():
    tensors = sample_tensors()
    data = written(tensors)
    start = header_length(data[:8])
    entries = parse_header(data[:start], len(data))
    for name, t in tensors.items():
        begin, end = entries[name]["data_offsets"]
        alone = bytearray(data[start + begin:start + end])   # only this tensor's bytes
        assert torch.equal(tensor_at(alone, entries[name]), t), name


def test_a_header_that_does_not_fit_the_file_is_refused():
    data = written({"t": torch.arange(10, dtype=torch.float32)})
    start = header_length(data)
    with pytest.raises(TensorFileError, match="header runs past"):
        parse_header(data[:start - 1], len(data))
    with pytest.raises(TensorFileError, match="does not fit"):
        parse_header(data, len(data) - 4)                         # the file is shorter than its header says
    lying = bytearray(data.replace(b'"shape":[10]', b'"shape":[11]'))
    with pytest.raises(TensorFileError, match="does not fit"):
        parse_header(lying, len(lying))                           # 11 floats do not fit 40 bytes
