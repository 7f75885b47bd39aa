"""Peak memory of a training run against what the training state needs: parameters + gradients + AdamW moments.

    python bench/memory.py [--hidden H --intermediate I --layers L] [--steps N]

The run: schedules/curriculum.toml with a bigger model (by default 768 hidden, 2048 intermediate,
4 layers, 8 heads: 28.5 M parameters, so that the state — 456 MB in float32 — dwarfs activations and
the framework) and a small batch (2 sequences of 64 tokens a step, one micro-batch) so that the
activations stay small and known. Each figure is the peak resident set (VmHWM in
/proc/self/status) of a fresh process, measured one after the other:

- baseline: a process that imports every module the fresh run had imported by its end (the list is
  taken from that run's sys.modules: torch, torch._dynamo — which torch.optim imports on first
  use —, nanoflow, the data libraries, tensorboard …) and builds nothing.
- fresh run: `nanoflow.training.loop.train` of N steps (default 8) from scratch, in the pretrain stage (its
  HF text data), with metrics.jsonl, TensorBoard events when installed, and a checkpoint saved
  at step N/2 (`until_step`, a planned stop).
- resumed run: `nanoflow.training.loop.train` again, which resumes from that checkpoint (reads it, restores
  weights, moments and RNG) and trains the remaining N/2 steps, saving at the end.
- bare PyTorch: the baseline's imports, then the same model (nanoflow.model.Llama), AdamW and N
  steps on random batches of the same shape, written by hand: no data loader, no logging, no
  checkpoint — what PyTorch itself needs for this training.

Each process also samples its resident set (VmRSS) after every phase, to show where the peak falls.
The activations (the tensors autograd saves for the backward pass of one micro-batch, counted once
per storage) are measured in this process with torch.autograd.graph.saved_tensors_hooks.
Target: (peak − baseline) ≤ 1.5 × (parameters + gradients + optimizer state) + activations.

    python bench/memory.py --features [--sequence 2048] [--positions 2048]

measures instead what recompute_layer and the chunked loss save, in one process started with
MALLOC_MMAP_THRESHOLD_ (so that freed tensors leave the resident set at once) and the resident set's
peak reset before each measurement (`echo 5 > /proc/self/clear_refs`):

- recompute_layer: `nanoflow.train_step` of a model whose activations dominate (256 hidden, 688
  intermediate, 4 layers, 2 × `--sequence` tokens a step), recompute_layer off and on, steps
  interleaved; activation memory = the step's peak − the resident set before it (gradients cleared).
  Targets: on ≤ 0.5 × off, step time on ≤ 1.4 × off.
- the loss: forward and backward of the cross-entropy of `--positions` positions at vocabulary
  128,256 (64 hidden), `F.cross_entropy(logits.float())` as step.py did, against nanoflow.loss, in
  float32 and under bf16 autocast; the peak − the resident set before. Target: ≤ 0.25 × the plain path.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..")
sys.path.insert(0, REPO)  # this checkout's nanoflow, also without `pip install -e .`
from benchlib import parse, status  # noqa: E402  (bench/benchlib.py)

CONFIG = os.path.join(REPO, "schedules", "curriculum.toml")
MB = 1e6



def overrides(args, run: str) -> list[str]:
    steps = args.steps
    return [
        f"model.hidden_size={args.hidden}", f"model.intermediate_size={args.intermediate}",
        f"model.num_hidden_layers={args.layers}", "model.num_attention_heads=8", "model.num_key_value_heads=8",
        "tokens.sequence_length=64", "tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=1",
        f"tokens.train_steps={steps}", f"data_stages.anneal.start_training_step={steps + 1}",
        f"data_stages.sft.start_training_step={steps + 2}",
        f"optimizer.learning_rate_scheduler.lr_decay_starting_step={steps - 1}",
        f'checkpoints.checkpoints_path="{run}"', f"checkpoints.checkpoint_interval={steps}",
    ]


# ---------------------------------------------------------------------------------------------
# The measured processes: each prints one JSON line

def worker_baseline(modules: list[str]) -> dict:
    import importlib
    import warnings

    warnings.simplefilter("ignore")
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # a module made at run time (a compiled kernel, a generated class …)
            failed.append(name)
    return {"peak": status("VmHWM"), "rss": status("VmRSS"), "imported": len(modules) - len(failed),
            "not_importable": len(failed)}


def worker_train(args, run: str, resume: bool) -> dict:
    import nanoflow
    import nanoflow.training.loop as loop

    samples = {"imported": (status("VmRSS"), status("VmHWM"))}
    config = nanoflow.load_config(CONFIG, overrides(args, run))

    def sampled(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            result = original(*a, **k)
            samples[label] = (status("VmRSS"), status("VmHWM"))
            return result

        setattr(owner, name, wrapper)

    sampled(loop.Checkpointer, "restore", "state ready (fresh or restored)")
    step_of_loop = loop.train_step
    count = [0]

    def step(state, batch):
        result = step_of_loop(state, batch)
        count[0] += 1
        samples[f"after step {state.step + 1}"] = (status("VmRSS"), status("VmHWM"))
        return result

    loop.train_step = step
    sampled(loop.Checkpointer, "save", "after the checkpoint save")  # the save moved into Checkpointer
    with open(os.devnull, "w") as out:
        state = loop.train(config, until_step=None if resume else args.steps // 2, out=out, progress=False)
    model_bytes = sum(p.numel() * p.element_size() for p in state.model.parameters())
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in state.model.parameters() if p.grad is not None)
    moment_bytes = sum(t.numel() * t.element_size() for s in state.optimizer.state.values() for t in s.values())
    return {"peak": status("VmHWM"), "rss": status("VmRSS"), "samples": samples, "steps": count[0],
            "parameters": sum(p.numel() for p in state.model.parameters()), "model_bytes": model_bytes,
            "grad_bytes": grad_bytes, "moment_bytes": moment_bytes, "modules": sorted(sys.modules)}


def worker_bare(args, modules: list[str]) -> dict:
    worker_baseline(modules)  # the same imports as the baseline, so that peak − baseline compares
    import torch
    import torch.nn.functional as F

    import nanoflow
    from nanoflow.model import Llama

    samples = {"imported": (status("VmRSS"), status("VmHWM"))}
    config = nanoflow.load_config(CONFIG, overrides(args, "unused"))
    model = Llama(config.model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=1e-3)
    samples["model and optimizer built"] = (status("VmRSS"), status("VmHWM"))
    generator = torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, 257, (2, 65), generator=generator)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        samples[f"after step {step}"] = (status("VmRSS"), status("VmHWM"))
    return {"peak": status("VmHWM"), "rss": status("VmRSS"), "samples": samples}


# ---------------------------------------------------------------------------------------------
# The parent

def launch(args, kind: str, *extra: str) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--hidden", str(args.hidden), "--intermediate",
               str(args.intermediate), "--layers", str(args.layers), "--steps", str(args.steps), *extra]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def activation_bytes(args) -> int:
    """Bytes autograd saves for backward in one micro-batch (each storage once), logits and loss included."""
    import torch
    import torch.nn.functional as F

    import nanoflow
    from nanoflow.model import Llama

    config = nanoflow.load_config(CONFIG, overrides(args, "unused"))
    model = Llama(config.model)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 257, (2, 65))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
    del loss
    return sum(storages.values())


# ---------------------------------------------------------------------------------------------
# --features: recompute_layer and the chunked loss

def reset_peak() -> int:
    """Sets the peak resident set to the current one (Linux's clear_refs 5) and returns it."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def feature_recompute(args) -> None:
    import statistics
    import time

    import torch

    import nanoflow

    sets = ["model.hidden_size=256", "model.intermediate_size=688", "model.num_hidden_layers=4",
            "model.num_attention_heads=4", "model.num_key_value_heads=4", f"model.max_position_embeddings={args.sequence}",
            f"tokens.sequence_length={args.sequence}", "tokens.micro_batch_size=2",
            "tokens.batch_accumulation_per_replica=1", "tokens.train_steps=100"]
    states, activations, times = {}, {"off": [], "on": []}, {"off": [], "on": []}
    for name in ("off", "on"):
        config = nanoflow.load_config(CONFIG, [*sets, f"parallelism.recompute_layer={'true' if name == 'on' else 'false'}"])
        states[name] = nanoflow.init_state(config)
    vocab = states["off"].config.model.vocab_size
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab, (2, args.sequence), generator=generator),
             "labels": torch.randint(0, vocab, (2, args.sequence), generator=generator)}
    for round_ in range(args.rounds + 1):  # round 0 warms up (AdamW's moments are made there)
        for name in (("off", "on") if round_ % 2 else ("on", "off")):
            states[name].optimizer.zero_grad(set_to_none=True)
            before = reset_peak()
            started = time.perf_counter()
            states[name], _ = nanoflow.train_step(states[name], batch)
            elapsed = time.perf_counter() - started
            if round_:
                activations[name].append(status("VmHWM") - before)
                times[name].append(elapsed)
    params = sum(p.numel() for p in states["off"].model.parameters())
    off, on = (statistics.median(activations[k]) for k in ("off", "on"))
    t_off, t_on = (statistics.median(times[k]) for k in ("off", "on"))
    print(f"recompute_layer: {params:,} parameters, 2 × {args.sequence} tokens a step, float32, {args.rounds} "
          "interleaved steps each (medians)\n")
    print("| recompute_layer | step peak − before MB | step s |\n|---|---:|---:|")
    print(f"| false | {off / MB:,.0f} | {t_off:.3f} |\n| true | {on / MB:,.0f} | {t_on:.3f} |")
    print(f"\nactivation memory on / off = {on / off:.2f} (target ≤ 0.5: {'met' if on <= 0.5 * off else 'NOT met'}); "
          f"step time on / off = {t_on / t_off:.2f} (target ≤ 1.4: {'met' if t_on <= 1.4 * t_off else 'NOT met'})\n")


