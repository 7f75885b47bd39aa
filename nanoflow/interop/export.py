"""Export a checkpoint as an HF `transformers` folder of its model family (see nanoflow/io/hf.py for the folder).

Reads a run folder (its latest intact checkpoint) or a step folder, local or s3://, and writes a
local folder or an s3:// prefix: the weights and config.json as io writes them, plus the run's own
tokenizer (data/), which is why this lives above both.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from nanoflow.config import hf_config, recorded_model, trained_rope
from nanoflow.data.chat import ChatError, ChatTemplate
from nanoflow.data.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, load_tokenizer
from nanoflow.errors import CheckpointError, NanoflowError
from nanoflow.io.checkpoint import read_metadata
from nanoflow.io.hf import (
    CONFIG,
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
    GENERATION_CONFIG,
    byte_tokenizer_json,
    generation_config,
    generation_config_from_base,
    is_hf_folder,
    read_generation_config,
    write_weights,
)
from nanoflow.io.reader import read_checkpoint
from nanoflow.io.store import Store

log = logging.getLogger(__name__)


def export_hf(checkpoint_path: str, out_dir: str, *, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
              dtype: str | None = None, ema: bool = False) -> dict:
    """Write checkpoint `checkpoint_path` (a run folder or step folder, local or s3://) as an HF folder of its
    model_type (config.json as transformers writes that family: nanoflow.config.hf_config), with the RoPE of the
    stage that trained the checkpoint's step.

    Weights go to model.safetensors, or to model-0000i-of-0000n.safetensors shards with an index
    when they exceed `max_shard_size` bytes. `dtype` ("float32", "bfloat16", "float16") casts the
    weights; default: as saved (float32 master weights). The run's tokenizer is written alongside
    (tokenizer.json + tokenizer_config.json; the built-in byte tokenizer as an equivalent
    byte-level tokenizer.json; its chat template too, as the source had it: chat_template.jinja or inside
    tokenizer_config.json), and generation_config.json: the released model's the run began from (`init_from`,
    also through the checkpoints a branch resumed from), updated where the run's tokenizer differs, else the
    tokenizer's BOS/EOS ids; either way stopping at the chat template's end-of-turn token too. With `ema`, the
    weights written are the checkpoint's weight EMA ([optimizer] ema_decay) instead of its weights; config.json's
    "nanoflow" entry says so. Returns a summary: {"step", "path", "files", "dtype", "tokenizer"}.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    group = "ema" if ema else "model"
    try:
        checkpoint = read_checkpoint(checkpoint_path, groups=(group,))
    except CheckpointError as e:
        if ema and "no 'ema' tensors" in str(e):
            raise CheckpointError(f"{e}: it was saved by a run without [optimizer] ema_decay; export its weights "
                                  "without --ema") from None
        raise
    meta, tensors = checkpoint.metadata, dict(checkpoint.groups[group])
    model = recorded_model(meta["config"]["model"])   # complete, also a record older than the model families
    rope = trained_rope(meta)   # the RoPE of the stage that trained the step: a long-context stage's after it
    model = {**model, "rope_theta": rope.theta, "rope_scaling": rope.scaling_table()}
    if model.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)   # HF saves a tied head once, as the embedding
    if dtype is not None:
        tensors = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
    saved_dtype = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    out_dtype = dtype or (saved_dtype.pop() if len(saved_dtype) == 1 else "float32")

    store = Store(out_dir)
    files = write_weights(store, tensors, max_shard_size)
    tokenizer_section = meta["config"].get("tokenizer", {})
    tokenizer_name = tokenizer_section.get("tokenizer_name_or_path", "bytes")
    bos, eos, tokenizer_files = _write_tokenizer(store, tokenizer_section, model.get("max_position_embeddings", 2048))
    stops = _stop_ids(eos, tokenizer_section)
    base = _base_generation_config(meta)
    generation = generation_config(bos, stops) if base is None else \
        _with_stops(generation_config_from_base(base, bos, eos), stops)
    store.write(GENERATION_CONFIG, (json.dumps(generation, indent=2) + "\n").encode())
    config = hf_config(model, dtype=out_dtype, bos_token_id=bos, eos_token_id=eos)
    config["nanoflow"] = {"checkpoint": checkpoint.path, "step": meta["step"]} | ({"weights": "ema"} if ema else {})
    store.write(CONFIG, (json.dumps(config, indent=2) + "\n").encode())   # last: a folder with config.json is whole
    return {"step": meta["step"], "path": store.root, "files": files + tokenizer_files + [GENERATION_CONFIG, CONFIG],
            "dtype": out_dtype, "tokenizer": tokenizer_name if tokenizer_files else None}


