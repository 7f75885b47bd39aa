"""Property tests of the pure stage math in nanoflow.schedule."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanoflow.schedule import (
    ResumePoint,
    Schedule,
    ScheduleDriftError,
    ScheduleError,
    Stage,
    TrainingMetadata,
    active_stage,
    consumed_samples,
    consumed_tokens,
    remaining_steps,
    resume_point,
    stage_steps,
    training_metadata,
)

FAST = settings(max_examples=150, deadline=None)

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=8)
SIZES = st.integers(1, 64)


@st.composite
def schedules(draw, min_stages=1, max_stages=6):
    """A valid schedule: first stage at 1, unique names and starts, some maybe past train_steps."""
    train_steps = draw(st.integers(1, 500))
    n = draw(st.integers(min_stages, max_stages))
    names = draw(st.lists(NAMES, min_size=n, max_size=n, unique=True))
    later = draw(st.lists(st.integers(2, train_steps + 50), min_size=n - 1, max_size=n - 1, unique=True))
    starts = [1] + later
    stages = [Stage(name, start, draw(SIZES), draw(SIZES)) for name, start in zip(names, starts, strict=True)]
    stages = draw(st.permutations(stages))  # Schedule sorts them
    return Schedule(stages, train_steps)


@st.composite
def schedule_and_completed(draw, **kw):
    schedule = draw(schedules(**kw))
    return schedule, draw(st.integers(0, schedule.train_steps))


def brute_active(schedule: Schedule, step: int) -> int:
    return max((i for i, s in enumerate(schedule.stages) if s.start_step <= step),
               key=lambda i: schedule.stages[i].start_step)


def steps_done(schedule: Schedule, completed: int) -> list[int]:
    """Per stage, the number of its steps among 1..completed, by counting."""
    counts = [0] * len(schedule.stages)
    for step in range(1, completed + 1):
        counts[brute_active(schedule, step)] += 1
    return counts


# ---------------------------------------------------------------------------------------------
# Construction


@FAST
@given(schedules())
def test_schedule_sorts_stages(schedule):
    starts = [s.start_step for s in schedule.stages]
    assert starts == sorted(starts)
    assert starts[0] == 1
    assert isinstance(schedule.stages, tuple)
    for i, s in enumerate(schedule.stages):
        assert schedule.index(s.name) == i


def test_schedule_sorts_given_order():
    a, b, c = Stage("a", 1, 2, 8), Stage("b", 10, 2, 8), Stage("c", 5, 2, 8)
    assert Schedule([b, c, a], 20).stages == (a, c, b)


def _raises(stages, train_steps=10):
    with pytest.raises(ScheduleError) as info:
        Schedule(stages, train_steps)
    return info.value


def test_error_no_stages():
    e = _raises([])
    assert e.key == "data_stages"


def test_error_duplicate_names():
    e = _raises([Stage("a", 1, 2, 8), Stage("a", 5, 2, 8)])
    assert (e.stage, e.key) == ("a", "name")
    assert '"a"' in str(e)


def test_error_duplicate_starts():
    e = _raises([Stage("a", 1, 2, 8), Stage("b", 5, 2, 8), Stage("c", 5, 2, 8)])
    assert e.key == "start_step"
    assert e.stage in ("b", "c")
    assert "5" in str(e)


def test_error_first_stage_not_at_one():
    e = _raises([Stage("b", 7, 2, 8), Stage("a", 3, 2, 8)])
    assert (e.stage, e.key) == ("a", "start_step")
    assert "step 1" in str(e)


@pytest.mark.parametrize("start", [0, -3])
def test_error_start_below_one(start):
    e = _raises([Stage("a", 1, 2, 8), Stage("b", start, 2, 8)])
    assert (e.stage, e.key) == ("b", "start_step")


@pytest.mark.parametrize("key", ["global_batch_size", "sequence_length"])
@pytest.mark.parametrize("value", [0, -1])
def test_error_non_positive_sizes(key, value):
    bad = attrs.evolve(Stage("b", 4, 2, 8), **{key: value})
    e = _raises([Stage("a", 1, 2, 8), bad])
    assert (e.stage, e.key) == ("b", key)
    assert key in str(e)


def test_error_train_steps():
    e = _raises([Stage("a", 1, 2, 8)], train_steps=0)
    assert e.key == "train_steps"


def test_schedule_error_is_value_error():
    assert issubclass(ScheduleError, ValueError)
    assert issubclass(ScheduleDriftError, ScheduleError)


@FAST
@given(schedules(min_stages=2), st.data())
def test_error_properties_on_random_schedules(schedule, data):
    """Breaking one stage of a valid schedule names that stage."""
    stages = list(schedule.stages)
    i = data.draw(st.integers(1, len(stages) - 1))
    victim = stages[i]
    kind = data.draw(st.sampled_from(["dup_name", "dup_start", "zero_batch", "zero_seq", "start0"]))
    if kind == "dup_name":
        other = stages[data.draw(st.integers(0, i - 1))]
        stages[i] = attrs.evolve(victim, name=other.name)
        expected = (other.name, "name")
    elif kind == "dup_start":
        other = stages[data.draw(st.integers(0, i - 1))]
        stages[i] = attrs.evolve(victim, start_step=other.start_step)
        expected = (victim.name, "start_step")
    elif kind == "zero_batch":
        stages[i] = attrs.evolve(victim, global_batch_size=0)
        expected = (victim.name, "global_batch_size")
    elif kind == "zero_seq":
        stages[i] = attrs.evolve(victim, sequence_length=0)
        expected = (victim.name, "sequence_length")
    else:
        stages[i] = attrs.evolve(victim, start_step=0)
        expected = (victim.name, "start_step")
    with pytest.raises(ScheduleError) as info:
        Schedule(stages, schedule.train_steps)
    assert (info.value.stage, info.value.key) == expected
    assert expected[0] in str(info.value)


# ---------------------------------------------------------------------------------------------
# active_stage


@FAST
@given(schedules())
def test_active_stage_monotone_and_covering(schedule):
    T = schedule.train_steps
    indices = [active_stage(schedule, step) for step in range(1, T + 1)]
    assert indices[0] == 0
    assert all(a <= b for a, b in zip(indices, indices[1:], strict=False))
    for step, index in zip(range(1, T + 1), indices, strict=True):
        assert index == brute_active(schedule, step)
        assert schedule.stages[index].start_step <= step
        if index + 1 < len(schedule.stages):
            assert schedule.stages[index + 1].start_step > step
    with pytest.raises(ValueError):
        active_stage(schedule, 0)
    with pytest.raises(ValueError):
        active_stage(schedule, T + 1)


# ---------------------------------------------------------------------------------------------
# stage_steps


@FAST
@given(schedules())
def test_stage_steps_partition(schedule):
    T = schedule.train_steps
    ranges = [stage_steps(schedule, i) for i in range(len(schedule.stages))]
    assert [step for r in ranges for step in r] == list(range(1, T + 1))
    for i, (stage, r) in enumerate(zip(schedule.stages, ranges, strict=True)):
        assert isinstance(r, range)
        if stage.start_step > T:
            assert len(r) == 0
        else:
            assert r.start == stage.start_step
            assert len(r) > 0
            assert all(active_stage(schedule, step) == i for step in r)


def test_stage_steps_example():
    s = Schedule([Stage("pretrain", 1, 16, 256), Stage("anneal", 201, 16, 256),
                  Stage("sft", 251, 64, 32), Stage("later", 1000, 1, 1)], 300)
    assert [stage_steps(s, i) for i in range(4)] == [range(1, 201), range(201, 251), range(251, 301), range(1000, 1000)]
    assert remaining_steps(s, 100) == 100
    assert remaining_steps(s, 200) == 50
    assert remaining_steps(s, 299) == 1
    assert remaining_steps(s, 300) == 0


# ---------------------------------------------------------------------------------------------
# consumed samples and tokens


@FAST
@given(schedules())
def test_consumed_totals(schedule):
    T = schedule.train_steps
    lengths = [len(stage_steps(schedule, i)) for i in range(len(schedule.stages))]
    samples = consumed_samples(schedule, T)
    tokens = consumed_tokens(schedule, T)
    assert len(samples) == len(tokens) == len(schedule.stages)
    assert samples == tuple(n * s.global_batch_size for n, s in zip(lengths, schedule.stages, strict=True))
    assert tokens == tuple(n * s.global_batch_size * s.sequence_length for n, s in zip(lengths, schedule.stages, strict=True))
    assert sum(samples) == sum(n * s.global_batch_size for n, s in zip(lengths, schedule.stages, strict=True))
    assert sum(tokens) == sum(n * s.global_batch_size * s.sequence_length for n, s in zip(lengths, schedule.stages, strict=True))
    assert consumed_samples(schedule, 0) == (0,) * len(schedule.stages)
    assert consumed_tokens(schedule, 0) == (0,) * len(schedule.stages)


@FAST
@given(schedule_and_completed())
def test_consumed_matches_counting(setup):
    schedule, k = setup
    counts = steps_done(schedule, k)
    assert consumed_samples(schedule, k) == tuple(n * s.global_batch_size for n, s in zip(counts, schedule.stages, strict=True))
    assert consumed_tokens(schedule, k) == tuple(n * s.tokens_per_step for n, s in zip(counts, schedule.stages, strict=True))


@FAST
@given(schedules())
def test_consumed_samples_additive(schedule):
    T = schedule.train_steps
    previous = consumed_samples(schedule, 0)
    previous_tokens = consumed_tokens(schedule, 0)
    for k in range(T):
        current = consumed_samples(schedule, k + 1)
        current_tokens = consumed_tokens(schedule, k + 1)
        j = active_stage(schedule, k + 1)
        stage = schedule.stages[j]
        for i, (a, b) in enumerate(zip(previous, current, strict=True)):
            assert b - a == (stage.global_batch_size if i == j else 0)
        for i, (a, b) in enumerate(zip(previous_tokens, current_tokens, strict=True)):
            assert b - a == (stage.global_batch_size * stage.sequence_length if i == j else 0)
        previous, previous_tokens = current, current_tokens


@FAST
@given(schedules())
def test_consumed_out_of_range_raises(schedule):
    for bad in (-1, schedule.train_steps + 1):
        with pytest.raises(ValueError):
            consumed_samples(schedule, bad)
        with pytest.raises(ValueError):
            consumed_tokens(schedule, bad)
        with pytest.raises(ValueError):
            remaining_steps(schedule, bad)


# ---------------------------------------------------------------------------------------------
# remaining_steps


@FAST
@given(schedules())
def test_remaining_steps(schedule):
    T = schedule.train_steps
    for k in range(T):
        j = active_stage(schedule, k + 1)
        done = k + 1 - schedule.stages[j].start_step
        remaining = remaining_steps(schedule, k)
        assert remaining + done == len(stage_steps(schedule, j))
        assert remaining > 0  # mid-stage too: nanotron answers 0 here
    assert remaining_steps(schedule, T) == 0


# ---------------------------------------------------------------------------------------------
# Resume


@FAST
@given(schedules())
def test_resume_point_every_step(schedule):
    T = schedule.train_steps
    for k in range(T):
        j = active_stage(schedule, k + 1)
        expected = ResumePoint(j, k + 1, consumed_samples(schedule, k)[j])
        assert resume_point(schedule, training_metadata(schedule, k)) == expected
    end = resume_point(schedule, training_metadata(schedule, T))
    assert end.step == T + 1
    assert end.stage == active_stage(schedule, T)
    assert end.samples_in_stage == consumed_samples(schedule, T)[end.stage]


@FAST
@given(schedule_and_completed())
def test_training_metadata_contents(setup):
    schedule, k = setup
    meta = training_metadata(schedule, k)
    assert meta.completed == k
    assert meta.stages == tuple(s for s in schedule.stages if s.start_step <= k)
    assert meta.consumed_samples == consumed_samples(schedule, k)[: len(meta.stages)]


@FAST
@given(schedule_and_completed())
def test_training_metadata_json_round_trip(setup):
    schedule, k = setup
    meta = training_metadata(schedule, k)
    text = json.dumps(meta.to_dict())
    back = TrainingMetadata.from_dict(json.loads(text))
    assert back == meta
    assert isinstance(back.stages, tuple) and isinstance(back.consumed_samples, tuple)


@st.composite
def begun_edit(draw):
    """A schedule, a checkpoint step k >= 1, and a change to one field of a stage that has begun."""
    schedule = draw(schedules())
    k = draw(st.integers(1, schedule.train_steps))
    begun = [i for i, s in enumerate(schedule.stages) if s.start_step <= k]
    i = draw(st.sampled_from(begun))
    stage = schedule.stages[i]
    used_names = {s.name for s in schedule.stages}
    used_starts = {s.start_step for s in schedule.stages}
    keys = ["name", "global_batch_size", "sequence_length"]
    if i > 0:  # the first stage must start at 1
        # a new start that keeps the stage begun (moving it past k is covered by an example test)
        free = [s for s in range(2, k + 1) if s not in used_starts]
        if free:
            keys.append("start_step")
    key = draw(st.sampled_from(keys))
    if key == "name":
        value = draw(NAMES.filter(lambda n: n not in used_names))
    elif key == "start_step":
        value = draw(st.sampled_from(free))
    else:
        value = draw(SIZES.filter(lambda v: v != getattr(stage, key)))
    stages = list(schedule.stages)
    stages[i] = attrs.evolve(stage, **{key: value})
    return schedule, k, stage, key, Schedule(stages, schedule.train_steps)


@FAST
@given(begun_edit())
def test_history_is_frozen(setup):
    old, k, stage, key, new = setup
    meta = training_metadata(old, k)
    with pytest.raises(ScheduleDriftError) as info:
        resume_point(new, meta)
    message = str(info.value)
    assert stage.name in message
    assert key in message


@st.composite
def future_edit(draw):
    """A schedule, a checkpoint step k, and any valid rewrite of the stages that have not begun."""
    schedule = draw(schedules())
    T = schedule.train_steps
    k = draw(st.integers(0, T))
    frozen_before = max(k, 1)  # the stage at step 1 keeps its start even at k == 0
    kept = [s for s in schedule.stages if s.start_step <= frozen_before]
    future = [s for s in schedule.stages if s.start_step > frozen_before]
    used_names = {s.name for s in kept}
    used_starts = {s.start_step for s in kept}
    new_future = []
    for s in future:
        action = draw(st.sampled_from(["keep", "drop", "edit"]))
        if action == "drop":
            continue
        if action == "edit":
            s = Stage(
                name=draw(st.one_of(st.just(s.name), NAMES)),
                start_step=draw(st.integers(frozen_before + 1, T + 50)),
                global_batch_size=draw(SIZES),
                sequence_length=draw(SIZES),
            )
        new_future.append(s)
    for _ in range(draw(st.integers(0, 3))):  # add stages after k
        new_future.append(Stage(draw(NAMES), draw(st.integers(frozen_before + 1, T + 50)), draw(SIZES), draw(SIZES)))
    result = []
    for s in new_future:
        if s.name in used_names or s.start_step in used_starts:
            continue
        used_names.add(s.name)
        used_starts.add(s.start_step)
        result.append(s)
    if k == 0 and draw(st.booleans()):
        # nothing trained yet: even the first stage may change, as long as it still starts at 1
        first = kept[0]
        name = draw(NAMES.filter(lambda n: n not in used_names - {first.name}))
        kept[0] = Stage(name, 1, draw(SIZES), draw(SIZES))
    train_steps = draw(st.one_of(st.just(T), st.integers(T, T + 100)))  # also: extend the run
    return schedule, k, Schedule(kept + result, train_steps)


@FAST
@given(future_edit())
def test_future_is_editable(setup):
    old, k, new = setup
    point = resume_point(new, training_metadata(old, k))
    assert point.step == k + 1
    if k < new.train_steps:
        j = active_stage(new, k + 1)
        assert point == ResumePoint(j, k + 1, consumed_samples(new, k)[j])
        if new.stages[j].start_step <= k:  # a stage of the frozen history: same samples as before
            assert point.samples_in_stage == consumed_samples(old, k)[old.index(new.stages[j].name)]
        else:  # a stage that starts right now
            assert point.samples_in_stage == 0


@FAST
@given(schedules(), st.data())
def test_inserting_stage_inside_trained_steps_is_drift(schedule, data):
    T = schedule.train_steps
    used_starts = {s.start_step for s in schedule.stages}
    free = [s for s in range(2, T + 1) if s not in used_starts]
    assume(free)
    start = data.draw(st.sampled_from(free))
    k = data.draw(st.integers(start, T))
    used_names = {s.name for s in schedule.stages}
    name = data.draw(NAMES.filter(lambda n: n not in used_names))
    new = Schedule(list(schedule.stages) + [Stage(name, start, 1, 1)], T)
    with pytest.raises(ScheduleDriftError) as info:
        resume_point(new, training_metadata(schedule, k))
    assert name in str(info.value)


@FAST
@given(schedules(min_stages=2), st.data())
def test_removing_begun_stage_is_drift(schedule, data):
    T = schedule.train_steps
    begun = [i for i, s in enumerate(schedule.stages) if 1 < s.start_step <= T]
    assume(begun)
    i = data.draw(st.sampled_from(begun))
    k = data.draw(st.integers(schedule.stages[i].start_step, T))
    new = Schedule([s for j, s in enumerate(schedule.stages) if j != i], T)
    with pytest.raises(ScheduleDriftError) as info:
        resume_point(new, training_metadata(schedule, k))
    assert schedule.stages[i].name in str(info.value)


def test_drift_examples():
    old = Schedule([Stage("pretrain", 1, 16, 256), Stage("anneal", 201, 16, 256), Stage("sft", 251, 64, 32)], 300)
    meta = training_metadata(old, 220)
    assert resume_point(old, meta) == ResumePoint(1, 221, 20 * 16)
    # the future (sft) may change
    future = Schedule([Stage("pretrain", 1, 16, 256), Stage("anneal", 201, 16, 256), Stage("chat", 260, 8, 64)], 400)
    assert resume_point(future, meta) == ResumePoint(1, 221, 20 * 16)
    # the past may not
    past = Schedule([Stage("pretrain", 1, 16, 256), Stage("anneal", 201, 16, 128), Stage("sft", 251, 64, 32)], 300)
    with pytest.raises(ScheduleDriftError, match=r'anneal.*sequence_length.*256.*128'):
        resume_point(past, meta)


def test_moving_begun_stage_past_checkpoint_names_key():
    """A begun stage whose start moves beyond the checkpoint step has been changed, not removed:
    the message should say which key changed (start_step), like any other edit of the history."""
    old = Schedule([Stage("pretrain", 1, 4, 16), Stage("anneal", 5, 4, 16)], 20)
    new = Schedule([Stage("pretrain", 1, 4, 16), Stage("anneal", 15, 4, 16)], 20)
    with pytest.raises(ScheduleDriftError) as info:
        resume_point(new, training_metadata(old, 10))
    message = str(info.value)
    assert "anneal" in message
    assert "start_step" in message


def test_checkpoint_beyond_train_steps_is_drift():
    old = Schedule([Stage("a", 1, 2, 8)], 20)
    new = Schedule([Stage("a", 1, 2, 8)], 10)
    with pytest.raises(ScheduleDriftError, match="train_steps"):
        resume_point(new, training_metadata(old, 15))
