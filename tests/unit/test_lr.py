"""The closed-form learning rate: exact values at the schedule's landmarks, and bounds as a property."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoflow.config import LRSchedulerArgs
from nanoflow.lr import lr_at

LR, MIN = 3e-3, 3e-4


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=0)


def args(**kw):
    base = dict(learning_rate=LR, lr_warmup_steps=10, lr_warmup_style="linear",
                lr_decay_style="cosine", min_decay_lr=MIN)
    base.update(kw)
    return LRSchedulerArgs(**base)


# Decay shapes, written independently of the module: progress p in [0, 1] -> fraction of (peak - floor).
SHAPES = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: (1 + math.cos(math.pi * p)) / 2,
    "1-sqrt": lambda p: 1 - p ** 0.5,
}


def expected_decay(style, step, decay_start, decay_steps):
    """Step decay_start trains at the peak; step decay_start + decay_steps at the floor."""
    p = (step - decay_start) / decay_steps
    return MIN + (LR - MIN) * SHAPES[style](p)


# ---------------------------------------------------------------------------------------------
# Warmup


def test_linear_warmup_start_and_end():
    a = args(lr_warmup_steps=10)
    assert lr_at(1, a, 100) == approx(LR / 10)
    assert lr_at(5, a, 100) == approx(LR * 5 / 10)
    assert lr_at(10, a, 100) == approx(LR)


def test_linear_warmup_is_strictly_increasing_and_never_zero():
    a = args(lr_warmup_steps=7)
    values = [lr_at(s, a, 50) for s in range(1, 8)]
    assert all(v > 0 for v in values)
    assert all(x < y for x, y in zip(values, values[1:], strict=False))
    assert values[-1] == approx(LR)


def test_constant_warmup():
    a = args(lr_warmup_steps=10, lr_warmup_style="constant")
    assert lr_at(1, a, 100) == approx(LR)
    assert lr_at(10, a, 100) == approx(LR)


def test_zero_warmup_trains_step_one_at_full_rate():
    # nanotron trains its first step at lr 0; here step 1 with no warmup trains at the peak.
    for style in ("constant",):
        assert lr_at(1, args(lr_warmup_steps=0, lr_decay_style=style), 100) == approx(LR)
    for style in SHAPES:  # WSD: flat until the decay starts
        a = args(lr_warmup_steps=0, lr_decay_style=style, lr_decay_starting_step=50)
        assert lr_at(1, a, 100) == approx(LR)
    for style in SHAPES:  # immediate decay: step 1 is the first decay step, well above 0
        a = args(lr_warmup_steps=0, lr_decay_style=style)
        assert lr_at(1, a, 100) == approx(expected_decay(style, 1, 0, 100))
        assert lr_at(1, a, 100) > MIN
        assert lr_at(100, a, 100) == approx(MIN)


# ---------------------------------------------------------------------------------------------
# Decay


@pytest.mark.parametrize("style", sorted(SHAPES))
def test_decay_landmarks(style):
    W, T = 10, 110  # default lr_decay_steps = T - W = 100
    a = args(lr_warmup_steps=W, lr_decay_style=style)
    assert lr_at(W, a, T) == approx(LR)                                   # decay starts from the peak
    assert lr_at(W + 1, a, T) == approx(expected_decay(style, W + 1, W, 100))
    assert lr_at(W + 1, a, T) < LR
    assert lr_at(W + 50, a, T) == approx(expected_decay(style, W + 50, W, 100))   # mid-decay
    assert lr_at(W + 37, a, T) == approx(expected_decay(style, W + 37, W, 100))
    assert lr_at(T - 1, a, T) == approx(expected_decay(style, T - 1, W, 100))
    assert lr_at(T - 1, a, T) > MIN
    assert lr_at(T, a, T) == approx(MIN)                                  # the last step is at the floor
    assert lr_at(T + 1, a, T) == approx(MIN)                              # beyond: stays at the floor
    assert lr_at(T + 1000, a, T) == approx(MIN)


def test_mid_decay_values_by_hand():
    # progress 1/2 of a 100-step decay after 10 warmup steps
    T = 110  # warmup is 10 steps (args default here), so the decay spans steps 11..110
    assert lr_at(60, args(lr_decay_style="linear"), T) == approx(MIN + (LR - MIN) * 0.5)
    assert lr_at(60, args(lr_decay_style="cosine"), T) == approx(MIN + (LR - MIN) * 0.5)
    assert lr_at(60, args(lr_decay_style="1-sqrt"), T) == approx(MIN + (LR - MIN) * (1 - math.sqrt(0.5)))
    assert lr_at(35, args(lr_decay_style="cosine"), T) == approx(MIN + (LR - MIN) * (1 + math.cos(math.pi / 4)) / 2)


@pytest.mark.parametrize("style", sorted(SHAPES))
def test_explicit_decay_steps(style):
    a = args(lr_warmup_steps=10, lr_decay_style=style, lr_decay_steps=40)
    assert lr_at(30, a, 1000) == approx(expected_decay(style, 30, 10, 40))
    assert lr_at(50, a, 1000) == approx(MIN)
    assert lr_at(51, a, 1000) == approx(MIN)
    assert lr_at(999, a, 1000) == approx(MIN)


def test_constant_decay_style():
    a = args(lr_warmup_steps=10, lr_decay_style="constant")
    assert lr_at(5, a, 100) == approx(LR / 2)
    for step in (10, 11, 50, 100, 101, 10_000):
        assert lr_at(step, a, 100) == approx(LR)


@pytest.mark.parametrize("style", sorted(SHAPES))
def test_wsd(style):
    W, D, T = 10, 80, 120  # warmup, stable until step 80, decay over the last 40 steps
    a = args(lr_warmup_steps=W, lr_decay_style=style, lr_decay_starting_step=D)
    assert lr_at(W, a, T) == approx(LR)
    for step in range(W, D + 1):
        assert lr_at(step, a, T) == approx(LR)
    assert lr_at(D + 1, a, T) == approx(expected_decay(style, D + 1, D, T - D))
    assert lr_at(D + 1, a, T) < LR
    assert lr_at(D + 20, a, T) == approx(expected_decay(style, D + 20, D, T - D))
    assert lr_at(T, a, T) == approx(MIN)
    assert lr_at(T + 1, a, T) == approx(MIN)


def test_wsd_with_explicit_decay_steps():
    a = args(lr_warmup_steps=10, lr_decay_style="linear", lr_decay_starting_step=50, lr_decay_steps=20)
    assert lr_at(50, a, 1000) == approx(LR)
    assert lr_at(60, a, 1000) == approx(MIN + (LR - MIN) * 0.5)
    assert lr_at(70, a, 1000) == approx(MIN)
    assert lr_at(500, a, 1000) == approx(MIN)


# ---------------------------------------------------------------------------------------------
# Origin (a resume that restarts the schedule)


def test_origin_shifts_the_schedule():
    a = args(lr_warmup_steps=10, lr_decay_style="linear")
    assert lr_at(101, a, 300, origin=100) == approx(LR / 10)     # warmup step 1
    assert lr_at(110, a, 300, origin=100) == approx(LR)          # warmup step 10
    # decay over the remaining 300 - 100 - 10 = 190 steps
    assert lr_at(205, a, 300, origin=100) == approx(MIN + (LR - MIN) * (1 - 95 / 190))
    assert lr_at(300, a, 300, origin=100) == approx(MIN)
    for step in range(101, 311):
        assert lr_at(step, a, 300, origin=100) == approx(lr_at(step - 100, a, 200))


@pytest.mark.parametrize("origin", [0, 1, 100])
def test_step_at_or_before_origin_raises(origin):
    a = args()
    with pytest.raises(ValueError):
        lr_at(origin, a, 300, origin=origin)
    with pytest.raises(ValueError):
        lr_at(origin - 1, a, 300, origin=origin)


def test_step_zero_raises():
    with pytest.raises(ValueError):
        lr_at(0, args(), 100)


# ---------------------------------------------------------------------------------------------
# Property: bounds and monotonicity


@st.composite
def lr_setups(draw):
    peak = draw(st.floats(1e-6, 1.0, allow_nan=False))
    floor = draw(st.one_of(st.just(0.0), st.just(peak), st.floats(0.0, peak)))
    train_steps = draw(st.integers(1, 300))
    origin = draw(st.sampled_from([0, 0, draw(st.integers(0, train_steps - 1))]))
    a = LRSchedulerArgs(
        learning_rate=peak,
        min_decay_lr=floor,
        lr_warmup_steps=draw(st.integers(0, 50)),
        lr_warmup_style=draw(st.sampled_from(["linear", "constant"])),
        lr_decay_style=draw(st.sampled_from(["linear", "cosine", "1-sqrt", "constant"])),
        lr_decay_starting_step=draw(st.one_of(st.none(), st.integers(origin + 1, origin + 400))),
        lr_decay_steps=draw(st.one_of(st.none(), st.integers(1, 400))),
    )
    return a, train_steps, origin


@settings(max_examples=200, deadline=None)
@given(lr_setups())
def test_lr_bounded_and_non_increasing_after_warmup(setup):
    a, train_steps, origin = setup
    tol = 1e-12 * a.learning_rate
    steps = range(origin + 1, max(train_steps, origin + a.lr_warmup_steps) + 20)
    values = [lr_at(s, a, train_steps, origin) for s in steps]
    warmup = min(a.lr_warmup_steps, len(values))
    for v in values[:warmup]:  # a linear warmup climbs from peak/W, possibly below the floor
        assert 0 < v <= a.learning_rate + tol
    after = values[warmup:]
    for v in after:
        assert a.min_decay_lr - tol <= v <= a.learning_rate + tol
    for x, y in zip(after, after[1:], strict=False):
        assert y <= x + tol
    if a.lr_warmup_steps:
        assert values[a.lr_warmup_steps - 1] == pytest.approx(a.learning_rate, rel=1e-12)
    if a.lr_warmup_style == "linear":
        assert all(x <= y for x, y in zip(values[:warmup], values[1:warmup], strict=False))


# ---------------------------------------------------------------------------------------------
# A stage's own schedule ([data_stages.learning_rate_scheduler])

from types import SimpleNamespace  # noqa: E402

from nanoflow.config import StageLRSchedulerArgs  # noqa: E402
from nanoflow.lr import scheduled_lr, stage_span  # noqa: E402
from nanoflow.schedule import Schedule, Stage  # noqa: E402

STYLES = ["linear", "cosine", "1-sqrt"]


def run_of(starts, train_steps, run_args, own_args):
    """A config-shaped record (what scheduled_lr reads) and its Schedule: stage i starts at starts[i]."""
    stages = [SimpleNamespace(learning_rate_scheduler=own) for own in own_args]
    config = SimpleNamespace(optimizer=SimpleNamespace(learning_rate_scheduler=run_args), data_stages=stages)
    schedule = Schedule([Stage(f"s{i}", start, 4, 16) for i, start in enumerate(starts)], train_steps)
    return config, schedule


@st.composite
def stage_setups(draw):
    """Two stages, the second with its own schedule; the run's schedule of any style, with or without warmup."""
    train_steps = draw(st.integers(4, 300))
    start = draw(st.integers(2, train_steps))
    run_args = args(lr_warmup_steps=draw(st.integers(0, start - 1)), lr_decay_style=draw(st.sampled_from(STYLES)))
    length = train_steps - start + 1
    own = StageLRSchedulerArgs(lr_decay_style=draw(st.sampled_from(STYLES)),
                               min_decay_lr=draw(st.sampled_from([None, 0.0, 1e-5])),
                               lr_warmup_steps=draw(st.integers(0, max(0, length - 1))))
    return run_of([1, start], train_steps, run_args, [None, own])


