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
from nanoflow.schedule import Schedule, TrainingMetadata, consumed_samples, resume_point, training_metadata


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
               lr_origin: int, config: Config, schedule: Schedule) -> TrainState:
        return cls(step, consumed_samples(schedule, step), model, optimizer, rng_state, lr_origin,
                   config, schedule, _Lineage(step))


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


def init_state(config: Config) -> TrainState:
    """A fresh run at step 0 with empty optimizer moments: weights drawn from general.seed, or
    read from `[model] init_from` (a checkpoint's run or step folder)."""
    schedule = Schedule.from_config(config)
    generator = torch.Generator().manual_seed(config.general.seed)
    model = Llama(config.model)
    model.reset_parameters(generator)
    if config.model.init_from is not None:
        from nanoflow.io import read_model  # io.py reads the bytes; this module only places the tensors

        load_weights(model, read_model(config.model.init_from), config.model.init_from)
    return TrainState.create(step=0, model=model, optimizer=build_optimizer(model, config.optimizer),
                             rng_state=generator.get_state(), lr_origin=0, config=config, schedule=schedule)


# ---------------------------------------------------------------------------------------------
# To and from checkpoint tensors (io.py does the bytes)

MOMENTS = ("exp_avg", "exp_avg_sq", "step")


def checkpoint_contents(state: TrainState) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """The tensors of a checkpoint by group and HF name, and what its metadata records besides them."""
    state.check_live()
    params = dict(state.model.named_parameters())  # a tied lm_head is saved once, as model.embed_tokens.weight
    names = {id(p): name for name, p in params.items()}
    optimizer = {}
    for p, moments in state.optimizer.state.items():
        for key in MOMENTS:
            optimizer[f"{key}.{names[id(p)]}"] = moments[key]
    config = state.config
    info = {
        "training": training_metadata(state.schedule, state.step).to_dict(),
        "lr_origin": state.lr_origin,
        "topology": {"dp": config.parallelism.dp, "tp": config.parallelism.tp, "world_size": 1},
        "config": config.to_dict(),
    }
    return {"model": params, "optimizer": optimizer, "rng": {"cpu": state.rng_state}}, info


def load_weights(model: Llama, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy full tensors by HF name into `model`, refusing missing, unexpected or misshapen ones."""
    params = dict(model.named_parameters())
    tied_alias = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params) - tied_alias)
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(f"{source}: {name} has shape {list(tensors[name].shape)}, the model expects {list(p.shape)}")
            p.copy_(tensors[name])


def restore_state(config: Config, groups: dict[str, dict[str, torch.Tensor]], metadata: dict, *,
                  load_optimizer: bool = True, load_lr_scheduler: bool = True, source: str = "checkpoint") -> TrainState:
    """The TrainState a checkpoint recorded, under `config` (whose begun stages must match the checkpoint's).

    `load_optimizer=False` starts fresh AdamW moments; `load_lr_scheduler=False` restarts the LR
    schedule (warmup included) at the resume step. Step, stage and data position are kept either way.
    """
    schedule = Schedule.from_config(config)
    trained = TrainingMetadata.from_dict(metadata["training"])
    resume_point(schedule, trained)  # raises ScheduleDriftError if the config rewrites trained history
    model = Llama(config.model)
    load_weights(model, groups["model"], source)
    optimizer = build_optimizer(model, config.optimizer)
    if load_optimizer:
        moments = groups["optimizer"]
        for name, p in model.named_parameters():
            if f"step.{name}" in moments:
                optimizer.state[p] = {key: moments[f"{key}.{name}"].clone() for key in MOMENTS}
    lr_origin = metadata["lr_origin"] if load_lr_scheduler else trained.completed
    return TrainState.create(step=trained.completed, model=model, optimizer=optimizer,
                             rng_state=groups["rng"]["cpu"].clone(), lr_origin=lr_origin, config=config,
                             schedule=schedule)
