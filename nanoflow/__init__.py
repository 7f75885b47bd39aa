"""nanoflow: curriculum training for Llama-style language models that stops and resumes without fear.

    config = nanoflow.load_config("schedules/tiny.toml")
    checkpointer = nanoflow.Checkpointer(config)
    state = checkpointer.restore()                        # or nanoflow.init_state(config): always fresh
    with nanoflow.stage_data(state) as loader:            # the data of the stage of step state.step + 1
        state, metrics = nanoflow.train_step(state, loader.batch_at(state.step + 1))
    checkpointer.save(state)

or the whole of bin/train's start-up, in its order, and its loop (nanoflow.training.loop):

    with nanoflow.open_training("schedules/tiny.toml") as training:   # config, run, lock, checkpoint, data
        state = training.run_loop()
"""

import importlib

from nanoflow.version import __version__

# Each public name is imported when first used (PEP 562), not with the package: `import nanoflow.commands.cli` or
# nanoflow.config must not import torch, so that bin/train reports a bad config before torch's seconds.
_HOMES = {"init_state": "nanoflow.build", "stage_data": "nanoflow.build", "Checkpointer": "nanoflow.checkpoint.checkpointer",
          "ConfigError": "nanoflow.config", "load_config": "nanoflow.config",
          "open_training": "nanoflow.training.loop", "Schedule": "nanoflow.schedule",
          "Stage": "nanoflow.schedule", "StaleStateError": "nanoflow.state", "TrainState": "nanoflow.state",
          "train_step": "nanoflow.step"}

__all__ = ["Checkpointer", "ConfigError", "Schedule", "Stage", "StaleStateError", "TrainState", "__version__",
           "init_state", "load_config", "open_training", "stage_data", "train_step"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'nanoflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
