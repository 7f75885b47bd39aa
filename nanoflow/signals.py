"""Stopping on request: Ctrl-C, SIGTERM (a scheduler's preemption) or SIGUSR1 ask the loop to stop after the
current step and save; a second Ctrl-C stops at once. Its own module because it is neither display
(progress.py) nor the loop's order of work: it owns the signal handlers and the ranks' agreement."""

from __future__ import annotations

import signal

import torch

from nanoflow.parallel import SINGLE, Topology, device

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Under torchrun the ranks may see a signal at different steps, so they agree each step (one
    tiny all-reduce) and all stop, and save, after the same one.
    """

    def __init__(self, topology: Topology = SINGLE):
        self.requested: str | None = None
        self.topology = topology

    def agreed(self) -> str | None:
        if self.topology.mesh is None:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return (self.requested or "a signal to another rank") if flag.item() else None

    def _handle(self, signum, _frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def installed(self):
        stop = self

        class _Installed:
            def __enter__(self):
                self.previous = {s: signal.signal(s, stop._handle) for s in STOP_SIGNALS}

            def __exit__(self, *exc):
                for s, handler in self.previous.items():
                    signal.signal(s, handler)

        return _Installed()
