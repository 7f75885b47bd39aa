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
    assert all(x < y for x, y in zip(values, values[1:]))
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
    for x, y in zip(after, after[1:]):
        assert y <= x + tol
    if a.lr_warmup_steps:
        assert values[a.lr_warmup_steps - 1] == pytest.approx(a.learning_rate, rel=1e-12)
    if a.lr_warmup_style == "linear":
        assert all(x <= y for x, y in zip(values[:warmup], values[1:warmup]))
