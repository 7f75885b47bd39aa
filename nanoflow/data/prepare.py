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

import attrs

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
        groups: list = []
        pending: list = []   # consecutive files of one builder are read by one load_dataset call

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
            rows = _load_named(name, cache_dir)
            groups.append(_select_text(rows, text_column, name))
        flush()
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
    if not groups:
        raise PrepareError("no inputs")
    return groups[0] if len(groups) == 1 else datasets.concatenate_datasets(groups)


def _load_named(name: str, cache_dir: str | None):
    """The rows of an input that is no file: a folder saved with Dataset.save_to_disk (its "train" split), or a
    dataset on the hub."""
    import datasets

    if os.path.isdir(name):
        if saved_folder(name).problems:   # what a stage's check before the run asks of a folder too
            raise PrepareError(f"{name}: a folder, but not one saved with Dataset.save_to_disk; "
                               "pass the files in it instead (e.g. folder/*.txt)")
        rows = datasets.load_from_disk(name)
        if isinstance(rows, datasets.DatasetDict):
            if "train" not in rows:
                raise PrepareError(f'{name}: no split "train" (splits: {", ".join(rows)})')
            rows = rows["train"]
        return rows
    if any(ch in name for ch in "*?["):
        raise PrepareError(f"{name}: matches no file")
    try:
        return datasets.load_dataset(name, split="train", cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - the hub's errors are many; name the input either way
        raise PrepareError(f"{name}: no such file or folder, and no dataset of that name could be "
                           f"loaded from the hub: {type(e).__name__}: {e}") from None


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


@attrs.frozen
class ShardPlan:
    """What a run of bin/prepare does in its output folder, decided before anything is written (plan_shards)."""

    shards: list[tuple[str, int, int]]   # every shard of the preparation: (name, first row, row after the last)
    done: dict[str, dict]                # the recorded shards whose files are whole: kept, with their stats
    todo: list[tuple[str, int, int]]     # the shards to tokenize, in order
    leftovers: list[str]                 # the files a killed run left half written, to delete


def plan_shards(identity: dict, output: str, previous: dict | None, listing: dict[str, int | None]) -> ShardPlan:
    """The plan for preparing `identity` (the documents, the shard size, what they are read and tokenized with) in
    the folder `output`, from what is there: `previous`, its prepare.json (None: none), and `listing`, each name in
    it with its size (None: not a file one can read). Raises PrepareError when the folder holds another preparation,
    or token files bin/prepare did not record. Reads and writes nothing."""
    done = _recorded_shards(identity, output, previous, listing)
    # Leftovers of a killed run, never under a real name: what nanoflow.io.store.write_atomically leaves.
    leftovers = [name for name in listing if re.fullmatch(r".+\.tmp-[0-9]+", name)]
    documents, per_shard = identity["documents"], identity["docs_per_shard"]
    shards = [(f"{k:05d}", start, min(start + per_shard, documents))
              for k, start in enumerate(range(0, documents, per_shard))]
    # A recorded shard whose file is gone or the wrong size, or has no metadata, is redone.
    whole = {name: stats for name, stats in done.items()
             if listing.get(name + SUFFIX) == stats["tokens"] * identity["token_size"]
             and listing.get(name + SUFFIX + ".metadata") is not None}
    return ShardPlan(shards=shards, done=whole, todo=[shard for shard in shards if shard[0] not in whole],
                     leftovers=leftovers)


def _recorded_shards(identity: dict, output: str, previous: dict | None, listing: dict[str, int | None]
                     ) -> dict[str, dict]:
    """The shards `previous` records as finished, when it prepares the same `identity`: a folder that holds another
    preparation, or token files without a prepare.json, is refused rather than mixing two preparations in one."""
    if previous is None:
        if any(name.endswith(SUFFIX) for name in listing):
            raise PrepareError(f"{output} already holds token files that bin/prepare did not record; "
                               "choose another --output, or empty this folder first")
        return {}
    if {k: previous.get(k) for k in identity} != identity:
        changed = [k for k in identity if previous.get(k) != identity[k]]
        raise PrepareError(f"{output} holds another preparation (it differs in {', '.join(changed)}); "
                           "choose another --output, or empty this folder first")
    return previous.get("shards", {})


def _listing(folder: str) -> dict[str, int | None]:
    """Each name in `folder` with its size; None where there is nothing to read (a dangling link)."""
    paths = {name: os.path.join(folder, name) for name in os.listdir(folder)}
    return {name: os.path.getsize(path) if os.path.exists(path) else None for name, path in paths.items()}


def _read_manifest(output: str) -> dict | None:
    path = os.path.join(output, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _as_tokenizer(tokenizer: str | TokenizerArgs | Tokenizer, eos_token: str | None) -> Tokenizer:
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer, eos_token=eos_token)
    if isinstance(tokenizer, TokenizerArgs):
        return load_tokenizer(tokenizer)
    return tokenizer


def prepare(inputs: list[str], output: str, *, tokenizer: str | TokenizerArgs | Tokenizer = "bytes",
            eos_token: str | None = None, text_column: str = "text", num_proc: int | None = None,
            docs_per_shard: int = DOCS_PER_SHARD, progress: bool | None = None, out: TextIO = sys.stderr,
            cache_dir: str | None = None) -> dict:
    """Tokenize `inputs` into the token folder `output`; returns the summary (documents, tokens, files, ...).
    `tokenizer`: a name or path (with `eos_token`, the end-of-text token to name), a [tokenizer] section, or a
    loaded tokenizer."""
    started = time.perf_counter()
    tokenizer = _as_tokenizer(tokenizer, eos_token)
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
    plan = plan_shards(identity, output, _read_manifest(output), _listing(output))
    for name in plan.leftovers:
        os.unlink(os.path.join(output, name))
    shards = dict(plan.done)   # filled in as shards finish
    manifest = {**identity, "shards": shards, "complete": False}
    _write_manifest(output, manifest)
    _tokenize(rows, plan.todo, tokenizer.args, output, manifest, workers=num_proc, progress=progress, out=out)
    verify(output, manifest)
    manifest["complete"] = True
    _write_manifest(output, manifest)
    return {
        "output": output, "documents": len(rows), "tokens": sum(s["tokens"] for s in shards.values()),
        "files": len(plan.shards), "resumed": len(plan.shards) - len(plan.todo), "tokenizer": identity["tokenizer"],
        "token_size": identity["token_size"], "seconds": time.perf_counter() - started,
    }


def _tokenize(rows, todo: list[tuple[str, int, int]], tokenizer_args: TokenizerArgs, output: str, manifest: dict, *,
              workers: int | None, progress: bool | None, out: TextIO) -> None:
    """Tokenize and write the shards `todo`, in a pool of processes when there are several: each finished shard is
    recorded in manifest["shards"] and the manifest written at once, so a killed run keeps it."""
    from tqdm import tqdm

    done = manifest["shards"]
    live = out.isatty() if progress is None else progress
    bar = tqdm(total=len(rows), initial=sum(s["documents"] for s in done.values()), unit="doc", file=out,
               disable=not live, dynamic_ncols=True, desc="tokenizing")

    def finished(name: str, stats: dict) -> None:
        done[name] = stats
        _write_manifest(output, manifest)
        bar.update(stats["documents"])

    processes = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    try:
        if processes == 1:
            for shard, start, stop in todo:
                finished(*_prepare_shard(rows, start, stop, tokenizer_args, output, shard))
            return
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            running = {pool.submit(_prepare_shard, rows, start, stop, tokenizer_args, output, shard)
                       for shard, start, stop in todo}
            while running:
                ready, running = wait(running, return_when=FIRST_COMPLETED)
                for future in ready:
                    finished(*future.result())
    finally:
        bar.close()


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
