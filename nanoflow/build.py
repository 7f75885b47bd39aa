"""Factories: the model, the optimizer, a fresh TrainState and the data of the stage a state is at."""

from __future__ import annotations

import torch

from nanoflow.config import Config, OptimizerArgs, stage_rope
from nanoflow.data import open_stage
from nanoflow.data.loader import StageLoader
from nanoflow.io import read_init_weights
from nanoflow.model import Llama
from nanoflow.parallel.agree import on_every_rank
from nanoflow.parallel.mesh import SINGLE, Topology, device, parallelize
from nanoflow.parallel.shards import load_weights
from nanoflow.run import Run, as_run
from nanoflow.schedule import active_stage
from nanoflow.state import TrainState, ema_of


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


def build_model(config: Config, topology: Topology = SINGLE, *, init: bool = True, stage: int = 0) -> Llama:
    """The model of `config`, its weights drawn from general.seed (when `init`), sharded over `topology`, encoding
    positions with the RoPE of stage `stage` (nanoflow.config.stage_rope; train_step sets each step's stage's).

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
    rope = stage_rope(config, stage)
    model.set_rope(rope.theta, rope.scaling)
    if config.model.compile:
        for layer in model.model.layers:
            layer.compile()  # in place: parameter names stay HF's
    return parallelize(model, topology, config)


def init_state(run: Run | Config, topology: Topology | None = None) -> TrainState:
    """A fresh run at step 0 with empty optimizer moments: weights drawn from general.seed, or
    read from `[model] init_from` (a checkpoint's run or step folder, or an HF model folder).

    Given a Config, its run is opened here (nanoflow.run.open_run: its checks, the tokenizer, and
    `topology`, by default the one torchrun's environment describes: a single process without it).
    """
    run = as_run(run, topology)
    model = build_model(run.config, run.topology)
    source = run.config.model.init_from
    if source is not None:  # open_run checked an HF folder's config.json against [model]: read its weights
        on_every_rank(lambda: load_weights(model, read_init_weights(source), source), run.topology)
    ema = ema_of(model) if run.config.keeps_ema else None  # starts at the initial weights
    return TrainState.create(step=0, model=model, optimizer=build_optimizer(model, run.config.optimizer), lr_origin=0,
                             run=run, ema=ema)


def stage_data(state: TrainState) -> StageLoader:
    """The loader of the stage that trains step state.step + 1, the next one (close it, or use it in `with`):
    `loader.batch_at(step, state.topology.dp_rank, state.topology.dp)` is the batch of any step of that stage."""
    run = state.run
    return open_stage(run.config, active_stage(run.schedule, state.step + 1), run.tokenizer, run.schedule)
