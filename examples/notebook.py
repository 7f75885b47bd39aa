"""nanoflow from Python, step by step, as in a notebook: load a config, step the curriculum by hand.

    python examples/notebook.py

Trains the two-stage tiny schedule (schedules/tiny.toml) for a few seconds on a CPU, saves a checkpoint through
the Checkpointer and restores it; the run folder is a temporary directory, removed at the end.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # works without `pip install -e .`

import io  # noqa: E402

import torch  # noqa: E402

import nanoflow  # noqa: E402
from nanoflow.schedule import active_stage, remaining_steps, stage_steps  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "schedules", "tiny.toml")

with tempfile.TemporaryDirectory() as tmp:
    # 1. The config: the TOML file plus overrides, written as on the command line (values are TOML).
    config = nanoflow.load_config(TINY, overrides=[
        f"checkpoints.checkpoints_path='{tmp}'",   # a TOML literal string: nothing lands in the repository
        "logging.iteration_step_info_interval=1",
    ])

    # 2. A fresh state: model, optimizer and the stage schedule, at step 0.
    state = nanoflow.init_state(config)
    schedule = state.schedule
    print(f"{len(schedule.stages)} stages, {schedule.train_steps} steps:",
          ", ".join(f"{s.name} from step {s.start_step} ({s.global_batch_size}×{s.sequence_length})"
                    for s in schedule.stages))

    # 3. The stage math is plain functions of (schedule, step): which stage trains a step, what is left of it.
    print("active_stage(schedule, 1) =", active_stage(schedule, 1), "  active_stage(schedule, 8) =",
          active_stage(schedule, 8))

    # 4. Step every stage by hand. stage_data(state) opens the data of the stage the state is at (the stage of
    #    step state.step + 1); its loader gives the batch of any global step of that stage directly.
    for index, stage in enumerate(schedule.stages):
        steps = stage_steps(schedule, index)
        print(f'stage "{stage.name}": steps {steps[0]}–{steps[-1]}; '
              f"remaining_steps(schedule, {state.step}) = {remaining_steps(schedule, state.step)}")
        with nanoflow.stage_data(state) as loader:
            for step in steps:
                state, metrics = nanoflow.train_step(state, loader.batch_at(step))
                print(f"step {metrics['step']:>2}  {metrics['stage']:<8}  loss {metrics['loss']:.4f}  "
                      f"lr {metrics['lr']:.2e}  grad norm {metrics['grad_norm']:.3f}")

    # 5. Save through the Checkpointer (the run folder's lock held while it writes) and restore: the same weights.
    checkpointer = nanoflow.Checkpointer(config, out=io.StringIO())
    with checkpointer.locked():
        folder = checkpointer.save(state)
    restored = checkpointer.restore()
    same = all(torch.equal(p, q) for p, q in zip(state.model.parameters(), restored.model.parameters(), strict=True))
    print(f"saved {folder}; restored step {restored.step}, the same weights: {same}")

    # 6. train_step consumes the state it is given (the model and optimizer are updated in place):
    #    the old state is stale and refuses to train again. Shown on a fresh state at step 0.
    state = nanoflow.init_state(config)
    with nanoflow.stage_data(state) as loader:
        batch = loader.batch_at(1)
        new_state, _ = nanoflow.train_step(state, batch)
        try:
            nanoflow.train_step(state, batch)
        except nanoflow.StaleStateError as e:
            print(f"reusing a consumed state raises StaleStateError: {e}")
    print(f"the live state is at step {new_state.step}")
