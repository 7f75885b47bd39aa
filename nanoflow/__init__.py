"""nanoflow: curriculum training for Llama-style language models that stops and resumes without fear."""

from nanoflow.config import ConfigError, load_config
from nanoflow.schedule import Schedule, Stage
from nanoflow.state import StaleStateError, TrainState, init_state
from nanoflow.step import train_step

__version__ = "0.1.0"
__all__ = ["ConfigError", "Schedule", "Stage", "StaleStateError", "TrainState", "__version__", "init_state",
           "load_config", "train_step"]
