"""What the user watches during training: a start-up header, then a tqdm bar on a terminal, plain lines every
logging interval elsewhere (CI logs, files). Its lines are messages of the one channel (nanoflow/console.py).

Each step's record gets what the line shows (`Progress.step_done`): tokens/s over the last WINDOW_SECONDS
(metrics.Window), the model FLOPs utilisation over the same steps where the devices' peak is known
(nanoflow/flops.py's count against its GPU table, or a matmul peak measured once at start on the CPU), and the
process's peak memory. The ETA weighs every remaining step by its stage's model FLOPs a step, at the seconds per
FLOP measured over the current stage's recent steps: an SFT stage of short sequences ahead of a pretrain stage
costs what its own steps cost.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time

import torch
from attrs import frozen

from nanoflow import console
from nanoflow.flops import flops_per_token, gpu_peak
from nanoflow.observe.metrics import Window
from nanoflow.schedule import Schedule, Stage, stage_steps

log = logging.getLogger(__name__)

WINDOW_SECONDS = 30.0   # the span of the recent rate
PEAK_SECONDS = 0.1      # the CPU matmul peak's measuring budget, once at start


@frozen
class FlopsAndPeak:
    """What a step of each stage asks of the devices, and what they can do."""

    schedule: Schedule
    stage_flops: tuple[float, ...]    # model FLOPs of one (global) step of each stage
    peak: float | None                # FLOP/s of all the run's devices together; None: unknown, no MFU
    device: torch.device              # whose peak memory the records hold
    peak_source: str                  # how the peak was found, for the header

    @classmethod
    def of(cls, state) -> FlopsAndPeak:
        config, schedule = state.config, state.schedule
        flops = tuple(s.tokens_per_step * flops_per_token(config.model, s.sequence_length) for s in schedule.stages)
        device = next(state.model.parameters()).device
        peak, source = device_peak(device, config, schedule)
        devices = state.topology.world_size
        return cls(schedule, flops, None if peak is None else peak * devices, device,
                   source + (f", × {devices} processes" if devices > 1 and peak is not None else ""))

    def remaining(self, step: int) -> float:
        """The model FLOPs of the steps after `step`."""
        total = 0.0
        for index, flops in enumerate(self.stage_flops):
            steps = stage_steps(self.schedule, index)
            if steps and steps[-1] > step:
                total += (steps[-1] - max(step, steps[0] - 1)) * flops
        return total


def device_peak(device: torch.device, config, schedule: Schedule) -> tuple[float | None, str]:
    """(one device's peak FLOP/s or None, where it comes from): a CUDA device's from nanoflow.flops' table of dense
    bf16 peaks by its name, whatever [model] dtype (the figure MFU is usually quoted against); the CPU's measured
    on matmuls shaped like rows of a micro-batch through the MLP's first projection."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name)
        return peak, f"{name}, " + ("dense bf16 peak from nanoflow.flops" if peak else "not in nanoflow.flops: no MFU")
    if device.type == "cpu":
        # 256 rows of a micro-batch (each row costs the same); the widths at least 128, or a toy model's matmuls
        # would measure dispatch, not the machine, and at most 1024: wider ones run no faster, only longer
        shape = (256, *(min(max(width, 128), 1024) for width in (config.model.hidden_size,
                                                                   config.model.intermediate_size)))
        measured = (f"measured: fp32 matmul {'×'.join(map(str, shape))} in one thread's CPU time × "
                    f"{torch.get_num_threads()} threads")
        return cpu_matmul_peak(*shape), measured
    return None, f"{device.type}: peak unknown, no MFU"


def cpu_matmul_peak(m: int, k: int, n: int, budget: float = PEAK_SECONDS) -> float:
    """FLOP/s of this process's torch threads on fp32 [m, k] @ [k, n] products: one thread's fastest product, by
    the CPU time the thread spent on it, times the threads. CPU time, not wall time: on cores other processes
    share, a product is descheduled for part of its wall time, and a peak read off the wall clock would be a
    fraction of the machine's (and MFU that many times too high). Products are timed until `budget` seconds of
    wall time have passed (three at least)."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b  # the first call pays for allocation and dispatch
        best, start = math.inf, time.perf_counter()
        for repeat in range(200):
            began = time.thread_time()
            a @ b
            best = min(best, time.thread_time() - began)
            if repeat >= 2 and time.perf_counter() - start > budget:
                break
    finally:
        torch.set_num_threads(threads)
    return threads * 2 * m * k * n / max(best, 1e-9)


def peak_memory(device: torch.device) -> int:
    """Bytes: the most this process has had allocated on a CUDA device; on the CPU, its peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # Linux's RUSAGE_THREAD reports the process's peak too (the threads share one address space), and cheaper:
    # RUSAGE_SELF adds up the CPU time of every torch thread first (BENCHMARKS.md, "Loop overhead")
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    peak = resource.getrusage(who).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux counts kilobytes, macOS bytes


class Progress:
    """`live`: a bar (None: when the console stream is a terminal). Its clock starts at construction: `elapsed()`
    is what each step's record holds, and its tokens/s are the record's (nanoflow.observe.metrics.Window). Without `costs`
    every step weighs the same and there is no MFU."""

    def __init__(self, train_steps: int, start_step: int, live: bool | None = None, interval: int = 10,
                 costs: FlopsAndPeak | None = None, window: float = WINDOW_SECONDS):
        self.interval, self.train_steps, self.start_step, self.costs = interval, train_steps, start_step, costs
        self.window = Window(window)
        self.device = torch.device("cpu") if costs is None else costs.device
        names = () if costs is None else (stage.name for stage in costs.schedule.stages)
        self._stage_flops = {} if costs is None else dict(zip(names, costs.stage_flops, strict=True))
        self.start_time = time.perf_counter()
        stream = console.stream()
        self.bar = None
        if stream.isatty() if live is None else live:
            from tqdm import tqdm
            self.bar = tqdm(total=train_steps, initial=start_step, file=stream, unit="step", dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    @classmethod
    def start(cls, state, live: bool | None = None, interval: int = 10, attention: str | None = None) -> Progress:
        """The display of a run about to train from `state`, after logging its header (with `attention`, the
        attention kernel's line)."""
        costs = FlopsAndPeak.of(state)
        for line in header(state, costs, attention):
            log.info(line)
        return cls(state.schedule.train_steps, state.step, live, interval, costs)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start_time

    def stage_started(self, schedule, index: int, rope: str | None = None) -> None:
        """Say the stage that begins (or that a resume goes on with); `rope`, its RoPE in words, when stages differ
        in it."""
        stage, steps = schedule.stages[index], stage_steps(schedule, index)
        log.info(f'stage "{stage.name}": steps {steps[0]}–{steps[-1]}, global batch {stage.global_batch_size}, '
                 f"sequence length {stage.sequence_length}" + (f", rope {rope}" if rope else ""))

    def eta(self, step: int) -> float:
        """Seconds until train_steps: each step left weighed by its stage's FLOPs, at the current stage's pace."""
        left = self.train_steps - step if self.costs is None else self.costs.remaining(step)
        return left * self.window.seconds_per_work

    def step_done(self, m: dict) -> None:
        """Count a step's record in (its "elapsed" set from `elapsed()`), add what the line shows to it —
        tokens_per_s (recent), mfu, peak_memory_bytes — and show it."""
        self.window.add(m, self._stage_flops.get(m["stage"], 1.0))
        rate = m["tokens_per_s"] = _finite(round(self.window.rate, 1))
        peak = None if self.costs is None else self.costs.peak
        mfu = m["mfu"] = None if peak is None else _finite(round(self.window.work_rate / peak, 5))
        m["peak_memory_bytes"] = peak_memory(self.device)
        if self.bar is not None:
            shown = {"loss": f"{m['loss']:.3f}", "lr": f"{m['lr']:.2e}", "tok_s": _count(rate)}
            if mfu is not None:
                shown["mfu"] = f"{mfu:.1%}"
            shown["mem"] = _bytes(m["peak_memory_bytes"])
            shown["eta"] = _duration(self.eta(m["step"]))
            self.bar.set_description(m["stage"], refresh=False)
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        elif m["step"] % self.interval == 0 or m["step"] == self.train_steps:
            usage = f"  mem {_bytes(m['peak_memory_bytes'])}" + ("" if mfu is None else f"  mfu {mfu:.1%}")
            log.info(f"step {m['step']:>{len(str(self.train_steps))}}/{self.train_steps}  {m['stage']:<12} "
                     f"loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad {m['grad_norm']:.3f}{usage}  {_count(rate)} tok/s  "
                     f"eta {_duration(self.eta(m['step']))}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def header(state, costs: FlopsAndPeak, attention: str | None = None) -> list[str]:
    """The start-up lines: the model and its precision, the device and its peak, the layout, whether the run starts
    or resumes, the loss, and the attention kernel when the caller says it (nanoflow.parallel.runtime knows it)."""
    config, schedule = state.config, state.schedule
    model, parallelism = config.model, config.parallelism
    parameters = sum(p.numel() for p in state.model.parameters())
    per_token = ", ".join(f"{flops_per_token(model, s.sequence_length) / 1e6:,.3g} M at sequence length "
                          f"{s.sequence_length}" for s in _distinct_lengths(schedule))
    peak = "" if costs.peak is None else f"peak {_flop_rate(costs.peak)} ({costs.peak_source})"
    family = "" if model.model_type == "llama" else f"{model.model_type}, "
    start = (f"fresh start at step 1 of {schedule.train_steps}" if state.step == 0 else
             f"resumed after step {state.step} of {schedule.train_steps}")
    if state.step == 0 and model.init_from is not None:
        start += f", weights from init_from = {model.init_from}"
    deterministic = "deterministic algorithms" if config.general.deterministic else "torch's fastest algorithms"
    return [
        f"model: {parameters:,} parameters ({family}{model.num_hidden_layers} layers × {model.hidden_size} hidden, "
        f"vocabulary {model.vocab_size}), {_precision(model.dtype, costs.device)}; model FLOPs a token: {per_token}",
        f"device: {costs.device}; " + (peak or f"no MFU ({costs.peak_source})") + f"; {deterministic}",
        f"layout: dp {parallelism.dp} × tp {parallelism.tp} (tp_mode {parallelism.tp_mode}), recompute_layer "
        f"{_on(parallelism.recompute_layer)}, compile {_on(model.compile)}",
        f"start: {start}",
        f"loss: {_loss_path(state)}",
        *([f"attention: {attention}"] if attention else []),
    ]


def _precision(dtype: str, device: torch.device) -> str:
    """`[model] dtype` as the run computes (the run's config holds it resolved for the device: nanoflow.run)."""
    text = "bfloat16 autocast, float32 weights and AdamW moments" if dtype == "bfloat16" else "float32"
    if device.type == "cuda":
        text += ", TF32 for float32 matmuls"
    return text


def _loss_path(state) -> str:
    """The loss the micro-batches take, as the model says it (nanoflow.loss)."""
    describe = getattr(state.model, "describe_loss", None)
    return "the model's own" if describe is None else describe()


def _distinct_lengths(schedule: Schedule):
    seen: dict[int, Stage] = {}
    for stage in schedule.stages:
        seen.setdefault(stage.sequence_length, stage)
    return seen.values()


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN


def _count(rate: float | None) -> str:
    return "?" if rate is None else f"{rate:,.0f}"


def _flop_rate(rate: float) -> str:
    return f"{rate / 1e12:,.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:,.1f} GFLOP/s"


def _bytes(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
