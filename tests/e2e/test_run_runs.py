"""nanoflow.run over a whole run: the tokenizer loaded once, and the loop's garbage collection
(tests/unit/test_run.py: the rest)."""

from __future__ import annotations

from helpers import quiet, tiny

import nanoflow.run
from nanoflow import Checkpointer, init_state, stage_data
from nanoflow.run import open_run
from nanoflow.training.loop import train


def test_the_tokenizer_is_loaded_once_for_a_whole_run(tmp_path, monkeypatch):
    loads = []
    real = nanoflow.run.load_run_tokenizer

    def counted(config):
        loads.append(config)
        return real(config)

    monkeypatch.setattr(nanoflow.run, "load_run_tokenizer", counted)
    config = tiny(tmp_path / "run")
    state = train(config, out=quiet(), progress=False)   # 12 steps over two stages, saved at 4, 8 and 12
    assert state.step == 12 and len(loads) == 1
    run = open_run(config)
    assert len(loads) == 2
    state = Checkpointer(run, out=quiet()).restore()    # handed the run: nothing is loaded again
    for _ in range(3):
        stage_data(init_state(run)).close()
    assert len(loads) == 2 and state.run is run and state.run.tokenizer is run.tokenizer


def test_the_loop_runs_with_the_garbage_collector_off_and_collects_between_steps(tmp_path, monkeypatch):
    import gc

    import nanoflow.training.loop as loop

    calls = []

    class Recorder:   # nanoflow.training.loop's gc: what it asks of Python's collector, in order
        def isenabled(self):
            return gc.isenabled()

        def disable(self):
            calls.append("disable")

        def enable(self):
            calls.append("enable")

        def collect(self, generation=2):
            calls.append(f"collect {generation}")

    steps = []
    real_step = loop.train_step

    def step(state, batch):
        steps.append(state.step + 1)
        calls.append(f"step {state.step + 1}")
        return real_step(state, batch)

    monkeypatch.setattr(loop, "gc", Recorder())
    monkeypatch.setattr(loop, "GC_INTERVAL", 2)
    monkeypatch.setattr(loop, "train_step", step)
    train(tiny(tmp_path / "run"), until_step=5, out=quiet(), progress=False)
    assert calls == ["disable", "collect 1", "step 1", "step 2", "collect 1", "step 3", "step 4", "collect 1",
                     "step 5", *(["enable"] if gc.isenabled() else [])]

