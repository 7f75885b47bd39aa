"""What the user watches during training: a tqdm bar on a terminal, plain lines every logging interval
elsewhere (CI logs, files). Its lines are messages of the one channel (nanoflow/console.py)."""

from __future__ import annotations

import logging
import time

from nanoflow import console
from nanoflow.metrics import Throughput
from nanoflow.schedule import stage_steps

log = logging.getLogger(__name__)


class Progress:
    """`live`: a bar (None: when the console stream is a terminal). Its clock starts at construction: `elapsed()`
    is what each step's record holds, and its tokens/s are the record's (nanoflow.metrics.Throughput)."""

    def __init__(self, train_steps: int, start_step: int, live: bool | None = None, interval: int = 10):
        self.interval, self.train_steps, self.start_step = interval, train_steps, start_step
        self.start_time = time.perf_counter()
        self.throughput = Throughput()
        stream = console.stream()
        self.bar = None
        if stream.isatty() if live is None else live:
            from tqdm import tqdm
            self.bar = tqdm(total=train_steps, initial=start_step, file=stream, unit="step", dynamic_ncols=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start_time

    def stage_started(self, schedule, index: int) -> None:
        stage, steps = schedule.stages[index], stage_steps(schedule, index)
        log.info(f'stage "{stage.name}": steps {steps[0]}–{steps[-1]}, global batch {stage.global_batch_size}, '
                 f"sequence length {stage.sequence_length}")

    def step_done(self, m: dict) -> None:
        self.throughput.add(m)
        rate = self.throughput.rate
        if self.bar is not None:
            self.bar.set_description(m["stage"], refresh=False)
            self.bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}", tok_s=f"{rate:,.0f}", refresh=False)
            self.bar.update(1)
        elif m["step"] % self.interval == 0 or m["step"] == self.train_steps:
            remaining = (self.train_steps - m["step"]) * self.throughput.seconds / (m["step"] - self.start_step)
            log.info(f"step {m['step']:>{len(str(self.train_steps))}}/{self.train_steps}  {m['stage']:<12} "
                     f"loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad {m['grad_norm']:.3f}  {rate:,.0f} tok/s  "
                     f"eta {remaining:.0f}s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
