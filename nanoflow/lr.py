"""The learning rate as a closed-form function of the step: no scheduler object to save or restore.

nanotron's semantics (linear/constant warmup, then linear, cosine or 1-sqrt decay to
min_decay_lr, WSD through lr_decay_starting_step / lr_decay_steps), without its off-by-one:
here step 1 of a linear warmup over W steps trains at learning_rate / W, not at 0, and the last
warmup step trains at the full rate.
"""

from __future__ import annotations

import math


def lr_at(step: int, args, train_steps: int, origin: int = 0) -> float:
    """The learning rate of global step `step` (1-based).

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
    progress = (t - decay_start) / decay_steps
    if args.lr_decay_style == "linear":
        shape = 1.0 - progress
    elif args.lr_decay_style == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif args.lr_decay_style == "1-sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown lr_decay_style {args.lr_decay_style!r}")
    return floor + (peak - floor) * shape