def _base_generation_config(meta: dict, hops: int = 8) -> dict | None:
    """The generation_config.json of the released model a checkpoint's weights began from: followed back through the
    checkpoint it resumed from (lineage's began_from: a branch) or the one it was initialised from, to an HF folder
    named by `[model] init_from`. None when there is none (a run from scratch, a base without one, one unreadable:
    said)."""
    for _ in range(hops):
        began = (meta.get("lineage") or {}).get("began_from")
        source = began or ((meta.get("config") or {}).get("model") or {}).get("init_from")
        if source is None:
            return None
        try:
            if not began and is_hf_folder(source):
                return read_generation_config(source)
            meta = read_metadata(source)
        except (NanoflowError, OSError, ValueError) as e:
            log.warning(f"the model this run began from ({source}) cannot be read ({e}); generation_config.json is "
                        "derived from the run's tokenizer alone")
            return None
    return None


def _write_tokenizer(store: Store, tokenizer: dict | str, max_length: int) -> tuple[int | None, int | None, list[str]]:
    """Write the run's tokenizer (its [tokenizer] section, or just its name) as tokenizer.json +
    tokenizer_config.json naming its real end-of-text and BOS tokens; returns (bos id, eos id, files written).

    A folder's own tokenizer_config.json is carried over (chat template, added tokens, ...) with the run's
    special tokens and the model's length written over it."""
    section = {"tokenizer_name_or_path": tokenizer} if isinstance(tokenizer, str) else tokenizer
    name = section.get("tokenizer_name_or_path", "bytes")
    try:
        loaded = load_tokenizer(name, eos_token=section.get("eos_token"), bos_token=section.get("bos_token"))
        tokenizer_config: dict
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
        log.warning(f"the run's tokenizer {name} cannot be read ({e}); exporting without a tokenizer")
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
    return loaded.bos_id, loaded.eos_id, ["tokenizer.json", "tokenizer_config.json", *_write_chat_template(store, loaded)]


def _write_chat_template(store: Store, tokenizer) -> list[str]:
    """The tokenizer's chat_template.jinja, written as it is (a template inside tokenizer_config.json travels with
    that file), so AutoTokenizer on the export renders conversations as the run did."""
    path = getattr(tokenizer, "chat_template_path", None)
    if path is None or os.path.basename(path) != CHAT_TEMPLATE_FILE:
        return []
    store.write(CHAT_TEMPLATE_FILE, tokenizer.chat_template.encode("utf-8"))
    return [CHAT_TEMPLATE_FILE]


def _with_stops(generation: dict, stops: int | list[int] | None) -> dict:
    """`generation` also stopping at each of `stops` it does not stop at yet: a base model fine-tuned on a chat
    template whose end-of-turn token its own generation_config.json does not name (a base Llama 3's <|eot_id|>)."""
    have = generation.get("eos_token_id")
    have = [] if have is None else have if isinstance(have, list) else [have]
    wanted = [] if stops is None else stops if isinstance(stops, list) else [stops]
    merged = have + [t for t in wanted if t not in have]
    return generation if merged == have else {**generation, "eos_token_id": merged[0] if len(merged) == 1 else merged}


def _stop_ids(eos: int | None, tokenizer: dict | str) -> int | list[int] | None:
    """generation_config.json's eos_token_id: the end-of-text id, and the chat template's end-of-turn token when
    it is another (Llama 3's <|eot_id|>, ChatML's <|im_end|>), so generate() stops at the end of an answer."""
    section = {"tokenizer_name_or_path": tokenizer} if isinstance(tokenizer, str) else tokenizer
    try:
        loaded = load_tokenizer(section.get("tokenizer_name_or_path", "bytes"), eos_token=section.get("eos_token"),
                                bos_token=section.get("bos_token"))
        turn = ChatTemplate(loaded).end_of_turn_ids() if loaded.chat_template is not None else []
    except (NanoflowError, ChatError, OSError, ValueError):
        return eos   # as the tokenizer export says (a tokenizer that cannot be read is exported without one)
    stops = ([] if eos is None else [eos]) + [t for t in turn if t != eos]
    return stops[0] if len(stops) == 1 else (stops or None)
