"""What may change on a resume: the checks a checkpoint's metadata meets before any of its tensors is read.

Each check compares what the checkpoint recorded with the run resuming it, raises the error of a change that
would make the resumed run compute something else than the one saved (unless the config says to go on), and
returns what it found that does not refuse the resume: the Checkpointer says it (docs/resume.md lists the keys).
"""

from __future__ import annotations

import attrs

from nanoflow import io
from nanoflow.checkpoint.lineage import LRChangedError, lr_schedule_change
from nanoflow.config import Rope, model_changes, recorded_stage_ropes, stage_rope
from nanoflow.data.fingerprint import DataChangedError
from nanoflow.errors import ScheduleDriftError
from nanoflow.run import Run
from nanoflow.schedule import TrainingMetadata

MOST_CHANGES_SHOWN = 20   # of the data changes one refusal lists; the rest are counted


@attrs.frozen
class Findings:
    """What a check found that lets the resume go on: `warnings` (a deliberate change, to be seen) and `notes`."""

    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def check_model(reader: io.CheckpointReader, run: Run) -> Findings:
    """Refuse a [model] whose weights would not fit the checkpoint's, or would compute something else than they
    were trained to; warn of the deliberate changes (dtype), note the harmless ones (nanoflow.config's MODEL_KEYS
    says which keys are which; RoPE is the stages', check_rope's)."""
    changes = model_changes(reader.metadata["config"]["model"], run.config.to_dict()["model"])
    refused = changes["shape"] + changes["numbers"]
    if refused:
        raise io.CheckpointError(
            f"{reader.path} holds a different model:\n  " + "\n  ".join(refused)
            + ("" if changes["shape"] else "\nSet it back to resume; to train these weights on under the new "
               f"settings, start a new run with [model] init_from = {reader.path}"))
    return Findings(tuple(f"resuming with {line}" for line in changes["changes"]),
                    tuple(f"resuming with {line}" for line in changes["free"]))


def check_rope(reader: io.CheckpointReader, run: Run, trained: TrainingMetadata) -> Findings:
    """Refuse a config that gives a stage the checkpoint has begun another RoPE than the checkpoint's config gave it
    (ScheduleDriftError): a stage's RoPE is part of the stage, like its sequence length; a context extension is a new
    stage. A record that cannot be read as a config of today's nanoflow is not compared."""
    try:
        before = recorded_stage_ropes(reader.metadata["config"])
    except (KeyError, TypeError, ValueError):
        return Findings()
    now = {stage.name: stage_rope(run.config, index) for index, stage in enumerate(run.config.data_stages)}
    changes = [line for stage in trained.stages if stage.name in before and stage.name in now
               for line in _rope_changes(stage.name, before[stage.name], now[stage.name])]
    if changes:
        raise ScheduleDriftError(
            f"{reader.path}: the RoPE of stages this checkpoint has trained differs from what they trained with:\n  "
            + "\n  ".join(changes) + f"\nSet it back to resume (a stage that sets no RoPE keys has the stage "
            f"before's, the first [model]'s); to encode positions otherwise from step {trained.completed + 1}, start "
            "a new stage there with its own rope_theta or [data_stages.rope_scaling]")
    return Findings()


def _rope_changes(name: str, was: Rope, now: Rope) -> list[str]:
    lines = [f'stage "{name}": rope_theta was {was.theta!r}, the config now says {now.theta!r}'] \
        if was.theta != now.theta else []
    if was.scaling_table() != now.scaling_table():
        lines.append(f'stage "{name}": rope_scaling was {was.scaling_table()}, the config now says '
                     f"{now.scaling_table()}")
    return lines