def feature_loss(args) -> None:
    import time

    import torch
    import torch.nn.functional as F

    from nanoflow.loss import cross_entropy_sum

    vocab, hidden_size = 128_256, 64
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.positions, hidden_size, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (args.positions,), generator=generator)

    def plain():
        return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")

    def chunked():
        return cross_entropy_sum(hidden, weight, labels, -100)

    rows = []
    for dtype in ("float32", "bfloat16"):
        for name, loss_of in (("logits.float() (step.py before)", plain), ("nanoflow.loss (chunked)", chunked)):
            peaks, seconds = [], []
            for _ in range(3):
                hidden.grad = weight.grad = None
                before = reset_peak()
                started = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                    loss = loss_of()
                loss.backward()
                seconds.append(time.perf_counter() - started)
                peaks.append(status("VmHWM") - before)
                del loss
            rows.append((dtype, name, min(peaks), min(seconds)))
    print(f"the loss: {args.positions:,} positions, vocabulary {vocab:,}, hidden {hidden_size}; forward + backward, "
          f"best of 3 (the float32 logits alone: {args.positions * vocab * 4 / MB:,.0f} MB)\n")
    print("| dtype | loss | peak − before MB | s |\n|---|---|---:|---:|")
    for dtype, name, peak, seconds in rows:
        print(f"| {dtype} | {name} | {peak / MB:,.0f} | {seconds:.3f} |")
    for i in (0, 2):
        ratio = rows[i + 1][2] / rows[i][2]
        print(f"\n{rows[i][0]}: chunked / plain peak = {ratio:.3f} (target ≤ 0.25: {'met' if ratio <= 0.25 else 'NOT met'}), "
              f"time ×{rows[i + 1][3] / rows[i][3]:.2f}")


