"""The run: what stays the same from its first step to its last, worked out once and handed to everything.

    run = open_run(config)                       # joins the process group, checks, loads the tokenizer
    checkpointer = Checkpointer(run)             # and init_state(run), Evaluator(run, …), the loop …

It is step 2 of the start-up sequence (nanoflow.training.loop.open_training: config, run, lock, checkpoint, data),
which opens it once for everything the run uses. The notebook's building blocks (init_state, Checkpointer) accept a
Config too and open its run themselves (as_run): give them one Run to share one tokenizer and topology.

`open_run` is the one place the schedule is built, the topology joined and the tokenizer loaded, and where torch's
process-wide settings are made, before any CUDA work (nanoflow.parallel.runtime: the environment CUDA, cuBLAS and
NCCL read when they start, determinism, TF32; `[model] dtype = "auto"` resolved for the device).
`load_config` has already applied every rule a config file can break on its own (config/checks.py);
`open_run` applies the ones that need more than the file (nanoflow/preflight.py): an HF `init_from` folder's
config.json completes [model] (the run's config is that completed one, recorded in every checkpoint), then the
model's size against this machine, the tokenizer against model.vocab_size, the folder's weights against [model]
— before the run folder is locked, data is tokenized or a weight is read.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from nanoflow.config import Config
from nanoflow.data.fingerprint import Fingerprints
from nanoflow.data.tokenizer import Tokenizer, load_run_tokenizer
from nanoflow.io.runfolder import record_folder
from nanoflow.io.store import is_remote
from nanoflow.parallel import runtime
from nanoflow.parallel.mesh import SINGLE, Topology, device, init_topology
from nanoflow.preflight import check_init_from, check_model_size, complete_from_init
from nanoflow.schedule import Schedule


@attrs.frozen(eq=False)
class Run:
    """The config, its stage schedule, the run's tokenizer and this process's place in the (dp, tp) mesh."""

    config: Config = attrs.field(repr=False)
    schedule: Schedule = attrs.field(repr=False)
    tokenizer: Tokenizer = attrs.field(repr=False)
    topology: Topology = attrs.field(default=SINGLE, repr=False)
    # The data fingerprints of the stages, each computed once for the whole run (files hashed once, not per save)
    fingerprints: Fingerprints = attrs.field(init=False, repr=False, default=attrs.Factory(
        lambda self: Fingerprints(self.config, self.tokenizer, self.schedule), takes_self=True))

    @property
    def is_remote(self) -> bool:
        """Whether the checkpoints go to S3 (then the run folder here holds only the records)."""
        return is_remote(self.config.checkpoints.checkpoints_path)

    @property
    def folder(self) -> Path:
        """The local run folder, where metrics.jsonl, eval.jsonl and TensorBoard go (nanoflow.io.runfolder)."""
        return record_folder(self.config.checkpoints.checkpoints_path)


def open_run(config: Config, *, topology: Topology | None = None, join: bool = True) -> Run:
    """The run of `config` on `topology` — by default the process group torchrun started, joined here (`join`);
    without `join` a single process, for a plan, which changes no setting of torch's. Raises the NanoflowError
    of the first check that fails. The run's config has `[model] dtype` resolved for this process's device (a
    plan's too: it shows what a run on this machine would compute in)."""
    if join:
        runtime.set_environment(config, record_folder(config.checkpoints.checkpoints_path), config.parallelism.dp * config.parallelism.tp)
        runtime.set_torch(config)
    if topology is None:
        topology = init_topology(config) if join else SINGLE
    config = complete_from_init(config)  # first: an HF init_from's config.json completes [model]
    config = runtime.resolved(config, device())
    check_model_size(config)  # then: the typo of a size is what to fix, whatever else is wrong
    tokenizer = load_run_tokenizer(config)
    check_init_from(config)
    return Run(config, Schedule.from_config(config), tokenizer, topology)


def as_run(run: Run | Config, topology: Topology | None = None) -> Run:
    """`run` itself, or the run of a config (opened here): what the public entry points accept."""
    if isinstance(run, Run):
        return run
    return open_run(run, topology=topology)
