"""bin/prepare: tokenize text into a token folder (the datatrove / Nanoset layout of tokens.py).

The inputs (text files, one document each; jsonl / json / csv / parquet / arrow files, one document
per row of the text column, compressed or not (docs.jsonl.gz: its rows, as `datasets` reads it); a folder saved with `Dataset.save_to_disk`; or a hub dataset name)
are read in the order given and cut into shards of `docs_per_shard` documents; shard k becomes
NNNNN.ds (+ .index, + .metadata), so the output is the documents in input order, each followed by
end-of-text — the token stream the same text gives as an HF source.

Shards are tokenized by a pool of processes and each is written all-or-nothing (tokens.py), so
a killed run leaves whole shards only. `prepare.json` in the output records what is being
prepared (the inputs with their sizes and modification times, the tokenizer and its content
hash, the column, the shard size) and each finished shard with its token count and checksum; a
rerun with the same arguments skips the finished shards, and a rerun with different ones is
refused rather than mixing two preparations in one folder. At the end every shard is read back
and checked against its checksum, its index and its metadata.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import TextIO

from nanoflow.config import TokenizerArgs
from nanoflow.config.locations import archive_of, saved_folder
from nanoflow.data.hf_datasets import (
    _ROWS_PER_BATCH,
    builder_for,
    tokenizer_fingerprint,
)
from nanoflow.data.local_files import load_files
from nanoflow.data.tokenizer import Tokenizer, load_tokenizer
from nanoflow.data.tokens import (
    MANIFEST,
    SUFFIX,
    TokenFolder,
    file_digest,
    recorded_name,
    token_size_for,
    write_token_file,
)
from nanoflow.errors import PrepareError
from nanoflow.io.store import write_atomically

FORMAT = "nanoflow-prepare-1"
DOCS_PER_SHARD = 50_000


def _input_identity(name: str) -> list:
    if os.path.isfile(name):
        stat = os.stat(name)
        return [os.path.abspath(name), stat.st_size, stat.st_mtime_ns]
    if os.path.isdir(name):
        found = sorted(os.path.join(d, f) for d, _, fs in os.walk(name) for f in fs)
        return [os.path.abspath(name), [[os.path.relpath(p, name), os.stat(p).st_size, os.stat(p).st_mtime_ns]
                                        for p in found]]
    return [name]   # a hub dataset


def _select_text(rows, column: str, where: str):
    if column not in rows.column_names:
        raise PrepareError(f'{where}: no column "{column}"; the columns are {", ".join(rows.column_names)} '
                           "(choose one with --text-column)")
    rows = rows.select_columns([column])
    return rows.rename_column(column, "text") if column != "text" else rows


def load_inputs(inputs: list[str], text_column: str = "text", cache_dir: str | None = None):
    """Every input's documents, in order, as one `datasets.Dataset` with a single "text" column."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        groups, pending = [], []   # consecutive files of one builder are read by one load_dataset call

        def flush():
            if pending:
                builder = builder_for(pending[0])
                options = {"sample_by": "document"} if builder == "text" else {}
                rows = load_files(builder, pending, error=PrepareError, split="train", cache_dir=cache_dir, **options)
                where = pending[0] if len(pending) == 1 else f"{pending[0]} (and {len(pending) - 1} more)"
                groups.append(_select_text(rows, "text" if builder == "text" else text_column, where))
                pending.clear()

        for name in inputs:
            if os.path.isfile(name) and archive_of(name) is not None:   # as a stage refuses it (config.locations)
                raise PrepareError(f"{name} is an archive ({archive_of(name)}): extract it and name the files in it")
            if os.path.isfile(name):
                if pending and builder_for(pending[0]) != builder_for(name):
                    flush()
                pending.append(name)
                continue
            flush()
            if os.path.isdir(name):
                if saved_folder(name).problems:   # what a stage's check before the run asks of a folder too
                    raise PrepareError(f"{name}: a folder, but not one saved with Dataset.save_to_disk; "
                                       "pass the files in it instead (e.g. folder/*.txt)")
                rows = datasets.load_from_disk(name)
                if isinstance(rows, datasets.DatasetDict):
                    if "train" not in rows:
                        raise PrepareError(f'{name}: no split "train" (splits: {", ".join(rows)})')
                    rows = rows["train"]
            elif any(ch in name for ch in "*?["):
                raise PrepareError(f"{name}: matches no file")
            else:
                try:
                    rows = datasets.load_dataset(name, split="train", cache_dir=cache_dir)
                except Exception as e:  # noqa: BLE001 - the hub's errors are many; name the input either way
                    raise PrepareError(f"{name}: no such file or folder, and no dataset of that name could be "
                                       f"loaded from the hub: {type(e).__name__}: {e}") from None
            groups.append(_select_text(rows, text_column, name))
        flush()
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
    if not groups:
        raise PrepareError("no inputs")
    return groups[0] if len(groups) == 1 else datasets.concatenate_datasets(groups)


