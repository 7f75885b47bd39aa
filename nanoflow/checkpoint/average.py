"""Checkpoint averaging: `bin/average RUN_DIR OUT_DIR --last K` (or --steps, --weights).

The (weighted) mean of some committed checkpoints' model weights, written as one committed nanoflow
checkpoint by the writer of nanoflow/io/checkpoint.py (same layout, same commit protocol), so that
bin/eval, bin/export, `init_from` and `resume_checkpoint_path` (with load_optimizer = false) read it.
It streams tensor by tensor: each source tensor is read (any dp×tp layout, local or S3, every shard
checked against its checksum), added into an fp32 sum and dropped, so memory holds the averaged model
plus one tensor. The result has no optimizer state. Its metadata is the newest source checkpoint's
(training position, config, data fingerprint), on a one-process topology, plus `averaged_from`.
"""

from __future__ import annotations

import math

import torch

from nanoflow import io
from nanoflow.checkpoint.lineage import one_history
from nanoflow.config import MODEL_KEYS, recorded_model
from nanoflow.errors import AverageError
from nanoflow.io.checkpoint import commit, new_save, write_files
from nanoflow.io.marker import step_of

# The [model] keys a resume refuses (their MODEL_KEYS role): checkpoints differing in one are not averaged.
ARCHITECTURE = [key for key, (role, _, _) in MODEL_KEYS.items() if role in ("shape", "numbers")]
SINGLE_PROCESS = {"dp": 1, "tp": 1, "world_size": 1}


def committed_steps(run_dir: str) -> dict[int, str]:
    """{step: step folder} of a run folder's intact committed checkpoints."""
    return {_step(folder): folder for folder in io.checkpoints_to_try(run_dir)}


def _step(folder: str) -> int:
    step = step_of(folder.rstrip("/").rpartition("/")[2])
    assert step is not None   # a committed checkpoint's folder: named by its step
    return step


def choose(run_dir: str, *, last: int | None = None, steps: list[int] | None = None) -> list[str]:
    """The step folders to average, in step order: the `last` most recently committed of one history (the newest
    checkpoint's: nanoflow.checkpoint.lineage.one_history), or the `steps` named."""
    found = committed_steps(run_dir)
    if not found:
        raise AverageError(f"{run_dir} holds no committed checkpoint")
    if last is not None:
        if last < 1:
            raise AverageError(f"--last {last}: name one checkpoint or more")
        history, others = one_history(run_dir)
        if last > len(history):
            mine = sorted(_step(folder) for folder in history)
            beside = (f"; step{'s' * (len(others) > 1)} {', '.join(str(s) for s in sorted(map(_step, others)))} "
                      f"{'are' if len(others) > 1 else 'is'} of another history (a --fresh start or a start from an "
                      "older step passed over it), which --steps can name" if others else "")
            raise AverageError(f"--last {last}: {run_dir} keeps only {len(history)} committed checkpoint"
                               f"{'s' * (len(history) > 1)} of its latest history (step"
                               f"{'s' * (len(history) > 1)} {', '.join(map(str, mine))}){beside}")
        return sorted(history[:last], key=_step)
    assert steps is not None   # --last or --steps
    missing = [s for s in steps if s not in found]
    if missing:
        raise AverageError(f"--steps: {run_dir} holds no committed checkpoint of step "
                           f"{', '.join(map(str, missing))} (it has {', '.join(map(str, sorted(found)))})")
    if len(set(steps)) != len(steps):
        raise AverageError(f"--steps {','.join(map(str, steps))}: a step is named twice")
    return [found[s] for s in sorted(steps)]


def _same_model(readers: list[io.CheckpointReader]) -> None:
    """Refuse, before any tensor is read, checkpoints whose weights do not mean the same thing."""
    first = readers[0]
    for other in readers[1:]:
        a, b = first.metadata["config"], other.metadata["config"]
        ours, theirs = recorded_model(a["model"]), recorded_model(b["model"])   # a record from before a key: its default
        differences = [f"model.{key} is {ours.get(key)} in {first.path} but {theirs.get(key)} in "
                       f"{other.path}" for key in ARCHITECTURE if ours.get(key) != theirs.get(key)]
        if a.get("tokenizer") != b.get("tokenizer"):
            differences.append(f"the tokenizer is {a.get('tokenizer')} in {first.path} but {b.get('tokenizer')} in "
                               f"{other.path}")
        if not differences:
            shapes = {n: first.shape("model", n) for n in first.names("model")}
            theirs = {n: other.shape("model", n) for n in other.names("model")}
            if shapes != theirs:
                differences.append(f"the tensors of {first.path} and {other.path} differ in names or shapes")
        if differences:
            raise AverageError("cannot average checkpoints of different models: " + "; ".join(differences))


