"""Where a run began and what its start did, as its checkpoints record it; and an LR schedule edited under one.

A run starts fresh, or from `resume_checkpoint_path` (a branch point: another run's checkpoint, or an older one
of its own). `load_optimizer = false` and `load_lr_scheduler = false` act there, once: every checkpoint the run
commits records where it began (`began_from`, `began_at`), from which step its AdamW state counts
(`optimizer_origin`) and its LR schedule (the metadata's `lr_origin`). A resume of those checkpoints (a requeue,
a crash, --until-step) continues them as they are, so that it ends equal to the run trained straight; and
rerunning the same command with the same resume_checkpoint_path continues the newest checkpoint that began
there instead of starting over.

The LR is a closed-form function of the step and of the config; a config edited under a checkpoint can change
the LR the next step of a begun stage trains at (the stage's length: the next stage's start moved, a stage
inserted after the resume step, train_steps; its LR keys). That is never silent: refused, or with
[checkpoints] ignore_lr_schedule_change = true, said (lr_schedule_change).
"""

from __future__ import annotations

import math
import os
import secrets

import attrs
from attrs import frozen

from nanoflow import io
from nanoflow.config import LRSchedulerArgs, StageLRSchedulerArgs, converter
from nanoflow.errors import LRChangedError  # noqa: F401 - imported from here
from nanoflow.io.marker import committed_at
from nanoflow.io.store import is_remote
from nanoflow.lr import lr_of, scheduled_lr
from nanoflow.schedule import Schedule, Stage, active_stage


@frozen
class Lineage:
    """The "lineage" record of a checkpoint's metadata (lr_origin is the metadata's own top-level key)."""

    optimizer_origin: int = 0          # the completed step the AdamW moments and step counts began at
    began_from: str | None = None      # the resume_checkpoint_path the run started from; None: a fresh start
    began_at: int = 0                  # the completed step it started from there
    history: str | None = None         # a token drawn when the run started (fresh or from began_from), kept by its
                                       # resumes: the checkpoints of one history share it (None: before it was kept)

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def of(cls, metadata: dict) -> Lineage | None:
        """A checkpoint's lineage; None for one written before nanoflow recorded it (where it began is unknown;
        its optimizer state then counts from 0 as far as anyone can tell)."""
        record = metadata.get("lineage")
        if not isinstance(record, dict):
            return None
        history = record.get("history")
        return cls(int(record.get("optimizer_origin", 0)), record.get("began_from"), int(record.get("began_at", 0)),
                   history if isinstance(history, str) else None)

    @classmethod
    def started(cls, optimizer_origin: int = 0, began_from: str | None = None, began_at: int = 0) -> Lineage:
        """The lineage of a run that starts now (afresh, or from `began_from`): a history of its own."""
        return cls(optimizer_origin, began_from, began_at, secrets.token_hex(8))


