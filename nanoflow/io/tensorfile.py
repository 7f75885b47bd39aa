"""safetensors files, streamed: written straight from tensor memory, read back as views of one buffer.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
mapping each name to {dtype, shape, data_offsets} (plus optional "__metadata__"), padded with
spaces to a multiple of 8, then the raw little-endian tensor bytes. `safetensors.torch.save`
builds the whole file as one bytes object and `load` copies every tensor out of it; for
checkpoints of many GB those copies cost more than the disk. Here a file is a header plus
memoryviews of the tensors themselves, hashed as they are written, and a read makes one buffer
whose slices become the tensors. The files are ordinary safetensors files (tested with the
safetensors library).
"""

from __future__ import annotations

import json
import struct

import torch
import xxhash

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


class TensorFileError(ValueError):
    """Bytes that are not a well-formed safetensors file."""


def new_checksum():
    """The checksum of checkpoint files: XXH3-128, fast enough not to slow a save (it catches damage, not attacks)."""
    return xxhash.xxh3_128()


def tensor_chunks(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """A safetensors file as a list of byte chunks: the header, then each tensor's own memory (no copy)."""
    header, chunks, offset = {}, [], 0
    # Widest elements first, so every tensor starts aligned to its element size (as safetensors does).
    for name, tensor in sorted(tensors.items(), key=lambda item: -item[1].element_size()):
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        chunks.append(memoryview(raw))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [memoryview(struct.pack("<Q", len(text)) + text), *chunks]


def parse(buffer: bytearray, where: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buffer`, as views of it (keep or clone as needed)."""
    if len(buffer) < 8:
        raise TensorFileError(f"{where}: {len(buffer)} bytes is too short for a safetensors file")
    (length,) = struct.unpack_from("<Q", buffer)
    start = 8 + length
    try:
        header = json.loads(bytes(buffer[8:start]))
    except ValueError as e:
        raise TensorFileError(f"{where}: the safetensors header is not JSON: {e}") from None
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = TORCH_DTYPES[entry["dtype"]]
        if start + end > len(buffer):
            raise TensorFileError(f"{where}: tensor {name} runs past the end of the file")
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=start + begin) if count \
            else torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(entry["shape"])
    return tensors