def selection(run_dir: str, *, last: int | None = None, steps: list[int] | None = None,
              weights: list[float] | None = None) -> tuple[list[str], list[float]]:
    """(the step folders of `run_dir` to average, in step order; their weights, normalised): what an average of
    these arguments is made from, checked before anything is read."""
    if (last is None) == (steps is None):
        raise AverageError("name the checkpoints with one of --last K or --steps A,B,...")
    if steps is not None and not steps:
        raise AverageError("--steps: name one step or more")
    folders = choose(run_dir, last=last, steps=steps)
    if weights is None:
        weights = [1.0] * len(folders)
    if len(weights) != len(folders):
        raise AverageError(f"--weights: {len(weights)} weights for {len(folders)} checkpoints")
    if not all(math.isfinite(w) for w in weights) or not math.isfinite(sum(weights)):
        # inf normalises to nan, and 1e308 + 1e308 overflows the sum: a NaN or all-zero "average"
        raise AverageError(f"--weights {','.join(map(str, weights))}: weights must be finite numbers whose sum is "
                           "finite too")
    if any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise AverageError(f"--weights {','.join(map(str, weights))}: weights must be ≥ 0, not all 0")
    return folders, [w / sum(weights) for w in weights]


def average_checkpoints(run_dir: str, out_dir: str, *, last: int | None = None, steps: list[int] | None = None,
                        weights: list[float] | None = None, ema: bool = False) -> dict:
    """Commit the weighted mean of the chosen checkpoints of `run_dir` as a checkpoint in `out_dir` (a run
    folder that holds no committed checkpoint yet, locked while it is written as a training run locks its folder);
    its step is the newest source's. With `ema`, the mean of their weight EMAs ([optimizer] ema_decay), written
    as the new checkpoint's weights. Returns a summary:
    {"path", "step", "sources", "weights"}."""
    folders, weights = selection(run_dir, last=last, steps=steps, weights=weights)
    readers = [io.CheckpointReader(folder) for folder in folders]
    _same_model(readers)
    group = "ema" if ema else "model"
    if missing := [r.path for r in readers if group not in r.metadata["tensors"]]:
        raise AverageError(f"--ema: {', '.join(missing)} hold{'s' * (len(missing) == 1)} no weight EMA (saved "
                           "without [optimizer] ema_decay)")
    # OUT_DIR's lock, the one a training run takes, from before it is found empty to after the commit: a second
    # average into it meanwhile is refused naming this one; one that comes after finds the committed checkpoint.
    lock = io.RunLock.acquire(out_dir, run="bin/average")
    try:
        if io.checkpoints_to_try(out_dir):
            raise AverageError(f"{out_dir} already holds a committed checkpoint; name a new folder")
        return _average(readers, weights, out_dir, lock, group)
    finally:
        lock.release()


def _average(readers: list[io.CheckpointReader], weights: list[float], out_dir: str, lock, group: str = "model"
             ) -> dict:
    newest = readers[-1]
    tensors = {}
    for name in newest.names("model"):
        total = None
        for reader, weight in zip(readers, weights, strict=True):
            part = reader.read(group, name).to(torch.float32)   # may be a view of the bytes read: never written to
            total = part * weight if total is None else total.add_(part, alpha=weight)
            del part
        assert total is not None   # one checkpoint or more
        tensors[name] = total.to(getattr(torch, newest.metadata["tensors"]["model"][name]["dtype"]))
    step = newest.metadata["step"]
    info = {key: newest.metadata[key] for key in ("training", "lr_origin", "config", "data_fingerprint")
            if key in newest.metadata}
    info["topology"] = SINGLE_PROCESS
    info["averaged_from"] = [{"checkpoint": r.path, "step": r.metadata["step"], "weight": w}
                             | ({"weights": "ema"} if group == "ema" else {}) for r, w in zip(readers, weights, strict=True)]
    lock.confirm()   # still this average's (its lease renewed): only then is anything written
    suffix = new_save(out_dir, step, ["model"])
    written = write_files(out_dir, step, {"model": tensors}, suffix, rank=0)
    lock.confirm()
    path = commit(out_dir, step, [written], info)
    return {"path": path, "step": step, "sources": [r.path for r in readers], "weights": weights}
