"""HF interop: export a checkpoint as a `transformers` Llama folder, and read such a folder back.

An HF Llama folder is what `LlamaForCausalLM.save_pretrained` writes and `from_pretrained` reads:

    config.json                        LlamaConfig fields, architectures = ["LlamaForCausalLM"]
    generation_config.json             the BOS/EOS ids generate() uses, as transformers writes them
    model.safetensors                  every weight by HF name (nanoflow's names are HF's), or, above
    model-00001-of-0000N.safetensors   max_shard_size, shards listed in
    model.safetensors.index.json       {"metadata": {"total_size": …}, "weight_map": {name: file}}
    tokenizer.json, tokenizer_config.json   so that AutoTokenizer loads the run's tokenizer

Export reads a run folder (its latest intact checkpoint) or a step folder, local or s3://, and
writes to a local folder or an s3:// prefix; config.json is written last, so a folder that has it
is complete. Import accepts sharded and unsharded folders, safetensors only (no pickle):
`read_hf` reads every weight whole; `read_init_weights` (for `[model] init_from`) reads, on each
rank, only the rows of each weight that rank holds.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save as save_safetensors  # for the {"format": "pt"} header transformers wants

from nanoflow.config import ConfigError, hf_config_mismatches
from nanoflow.errors import NanoflowError
from nanoflow.io.checkpoint import CheckpointError
from nanoflow.io.reader import CheckpointReader, open_checkpoint, read_checkpoint
from nanoflow.io.store import Store, StoreError
from nanoflow.io.tensorfile import TensorFileError, parse, parse_header, read_head, tensor_at

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000   # bytes; transformers' own default for save_pretrained was 5 GB
DTYPES = ("float32", "bfloat16", "float16")

class HFFormatError(CheckpointError):
    """A folder that is not a readable HF Llama folder."""


# ---------------------------------------------------------------------------------------------
# Export

def hf_config(model: dict, *, dtype: str = "float32", bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict:
    """config.json for the `[model]` section `model` (a dict of nanoflow's resolved config)."""
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    rope_theta = float(model.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in (model.get("rope_scaling") or {"rope_type": "default"}).items() if v is not None}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["num_hidden_layers"],
        "num_attention_heads": model["num_attention_heads"],
        "num_key_value_heads": model.get("num_key_value_heads", model["num_attention_heads"]),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.get("max_position_embeddings", 2048),
        "rms_norm_eps": model.get("rms_norm_eps", 1e-5),
        # transformers < 5 reads rope_theta and rope_scaling (null: plain RoPE); transformers 5 reads
        # rope_parameters. Both say the same.
        "rope_theta": rope_theta,
        "rope_scaling": scaling if scaling["rope_type"] != "default" else None,
        "rope_parameters": {**scaling, "rope_theta": rope_theta},
        "pretraining_tp": 1,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": bool(model.get("tie_word_embeddings", False)),
        "initializer_range": model.get("initializer_range", 0.02),
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "use_cache": True,
    }


def generation_config(bos_token_id: int | None, eos_token_id: int | None,
                      pad_token_id: int | None = None) -> dict:
    """generation_config.json as transformers derives it from config.json: the special-token ids it has."""
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    return {"_from_model_config": True, **{key: value for key, value in ids.items() if value is not None}}


