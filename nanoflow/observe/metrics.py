"""metrics.jsonl, the record of a run: one JSON object per step (step, stage, loss, lr, grad_norm, tokens,
elapsed, tokens_per_s, mfu, peak_memory_bytes …), written by `MetricsLog` during training and read back by
`read_metrics`, and the one definition of tokens/s that the progress line, TensorBoard and bin/report all show
(`Throughput`; `Window` for the recent rate).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
from pathlib import Path

from nanoflow.errors import MetricsError, RunFolderError, StorageLostError
from nanoflow.io.files import open_to_append, refuse_link

FILE = "metrics.jsonl"
# The keys of a record that measure the machine, not the training: two runs of the same steps differ in these alone
MEASURED = ("elapsed", "tokens_per_s", "mfu", "peak_memory_bytes")
EVAL_FILE = "eval.jsonl"   # nanoflow.evaluation's rows, one per (step, eval set), written like metrics.jsonl


class MetricsLog:
    """metrics.jsonl: one JSON object per step. Lines after `start_step` (from an abandoned attempt) are dropped.

    Written by rank 0 only (`enabled`); the metrics are global, the same on every rank.
    """

    def __init__(self, path: Path, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.file = None
        if not enabled:
            return
        self.path = path
        with self._opened(binary=True) as f:  # created when missing; never through a link (its target lies anywhere)
            f.truncate(_kept_length(f, start_step))

    def _opened(self, binary: bool = False):
        try:
            return open_to_append(self.path, binary=binary)
        except OSError as e:
            raise RunFolderError(f"cannot write {self.path}: {e.strerror or e}") from None

    def __enter__(self) -> MetricsLog:
        if self.enabled:
            self.file = self._opened()
        return self

    def write(self, metrics: dict) -> None:
        if self.file is not None:
            try:
                self.file.write(json.dumps(metrics) + "\n")
                self.file.flush()
            except OSError as e:
                with contextlib.suppress(OSError):   # closing flushes the unwritten line again, into the same error
                    self.file.close()
                self.file = None
                raise StorageLostError(
                    f"cannot write {self.path} after step {metrics['step']}: {e.strerror or e}; the checkpoints "
                    "committed before stand: make room and run the same command again to resume") from None

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()


def set_aside(directory: Path) -> list[tuple[Path, Path]]:
    """Move a run folder's metrics.jsonl and eval.jsonl, before a fresh start over them, to metrics.<n>.jsonl and
    eval.<n>.jsonl (the first n free for both): the old run's records are kept, never truncated. (old, new) each."""
    found = [Path(directory, name) for name in (FILE, EVAL_FILE)]
    found = [path for path in found if path.is_file() and not path.is_symlink() and path.stat().st_size]
    n = 1
    while any(os.path.lexists(path.with_suffix(f".{n}.jsonl")) for path in found):   # a dangling link is taken too
        n += 1
    moved = []
    for path in found:
        try:
            refuse_link(path.with_suffix(f".{n}.jsonl"))   # (taken between the two looks: never renamed over)
            path.rename(path.with_suffix(f".{n}.jsonl"))
        except OSError as e:
            raise RunFolderError(f"cannot move {path} aside before a fresh start: {e.strerror or e}") from None
        moved.append((path, path.with_suffix(f".{n}.jsonl")))
    return moved


def _kept_length(f, step: int, block: int = 1 << 16) -> int:
    """The byte length of metrics.jsonl up to the end of its last line of a step ≤ `step`.

    The lines are in step order (each run drops those after its start and appends), so this reads
    backwards from the end, only as far as the lines it drops: a resume late in a long run does not
    read the run's whole history. A line that does not parse (cut by a kill) counts as one to drop.
    """
    if step <= 0:
        return 0
    position = f.seek(0, os.SEEK_END)
    buffer, limit = b"", 0  # the file's bytes from `position` on; buffer[:limit] is what is still in question
    while True:
        end = buffer.rfind(b"\n", 0, limit)                # the newline ending the last line in question
        start = buffer.rfind(b"\n", 0, max(end, 0)) + 1    # where that line begins, if buffer reaches it
        if (end < 0 or start == 0) and position > 0:
            size = min(block, position)
            position -= size
            f.seek(position)
            buffer, limit = f.read(size) + buffer[:limit], limit + size
            continue
        if end < 0:
            return 0
        try:
            if json.loads(buffer[start:end])["step"] <= step:
                return position + end + 1
        except (ValueError, KeyError, TypeError):
            pass
        limit = start


# What a row of each record must hold, with its kind: the fields bin/report and bin/compare read.
STEP, NAME, NUMBER = "a step number", "a name", "a number"
METRICS_FIELDS = {"step": STEP, "stage": NAME, "loss": NUMBER, "lr": NUMBER, "tokens": STEP}
EVAL_FIELDS = {"step": STEP, "dataset": NAME, "loss": NUMBER}
EVAL_OPTIONAL = {"accuracy": NUMBER}


