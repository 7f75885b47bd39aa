"""nanoflow: curriculum training for Llama-style language models that stops and resumes without fear.

    config = nanoflow.load_config("schedules/tiny.toml")
    checkpointer = nanoflow.Checkpointer(config)
    state = checkpointer.restore()                        # or nanoflow.init_state(config): always fresh
    with nanoflow.stage_data(state) as loader:            # the data of the stage of step state.step + 1
        state, metrics = nanoflow.train_step(state, loader.batch_at(state.step + 1))
    checkpointer.save(state)
"""

from nanoflow.version import __version__
from nanoflow.build import init_state, stage_data
from nanoflow.checkpointer import Checkpointer
from nanoflow.config import ConfigError, load_config
from nanoflow.schedule import Schedule, Stage
from nanoflow.state import StaleStateError, TrainState
from nanoflow.step import train_step

__all__ = ["Checkpointer", "ConfigError", "Schedule", "Stage", "StaleStateError", "TrainState", "__version__",
           "init_state", "load_config", "stage_data", "train_step"]
