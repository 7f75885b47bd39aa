"""TrainState: everything that changes from one step to the next, in one immutable record.

The record is frozen, but the model and optimizer it holds are torch objects updated in place
(copying them each step would double the memory). So a state is *consumed* by `train_step`, like a
donated buffer in JAX: the returned state is the live one, and handing the old one to
`train_step` again raises `StaleStateError` instead of silently training from stale values.
"""

from __future__ import annotations

import attrs
import torch
from attrs import define, field, frozen

from nanoflow.config import Config, OptimizerArgs
from nanoflow.model import Llama
from nanoflow.parallel import SINGLE, Topology, device, init_topology, parallelize
from nanoflow.schedule import Schedule, consumed_samples


class StaleStateError(RuntimeError):
    """A TrainState that `train_step` has already consumed was used again."""


@define
class _Lineage:
    """Shared by a state and its successors: which step the model and optimizer hold now."""

    live_step: int


@frozen(eq=False)
class TrainState:
    step: int                              # completed optimizer steps
    consumed_samples: tuple[int, ...]      # per stage, derived from the schedule
    model: Llama
    optimizer: torch.optim.Optimizer
    rng_state: torch.Tensor                # torch.Generator state for stochastic layers; restored on resume
    lr_origin: int                         # the step the LR schedule counts from (0, or a resume that restarts it)
    config: Config = field(repr=False)
    schedule: Schedule = field(repr=False)
    topology: Topology = field(repr=False)     # this process's place in the (dp, tp) mesh
    _lineage: _Lineage = field(repr=False)

    def check_live(self) -> None:
        if self._lineage.live_step != self.step:
            raise StaleStateError(
                f"this TrainState (step {self.step}) was consumed by train_step: the model and optimizer "
                f"now hold step {self._lineage.live_step}. Use the state train_step returned.")

    def advance(self, step: int) -> TrainState:
        """The successor after one more optimizer step; marks this state consumed."""
        self.check_live()
        successor = attrs.evolve(self, step=step, consumed_samples=consumed_samples(self.schedule, step))
        self._lineage.live_step = step
        return successor

    @classmethod
    def create(cls, *, step: int, model: Llama, optimizer: torch.optim.Optimizer, rng_state: torch.Tensor,
               lr_origin: int, config: Config, schedule: Schedule, topology: Topology = SINGLE) -> TrainState:
        return cls(step, consumed_samples(schedule, step), model, optimizer, rng_state, lr_origin,
                   config, schedule, topology, _Lineage(step))


def build_optimizer(model: torch.nn.Module, args: OptimizerArgs) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only: norms (1-D weights) are not decayed."""
    params = list(model.parameters())  # a tied weight appears once
    factory = args.optimizer_factory
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate_scheduler.learning_rate,  # overwritten every step by the closed-form LR
        betas=(factory.adam_beta1, factory.adam_beta2),
        eps=factory.adam_eps,
        fused=factory.torch_adam_is_fused or None,
    )


def new_model(config: Config, topology: Topology = SINGLE, *, init: bool = True) -> Llama:
    """The model of `config`, its weights drawn from general.seed (when `init`), sharded over `topology`.

    Every rank draws the same full weights before sharding, so any layout starts from the same model.
    Without `init` the weights are left uninitialised, for the caller to fill (a restore overwrites every one).
    """
    if init:
        model = Llama(config.model).to(device())
        model.reset_parameters(torch.Generator(device=device()).manual_seed(config.general.seed))
    else:  # built on the meta device: nn.Linear's own random init would be thrown away (0.12 s for 28 M weights)
        with torch.device("meta"):
            model = Llama(config.model)
        model = model.to_empty(device=device())
        if config.model.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
            model.lm_head.weight = model.model.embed_tokens.weight
    if config.model.compile:
        for layer in model.model.layers:
            layer.compile()  # in place: parameter names stay HF's
    return parallelize(model, topology, config)


def init_state(config: Config, topology: Topology | None = None) -> TrainState:
    """A fresh run at step 0 with empty optimizer moments: weights drawn from general.seed, or
    read from `[model] init_from` (a checkpoint's run or step folder, or an HF model folder).

    `topology` defaults to the one torchrun's environment describes (a single process without it).
    """
    topology = init_topology(config) if topology is None else topology
    model = new_model(config, topology)
    if config.model.init_from is not None:
        from nanoflow.io import read_init_weights  # nanoflow.io reads the bytes: a checkpoint or an HF folder
        from nanoflow.preflight import check_init_from
        from nanoflow.snapshot import load_weights, read_on_every_rank

        source = config.model.init_from
        check_init_from(config)   # an HF folder's config.json against [model], before a weight is read
        read_on_every_rank(lambda: load_weights(model, read_init_weights(source), source), topology)
    generator = torch.Generator().manual_seed(config.general.seed)
    return TrainState.create(step=0, model=model, optimizer=build_optimizer(model, config.optimizer),
                             rng_state=generator.get_state(), lr_origin=0, config=config,
                             schedule=Schedule.from_config(config), topology=topology)
