"""Training on a moving mixture resumes bit for bit, also stopped, crashed and stopped again
(tests/unit/test_data_mixture.py: the closed form, its bounds and the loaders)."""

from __future__ import annotations

import io as text_io

import pytest
from data_helpers import load
from support.data_mixture import moving_stages


def test_training_on_a_moving_mixture_resumes_bit_exactly(tmp_path, folders):
    from run_helpers import assert_same_training_state

    from nanoflow.training.loop import train

    def config(run, workers=0):
        return load(tmp_path, moving_stages(folders, num_loading_workers=workers), train_steps=12,
                    micro_batch_size=2, accumulation=2, overrides=[f'checkpoints.checkpoints_path="{run}"',
                                                                   "checkpoints.checkpoint_interval=100"])

    straight = train(config(tmp_path / "straight"), out=text_io.StringIO(), progress=False)
    for k in (5, 9):                                 # mid moving stage, just after it
        run = tmp_path / f"stop{k}"
        train(config(run, workers=2), until_step=k, out=text_io.StringIO(), progress=False)
        resumed = train(config(run), out=text_io.StringIO(), progress=False)
        assert_same_training_state(straight, resumed)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_stopped_crashed_and_stopped_again_resumes_three_times_to_the_straight_run(tmp_path, folders,
                                                                                        monkeypatch, async_save):
    """The class of torchtitan #3907 (the data restarts from the beginning at the second resume): a planned stop
    mid moving blend, a crash one step later than a save, a stop just after the stage boundary — three resumes,
    each of the previous one's checkpoint — end torch.equal to the run trained straight, with the same LRs."""
    from run_helpers import assert_same_training_state, metrics

    import nanoflow.training.loop
    from nanoflow.training.loop import train

    def config(run):
        return load(tmp_path, moving_stages(folders), train_steps=12, micro_batch_size=2, accumulation=2,
                    overrides=[f'checkpoints.checkpoints_path="{run}"', "checkpoints.checkpoint_interval=3",
                               f"checkpoints.async_save={str(async_save).lower()}"])

    straight = train(config(tmp_path / "straight"), out=text_io.StringIO(), progress=False)
    run = tmp_path / "run"
    train(config(run), until_step=4, out=text_io.StringIO(), progress=False)        # mid moving stage: 4 saved
    real_step = nanoflow.training.loop.train_step

    def crash_at_step_8(state, batch):
        if state.step + 1 == 8:
            raise RuntimeError("the node died")
        return real_step(state, batch)

    monkeypatch.setattr(nanoflow.training.loop, "train_step", crash_at_step_8)
    with pytest.raises(RuntimeError, match="the node died"):
        train(config(run), out=text_io.StringIO(), progress=False)                  # resume 1: 4 → 7, 6 saved
    monkeypatch.setattr(nanoflow.training.loop, "train_step", real_step)
    out = text_io.StringIO()
    train(config(run), until_step=10, out=out, progress=False)                     # resume 2: 6 → 10, across 9
    assert f"resuming from {run}/6" in out.getvalue(), out.getvalue()
    out = text_io.StringIO()
    resumed = train(config(run), out=out, progress=False)                          # resume 3: 10 → 12
    assert f"resuming from {run}/10" in out.getvalue(), out.getvalue()
    assert_same_training_state(straight, resumed)
    assert {s: (m["lr"], m["loss"]) for s, m in metrics(run).items()} == \
        {s: (m["lr"], m["loss"]) for s, m in metrics(tmp_path / "straight").items()}

