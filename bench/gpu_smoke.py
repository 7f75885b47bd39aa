"""GPU smoke check: a ~1B-parameter Llama in bf16 with torch.compile — tokens/s, MFU, peak memory, host
reads a step, recompute_layer's memory and time, and a resume-equality check. One run answers all.

    bash bench/gpu_smoke.sh            # on a machine with a CUDA GPU (installs missing wheels from .whl/)
    bash bench/gpu_smoke.sh --tiny     # the same code path, a tiny model, on any machine (the suite runs it)

Every result is one line that starts with "smoke: " (the test of --tiny checks them):
  smoke: device …                       the machine and the model
  smoke: step …                         tokens/s, model TFLOP/s, MFU, peak memory, host reads a step
  smoke: recompute_layer …              the same with recompute_layer = true, as ratios to the line above
  smoke: async-save stall …             step time lost to a save, async_save = true vs false
  smoke: resume …                       straight run vs stopped-and-resumed run, torch.equal on every weight
  smoke: done in …

MFU = achieved model FLOP/s ÷ the chip's dense bf16 peak. Model FLOPs per token: 6 × parameters
(forward and backward of every matmul) + 12 × layers × hidden × sequence length (attention scores
and values), as in the PaLM appendix's accounting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # this checkout's nanoflow, also without `pip install -e .`

import torch  # noqa: E402

import nanoflow  # noqa: E402
from nanoflow.io import read_model  # noqa: E402

CONFIG = os.path.join(HERE, "..", "schedules", "curriculum.toml")
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense, no sparsity

ONE_B = ["model.vocab_size=32768", "model.hidden_size=2048", "model.intermediate_size=5632",
         "model.num_hidden_layers=20", "model.num_attention_heads=32", "model.num_key_value_heads=8",
         "model.max_position_embeddings=2048", "tokens.sequence_length=2048", "tokens.micro_batch_size=4",
         "tokens.batch_accumulation_per_replica=1"]
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
        "tokens.sequence_length=64", "tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=1"]
# The resume check: a model small enough that three short runs and their checkpoints take seconds,
# trained by nanoflow.training.loop.train on the curriculum's own pretrain data.
RESUME = ["model.hidden_size=512", "model.intermediate_size=1408", "model.num_hidden_layers=4",
          "model.num_attention_heads=8", "model.num_key_value_heads=4", "tokens.sequence_length=256",
          "tokens.micro_batch_size=4", "tokens.batch_accumulation_per_replica=2"]


def say(line: str) -> None:
    print(f"smoke: {line}", flush=True)


def peak_memory(device: torch.device) -> float:
    """Peak bytes: the CUDA allocator's, or this process's peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(args, overrides: list[str]) -> dict:
    """Warm-up steps (compilation), then timed steps of train_step on one fixed random batch."""
    config = nanoflow.load_config(CONFIG, [*overrides, f"tokens.train_steps={args.steps + args.warmup + 1}"])
    state = nanoflow.init_state(config)
    params = sum(p.numel() for p in state.model.parameters())
    rows, seq = config.tokens.micro_batch_size, config.tokens.sequence_length
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, config.model.vocab_size, (rows, seq), generator=generator),
             "labels": torch.randint(0, config.model.vocab_size, (rows, seq), generator=generator)}
    device = next(state.model.parameters()).device
    cuda = device.type == "cuda"
    if cuda:
        batch = {k: v.pin_memory() for k, v in batch.items()}
    for _ in range(args.warmup):
        state, _ = nanoflow.train_step(state, batch)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = nanoflow.train_step(state, batch)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    syncs = None
    if cuda:  # one more step with CUDA's sync debug mode: each synchronising call warns
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                state, _ = nanoflow.train_step(state, batch)
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    m = config.model
    result = {"params": params, "rows": rows, "seq": seq, "device": device, "step_s": elapsed / args.steps,
              "tokens_per_s": args.steps * rows * seq / elapsed, "peak": peak_memory(device), "syncs": syncs,
              "loss": metrics["loss"], "flops_per_token": 6 * params + 12 * m.num_hidden_layers * m.hidden_size * seq}
    del state
    if cuda:
        torch.cuda.empty_cache()
    return result