def read_records(path: str | os.PathLike, fields: dict[str, str], optional: dict[str, str] | None = None
                 ) -> list[dict] | None:
    """The rows of a .jsonl record nanoflow appends to (metrics.jsonl, eval.jsonl), each checked to be a JSON
    object holding `fields` (and, when present, `optional`) of their kinds; None when there is no such file. A
    last line cut by a kill is skipped; anything else wrong — a file that cannot be read (a folder, no
    permission), bytes that are not UTF-8, a line that is not a JSON object or lacks a field — is a
    MetricsError naming the file and the line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise MetricsError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise MetricsError(f"{path}:{line}: not UTF-8 text (byte {e.start} of the file); nanoflow writes JSON lines "
                           "here") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            if number == len(lines):
                continue
            raise MetricsError(f"{path}:{number}: not a JSON line") from None
        problem = _row_problem(row, fields, optional or {})
        if problem is not None:
            raise MetricsError(f"{path}:{number}: {problem}")
        rows.append(row)
    return rows


def _row_problem(row, fields: dict[str, str], optional: dict[str, str]) -> str | None:
    if not isinstance(row, dict):
        return f"not a JSON object but {json.dumps(row)[:60]}"
    for key, kind in {**fields, **{k: v for k, v in optional.items() if k in row}}.items():
        if key not in row:
            return f"no {key}"
        value = row[key]
        if value is None:
            return f"{key} is null, not {kind}"
        ok = (isinstance(value, str) if kind == NAME else isinstance(value, (int, float)) and not isinstance(value, bool)
              and (kind == NUMBER or isinstance(value, int) and value >= 0))
        if not ok:
            return f"{key} is {json.dumps(value)[:60]}, not {kind}"
    return None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """A run folder's metrics.jsonl, one dict per step, in step order (a last line cut by a kill is skipped)."""
    path = Path(run_dir) / FILE
    metrics = read_records(path, METRICS_FIELDS)
    if metrics is None:
        raise MetricsError(f"{path}: no such file (bin/train writes it into the run folder, "
                           "checkpoints.checkpoints_path; runs/s3/<bucket>/<prefix>/ when checkpoints go to S3)")
    if not metrics:
        raise MetricsError(f"{path} holds no steps yet")
    return sorted(metrics, key=lambda m: m["step"])


def read_eval(run_dir: str | os.PathLike) -> list[dict]:
    """A run folder's eval.jsonl rows (step, stage, dataset, loss, tokens, accuracy), none without evaluation."""
    return read_records(Path(run_dir) / EVAL_FILE, EVAL_FIELDS, EVAL_OPTIONAL) or []


def tokens_per_second(tokens: float, seconds: float) -> float:
    """The rate, or nan when no time was measured (a step faster than `elapsed`'s millisecond)."""
    return tokens / seconds if seconds > 0 else math.nan


class Throughput:
    """Tokens and wall time of the steps added so far, as their records say: a step took the difference of its
    `elapsed` (seconds since its process began) and the step before's; a resumed process starts its clock again,
    so its first step counts from 0. The time a step waited for its stage's data to load is the step's."""

    def __init__(self):
        self.tokens, self.seconds, self._elapsed = 0, 0.0, 0.0

    def add(self, metrics: dict) -> float:
        """Count one step in; returns its wall time."""
        elapsed = float(metrics.get("elapsed", 0.0))
        seconds = elapsed - self._elapsed if elapsed >= self._elapsed else elapsed
        self._elapsed = elapsed
        self.tokens += metrics["tokens"]
        self.seconds += seconds
        return seconds

    @property
    def rate(self) -> float:
        """tokens/s over every step added."""
        return tokens_per_second(self.tokens, self.seconds)


def step_seconds(metrics: list[dict]) -> list[float]:
    """The wall time of each step of a run's record, in order."""
    throughput = Throughput()
    return [throughput.add(m) for m in metrics]


class Window:
    """The steps of the last `span` seconds of wall time (at least the latest step), timed as `Throughput` times
    them: tokens/s over them is the rate the progress line and metrics.jsonl's "tokens_per_s" show, which follows
    a change of speed that the mean since the start hides for hours. Each step brings its `work` too (its model
    FLOPs; any measure of its cost), for work/s over the same steps and for `seconds_per_work` of the latest
    stage's steps among them (the ETA's measure). A resumed process starts with an empty window."""

    def __init__(self, span: float = 30.0):
        self.span = span
        self._clock = Throughput()
        self._steps = collections.deque()   # (stage, seconds, tokens, work), oldest first
        self.seconds, self.tokens, self.work = 0.0, 0, 0.0
        self._stage, self._stage_seconds, self._stage_work = None, 0.0, 0.0

    def add(self, metrics: dict, work: float = 0.0) -> None:
        seconds, stage, tokens = self._clock.add(metrics), metrics["stage"], metrics["tokens"]
        if stage != self._stage:  # stages never come back: the new one's sums start here
            self._stage, self._stage_seconds, self._stage_work = stage, 0.0, 0.0
        self._steps.append((stage, seconds, tokens, work))
        self.seconds, self.tokens, self.work = self.seconds + seconds, self.tokens + tokens, self.work + work
        self._stage_seconds, self._stage_work = self._stage_seconds + seconds, self._stage_work + work
        while len(self._steps) > 1 and self.seconds - self._steps[0][1] >= self.span:  # the rest still spans it
            old_stage, old_seconds, old_tokens, old_work = self._steps.popleft()
            self.seconds, self.tokens = self.seconds - old_seconds, self.tokens - old_tokens
            self.work -= old_work
            if old_stage == self._stage:
                self._stage_seconds, self._stage_work = self._stage_seconds - old_seconds, self._stage_work - old_work

    @property
    def rate(self) -> float:
        """tokens/s over the window."""
        return tokens_per_second(self.tokens, self.seconds)

    @property
    def work_rate(self) -> float:
        """work/s over the window (model FLOP/s when the work is model FLOPs)."""
        return self.work / self.seconds if self.seconds > 0 else math.nan

    @property
    def seconds_per_work(self) -> float:
        """Seconds per unit of work over the window's steps of the latest stage."""
        return self._stage_seconds / self._stage_work if self._stage_work > 0 else math.nan
