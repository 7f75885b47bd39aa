"""bin/verify-resume's kill plan: exactly the kills asked, spread over the whole run and over every save."""

import random

import pytest

from nanoflow.commands.verify import Kill, _aimed, plan_kills, save_steps


def test_save_steps_are_every_interval_and_the_last():
    assert save_steps(4, 12) == [4, 8, 12]
    assert save_steps(5, 12) == [5, 10, 12]
    assert save_steps(100, 12) == [12]


@pytest.mark.parametrize("kills", [1, 2, 5, 12, 20, 41])
def test_the_plan_has_exactly_the_kills_asked_over_every_save_and_the_whole_run(kills):
    saves = save_steps(50, 400)   # 8 saves
    plan = plan_kills(kills, saves, 400, 100_000, random.Random(kills))
    assert len(plan) == kills
    assert [k.position for k in plan] == sorted(k.position for k in plan)
    in_saves, in_steps = [k for k in plan if k.kind == "save"], [k for k in plan if k.kind == "step"]
    assert len(in_saves) == kills - kills // 2 and len(in_steps) == kills // 2
    assert all(k.step in saves and 0 <= k.offset < 100_000 - 4096 for k in in_saves)   # before the commit
    assert all(1 <= k.step < 400 for k in in_steps)
    if len(in_saves) >= len(saves):
        assert {k.step for k in in_saves} == set(saves)                  # every save is hit
    if len(in_steps) >= 4:   # stratified: every quarter of the run has a kill inside a step
        assert {min(3, (k.step - 1) * 4 // 399) for k in in_steps} == {0, 1, 2, 3}


def test_a_kill_the_resumed_run_has_passed_moves_to_where_it_still_goes():
    saves = [4, 8, 12]
    assert _aimed(Kill("step", 6), 4, saves, 12) == Kill("step", 6)
    assert _aimed(Kill("step", 6), 8, saves, 12) == Kill("step", 9)
    assert _aimed(Kill("step", 11), 11, saves, 12) == Kill("save", 12, 0)
    assert _aimed(Kill("save", 4, 77), 4, saves, 12) == Kill("save", 8, 77)
    assert _aimed(Kill("save", 8, 77), 4, saves, 12) == Kill("save", 8, 77)


