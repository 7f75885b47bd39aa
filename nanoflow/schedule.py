"""The stage math: which stage trains a step, how far each stage has read, where a resume lands.

Pure functions of a `Schedule` and a step count. No torch, no IO, no state: everything the
training loop and the checkpoint reader need to know about "where are we" is derived here
from (schedule, completed steps), so it can be property-tested exhaustively.

Steps are 1-based global optimizer steps, as in nanotron. `completed` counts finished steps
(0 before training, `train_steps` at the end).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs
from attrs import field, frozen

from nanoflow.errors import ScheduleDriftError, ScheduleError


@frozen
class Stage:
    name: str
    start_step: int
    global_batch_size: int
    sequence_length: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.sequence_length


def _sorted_stages(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    return tuple(sorted(stages, key=lambda s: s.start_step))


@frozen
class Schedule:
    stages: tuple[Stage, ...] = field(converter=_sorted_stages)
    train_steps: int

    def __attrs_post_init__(self) -> None:
        if not self.stages:
            raise ScheduleError("the schedule has no stages: add at least one [[data_stages]] table", key="data_stages")
        if self.train_steps < 1:
            raise ScheduleError(f"train_steps must be at least 1, got {self.train_steps}", key="train_steps")
        seen_names: set[str] = set()
        starts: dict[int, str] = {}
        for stage in self.stages:
            if stage.name in seen_names:
                raise ScheduleError(f'two stages are named "{stage.name}"', stage=stage.name, key="name")
            seen_names.add(stage.name)
            if stage.start_step < 1:
                raise ScheduleError(
                    f'stage "{stage.name}" starts at step {stage.start_step}; steps are 1-based',
                    stage=stage.name, key="start_step")
            if stage.start_step in starts:
                raise ScheduleError(
                    f'stages "{starts[stage.start_step]}" and "{stage.name}" both start at step {stage.start_step}',
                    stage=stage.name, key="start_step")
            starts[stage.start_step] = stage.name
            for key in ("global_batch_size", "sequence_length"):
                if getattr(stage, key) < 1:
                    raise ScheduleError(
                        f'stage "{stage.name}" has {key} = {getattr(stage, key)}; it must be positive',
                        stage=stage.name, key=key)
        first = self.stages[0]
        if first.start_step != 1:
            raise ScheduleError(
                f'the first stage "{first.name}" starts at step {first.start_step}; it must start at step 1',
                stage=first.name, key="start_step")

    @classmethod
    def from_config(cls, config) -> Schedule:
        """The schedule of a loaded `nanoflow.config.Config`, with per-stage overrides applied."""
        stages = []
        for index, stage_args in enumerate(config.data_stages):
            tokens = config.stage_tokens(index)
            stages.append(Stage(
                name=stage_args.name,
                start_step=stage_args.start_training_step,
                global_batch_size=tokens.micro_batch_size * tokens.batch_accumulation_per_replica * config.parallelism.dp,
                sequence_length=tokens.sequence_length,
            ))
        return cls(stages, config.tokens.train_steps)

    def index(self, name: str) -> int:
        for i, stage in enumerate(self.stages):
            if stage.name == name:
                return i
        raise KeyError(name)


@frozen
class TrainingMetadata:
    """What a checkpoint records about the schedule: enough to resume, and to detect a rewritten history."""

    completed: int
    stages: tuple[Stage, ...]             # the stages that had begun, as they were trained
    consumed_samples: tuple[int, ...]     # per begun stage

    def to_dict(self) -> dict:
        return attrs.asdict(self, recurse=True)

    @classmethod
    def from_dict(cls, data: dict) -> TrainingMetadata:
        return cls(
            completed=int(data["completed"]),
            stages=tuple(Stage(**s) for s in data["stages"]),
            consumed_samples=tuple(int(n) for n in data["consumed_samples"]),
        )


@frozen
class ResumePoint:
    stage: int              # index of the stage that trains `step` (the last stage when training is done)
    step: int               # the next step to train; train_steps + 1 when done
    samples_in_stage: int   # samples of that stage already read


def _check_step(schedule: Schedule, step: int) -> None:
    if not 1 <= step <= schedule.train_steps:
        raise ValueError(f"step {step} is outside the schedule's steps 1..{schedule.train_steps}")


def _check_completed(schedule: Schedule, completed: int) -> None:
    if not 0 <= completed <= schedule.train_steps:
        raise ValueError(f"completed = {completed} is outside 0..{schedule.train_steps}")


def active_stage(schedule: Schedule, step: int) -> int:
    """Index of the stage that trains global step `step` (1-based)."""
    _check_step(schedule, step)
    starts = [s.start_step for s in schedule.stages]
    return bisect.bisect_right(starts, step) - 1


def stage_steps(schedule: Schedule, index: int) -> range:
    """The steps stage `index` trains; empty for a stage that starts after train_steps ("not reached")."""
    stages = schedule.stages
    start = stages[index].start_step
    stop = stages[index + 1].start_step if index + 1 < len(stages) else schedule.train_steps + 1
    return range(start, max(start, min(stop, schedule.train_steps + 1)))


def remaining_steps(schedule: Schedule, completed: int) -> int:
    """Steps left in the stage of step `completed + 1`; 0 once training is done."""
    _check_completed(schedule, completed)
    if completed == schedule.train_steps:
        return 0
    return stage_steps(schedule, active_stage(schedule, completed + 1)).stop - (completed + 1)


def steps_trained(schedule: Schedule, completed: int) -> tuple[int, ...]:
    """Per stage, how many of its steps are among the first `completed`."""
    _check_completed(schedule, completed)
    return tuple(
        len(range(steps.start, min(steps.stop, completed + 1)))
        for steps in (stage_steps(schedule, i) for i in range(len(schedule.stages)))
    )


def consumed_samples(schedule: Schedule, completed: int) -> tuple[int, ...]:
    """Per stage, the samples read after `completed` steps."""
    return tuple(n * s.global_batch_size for n, s in zip(steps_trained(schedule, completed), schedule.stages, strict=True))


def consumed_tokens(schedule: Schedule, completed: int) -> tuple[int, ...]:
    """Per stage, the tokens read after `completed` steps."""
    return tuple(n * s.tokens_per_step for n, s in zip(steps_trained(schedule, completed), schedule.stages, strict=True))


def begun_stages(schedule: Schedule, completed: int) -> tuple[Stage, ...]:
    """The stages that trained at least one of the first `completed` steps: the frozen history."""
    return tuple(s for s in schedule.stages if s.start_step <= completed)


def training_metadata(schedule: Schedule, completed: int) -> TrainingMetadata:
    """What a checkpoint taken after `completed` steps records."""
    begun = begun_stages(schedule, completed)
    return TrainingMetadata(completed, begun, consumed_samples(schedule, completed)[: len(begun)])


def schedule_drift(schedule: Schedule, meta: TrainingMetadata) -> list[str]:
    """Differences between the checkpoint's trained history and this schedule; empty when compatible.

    Stages that have begun are frozen (name, start, batch, sequence length); stages that have not
    begun may be edited, added or removed.
    """
    if meta.completed > schedule.train_steps:
        return [f"the checkpoint has trained {meta.completed} steps, beyond train_steps = {schedule.train_steps}"]
    differences = []
    current = {stage.name: stage for stage in schedule.stages}
    renamed = {}  # a trained stage missing by name, but with a stage at its start: a rename
    for before in meta.stages:
        after = current.get(before.name)
        if after is None:
            after = next((s for s in schedule.stages if s.start_step == before.start_step), None)
            if after is None:
                differences.append(f'- stage "{before.name}" (trained from step {before.start_step}) is gone')
                continue
            renamed[after.name] = before.name
            differences.append(f'stage "{before.name}": name was "{before.name}", the config now says "{after.name}"')
        for key in ("start_step", "global_batch_size", "sequence_length"):
            was, now = getattr(before, key), getattr(after, key)
            if was != now:
                differences.append(f'stage "{before.name}": {key} was {was}, the config now says {now}')
    trained = {stage.name for stage in meta.stages}
    for stage in begun_stages(schedule, meta.completed):
        if stage.name not in trained and stage.name not in renamed:
            differences.append(f'+ stage "{stage.name}" starts at step {stage.start_step}, '
                               f"inside the {meta.completed} steps already trained")
    return differences


def resume_point(schedule: Schedule, meta: TrainingMetadata) -> ResumePoint:
    """Where training continues after the checkpoint described by `meta`.

    Raises ScheduleDriftError when the schedule rewrites what was already trained.
    """
    differences = schedule_drift(schedule, meta)
    if differences:
        raise ScheduleDriftError(
            f"the schedule differs from the one this checkpoint was trained with (step {meta.completed}):\n  "
            + "\n  ".join(differences))
    completed = meta.completed
    stage = active_stage(schedule, min(completed + 1, schedule.train_steps))
    return ResumePoint(stage, completed + 1, consumed_samples(schedule, completed)[stage])


def is_save_step(step: int, interval: int, train_steps: int) -> bool:
    """Whether a run saves after `step` on its own: every `interval` steps, and after the last one (a stop
    saves too, whatever the step). The one save rule, for the checkpointer and for bin/verify-resume."""
    return step % interval == 0 or step == train_steps