def reference_stage_lr(step, first, last, peak, floor, warmup, style):
    """Written from the documented contract, not from the module: warmup from the stage's first step, then
    from the peak at the last warmup step (or the first step) down to the floor at the stage's last step."""
    if step - first + 1 <= warmup:
        return peak * (step - first + 1) / warmup
    top = first - 1 + max(warmup, 1)
    if last == top:
        return floor
    return floor + (peak - floor) * SHAPES[style]((step - top) / (last - top))


@settings(max_examples=300, deadline=None)
@given(stage_setups())
def test_a_stage_schedule_joins_continuously_decays_monotonically_and_ends_at_min(setup):
    config, schedule = setup
    run_args, own = config.optimizer.learning_rate_scheduler, config.data_stages[1].learning_rate_scheduler
    span = stage_span(schedule, 1)
    first, last = span.start, span.stop - 1
    floor = run_args.min_decay_lr if own.min_decay_lr is None else own.min_decay_lr
    peak = lr_at(first, run_args, schedule.train_steps)        # "decay from here"
    values = [scheduled_lr(s, config, schedule) for s in span]
    for s in range(1, first):                                  # the run's schedule before the stage
        assert scheduled_lr(s, config, schedule) == lr_at(s, run_args, schedule.train_steps)
    if own.lr_warmup_steps == 0 and len(span) > 1:
        assert values[0] == peak                               # the join: exactly what the run gave that step
    top = own.lr_warmup_steps
    after_warmup = values[max(top - 1, 0):]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:], strict=False))
    assert values[-1] == floor
    for s, v in zip(span, values, strict=True):
        assert v == pytest.approx(reference_stage_lr(s, first, last, peak, floor, own.lr_warmup_steps,
                                                     own.lr_decay_style), rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("style", STYLES + ["constant"])
def test_every_style_with_an_explicit_rate_and_wsd_inside_the_stage(style):
    own = StageLRSchedulerArgs(learning_rate=5e-3, lr_warmup_steps=2, lr_decay_style=style,
                               lr_decay_starting_step=25, lr_decay_steps=10, min_decay_lr=1e-4)
    config, schedule = run_of([1, 11], 50, args(), [None, own])   # stage 2: steps 11–50
    lrs = {s: scheduled_lr(s, config, schedule) for s in range(11, 51)}
    assert lrs[11] == approx(5e-3 / 2) and lrs[12] == approx(5e-3)    # warmup over the stage's first 2 steps
    assert all(lrs[s] == approx(5e-3) for s in range(12, 26))          # stable to the decay start
    if style == "constant":
        assert all(v == approx(5e-3) for v in lrs.values() if v != lrs[11])
    else:
        assert lrs[30] == approx(expected_decay_to(style, 5e-3, 1e-4, (30 - 25) / 10))
        assert all(lrs[s] == 1e-4 for s in range(35, 51))              # the floor after 10 decay steps


def expected_decay_to(style, peak, floor, p):
    return floor + (peak - floor) * SHAPES[style](p)


def test_a_one_step_stage_trains_at_min_decay_lr():
    config, schedule = run_of([1, 10, 11], 20, args(), [None, StageLRSchedulerArgs(min_decay_lr=1e-4), None])
    assert scheduled_lr(10, config, schedule) == 1e-4
    assert scheduled_lr(11, config, schedule) == lr_at(11, args(), 20)   # the run's schedule again after it


def test_a_stage_cut_short_by_train_steps_trains_the_full_runs_lrs():
    """A trial of the first steps of a long schedule trains the LRs of the full run (the stage spans its steps
    in the schedule, not those train_steps leaves it); the decay still ends at the stage's last step."""
    own = [None, StageLRSchedulerArgs(lr_decay_style="linear"), None]
    full = run_of([1, 21, 41], 60, args(lr_decay_style="constant"), own)
    trial = run_of([1, 21, 41], 30, args(lr_decay_style="constant"), own)
    assert [scheduled_lr(s, *trial) for s in range(1, 31)] == [scheduled_lr(s, *full) for s in range(1, 31)]
    assert scheduled_lr(40, *full) == MIN


def test_an_unreached_last_stage_is_never_evaluated_and_has_no_span():
    config, schedule = run_of([1, 30], 20, args(), [None, StageLRSchedulerArgs()])
    assert not stage_span(schedule, 1)
    assert [scheduled_lr(s, config, schedule) for s in range(1, 21)] == [lr_at(s, args(), 20) for s in range(1, 21)]


def test_origin_before_the_stage_joins_the_restarted_run_schedule():
    """load_lr_scheduler = false at step 5: the run's schedule restarts there; a later stage decays from the
    LR that restarted schedule gives at its first step."""
    config, schedule = run_of([1, 21], 40, args(lr_decay_style="constant"), [None, StageLRSchedulerArgs()])
    assert scheduled_lr(6, config, schedule, origin=5) == approx(LR / 10)      # the run's warmup again
    assert scheduled_lr(21, config, schedule, origin=5) == lr_at(21, args(lr_decay_style="constant"), 40, 5)
    assert scheduled_lr(40, config, schedule, origin=5) == MIN


@pytest.mark.parametrize("origin", [20, 25, 38])  # 20: the resume step is the step before the stage
def test_origin_inside_the_stage_restarts_the_stage_schedule(origin):
    """load_lr_scheduler = false mid-stage: the stage's schedule restarts at origin + 1, warmup too, from the run's
    learning_rate (or its own) down to min_decay_lr at the stage's last step."""
    config, schedule = run_of([1, 21], 40, args(), [None, StageLRSchedulerArgs(lr_warmup_steps=1)])
    assert scheduled_lr(origin + 1, config, schedule, origin=origin) == LR
    assert scheduled_lr(40, config, schedule, origin=origin) == MIN
    values = [scheduled_lr(s, config, schedule, origin=origin) for s in range(origin + 1, 41)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    with pytest.raises(ValueError, match="precedes"):
        scheduled_lr(origin, config, schedule, origin=origin)


# ---------------------------------------------------------------------------------------------
# Validation: a stage's schedule must fit in the stage; errors name the stage and the key

from helpers import TINY  # noqa: E402   # sft: steps 8–12

from nanoflow.config import ConfigError, load_config  # noqa: E402

SFT = 'data_stages[1] (stage "sft").learning_rate_scheduler.'


@pytest.mark.parametrize(("key", "value", "message"), [
    ("lr_warmup_steps", "5", "lr_warmup_steps = 5 leaves no step of the stage's 5 steps 8–12 to decay in"),
    ("lr_decay_starting_step", "3", "lr_decay_starting_step = 3 is outside the stage's 5 steps 8–12"),
    ("lr_decay_starting_step", "13", "lr_decay_starting_step = 13 is outside"),
    ("lr_decay_steps", "5", "would end at step 13, after the stage's last step 12; at most 4"),
    ("min_decay_lr", "-1.0", "'min_decay_lr' must be >= 0"),
    ("learning_rate", "0", "'learning_rate' must be > 0"),
    ("lr_decay_style", '"cosin"', "lr_decay_style"),
    ("learnin_rate", "1e-3", "did you mean 'learning_rate'"),
])
def test_a_stage_schedule_that_does_not_fit_names_the_stage_and_the_key(key, value, message):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, [f"data_stages.sft.learning_rate_scheduler.{key}={value}"])
    assert message in str(error.value) and 'stage "sft"' in str(error.value)
    assert str(TINY) in str(error.value)


def test_a_stage_schedule_from_toml_drives_the_lr_and_the_last_stage_ends_at_its_floor():
    config = load_config(TINY, ["data_stages.sft.learning_rate_scheduler.min_decay_lr=1e-5",
                                "data_stages.sft.learning_rate_scheduler.lr_decay_style=\"cosine\""])
    schedule = Schedule.from_config(config)
    run = config.optimizer.learning_rate_scheduler
    assert scheduled_lr(8, config, schedule) == lr_at(8, run, 12)
    assert scheduled_lr(12, config, schedule) == 1e-5
    assert scheduled_lr(7, config, schedule) == lr_at(7, run, 12)
