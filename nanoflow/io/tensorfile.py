"""safetensors files, streamed: written straight from tensor memory, read back as views of one buffer.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
mapping each name to {dtype, shape, data_offsets} (plus optional "__metadata__"), padded with
spaces to a multiple of 8, then the raw little-endian tensor bytes. `safetensors.torch.save`
builds the whole file as one bytes object and `load` copies every tensor out of it; for
checkpoints of many GB those copies cost more than the disk. Here a file is a header plus
memoryviews of the tensors themselves; a reader takes the header, then just the byte range of the
tensors it wants, into one buffer whose slices become the tensors. The files are ordinary
safetensors files (tested with the safetensors library).
"""

from __future__ import annotations

import json
import math
import struct

import numpy
import torch
import xxhash

from nanoflow.errors import TensorFileError

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


def new_checksum():
    """The checksum of checkpoint files: XXH3-128, fast enough not to slow a save (it catches damage, not attacks)."""
    return xxhash.xxh3_128()


def tensor_chunks(tensors: dict[str, torch.Tensor]) -> tuple[memoryview, dict[str, memoryview]]:
    """A safetensors file as byte chunks: the header, then each tensor's own memory (no copy) by name,
    in file order. Written one after the other, they are the file."""
    header, chunks, offset = {}, {}, 0
    # Widest elements first, so every tensor starts aligned to its element size (as safetensors does).
    for name, tensor in sorted(tensors.items(), key=lambda item: -item[1].element_size()):
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else memoryview(b"")
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        chunks[name] = memoryview(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return memoryview(struct.pack("<Q", len(text)) + text), chunks


def header_length(prefix: bytes | bytearray, where: str = "") -> int:
    """How many bytes the header takes, with its 8-byte length field, from (at least) a file's first 8 bytes."""
    if len(prefix) < 8:
        raise TensorFileError(f"{where}: {len(prefix)} bytes is too short for a safetensors file")
    (length,) = struct.unpack_from("<Q", prefix)
    return 8 + length


HEAD_GUESS = 64 << 10   # one read of a file's first bytes holds the whole header of all but huge files


def read_head(read_range, size: int, where: str = ""):
    """A file's first bytes, through the end of its header: `read_range(start, length)` (a writable uint8 array)
    is asked once for up to HEAD_GUESS bytes, and once more only for a longer header. Returns (header_length, head);
    a file no bigger than HEAD_GUESS comes whole."""
    head = read_range(0, min(size, HEAD_GUESS))
    length = header_length(head, where)
    if length > len(head):
        rest = read_range(len(head), min(length, size) - len(head))
        head = numpy.concatenate([head, rest])  # (arrays: + would add them element-wise)
    return length, head


def parse_header(head: bytes | bytearray, size: int, where: str = "") -> dict[str, dict]:
    """The tensor entries of a file of `size` bytes, from (at least) its first header_length(head) bytes.
    Every tensor's data_offsets are relative to the end of the header and checked to lie inside the file."""
    start = header_length(head, where)
    if start > min(len(head), size):
        raise TensorFileError(f"{where}: the safetensors header runs past the end of the file")
    try:
        header = json.loads(bytes(head[8:start]))
        entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
        for name, entry in entries.items():
            begin, end = entry["data_offsets"]
            itemsize = torch.empty((), dtype=TORCH_DTYPES[entry["dtype"]]).element_size()
            if not 0 <= begin <= end or start + end > size or (end - begin) != itemsize * math.prod(entry["shape"]):
                raise TensorFileError(f"{where}: tensor {name} does not fit its place in the file")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TensorFileError(f"{where}: the safetensors header is not readable: {e}") from None
    return entries


def tensor_at(buffer, entry: dict, at: int = 0) -> torch.Tensor:
    """The tensor described by a header `entry` whose bytes start at `at` in `buffer` (any writable buffer:
    a bytearray, a uint8 numpy array), as a view of it."""
    dtype = TORCH_DTYPES[entry["dtype"]]
    count = math.prod(entry["shape"])
    flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=at) if count else torch.empty(0, dtype=dtype)
    return flat.view(entry["shape"])


def parse(buffer: bytearray, where: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a whole safetensors file held in `buffer`, as views of it (keep or clone as needed)."""
    entries = parse_header(buffer, len(buffer), where)
    start = header_length(buffer)
    return {name: tensor_at(buffer, entry, start + entry["data_offsets"][0]) for name, entry in entries.items()}