def _prepare_shard(rows, start: int, stop: int, tokenizer_args: TokenizerArgs, output: str,
                   shard: str) -> tuple[str, dict]:
    """Runs in a worker process: tokenize rows start..stop - 1 and write them as SHARD.ds (all or nothing)."""
    tokenizer = load_tokenizer(tokenizer_args)
    eos = [tokenizer.eos_id]

    def documents():
        import numpy as np

        for first in range(start, stop, _ROWS_PER_BATCH):
            texts = rows[first:min(first + _ROWS_PER_BATCH, stop)]["text"]
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise PrepareError(f"document {first + i}: holds {type(text).__name__}, expected text")
            for ids in tokenizer.encode_batch(texts):
                yield np.concatenate([ids, eos])

    stats = write_token_file(output, shard, documents(), tokenizer_name=recorded_name(tokenizer),
                             token_size=token_size_for(tokenizer.vocab_size))
    return shard, stats


def _write_manifest(output: str, manifest: dict) -> None:
    write_atomically(os.path.join(output, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())


def prepare(inputs: list[str], output: str, *, tokenizer: str | TokenizerArgs | Tokenizer = "bytes",
            eos_token: str | None = None, text_column: str = "text", num_proc: int | None = None,
            docs_per_shard: int = DOCS_PER_SHARD, progress: bool | None = None, out: TextIO = sys.stderr,
            cache_dir: str | None = None) -> dict:
    """Tokenize `inputs` into the token folder `output`; returns the summary (documents, tokens, files, ...).
    `tokenizer`: a name or path (with `eos_token`, the end-of-text token to name), a [tokenizer] section, or a
    loaded tokenizer."""
    started = time.perf_counter()
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer, eos_token=eos_token)
    elif isinstance(tokenizer, TokenizerArgs):
        tokenizer = load_tokenizer(tokenizer)
    if docs_per_shard < 1:
        raise PrepareError(f"docs_per_shard must be at least 1, got {docs_per_shard}")
    rows = load_inputs(list(inputs), text_column, cache_dir)
    if len(rows) == 0:
        raise PrepareError("the inputs hold no documents")
    identity = {
        "format": FORMAT,
        "inputs": [_input_identity(name) for name in inputs],
        "text_column": text_column,
        "tokenizer": recorded_name(tokenizer),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "eos_id": tokenizer.eos_id,
        "token_size": token_size_for(tokenizer.vocab_size),
        "documents": len(rows),
        "docs_per_shard": docs_per_shard,
    }
    os.makedirs(output, exist_ok=True)
    manifest_path = os.path.join(output, MANIFEST)
    done: dict[str, dict] = {}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            previous = json.load(f)
        if {k: previous.get(k) for k in identity} != identity:
            changed = [k for k in identity if previous.get(k) != identity[k]]
            raise PrepareError(f"{output} holds another preparation (it differs in {', '.join(changed)}); "
                               "choose another --output, or empty this folder first")
        done = previous.get("shards", {})
    elif any(name.endswith(SUFFIX) for name in os.listdir(output)):
        raise PrepareError(f"{output} already holds token files that bin/prepare did not record; "
                           "choose another --output, or empty this folder first")
    for name in os.listdir(output):          # leftovers of a killed run: never under a real name
        if re.fullmatch(r".+\.tmp-[0-9]+", name):   # what nanoflow.io.store.write_atomically leaves
            os.unlink(os.path.join(output, name))

    shards = [(f"{k:05d}", start, min(start + docs_per_shard, len(rows)))
              for k, start in enumerate(range(0, len(rows), docs_per_shard))]
    token_size = identity["token_size"]
    for name in list(done):                 # a recorded shard whose file is gone or the wrong size is redone
        path = os.path.join(output, name + SUFFIX)
        if not (os.path.exists(path) and os.path.getsize(path) == done[name]["tokens"] * token_size
                and os.path.exists(path + ".metadata")):
            del done[name]
    todo = [shard for shard in shards if shard[0] not in done]
    manifest = {**identity, "shards": done, "complete": False}
    _write_manifest(output, manifest)

    from tqdm import tqdm

    live = out.isatty() if progress is None else progress
    bar = tqdm(total=len(rows), initial=sum(s["documents"] for s in done.values()), unit="doc", file=out,
               disable=not live, dynamic_ncols=True, desc="tokenizing")
    workers = max(1, min(num_proc or os.cpu_count() or 1, len(todo)))
    try:
        if workers == 1:
            for shard, start, stop in todo:
                name, stats = _prepare_shard(rows, start, stop, tokenizer.args, output, shard)
                done[name] = stats
                _write_manifest(output, manifest)
                bar.update(stats["documents"])
        else:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                running = {pool.submit(_prepare_shard, rows, start, stop, tokenizer.args, output, shard)
                           for shard, start, stop in todo}
                while running:
                    finished, running = wait(running, return_when=FIRST_COMPLETED)
                    for future in finished:
                        name, stats = future.result()
                        done[name] = stats
                        _write_manifest(output, manifest)
                        bar.update(stats["documents"])
    finally:
        bar.close()

    verify(output, manifest)
    manifest["complete"] = True
    _write_manifest(output, manifest)
    return {
        "output": output, "documents": len(rows), "tokens": sum(s["tokens"] for s in done.values()),
        "files": len(shards), "resumed": len(shards) - len(todo), "tokenizer": identity["tokenizer"],
        "token_size": token_size, "seconds": time.perf_counter() - started,
    }