def check_data(reader: io.CheckpointReader, run: Run) -> Findings:
    """Refuse to resume a begun stage on other data, tokenizer or seeds, or an eval set the checkpoint recorded on
    other samples under the same name (unless checkpoints.ignore_fingerprint_mismatch, then warn: eval.jsonl's rows
    carry each set's data_fingerprint, so the new set's rows are told apart). A checkpoint without fingerprints
    (written before nanoflow recorded them) is not checked; data that only moved is noted."""
    saved, saved_evals = reader.metadata.get("data_fingerprint"), reader.metadata.get("eval_fingerprint")
    changes, moves = run.fingerprints.compare(saved) if isinstance(saved, dict) else ([], [])
    eval_changes, eval_moves = run.fingerprints.compare_evals(saved_evals) if isinstance(saved_evals, dict) \
        else ([], [])
    notes = tuple(f"data moved: {line}" for line in moves + eval_moves)
    if not changes and not eval_changes:
        return Findings(notes=notes)
    parts = []
    if changes:
        parts.append("the data of stages this checkpoint has trained differs from what they trained on:\n  "
                     + _listed(changes))
    if eval_changes:
        parts.append(f"eval sets read other data than their rows in eval.jsonl (up to step {reader.metadata['step']}) "
                     "were scored on, under the same names:\n  " + _listed(eval_changes))
    text = f"{reader.path}: " + "\n".join(parts)
    if not run.config.checkpoints.ignore_fingerprint_mismatch:
        raise DataChangedError(text + "\nTo resume on the changed data anyway, set [checkpoints] "
                                      "ignore_fingerprint_mismatch = true (or start a new run"
                               + ("; or give a changed eval set a new name" if eval_changes else "") + ")")
    return Findings((f"{text}\n  resuming anyway, as checkpoints.ignore_fingerprint_mismatch = true says; "
                     "the next checkpoint records the new fingerprints"
                     + (" and eval.jsonl's rows from now on carry each set's new data_fingerprint" if eval_changes
                        else ""),), notes)


def _listed(changes: list[str]) -> str:
    more = len(changes) - MOST_CHANGES_SHOWN
    return "\n  ".join(changes[:MOST_CHANGES_SHOWN]) + (f"\n  … and {more} more" if more > 0 else "")


def check_lr(reader: io.CheckpointReader, run: Run, completed: int, lr_origin: int) -> Findings:
    """Refuse a config that gives the next step of a begun stage another LR than the checkpoint's config did
    (unless checkpoints.ignore_lr_schedule_change, then warn); `completed` steps are done, the LR schedule
    counts from `lr_origin`."""
    change = lr_schedule_change(reader.metadata["config"], run.config, run.schedule, completed, lr_origin)
    if change is None:
        return Findings()
    if not run.config.checkpoints.ignore_lr_schedule_change:
        raise LRChangedError(f"{reader.path}: {change}\nTo resume with the LR re-fitted anyway, set [checkpoints] "
                             "ignore_lr_schedule_change = true; to keep it, leave the stage's length (the next "
                             "stage's start, train_steps) and LR keys as the checkpoint has them")
    return Findings((f"{reader.path}: {change}\n  resuming anyway, as checkpoints.ignore_lr_schedule_change = true "
                     "says; the next checkpoint records the new schedule",))


def check_optimizer(reader: io.CheckpointReader, run: Run) -> tuple[bool, Findings]:
    """(whether the checkpoint's AdamW ran torch's fused kernel, what to say). The config's torch_adam_is_fused,
    when set, wins; unset, the run goes on with the checkpoint's implementation (a record without the key, or with
    false, is not fused: what nanoflow trained with before fused was the default). A config that names another
    implementation is warned of: the kernels round differently, so the run continues close to, not bit for bit
    as, the one trained straight."""
    factory = reader.metadata["config"].get("optimizer", {}).get("optimizer_factory", {})
    recorded = factory.get("torch_adam_is_fused") is True
    chosen = run.config.optimizer.optimizer_factory.torch_adam_is_fused
    if chosen is None or chosen == recorded:
        return recorded, Findings()
    return recorded, Findings((
        f"resuming with optimizer.optimizer_factory.torch_adam_is_fused = {str(chosen).lower()} (was "
        f"{str(recorded).lower()}): AdamW's updates round otherwise from here, so the run continues close to, not "
        "bit for bit as, the one trained straight; leave the key unset to go on as the checkpoint trained",))