def features(args) -> int:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # freed tensors must leave the resident set
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode
    import torch
    print(f"{datetime.date.today()}  torch {torch.__version__}  {os.cpu_count()} CPU cores "
          f"({platform.processor() or platform.machine()})  load average {os.getloadavg()[0]:.1f}\n")
    feature_recompute(args)
    feature_loss(args)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps of the run, saved and resumed at half (default 8)")
    parser.add_argument("--features", action="store_true", help="recompute_layer and the chunked loss instead")
    parser.add_argument("--sequence", type=int, default=2048, help="--features: tokens a sequence (default 2048)")
    parser.add_argument("--positions", type=int, default=2048, help="--features: positions of the loss (default 2048)")
    parser.add_argument("--rounds", type=int, default=4, help="--features: timed steps of each side (default 4)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--modules", help=argparse.SUPPRESS)
    args = parse(parser, None, hidden=64, intermediate=128, layers=1, steps=2, sequence=64, positions=64, rounds=1)
    if args.features:
        return features(args)
    modules = None
    if args.modules:
        with open(args.modules) as f:
            modules = json.load(f)
    if args.worker == "baseline":
        print(json.dumps(worker_baseline(modules)))
        return 0
    if args.worker in ("fresh", "resume"):
        print(json.dumps(worker_train(args, args.run, args.worker == "resume")))
        return 0
    if args.worker == "bare":
        print(json.dumps(worker_bare(args, modules)))
        return 0

    import torch
    print(f"{datetime.date.today()}  torch {torch.__version__}  {os.cpu_count()} CPU cores "
          f"({platform.processor() or platform.machine()})  load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as folder:
        run = os.path.join(folder, "run")
        fresh = launch(args, "fresh", "--run", run)
        modules_file = os.path.join(folder, "modules.json")
        with open(modules_file, "w") as f:
            json.dump([m for m in fresh["modules"] if m != "__main__"], f)
        rest = [("resume", "--run", run), ("baseline", "--modules", modules_file), ("bare", "--modules", modules_file)]
        if args.smoke:  # each process has its own peak, so in --smoke (figures that mean nothing) they may overlap
            with concurrent.futures.ThreadPoolExecutor(len(rest)) as pool:
                resumed, baseline, bare = pool.map(lambda job: launch(args, *job), rest)
        else:  # measured one after the other, on a machine otherwise idle
            resumed, baseline, bare = (launch(args, *job) for job in rest)
    activations = activation_bytes(args)

    state = fresh["model_bytes"] + fresh["grad_bytes"] + fresh["moment_bytes"]
    base = baseline["peak"]
    print(f"model: {fresh['parameters']:,} parameters (hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.layers} layers), float32; batch 2 × 64 tokens; {args.steps} steps, saved and resumed at "
          f"step {args.steps // 2}")
    print(f"parameters {fresh['model_bytes'] / MB:,.1f} MB + gradients {fresh['grad_bytes'] / MB:,.1f} MB + AdamW "
          f"moments {fresh['moment_bytes'] / MB:,.1f} MB = state {state / MB:,.1f} MB; activations saved for "
          f"backward {activations / MB:,.1f} MB")
    print(f"baseline: {baseline['imported']} modules imported ({baseline['not_importable']} made at run time "
          f"skipped), nothing built\n")
    print("| process | peak RSS MB | peak − baseline MB | ÷ state | ÷ (state + activations) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| baseline (imports only) | {base / MB:,.0f} | | | |")
    for name, result in (("fresh run (nanoflow.training.loop.train)", fresh), ("resumed run", resumed),
                         ("bare PyTorch loop", bare)):
        extra = result["peak"] - base
        print(f"| {name} | {result['peak'] / MB:,.0f} | {extra / MB:,.0f} | {extra / state:.2f} | "
              f"{extra / (state + activations):.2f} |")
    print()
    for name, result in (("fresh run", fresh), ("resumed run", resumed), ("bare PyTorch", bare)):
        print(f"{name}: RSS (peak so far) MB: " + ", ".join(
            f"{label} {rss / MB:,.0f} ({hwm / MB:,.0f})" for label, (rss, hwm) in result["samples"].items()))
    worst = max(fresh["peak"], resumed["peak"]) - base
    limit = 1.5 * state + activations
    print(f"\nworst run: peak − baseline = {worst / MB:,.0f} MB = {worst / state:.2f} × state; "
          f"target ≤ 1.5 × state + activations = {limit / MB:,.0f} MB: {'met' if worst <= limit else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