def verify(output: str, manifest: dict) -> None:
    """Read the folder back: every recorded shard present with its checksum, and the folder readable as a whole
    (sizes, indexes and metadata consistent, one tokenizer) with the recorded documents and tokens."""
    shards = manifest["shards"]
    for name, stats in sorted(shards.items()):
        path = os.path.join(output, name + SUFFIX)
        if not os.path.exists(path):
            raise PrepareError(f"verification: {path} is missing")
        if file_digest(path) != stats["blake2b"]:
            raise PrepareError(f"verification: {path} does not read back as written (checksum differs)")
    folder = TokenFolder(output, "verification")
    recorded = {os.path.basename(f.path) for f in folder.files}
    expected = {name + SUFFIX for name in shards}
    if recorded != expected:
        raise PrepareError(f"verification: {output} holds token files {sorted(recorded - expected)} that this "
                           "preparation did not write")
    documents = sum(f.documents or 0 for f in folder.files)
    if documents != manifest["documents"] or len(folder) != sum(s["tokens"] for s in shards.values()):
        raise PrepareError(f"verification: {output} reads back {documents} documents and {len(folder)} tokens, "
                           f"expected {manifest['documents']} and {sum(s['tokens'] for s in shards.values())}")
    if folder.tokenizer_name != manifest["tokenizer"] or folder.token_size != manifest["token_size"]:
        raise PrepareError(f"verification: {output} records {folder.tokenizer_name}|{folder.token_size}, expected "
                           f"{manifest['tokenizer']}|{manifest['token_size']}")
    folder.close()
