"""HF interop: export a checkpoint as a `transformers` model folder, and read such a folder back.

An HF model folder is what `<Family>ForCausalLM.save_pretrained` writes and `from_pretrained` reads:

    config.json                        the family's config fields, architectures = ["<Family>ForCausalLM"]
    generation_config.json             the ids and defaults generate() uses (a released base model's, kept)
    model.safetensors                  every weight by HF name (nanoflow's names are HF's), or, above
    model-00001-of-0000N.safetensors   max_shard_size, shards listed in
    model.safetensors.index.json       {"metadata": {"total_size": …}, "weight_map": {name: file}}
    tokenizer.json, tokenizer_config.json   so that AutoTokenizer loads the run's tokenizer

Here is the folder's format: its weight files, a byte-level tokenizer.json, and reading it back (what
config.json says is each family's: nanoflow.config.families.hf_config writes it, model_checks reads it). nanoflow.interop.export.export_hf writes a checkpoint as such a folder (with the run's
tokenizer, which io does not know); config.json is written last, so a folder that has it is
complete. Import accepts sharded and unsharded folders, safetensors only (no pickle):
`read_hf` reads every weight whole; `read_init_weights` (for `[model] init_from`) reads, on each
rank, only the rows of each weight that rank holds.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save as save_safetensors  # for the {"format": "pt"} header transformers wants

from nanoflow.errors import HFFormatError
from nanoflow.io.checkpoint import LATEST, METADATA
from nanoflow.io.reader import CheckpointReader, open_checkpoint
from nanoflow.io.store import Store, StoreError
from nanoflow.io.tensorfile import TensorFileError, parse, parse_header, read_head, tensor_at

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000   # bytes; transformers' own default for save_pretrained was 5 GB
DTYPES = ("float32", "bfloat16", "float16")

# ---------------------------------------------------------------------------------------------
# Export (the folder's files; nanoflow.interop.export.export_hf writes them for a checkpoint)

def generation_config(bos_token_id: int | None, eos_token_id: int | None,
                      pad_token_id: int | None = None) -> dict:
    """generation_config.json as transformers derives it from config.json: the special-token ids it has."""
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    return {"_from_model_config": True, **{key: value for key, value in ids.items() if value is not None}}


def generation_config_from_base(base: dict, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """generation_config.json for a run trained from a released model whose own is `base`: the base's, kept whole
    (stop ids, pad id, sampling defaults), as transformers saves a model it loaded, and changed only where the run's
    tokenizer differs, as TRL's clone_chat_template does: a run's end-of-text the base does not stop at replaces its
    stop ids, a BOS id other than the base's replaces it. An id the run's tokenizer has not leaves the base's."""
    out = dict(base)
    stops = base.get("eos_token_id")
    if eos_token_id is not None and eos_token_id not in (stops if isinstance(stops, list) else [stops]):
        out["eos_token_id"] = eos_token_id
    if bos_token_id is not None and bos_token_id != base.get("bos_token_id"):
        out["bos_token_id"] = bos_token_id
    return out


def read_generation_config(folder: str) -> dict | None:
    """An HF model folder's generation_config.json (None when it has none); an HFFormatError when it is no JSON object."""
    store = Store(folder)
    try:
        present = store.exists(GENERATION_CONFIG)
    except StoreError as e:
        raise HFFormatError(str(e)) from e
    return _read_json(store, GENERATION_CONFIG) if present else None


