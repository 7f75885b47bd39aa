"""The checks a run passes before any work starts: what `bin/train` and `bin/train --plan` both go through.

`load_config` has already applied every rule a config file can break on its own (config/checks.py,
one pass). What remains needs more than the file: the run's tokenizer, loaded and measured against
model.vocab_size, and, when `[model] init_from` is an HF model folder (local or s3://), its
config.json compared with `[model]` — before the run folder is locked, data is tokenized or a weight
is read. (The process count is checked where the processes join: nanoflow.parallel.init_topology.)
"""

from __future__ import annotations

import attrs

from nanoflow.config import Config, ConfigError, hf_config_mismatches
from nanoflow.data.tokenizer import Tokenizer, load_run_tokenizer
from nanoflow.io.hf import HFFormatError, is_hf_folder, read_hf_config


@attrs.frozen
class Checked:
    """A config that passed every check, and what the checks loaded on the way (so it is loaded once)."""

    config: Config
    tokenizer: Tokenizer


def preflight(config: Config) -> Checked:
    """Every check that needs more than the config file; raises the NanoflowError of the first that fails."""
    tokenizer = load_run_tokenizer(config)
    check_init_from(config)
    return Checked(config, tokenizer)


def check_init_from(config: Config) -> None:
    """When `[model] init_from` is an HF model folder, its config.json must describe the same model as
    `[model]`: a ConfigError names every key that differs and every setting nanoflow's Llama lacks.
    A nanoflow checkpoint (run or step folder) is checked when it is read, like a resume."""
    path = config.model.init_from
    if path is None or not is_hf_folder(path):
        return
    try:
        hf, where = read_hf_config(path)
    except HFFormatError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    problems = hf_config_mismatches(config.model, hf, where)
    if problems:
        raise ConfigError("\n  ".join(f"model.init_from: {p}" for p in problems))