def same_place(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it."""
    path, folder = path.rstrip("/"), folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")


def continues_start(metadata: dict, start: str, checkpoints_path: str) -> bool:
    """Whether a checkpoint of checkpoints_path belongs to a run that already began from `start`
    (resume_checkpoint_path). One written before lineage was recorded counts as such when `start` lies outside
    checkpoints_path (then only the run that began there wrote it: the rule before lineage), and as not when
    inside (it may be the history `start` rewinds)."""
    lineage = Lineage.of(metadata)
    if lineage is None:
        return not inside(start, checkpoints_path)
    return lineage.began_from is not None and same_place(lineage.began_from, start)


def begun_from_start(checkpoints_path: str, start: str) -> tuple[list[str], str | None]:
    """The committed checkpoints of `checkpoints_path` that began from `start` (resume_checkpoint_path), newest
    first — committed after `start` was read, they lead the commit order; inside the run's own folder the older
    history `start` rewinds follows them, and is not theirs — and, when the newest checkpoint began elsewhere,
    a line saying which is passed over."""
    descendants = []
    for folder in io.checkpoints_to_try(checkpoints_path):
        if same_place(folder, start):
            break
        try:
            metadata = io.read_metadata(folder)
        except io.CheckpointError:
            break
        if not continues_start(metadata, start, checkpoints_path):
            if descendants:
                break
            began = (Lineage.of(metadata) or Lineage()).began_from
            return [], (f"checkpoints_path = {checkpoints_path} holds checkpoints that did not begin from "
                        f"resume_checkpoint_path = {start} (the newest, {folder}, "
                        + (f"began from {began}" if began else "started afresh") + f"): starting from {start}; "
                        "they stay until this run commits steps of the same numbers")
        descendants.append(folder)
    return descendants, None


def one_history(run_dir: str) -> tuple[list[str], list[str]]:
    """(the committed step folders of `run_dir` in the history of its newest commit, newest first; the others,
    newest first). A history is what one run start committed (`Lineage.history`), resumes included, and, when it
    began from a checkpoint of this same folder (a start from an older step), the history that checkpoint ends,
    up to it. A --fresh start begins a history of its own, so the steps of the one it abandoned are not in it.
    For checkpoints written before histories were kept: commit order, each step below the one committed after it."""
    found = [(folder, io.read_metadata(folder)) for folder in io.checkpoints_to_try(run_dir)]
    if not found:
        return [], []
    lineage = Lineage.of(found[0][1]) or Lineage()
    if lineage.history is None:
        kept, below = [], math.inf
        for folder, meta in found:
            if meta["step"] < below:
                kept.append(folder)
                below = meta["step"]
    else:
        kept = _history(found, lineage, run_dir)
    return kept, [folder for folder, _ in found if folder not in kept]


def _history(found: list[tuple[str, dict]], lineage: Lineage, run_dir: str) -> list[str]:
    """The folders of `found` (newest commit first) in the history `lineage` is the newest checkpoint's of."""
    kept: list[tuple[str, dict]] = []
    ceiling = math.inf
    while True:
        for folder, meta in found:
            theirs = Lineage.of(meta)
            below = kept[-1][1]["step"] if kept else math.inf
            if theirs is not None and theirs.history == lineage.history and meta["step"] <= ceiling \
                    and meta["step"] < below:
                kept.append((folder, meta))
        began = lineage.began_from
        if began is None or not (_same_folder(began, run_dir) or _same_folder(began.rstrip("/").rpartition("/")[0],
                                                                               run_dir)):
            break
        # It began from a checkpoint of this folder, committed before it: that checkpoint's history, up to it.
        earliest = committed_at(kept[-1][1])
        parent = next((meta for _, meta in found if meta["step"] == lineage.began_at
                       and committed_at(meta) < earliest), None)
        if parent is None or (Lineage.of(parent) or Lineage()).history is None:
            break
        lineage, ceiling = Lineage.of(parent), lineage.began_at
    return [folder for folder, _ in kept]


def _same_folder(a: str, b: str) -> bool:
    if is_remote(a) or is_remote(b):
        return same_place(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def flags_note(load_optimizer: bool, load_lr_scheduler: bool, lineage: Lineage | None) -> str | None:
    """What a resume of the run's own checkpoint says about load_* flags set to false (they acted at its start,
    or have nothing to act on); None when both are true."""
    off = [key for key, loaded in (("load_optimizer", load_optimizer), ("load_lr_scheduler", load_lr_scheduler))
           if not loaded]
    if not off:
        return None
    text = f"{' and '.join(f'{key} = false' for key in off)} act{'s' * (len(off) == 1)} only when a run starts from " \
           "resume_checkpoint_path"
    if lineage is not None and lineage.began_from is not None:
        return f"{text}: this run did, at step {lineage.began_at} of {lineage.began_from}; its own checkpoints " \
               "are continued as they are"
    return f"{text}: this resume of the run's own checkpoint keeps its optimizer state and LR schedule; to reset " \
           "them here, set resume_checkpoint_path to this step folder"


# ---------------------------------------------------------------------------------------------
# An LR schedule edited under a checkpoint

def _recorded_lr(saved: dict):
    """(the run's LR schedule, each stage's own or None, the schedule of stage starts) of a recorded config."""
    run = converter.structure(saved["optimizer"]["learning_rate_scheduler"], LRSchedulerArgs)
    stages = sorted(saved["data_stages"], key=lambda s: s["start_training_step"])
    own = [None if s.get("learning_rate_scheduler") is None
           else converter.structure(s["learning_rate_scheduler"], StageLRSchedulerArgs) for s in stages]
    schedule = Schedule([Stage(s["name"], s["start_training_step"], 1, 1) for s in stages],
                        int(saved["tokens"]["train_steps"]))
    return run, own, schedule


def _changes(saved: dict, now: dict) -> list[str]:
    """The keys the LR depends on that differ between a recorded config and the current one."""
    changes = []

    def compare(label: str, was: dict, is_now: dict) -> None:
        for key in sorted(set(was) | set(is_now)):
            if was.get(key) != is_now.get(key):
                changes.append(f"{label}{key} was {was.get(key, 'unset')}, the config now says {is_now.get(key, 'unset')}")

    compare("tokens.", {"train_steps": saved["tokens"]["train_steps"]}, {"train_steps": now["tokens"]["train_steps"]})
    compare("optimizer.learning_rate_scheduler.", saved["optimizer"]["learning_rate_scheduler"],
            now["optimizer"]["learning_rate_scheduler"])
    before, after = ({s["name"]: s for s in c["data_stages"]} for c in (saved, now))
    for name, stage in after.items():
        if name not in before:
            changes.append(f'+ stage "{name}" starts at step {stage["start_training_step"]}')
            continue
        compare(f"data_stages.{name}.", {"start_training_step": before[name]["start_training_step"]},
                {"start_training_step": stage["start_training_step"]})
        compare(f"data_stages.{name}.learning_rate_scheduler.", before[name].get("learning_rate_scheduler") or {},
                stage.get("learning_rate_scheduler") or {})
    changes += [f'- stage "{name}" (from step {stage["start_training_step"]}) is gone'
                for name, stage in before.items() if name not in after]
    return changes


def lr_schedule_change(saved: dict, config, schedule: Schedule, completed: int, origin: int) -> str | None:
    """What changed, when `config` gives step completed + 1 — a step of the stage that trained step `completed`,
    under the recorded config `saved` too — another LR than `saved` does (both counted from `origin`); else None.
    A next step that starts a stage not begun yet may train at anything: that stage is the future. A record
    that cannot be read as a config of today's nanoflow is not compared."""
    step = completed + 1
    try:
        run, own, before_schedule = _recorded_lr(saved)
    except Exception:  # noqa: BLE001 - an older record: nothing to compare with, as before lineage was checked
        return None
    if not 1 <= completed < min(before_schedule.train_steps, schedule.train_steps):
        return None
    index = active_stage(schedule, step)
    if index != active_stage(schedule, completed) or \
            active_stage(before_schedule, step) != active_stage(before_schedule, completed):
        return None
    before = lr_of(step, run, own, before_schedule, origin)
    after = scheduled_lr(step, config, schedule, origin)
    if before == after:
        return None
    trained = lr_of(completed, run, own, before_schedule, origin)
    changes = _changes(saved, config.to_dict()) or ["(no LR key differs: the schedule around it does)"]
    return (f'the LR schedule of stage "{schedule.stages[index].name}", which step {completed} trained and step '
            f"{step} goes on with, changed under this checkpoint:\n  " + "\n  ".join(changes)
            + f"\n  step {step} trains at {after:.4g}, not the {before:.4g} this checkpoint's config gives it "
              f"(step {completed} trained at {trained:.4g})")