def write_weights(store: Store, tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[str]:
    """model.safetensors, or shards of at most max_shard_size bytes each (a bigger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    metadata = {"format": "pt"}   # transformers refuses safetensors files without it
    if len(shards) == 1:
        store.write(WEIGHTS, save_safetensors(shards[0], metadata=metadata))
        return [WEIGHTS]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        store.write(name, save_safetensors(shard, metadata=metadata))
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    store.write(INDEX, (json.dumps(index, indent=2) + "\n").encode())
    return names + [INDEX]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> str:
    """A tokenizer.json equivalent to nanoflow's byte tokenizer: id b is byte b, 256 is <|endoftext|>.

    A BPE model with the 256 byte-level characters as its vocabulary and no merges, behind a
    ByteLevel pre-tokenizer that does not split or add a prefix space: every byte of the text is one token.
    """
    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    return json.dumps({
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# Import

def is_hf_folder(path: str) -> bool:
    """A folder with a config.json and no nanoflow checkpoint (no commit marker, no latest.txt): an HF model
    folder. How `[model] init_from` tells the two kinds of folder apart, everywhere."""
    store = Store(path)
    try:
        return store.exists(CONFIG) and not store.exists(METADATA) and not store.exists(LATEST)
    except Exception:
        return False


def read_hf_config(folder: str) -> tuple[dict, str]:
    """(config.json of an HF model folder as a dict, where it was read from)."""
    store = Store(folder)
    return _read_json(store, CONFIG), store.url(CONFIG)


def _read_bytes(store: Store, relative: str) -> bytes:
    try:
        return store.read(relative)
    except StoreError as e:
        raise HFFormatError(str(e)) from e


def _read_json(store: Store, relative: str) -> dict:
    try:
        value = json.loads(_read_bytes(store, relative))
    except (ValueError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{store.url(relative)} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise HFFormatError(f"{store.url(relative)} is not a JSON object")
    return value


def _load(store: Store, relative: str) -> dict[str, torch.Tensor]:
    try:
        return parse(_read_bytes(store, relative), store.url(relative))
    except HFFormatError:
        raise
    except Exception as e:
        raise HFFormatError(f"{store.url(relative)} is not a readable safetensors file: {e}") from None


def _weight_map(store: Store) -> dict[str, str]:
    """Every weight's file, by HF name: the index's weight_map, or model.safetensors's own names."""
    if store.exists(INDEX):
        weight_map = _read_json(store, INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFFormatError(f"{store.url(INDEX)} has no weight_map")
    elif store.exists(WEIGHTS):
        weight_map = dict.fromkeys(_header(store, WEIGHTS)[1], WEIGHTS)
    else:
        other = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json") if store.exists(f)]
        raise HFFormatError(f"{store.root} has no {WEIGHTS} or {INDEX}"
                            + (f" ({other[0]} is a pickle; nanoflow reads safetensors only: re-save the model "
                               "with save_pretrained(..., safe_serialization=True))" if other else ""))
    # RoPE frequency buffers that old checkpoints carry are dropped: nanoflow recomputes them.
    return {name: file for name, file in weight_map.items() if not name.endswith("rotary_emb.inv_freq")}


def read_hf(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, every weight by HF name) of an HF model folder, sharded or not, local or s3://,
    each file read whole."""
    store = Store(folder)
    config = _read_json(store, CONFIG)
    weight_map, tensors = _weight_map(store), {}
    for file in sorted(set(weight_map.values())):
        shard = _load(store, file)
        listed = {name for name, f in weight_map.items() if f == file}
        missing = sorted(listed - set(shard))
        if missing:
            raise HFFormatError(f"{store.url(file)} lacks {missing[:5]}, which {INDEX} places there")
        tensors.update({name: shard[name] for name in listed})
    return config, tensors


class HFWeights:
    """An HF model folder's weights, read box by box as nanoflow.parallel.shards.load_weights asks (the same
    names / shape / fetch / read as a CheckpointReader): each file's header once, then only the bytes
    of the rows a box covers, so each rank of a sharded model reads its own slice, not the model."""

    def __init__(self, folder: str):
        self.store = Store(folder)
        self.path = self.store.root
        self._files = _weight_map(self.store)
        self._headers: dict[str, tuple[int, dict]] = {}

    def names(self, group: str = "model") -> list[str]:
        return sorted(self._files)

    def shape(self, group: str, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def entries(self) -> dict[str, dict]:
        """Every weight's header entry ({"dtype": "BF16", "shape": [...], ...}) by name: each file's header read
        once, no tensor bytes; a weight the index places in a file that lacks it is an HFFormatError."""
        return {name: self._entry(name)[1] for name in self.names()}

    def fetch(self, boxes) -> None:
        """Nothing to gather ahead: each box is one byte range, its rows."""

    def read(self, group: str, name: str, offset=None, shape=None) -> torch.Tensor:
        start, entry = self._entry(name)
        full = list(entry["shape"])
        shape = full if shape is None else list(shape)
        offset = [0] * len(full) if offset is None else list(offset)
        begin, end = entry["data_offsets"]
        rows, first = (full[0], offset[0]) if full else (1, 0)
        row_bytes = (end - begin) // rows if rows else 0
        count = shape[0] if full else 1
        file = self._files[name]
        try:
            data = self.store.read_range(file, start + begin + first * row_bytes, count * row_bytes)
        except StoreError as e:
            raise HFFormatError(str(e)) from e
        block = tensor_at(data, {**entry, "shape": [count, *full[1:]] if full else []})
        return block[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True)))] if full else block

    def _entry(self, name: str) -> tuple[int, dict]:
        file = self._files.get(name)
        if file is None:
            raise HFFormatError(f"{self.path} has no weight {name!r}")
        if file not in self._headers:
            self._headers[file] = _header(self.store, file)
        start, entries = self._headers[file]
        if name not in entries:
            raise HFFormatError(f"{self.store.url(file)} lacks {name}, which {INDEX} places there")
        return start, entries[name]


def _header(store: Store, file: str) -> tuple[int, dict]:
    """(where the tensor bytes start, the tensor entries) of one safetensors file, from its first bytes only."""
    where = store.url(file)
    try:
        size = store.size(file)
        if size is None:
            raise HFFormatError(f"{where} is missing")
        length, head = read_head(lambda start, n: store.read_range(file, start, n), size, where)
        return length, parse_header(head, size, where)
    except StoreError as e:
        raise HFFormatError(str(e)) from e
    except TensorFileError as e:
        raise HFFormatError(f"{where} is not a readable safetensors file: {e}") from None


def read_init_weights(path: str) -> CheckpointReader | HFWeights:
    """The weights `[model] init_from = path` starts from, as `load_weights` takes them: a reader of an HF
    folder (config.json + safetensors) or of a nanoflow checkpoint (run or step folder), local or s3://.
    Either reads only the boxes asked for. Whether an HF folder's config.json matches the run's [model]
    is checked above io, before this is called (nanoflow.preflight.check_init_from)."""
    return HFWeights(path) if is_hf_folder(path) else open_checkpoint(path)