def export_hf(checkpoint_path: str, out_dir: str, *, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
              dtype: str | None = None) -> dict:
    """Write checkpoint `checkpoint_path` (a run folder or step folder, local or s3://) as an HF Llama folder.

    Weights go to model.safetensors, or to model-0000i-of-0000n.safetensors shards with an index
    when they exceed `max_shard_size` bytes. `dtype` ("float32", "bfloat16", "float16") casts the
    weights; default: as saved (float32 master weights). The run's tokenizer is written alongside
    (tokenizer.json + tokenizer_config.json; the built-in byte tokenizer as an equivalent
    byte-level tokenizer.json), and generation_config.json with the tokenizer's BOS/EOS ids. Returns a
    summary: {"step", "path", "files", "dtype", "tokenizer"}.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    checkpoint = read_checkpoint(checkpoint_path, groups=("model",))
    meta, tensors = checkpoint.metadata, dict(checkpoint.groups["model"])
    model = meta["config"]["model"]
    if model.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)   # HF saves a tied head once, as the embedding
    if dtype is not None:
        tensors = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
    saved_dtype = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    out_dtype = dtype or (saved_dtype.pop() if len(saved_dtype) == 1 else "float32")

    store = Store(out_dir)
    files = _write_weights(store, tensors, max_shard_size)
    tokenizer_section = meta["config"].get("tokenizer", {})
    tokenizer_name = tokenizer_section.get("tokenizer_name_or_path", "bytes")
    bos, eos, tokenizer_files = _write_tokenizer(store, tokenizer_section, model.get("max_position_embeddings", 2048))
    store.write(GENERATION_CONFIG, (json.dumps(generation_config(bos, eos), indent=2) + "\n").encode())
    config = hf_config(model, dtype=out_dtype, bos_token_id=bos, eos_token_id=eos)
    config["nanoflow"] = {"checkpoint": checkpoint.path, "step": meta["step"]}
    store.write(CONFIG, (json.dumps(config, indent=2) + "\n").encode())   # last: a folder with config.json is whole
    return {"step": meta["step"], "path": store.root, "files": files + tokenizer_files + [GENERATION_CONFIG, CONFIG],
            "dtype": out_dtype, "tokenizer": tokenizer_name if tokenizer_files else None}


def _write_weights(store: Store, tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[str]:
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
    for name, shard in zip(names, shards):
        store.write(name, save_safetensors(shard, metadata=metadata))
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    store.write(INDEX, (json.dumps(index, indent=2) + "\n").encode())
    return names + [INDEX]


def _write_tokenizer(store: Store, tokenizer: dict | str, max_length: int) -> tuple[int | None, int | None, list[str]]:
    """Write the run's tokenizer (its [tokenizer] section, or just its name) as tokenizer.json +
    tokenizer_config.json naming its real end-of-text and BOS tokens; returns (bos id, eos id, files written).

    A folder's own tokenizer_config.json is carried over (chat template, added tokens, ...) with the run's
    special tokens and the model's length written over it."""
    from nanoflow.data.tokenizer import TOKENIZER_CONFIG, load_tokenizer

    section = {"tokenizer_name_or_path": tokenizer} if isinstance(tokenizer, str) else tokenizer
    name = section.get("tokenizer_name_or_path", "bytes")
    try:
        loaded = load_tokenizer(name, eos_token=section.get("eos_token"), bos_token=section.get("bos_token"))
        if loaded.path is None:
            text, tokenizer_config = byte_tokenizer_json().encode(), {}
        else:
            with open(loaded.path, "rb") as f:
                text = f.read()
            own = os.path.join(name, TOKENIZER_CONFIG)
            tokenizer_config = {}
            if os.path.isdir(name) and os.path.isfile(own):
                with open(own) as f:
                    tokenizer_config = json.load(f)
    except (NanoflowError, OSError, ValueError) as e:
        import warnings
        warnings.warn(f"the run's tokenizer {name} cannot be read ({e}); exporting without a tokenizer", stacklevel=3)
        return None, None, []
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **tokenizer_config,
        "model_max_length": max_length,
        "eos_token": loaded.eos_token,
    }
    if loaded.bos_token is not None:
        tokenizer_config["bos_token"] = loaded.bos_token
    store.write("tokenizer.json", text)
    store.write("tokenizer_config.json", (json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n").encode())
    return loaded.bos_id, loaded.eos_id, ["tokenizer.json", "tokenizer_config.json"]


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
    """A folder with a config.json (and no nanoflow checkpoint metadata): an HF model folder."""
    store = Store(path)
    try:
        return store.exists(CONFIG) and not store.exists("checkpoint_metadata.json") and not store.exists("latest.txt")
    except Exception:
        return False


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
    """An HF model folder's weights, read box by box as nanoflow.snapshot.load_weights asks (the same
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
        return block[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:])))] if full else block

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


def read_init_weights(path: str, model=None) -> CheckpointReader | HFWeights:
    """The weights `[model] init_from = path` starts from, as `nanoflow.snapshot.load_weights` takes them:
    a reader of an HF folder (config.json + safetensors) or of a nanoflow checkpoint (run or step
    folder), local or s3://. Either reads only the boxes asked for.

    For an HF folder, `model` (the `[model]` section) is checked against config.json first: a
    ConfigError names every mismatched key.
    """
    if not is_hf_folder(path):
        return open_checkpoint(path)
    if model is not None:
        store = Store(path)
        problems = hf_config_mismatches(model, _read_json(store, CONFIG), store.url(CONFIG))
        if problems:
            raise ConfigError("model.init_from: the [model] section does not match the HF model:\n  "
                              + "\n  ".join(problems))
    return HFWeights(path)
