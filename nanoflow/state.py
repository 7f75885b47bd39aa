"""TrainState: what changes from one step to the next, in one immutable record.

What never changes during a run — the config, the stage schedule, the tokenizer and this process's
place in the mesh — is one frozen nanoflow.run.Run, shared by every state of the run. The record is
frozen, but the model and optimizer it holds are torch objects updated in place (copying them each
step would double the memory). So a state is *consumed* by `train_step`, like a donated buffer in
JAX: the returned state is the live one, and handing the old one to `train_step` again raises
`StaleStateError` instead of silently training from stale values.

There is no RNG state: nothing in training draws randomness (the data order is a pure function of
the seed and the sample index; the model has no dropout), so there is nothing to save or restore.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch
from attrs import define, field, frozen

from nanoflow.config import Config
from nanoflow.model import Llama
from nanoflow.parallel.mesh import Topology
from nanoflow.schedule import Schedule, consumed_samples


class StaleStateError(RuntimeError):
    """A TrainState that `train_step` has already consumed was used again."""


class RunFacts(Protocol):
    """What a state reads of its nanoflow.run.Run (not imported here: the run sits above the state)."""

    @property
    def config(self) -> Config: ...
    @property
    def schedule(self) -> Schedule: ...
    @property
    def topology(self) -> Topology: ...
    @property
    def tokenizer(self) -> Any: ...   # nanoflow.data's Tokenizer (the data sits above the state too)


@define
class _LiveStep:
    """Shared by a state and its successors: which step the model and optimizer hold now."""

    step: int


@frozen(eq=False)
class TrainState:
    step: int                              # completed optimizer steps
    model: Llama
    optimizer: torch.optim.Optimizer
    lr_origin: int                         # the step the LR schedule counts from (0, or a resume that restarts it)
    # [optimizer] ema_decay's moving average of the weights, by parameter name, float32, each sharded like its
    # parameter (a DTensor of the same placements under dp/tp); None when the run keeps none. Updated in place.
    ema: dict[str, torch.Tensor] | None
    run: RunFacts = field(repr=False)      # the nanoflow.run.Run it belongs to
    _live: _LiveStep = field(repr=False)

    @property
    def config(self) -> Config:
        return self.run.config

    @property
    def schedule(self) -> Schedule:
        return self.run.schedule

    @property
    def topology(self) -> Topology:
        return self.run.topology

    @property
    def consumed_samples(self) -> tuple[int, ...]:
        """Per stage, the samples read after `step` steps."""
        return consumed_samples(self.schedule, self.step)

    def check_live(self) -> None:
        if self._live.step != self.step:
            raise StaleStateError(
                f"this TrainState (step {self.step}) was consumed by train_step: the model and optimizer "
                f"now hold step {self._live.step}. Use the state train_step returned.")

    def advance(self, step: int) -> TrainState:
        """The successor after one more optimizer step; marks this state consumed."""
        self.check_live()
        successor = attrs.evolve(self, step=step)
        self._live.step = step
        return successor

    @classmethod
    def create(cls, *, step: int, model: Llama, optimizer: torch.optim.Optimizer, lr_origin: int,
               run: RunFacts, ema: dict[str, torch.Tensor] | None = None) -> TrainState:
        return cls(step, model, optimizer, lr_origin, ema, run, _LiveStep(step))


def ema_of(model: Llama) -> dict[str, torch.Tensor]:
    """A weight EMA starting at `model`'s weights: float32 copies, sharded as the parameters are."""
    with torch.no_grad():
        return {name: p.detach().to(torch.float32, copy=True) for name, p in model.named_parameters()}