def async_save_stall(args, common: list[str]) -> None:
    """The step time a checkpoint save costs, [checkpoints] async_save = false and = true, as bench/async_save.py
    measures it (once here): S plain steps, then a save and S steps through its commit; the difference."""
    from nanoflow.checkpoint.checkpointer import Checkpointer

    steps = max(2, args.steps // 2)
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-save-") as root:
        configs = {mode: nanoflow.load_config(CONFIG, [
            *common, "tokens.train_steps=1000000", "checkpoints.checkpoint_interval=1000000", "checkpoints.keep=1",
            f"checkpoints.async_save={flag}", f"checkpoints.checkpoints_path={json.dumps(os.path.join(root, mode))}"])
            for mode, flag in (("sync", "false"), ("async", "true"))}
        state = nanoflow.init_state(configs["sync"])
        config = configs["sync"]
        rows, seq = config.tokens.micro_batch_size, config.tokens.sequence_length
        generator = torch.Generator().manual_seed(0)
        batch = {key: torch.randint(0, config.model.vocab_size, (rows, seq), generator=generator)
                 for key in ("input_ids", "labels")}
        cuda = torch.cuda.is_available()

        def segment(state, checkpointer=None):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            if checkpointer is not None:
                checkpointer.save(state)
            for _ in range(steps):
                state, _ = nanoflow.train_step(state, batch)
                if checkpointer is not None:
                    checkpointer.poll()
            if checkpointer is not None:
                checkpointer.finish()
            if cuda:
                torch.cuda.synchronize()
            return state, time.perf_counter() - started

        for _ in range(args.warmup):
            state, _ = nanoflow.train_step(state, batch)
        checkpointers = {mode: Checkpointer(c, out=open(os.devnull, "w")) for mode, c in configs.items()}
        lost, first = {}, 0.0
        with checkpointers["sync"].locked(), checkpointers["async"].locked():
            state, first = segment(state, checkpointers["async"])  # the first async save allocates (pins) its buffers
            for mode in ("sync", "async"):
                state, plain = segment(state)
                state, saving = segment(state, checkpointers[mode])
                lost[mode] = saving - plain
    gigabytes = sum(3 * p.numel() * p.element_size() for p in state.model.parameters()) / 1e9
    say(f"async-save stall {lost['async']:.3f} s vs sync {lost['sync']:.3f} s "
        f"({lost['async'] / lost['sync']:.1%}): step time lost to a save of {gigabytes:.1f} GB, {steps} steps after "
        f"it; the first async save, which allocates its host buffers, took {first:.1f} s with its steps")


def resume_check(args, root: str) -> None:
    """N steps straight, twice (the device's own run-to-run determinism), against N/2 steps, a planned
    stop and a resume to N in a new process: every final weight compared with torch.equal."""
    steps = 2 if args.tiny else 6   # --tiny: one step before the stop, one after it
    # A CPU is deterministic; on a GPU a second straight run tells the device's own run-to-run noise from the resume's.
    names = ("straight", "again", "resumed") if torch.cuda.is_available() else ("straight", "resumed")

    def run(name: str) -> tuple[str, dict]:
        folder = os.path.join(root, name)
        until = steps // 2 if name == "resumed" else None
        for stop in ([until, None] if until else [None]):
            command = [sys.executable, __file__, "--worker", folder, "--steps", str(steps)]
            if args.tiny:
                command.append("--tiny")
            if stop:
                command += ["--until", str(stop)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise SystemExit(f"the resume check's run {name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        return name, read_model(folder)

    if args.tiny:  # the runs share only the CPU cores, so they overlap; on a GPU each has the device to itself
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            runs = dict(pool.map(run, names))
    else:
        runs = dict(run(name) for name in names)

    def differences(a, b) -> tuple[int, float]:
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        worst = max(((a[k].float() - b[k].float()).abs().max().item() for k in unequal), default=0.0)
        return len(unequal), worst

    total = len(runs["straight"])
    resumed, worst = differences(runs["straight"], runs["resumed"])
    again = ""
    if "again" in runs:
        repeated, repeat_worst = differences(runs["straight"], runs["again"])
        again = f"; straight vs straight again: {total - repeated}/{total} equal (max |diff| {repeat_worst:.3g})"
    say(f"resume {'equal' if resumed == 0 else 'NOT equal'}: {steps} steps straight vs {steps // 2} + resumed "
        f"{steps - steps // 2} in a new process, {total - resumed}/{total} tensors torch.equal (max |diff| {worst:.3g})"
        + again)


def worker(args) -> None:
    """One run of the resume check: nanoflow.training.loop.train in `args.worker`, up to `--until` or the end."""
    from nanoflow.training.loop import train

    torch.use_deterministic_algorithms(True, warn_only=True)
    overrides = [*(TINY if args.tiny else RESUME), "model.dtype=bfloat16",
                 f"model.compile={'false' if args.no_compile else 'true'}", f"tokens.train_steps={args.steps}",
                 f"data_stages.anneal.start_training_step={args.steps + 1}",
                 f"data_stages.sft.start_training_step={args.steps + 2}",
                 "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
                 f"optimizer.learning_rate_scheduler.lr_decay_starting_step={args.steps - 1}",
                 f"checkpoints.checkpoints_path={json.dumps(args.worker)}",
                 f"checkpoints.checkpoint_interval={args.steps}"]
    with open(os.devnull, "w") as out:
        train(nanoflow.load_config(CONFIG, overrides), until_step=args.until, out=out, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path on a CPU")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak (default: by device name)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if not args.tiny and not torch.cuda.is_available():
        # The 1B model on a CPU would take hours: say so instead of starting it.
        print("gpu_smoke: no CUDA device here: the 1B check needs a GPU (--tiny runs the same code on a CPU)",
              file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the resume check's runs
    started = time.perf_counter()
    common = [*(TINY if args.tiny else ONE_B), "model.dtype=bfloat16",
              f"model.compile={'false' if args.no_compile else 'true'}", "checkpoints.checkpoints_path='/tmp/gpu_smoke'"]

    plain = measure(args, common)
    device = plain["device"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    say(f"device {name}, torch {torch.__version__}, {plain['params'] / 1e9:.2f}B parameters, "
        f"batch {plain['rows']}×{plain['seq']}, bf16, compile={not args.no_compile}")

    def line(r) -> str:
        flops = r["flops_per_token"] * r["tokens_per_s"]
        mfu = f"MFU {flops / (peak * 1e12):.1%} of {peak:.0f} TFLOP/s" if peak else "MFU unknown (no peak for this device)"
        syncs = "n/a on CPU" if r["syncs"] is None else str(r["syncs"])
        return (f"{r['step_s'] * 1e3:.0f} ms, {r['tokens_per_s']:,.0f} tokens/s, {flops / 1e12:.1f} model TFLOP/s, "
                f"{mfu}, peak memory {r['peak'] / 2**30:.2f} GiB, host syncs a step {syncs}, loss {r['loss']:.3f}")

    say(f"step {line(plain)}")
    recomputed = measure(args, [*common, "parallelism.recompute_layer=true"])
    say(f"recompute_layer {line(recomputed)}; step time ×{recomputed['step_s'] / plain['step_s']:.2f}, "
        f"peak memory ×{recomputed['peak'] / plain['peak']:.2f}")
    async_save_stall(args, common)
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as root:
        resume_check(args, root)
    say(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
