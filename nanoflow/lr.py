"""The learning rate as a closed-form function of the step: no scheduler object to save or restore.

nanotron's semantics (linear/constant warmup, then linear, cosine or 1-sqrt decay to
min_decay_lr, WSD through lr_decay_starting_step / lr_decay_steps), without its off-by-one:
here step 1 of a linear warmup over W steps trains at learning_rate / W, not at 0, and the last
warmup step trains at the full rate.

A stage may have its own schedule ([data_stages.learning_rate_scheduler]): it replaces the run's
for that stage's steps, counted from the stage's first step, and by default decays from the LR
the run's schedule gives there ("decay from here") to min_decay_lr at the stage's last step.
"""

from __future__ import annotations

import math

from attrs import frozen

from nanoflow.schedule import Schedule, active_stage


def lr_at(step: int, args, train_steps: int, origin: int = 0) -> float:
    """The learning rate of global step `step` (1-based) under the run's schedule.

    `args` is a `nanoflow.config.LRSchedulerArgs`. `origin` is the completed step the schedule
    counts from: 0 for a run, the resume step when a resume restarts the schedule
    (`load_lr_scheduler = false`).
    """
    t = step - origin  # 1-based position in this schedule
    if t < 1:
        raise ValueError(f"step {step} precedes the LR schedule's origin {origin}")
    peak, floor = args.learning_rate, args.min_decay_lr
    warmup = args.lr_warmup_steps
    if t <= warmup:
        return peak * t / warmup if args.lr_warmup_style == "linear" else peak

    decay_start = args.lr_decay_starting_step - origin if args.lr_decay_starting_step is not None else warmup
    decay_steps = args.lr_decay_steps if args.lr_decay_steps is not None else train_steps - origin - decay_start
    if args.lr_decay_style == "constant" or t <= decay_start:
        return peak
    if decay_steps <= 0 or t >= decay_start + decay_steps:
        return floor
    return _decayed(peak, floor, args.lr_decay_style, (t - decay_start) / decay_steps)


def _decayed(peak: float, floor: float, style: str, progress: float) -> float:
    """The LR a fraction `progress` in (0, 1) of the way down a decay of shape `style`."""
    if style == "linear":
        shape = 1.0 - progress
    elif style == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif style == "1-sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown lr_decay_style {style!r}")
    return floor + (peak - floor) * shape


# ---------------------------------------------------------------------------------------------
# A stage's own schedule


def stage_span(schedule: Schedule, index: int) -> range:
    """The steps stage `index` has in the schedule: to the step before the next stage's start even
    when train_steps stops the run earlier (so a short trial trains the LRs of the full run), the
    last stage to train_steps. A stage's own LR schedule spans these."""
    stages = schedule.stages
    end = stages[index + 1].start_step - 1 if index + 1 < len(stages) else schedule.train_steps
    return range(stages[index].start_step, end + 1)


@frozen
class StageLR:
    """A stage's schedule with every default resolved, in global steps: warmup over the `warmup` steps
    from `first`, `peak` until step `decay_start`, down to `floor` at step `decay_start + decay_steps`."""

    first: int
    peak: float
    floor: float
    warmup: int
    warmup_style: str
    decay_style: str
    decay_start: int
    decay_steps: int


def resolve_stage_lr(own, run, span: range, train_steps: int, origin: int = 0) -> StageLR:
    """Stage schedule `own` (a StageLRSchedulerArgs) over the stage's `span`, with the run's schedule `run`.

    learning_rate defaults to the run's LR at the stage's first step, so the first step after the
    warmup (by default: the stage's first step) trains at exactly what the run would have given it;
    min_decay_lr defaults to the run's. The decay ends at the stage's
    last step unless lr_decay_steps says otherwise. A resume with load_lr_scheduler = false (`origin` > 0)
    restarts the schedule that trains its next step: inside the stage (or at its first step) the stage's
    schedule restarts at step origin + 1, warmup too, its default learning_rate then the run's
    learning_rate (the restarted run schedule is only beginning its warmup there); a stage after it
    joins the restarted run schedule as usual.
    """
    first = max(span.start, origin + 1)
    if own.learning_rate is not None:
        peak = own.learning_rate
    elif origin == 0 or span.start > origin + 1:
        peak = lr_at(first, run, train_steps, origin)
    else:
        peak = run.learning_rate
    warmup = own.lr_warmup_steps
    # The step that still trains at the peak: the last warmup step, or the first step without warmup.
    earliest = first - 1 + max(warmup, 1)
    decay_start = earliest if own.lr_decay_starting_step is None else max(own.lr_decay_starting_step, earliest)
    decay_steps = own.lr_decay_steps if own.lr_decay_steps is not None else span.stop - 1 - decay_start
    return StageLR(first=first, peak=peak, floor=run.min_decay_lr if own.min_decay_lr is None else own.min_decay_lr,
                   warmup=warmup, warmup_style=own.lr_warmup_style,
                   decay_style=own.lr_decay_style, decay_start=decay_start,
                   decay_steps=decay_steps)


def stage_lr_at(step: int, s: StageLR) -> float:
    """The learning rate of global step `step` under a resolved stage schedule."""
    t = step - s.first + 1
    if t < 1:
        raise ValueError(f"step {step} precedes the stage schedule's first step {s.first}")
    if t <= s.warmup:
        return s.peak * t / s.warmup if s.warmup_style == "linear" else s.peak
    if s.decay_style == "constant":
        return s.peak
    if s.decay_steps <= 0 or step >= s.decay_start + s.decay_steps:  # a one-step stage trains at the floor
        return s.floor
    if step <= s.decay_start:
        return s.peak
    return _decayed(s.peak, s.floor, s.decay_style, (step - s.decay_start) / s.decay_steps)


def scheduled_lr(step: int, config, schedule: Schedule, origin: int = 0) -> float:
    """The learning rate of global step `step` of `config`'s run: its stage's own schedule, or the run's."""
    return lr_of(step, config.optimizer.learning_rate_scheduler,
                 [stage.learning_rate_scheduler for stage in config.data_stages], schedule, origin)


def lr_of(step: int, run, stage_schedules, schedule: Schedule, origin: int = 0) -> float:
    """scheduled_lr from the parts of a config: the run's schedule `run` and, per stage of `schedule`, its own
    schedule or None (a checkpoint's recorded config is compared with the current one through these)."""
    index = active_stage(schedule, step)
    own = stage_schedules[index]
    if own is None:
        return lr_at(step, run, schedule.train_steps, origin)
    return stage_lr_at(step, resolve_stage_lr(own, run, stage_span(schedule, index), schedule.train_steps, origin))
