"""GPU smoke check: what a first lent GPU must show, in one run of under 8 minutes on one H200.

    bash bench/gpu_smoke.sh            # on a CUDA machine (installs what the image lacks from .whl/)
    bash bench/gpu_smoke.sh --tiny     # every section at tiny sizes on any machine: CI runs it on a CPU

Sections, each with its estimated time on one H200 (the sum, ~4.5 min, leaves room in the 8):
  compare     ~45 s  a Llama 3.2 1B-shaped model (1.24 B parameters, vocabulary 128,256, 16 layers × 2048, GQA
                     32/8 heads, tied head) in bf16 at sequence 4096: nanoflow's train_step, a bare PyTorch loop on
                     the same model, and transformers' LlamaForCausalLM (sdpa) on the same shape, all three
                     resident and stepped in rotating rounds: tokens/s, MFU, peak memory, host syncs a step
  fsdp        ~25 s  a world of one FSDP2 step (nanoflow's shard_data_parallel, NCCL) against the same steps
                     unsharded: losses, weights, the loss scale's dtype, the fused AdamW state's placement
  resume      ~60 s  fused AdamW, [general] deterministic = true, a 13 M model on the curriculum's data: 6 steps
                     straight, again (the deterministic pair: bit-identical), and 3 + a resume in a new process
                     (torch.equal on every weight and moment); the three chains run at once
  async_save  ~100 s the step time a save of the 1B state (14.9 GB) costs, sync against async (the first async
                     save pins its host buffers: reported apart); at most two saves on disk, ~30 GB
Start-up (wheels, imports, CUDA) ~40 s. A section that would end past --budget seconds is skipped, and says so.

Results: one JSON file, OUT/gpu_smoke.json (OUT: the device tool's $OUT, else runs/gpu-smoke), written again
after every section, so a run cut short still leaves what it measured; a line "smoke: …" per section too.
MFU = model FLOPs a second (nanoflow.flops: 6 N + 12 L H T a token) ÷ the chip's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # this checkout's nanoflow, also without `pip install -e .`

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nanoflow  # noqa: E402

CONFIG = os.path.join(REPO, "schedules", "curriculum.toml")
IGNORE_INDEX = -100
SHAPES = {   # Llama 3.2 1B's shape; a tiny one for --tiny
    "1b": dict(vocab=128_256, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, sequence=4096,
               micro=2, rope_theta=500_000.0),
    "tiny": dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, sequence=64, micro=2,
                 rope_theta=500_000.0),
}
# The resume and fsdp sections' model: a 13 M Llama trained on the curriculum's own data (vocabulary 288)
SMALL = ["model.hidden_size=512", "model.intermediate_size=1408", "model.num_hidden_layers=4",
         "model.num_attention_heads=8", "model.num_key_value_heads=4", "tokens.sequence_length=256",
         "tokens.micro_batch_size=4", "tokens.batch_accumulation_per_replica=2"]
SMALL_TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
              "tokens.sequence_length=64", "tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=1"]
ESTIMATES = {"compare": 45, "fsdp": 25, "resume": 60, "async_save": 100}   # seconds on one H200


def say(line: str) -> None:
    print(f"smoke: {line}", flush=True)


def cuda() -> bool:
    return torch.cuda.is_available()


def synchronize() -> None:
    if cuda():
        torch.cuda.synchronize()


def overrides_of(shape: dict, steps: int) -> list[str]:
    """The curriculum's config at `shape`, bf16, every step in its pretrain stage (the later ones not reached)."""
    return [f"model.vocab_size={shape['vocab']}", f"model.hidden_size={shape['hidden']}",
            f"model.intermediate_size={shape['intermediate']}", f"model.num_hidden_layers={shape['layers']}",
            f"model.num_attention_heads={shape['heads']}", f"model.num_key_value_heads={shape['kv_heads']}",
            f"model.max_position_embeddings={shape['sequence']}", f"model.rope_theta={shape['rope_theta']}",
            "model.tie_word_embeddings=true", "model.dtype=bfloat16",
            f"tokens.sequence_length={shape['sequence']}", f"tokens.micro_batch_size={shape['micro']}",
            "tokens.batch_accumulation_per_replica=1", f"tokens.train_steps={steps}",
            f"data_stages.anneal.start_training_step={steps + 1}", f"data_stages.sft.start_training_step={steps + 2}",
            "optimizer.learning_rate_scheduler.lr_warmup_steps=0"]


def random_batch(shape: dict, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    rows = (shape["micro"], shape["sequence"])
    batch = {key: torch.randint(0, shape["vocab"], rows, generator=generator) for key in ("input_ids", "labels")}
    return {k: v.pin_memory() for k, v in batch.items()} if cuda() else batch


# -- compare: nanoflow, a bare loop, transformers ---------------------------------------------------------------

class Nanoflow:
    name = "nanoflow"

    def __init__(self, config):
        self.state = nanoflow.init_state(config)
        self.loss = None

    def step(self, batch) -> None:
        self.state, metrics = nanoflow.train_step(self.state, batch)
        self.loss = metrics["loss"]


def fused_adamw(model, config) -> torch.optim.AdamW:
    from nanoflow.build import build_optimizer

    return build_optimizer(model, config.optimizer)   # the same groups and hyper-parameters


class Bare:
    """nanoflow's Llama in a hand-written loop: bf16 autocast, the model's fused loss, clipping, fused AdamW."""

    name = "bare"

    def __init__(self, config, weights: dict):
        from nanoflow.model import Llama

        with torch.device("meta"):
            model = Llama(config.model)
        model = model.to_empty(device=device())
        model.lm_head.weight = model.model.embed_tokens.weight   # tied, as the shape says
        model.load_state_dict(weights)
        self.model, self.optimizer, self.loss = model, fused_adamw(model, config), None

    def step(self, batch) -> None:
        ids = batch["input_ids"].to(device(), non_blocking=True)
        labels = batch["labels"].to(device(), non_blocking=True)
        count = (labels != IGNORE_INDEX).sum()
        with torch.autocast(device().type, dtype=torch.bfloat16):
            loss = self.model(ids, labels, grad_scale=1.0 / count) / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = loss.detach()


class Transformers:
    """transformers' LlamaForCausalLM (sdpa attention) on the same weights, in the same kind of loop, its loss
    `F.cross_entropy(logits.float())` over the whole logits."""

    name = "transformers"

    def __init__(self, config, weights: dict):
        import transformers

        m = config.model
        hf = transformers.LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
            rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=True, attention_bias=False, mlp_bias=False)
        if hasattr(hf, "rope_parameters"):   # transformers ≥ 5 keeps RoPE's settings there
            hf.rope_parameters = {"rope_type": "default", "rope_theta": m.rope_theta}
        else:
            hf.rope_theta = m.rope_theta
        hf._attn_implementation = "sdpa"
        with torch.device(device()):
            model = transformers.LlamaForCausalLM(hf)
        model.load_state_dict(weights, strict=True)
        model.train()
        self.model, self.optimizer, self.loss = model, fused_adamw(model, config), None
        self.version = transformers.__version__

    def step(self, batch) -> None:
        ids = batch["input_ids"].to(device(), non_blocking=True)
        labels = batch["labels"].to(device(), non_blocking=True)
        with torch.autocast(device().type, dtype=torch.bfloat16):
            logits = self.model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = loss.detach()


def device() -> torch.device:
    from nanoflow.parallel.mesh import device as nanoflow_device

    return nanoflow_device()


def allocated() -> int:
    return torch.cuda.memory_allocated() if cuda() else 0


def host_syncs(side, batch) -> int | None:
    """Synchronising calls in one step (CUDA's sync debug mode warns at each); None on a CPU."""
    if not cuda():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            side.step(batch)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def compare(args, shape: dict, peak: float | None) -> dict:
    """The three sides resident at once and stepped in rounds whose order rotates (drift hits all alike). Each
    side's peak memory: its own resident tensors (weights, AdamW state) plus what its step allocates above
    everything resident."""
    from nanoflow.flops import flops_per_token

    config = nanoflow.load_config(CONFIG, overrides_of(shape, args.warmup + args.steps + 10))
    batch = random_batch(shape)
    sides, resident, reasons, initial = [], {}, {}, {}
    for make in (lambda: Nanoflow(config), lambda: Bare(config, initial), lambda: Transformers(config, initial)):
        before = allocated()
        try:
            side = make()
        except ImportError as error:   # transformers missing (and no wheel of it carried)
            reasons["transformers"] = f"not run: {error}"
            continue
        if not initial:   # every side starts from nanoflow's initial weights
            initial.update({k: v.detach().clone() for k, v in side.state.model.state_dict().items()})
            before += sum(v.numel() * v.element_size() for v in initial.values())   # not the side's own
        side.step(batch)   # the first step makes the AdamW state: resident from here on
        synchronize()
        sides.append(side)
        resident[side.name] = allocated() - before
    initial.clear()
    first_losses = {s.name: float(s.loss) for s in sides}
    for _ in range(args.warmup - 1):
        for side in sides:
            side.step(batch)
    seconds = {s.name: [] for s in sides}
    transient = {s.name: 0 for s in sides}
    for round_ in range(args.steps):
        order = sides[round_ % len(sides):] + sides[:round_ % len(sides)]
        for side in order:
            synchronize()
            if cuda():
                torch.cuda.reset_peak_memory_stats()
            base = allocated()
            started = time.perf_counter()
            side.step(batch)
            synchronize()
            seconds[side.name].append(time.perf_counter() - started)
            if cuda():
                transient[side.name] = max(transient[side.name], torch.cuda.max_memory_allocated() - base)
    tokens = shape["micro"] * shape["sequence"]
    per_token = flops_per_token(config.model, shape["sequence"])
    results = {}
    for side in sides:
        step = sorted(seconds[side.name])[len(seconds[side.name]) // 2]
        rate = tokens / step
        results[side.name] = {
            "step_s": round(step, 4), "tokens_per_s": round(rate, 1),
            "mfu": None if peak is None else round(rate * per_token / peak, 4),
            "peak_memory_gib": round((resident[side.name] + transient[side.name]) / 2**30, 2) if cuda() else None,
            "host_syncs": host_syncs(side, batch), "first_loss": round(first_losses[side.name], 4)}
    out = {"shape": shape, "parameters": sum(p.numel() for p in sides[0].state.model.parameters()),
           "tokens_a_step": tokens, "model_flops_a_token": per_token, "warmup": args.warmup, "steps": args.steps,
           "sides": results, **reasons}
    bare = results.get("bare", {}).get("tokens_per_s")
    hf = results.get("transformers", {}).get("tokens_per_s")
    out["nanoflow_over_bare"] = None if not bare else round(results["nanoflow"]["tokens_per_s"] / bare, 4)
    out["nanoflow_over_transformers"] = None if not hf else round(results["nanoflow"]["tokens_per_s"] / hf, 4)
    if "transformers" in sides[-1].name:
        out["transformers_version"] = sides[-1].version
    for side in sides:
        r = results[side.name]
        mfu = "?" if r["mfu"] is None else f"{r['mfu']:.1%}"
        say(f"compare {side.name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, peak {r['peak_memory_gib']} GiB, "
            f"host syncs {r['host_syncs']}, first loss {r['first_loss']}")
    del sides
    if cuda():
        torch.cuda.empty_cache()
    return out


# -- fsdp, resume: in processes of their own ----------------------------------------------------------------

def run_worker(args, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, __file__, "--worker", *extra] + (["--tiny"] if args.tiny else [])
    return subprocess.run(command, capture_output=True, text=True)


def fsdp(args, scratch: str) -> dict:
    result_file = os.path.join(scratch, "fsdp.json")
    done = run_worker(args, "fsdp", result_file)
    if done.returncode != 0:
        return {"ok": False, "error": done.stderr[-3000:]}
    with open(result_file) as f:
        result = json.load(f)
    say(f"fsdp: world of 1, {len(result['losses'])} steps, loss sharded {result['losses'][-1]:.6f} vs unsharded "
        f"{result['unsharded_losses'][-1]:.6f}, max |weight difference| {result['max_weight_difference']:.3g}, "
        f"loss scale {result['grad_scale_dtype']}, AdamW step on {result['adamw_step']}")
    return result


def fsdp_worker(args, result_file: str) -> None:
    """nanoflow's train_step on a model sharded by FSDP2 over a world of one, against the same steps unsharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import nanoflow.model
    from nanoflow.build import build_model, build_optimizer
    from nanoflow.parallel.mesh import Topology
    from nanoflow.parallel.plan import shard_data_parallel
    from nanoflow.run import open_run
    from nanoflow.state import TrainState

    steps = 3
    overrides = [*(SMALL_TINY if args.tiny else SMALL), "model.dtype=bfloat16", f"tokens.train_steps={steps}",
                 f"checkpoints.checkpoints_path={json.dumps(os.path.dirname(result_file))}"]
    config = nanoflow.load_config(CONFIG, overrides)
    dist.init_process_group("nccl" if cuda() else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": device()} if cuda() else {}))
    try:
        mesh = init_device_mesh(device().type, (1, 1), mesh_dim_names=("dp", "tp"))
        run = open_run(config, topology=Topology(1, 1, 0, mesh))
        model = build_model(run.config)
        shard_data_parallel(model, mesh["dp"], run.config.model.dtype)
        sharded = TrainState.create(step=0, model=model, optimizer=build_optimizer(model, run.config.optimizer),
                                    lr_origin=0, run=run)
        unsharded = nanoflow.init_state(config)
        scales = []
        real = nanoflow.model.lm_loss

        def spy(hidden, weight, labels, ignore_index, grad_scale=None, method="fused"):
            scales.append(str(grad_scale.dtype).removeprefix("torch."))
            return real(hidden, weight, labels, ignore_index, grad_scale, method)

        nanoflow.model.lm_loss = spy
        losses = {"sharded": [], "unsharded": []}
        shape = {"micro": config.tokens.micro_batch_size * config.stage_tokens(0).batch_accumulation_per_replica,
                 "sequence": config.tokens.sequence_length, "vocab": config.model.vocab_size}
        for step in range(steps):
            batch = random_batch(shape, seed=step)
            sharded, a = nanoflow.train_step(sharded, batch)
            unsharded, b = nanoflow.train_step(unsharded, batch)
            losses["sharded"].append(a["loss"])
            losses["unsharded"].append(b["loss"])
        difference = max((p.full_tensor() - q).abs().max().item() for p, q in
                         zip(sharded.model.parameters(), unsharded.model.parameters(), strict=True))
        step_state = next(iter(sharded.optimizer.state.values()))["step"]
        result = {"ok": True, "losses": losses["sharded"], "unsharded_losses": losses["unsharded"],
                  "max_weight_difference": difference, "grad_scale_dtype": sorted(set(scales)),
                  "adamw_step": f"{step_state.device} {str(step_state.dtype).removeprefix('torch.')}",
                  "weights": str(next(sharded.model.parameters()).dtype).removeprefix("torch.")}
        result["grad_scale_dtype"] = ",".join(result["grad_scale_dtype"])
        # FSDP2 computes in bf16 weights (the norms' too), the unsharded step in autocast (float32 norms):
        # close, not equal
        result["losses_close"] = all(abs(a - b) < 1e-2 for a, b in zip(*losses.values(), strict=True))
        result["ok"] = result["grad_scale_dtype"] == "float32" and result["losses_close"] \
            and all(map(math.isfinite, losses["sharded"]))
    finally:
        dist.destroy_process_group()
    with open(result_file, "w") as f:
        json.dump(result, f)


def resume(args, scratch: str) -> dict:
    """Three chains at once, each in processes of its own: straight, again, and stopped halfway then resumed."""
    from nanoflow.io import read_checkpoint

    steps = 2 if args.tiny else 6

    def chain(name: str) -> tuple[str, str | None]:
        folder = os.path.join(scratch, name)
        for until in ([steps // 2, None] if name == "resumed" else [None]):
            done = run_worker(args, "train", folder, str(steps), *([str(until)] if until else []))
            if done.returncode != 0:
                return name, f"run {name} failed ({done.returncode}): {done.stderr[-3000:]}"
        return name, None

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        failures = {name: error for name, error in pool.map(chain, ("straight", "again", "resumed")) if error}
    if failures:
        return {"resume_equal": False, "deterministic_equal": False, "errors": failures}
    runs = {name: read_checkpoint(os.path.join(scratch, name)).groups for name in ("straight", "again", "resumed")}

    def differences(a: dict, b: dict) -> tuple[int, int, float]:
        names = [(g, n) for g in a for n in a[g]]
        unequal = [(g, n) for g, n in names if not torch.equal(a[g][n], b[g][n])]
        worst = max(((a[g][n].double() - b[g][n].double()).abs().max().item() for g, n in unequal), default=0.0)
        return len(names), len(unequal), worst

    total, resumed, worst = differences(runs["straight"], runs["resumed"])
    _, repeated, repeat_worst = differences(runs["straight"], runs["again"])
    result = {"steps": steps, "stopped_after": steps // 2, "tensors": total,
              "resume_equal": resumed == 0, "resume_unequal": resumed, "resume_max_difference": worst,
              "deterministic_equal": repeated == 0, "deterministic_unequal": repeated,
              "deterministic_max_difference": repeat_worst, "fused_adamw": True, "deterministic": True}
    say(f"resume {'equal' if resumed == 0 else 'NOT equal'}: {total - resumed}/{total} weights and moments "
        f"torch.equal after {steps} steps straight vs {steps // 2} + resumed in a new process (max |diff| {worst:.3g}); "
        f"deterministic pair {'equal' if repeated == 0 else 'NOT equal'} ({total - repeated}/{total})")
    return result


def train_worker(args, folder: str, steps: int, until: int | None) -> None:
    """One run of the resume section: nanoflow.training.loop.train, deterministic, fused AdamW (the default)."""
    from nanoflow.training.loop import train

    overrides = [*(SMALL_TINY if args.tiny else SMALL), "model.dtype=bfloat16", "general.deterministic=true",
                 f"tokens.train_steps={steps}", f"data_stages.anneal.start_training_step={steps + 1}",
                 f"data_stages.sft.start_training_step={steps + 2}",
                 "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
                 f"optimizer.learning_rate_scheduler.lr_decay_starting_step={steps - 1}",
                 f"checkpoints.checkpoints_path={json.dumps(folder)}", f"checkpoints.checkpoint_interval={steps}"]
    with open(os.devnull, "w") as out:
        train(nanoflow.load_config(CONFIG, overrides), until_step=until, out=out, progress=False)


# -- async_save ----------------------------------------------------------------------------------------------

def async_save(args, shape: dict, scratch: str) -> dict:
    """Step time lost to a save, [checkpoints] async_save = false and = true (as bench/async_save.py measures it):
    S plain steps, then a save and S steps through its commit; the difference. S covers the sync save's write
    time, so an async save can finish behind the steps. At most two saves of the state are on disk at once."""
    from nanoflow.checkpoint.checkpointer import Checkpointer
    from nanoflow.parallel.shards import state_bytes

    steps_total = 1_000_000
    config = nanoflow.load_config(CONFIG, overrides_of(shape, steps_total))
    state = nanoflow.init_state(config)
    batch = random_batch(shape)

    def segment(state, count: int, checkpointer=None):
        synchronize()
        started = time.perf_counter()
        in_save = 0.0
        if checkpointer is not None:
            checkpointer.save(state)
            in_save = time.perf_counter() - started
        for _ in range(count):
            state, _ = nanoflow.train_step(state, batch)
            if checkpointer is not None:
                checkpointer.poll()
        if checkpointer is not None:
            checkpointer.finish()
        synchronize()
        return state, time.perf_counter() - started, in_save

    def checkpointer_for(mode: str) -> Checkpointer:
        path = os.path.join(scratch, f"save-{mode}")
        mode_config = nanoflow.load_config(CONFIG, [
            *overrides_of(shape, steps_total), "checkpoints.checkpoint_interval=1000000", "checkpoints.keep=1",
            f"checkpoints.async_save={'true' if mode != 'sync' else 'false'}",
            f"checkpoints.checkpoints_path={json.dumps(path)}"])
        return Checkpointer(mode_config, out=open(os.devnull, "w"))

    for _ in range(args.warmup):
        state, _ = nanoflow.train_step(state, batch)
    state, one, _ = segment(state, 1)
    lost, in_save, steps = {}, {}, 2 if args.tiny else 4
    sync = checkpointer_for("sync")
    with sync.locked():
        state, plain, _ = segment(state, steps)
        state, saving, in_save["sync"] = segment(state, steps, sync)
        lost["sync"] = saving - plain
    shutil.rmtree(os.path.join(scratch, "save-sync"))   # its 15 GB, before the async saves write theirs
    if not args.tiny:   # enough steps to cover the write a sync save took
        steps = max(steps, math.ceil(1.5 * in_save["sync"] / one))
    asynchronous = checkpointer_for("async")
    with asynchronous.locked():
        for mode in ("async_first", "async"):   # the first pins its host buffers
            state, plain, _ = segment(state, steps)
            state, saving, in_save[mode] = segment(state, steps, asynchronous)
            lost[mode] = saving - plain
    shutil.rmtree(os.path.join(scratch, "save-async"))
    saved = state_bytes(state.model)
    gigabytes = saved / 1e9
    result = {"bytes": saved, "steps_after_save": steps, "step_s": round(one, 4),
              "lost_s": {k: round(v, 3) for k, v in lost.items()},
              "in_save_s": {k: round(v, 3) for k, v in in_save.items()},
              "async_over_sync": round(lost["async"] / lost["sync"], 4) if lost["sync"] > 0 else None}
    say(f"async_save: a save of {gigabytes:.1f} GB costs the steps {lost['async']:.3f} s async vs {lost['sync']:.3f} s "
        f"sync (the first async save, which pins its buffers, {lost['async_first']:.3f} s); {steps} steps after each")
    del state
    if cuda():
        torch.cuda.empty_cache()
    return result


# -- the run --------------------------------------------------------------------------------------------------

def machine(args, shape: dict) -> dict:
    from nanoflow.flops import gpu_peak
    from nanoflow.parallel.runtime import attention_kernel

    name = torch.cuda.get_device_name() if cuda() else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (gpu_peak(name) if cuda() else None)
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    config = nanoflow.load_config(CONFIG, overrides_of(shape, 10))
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": hf,
            "python": sys.version.split()[0], "peak_flops": peak, "cpu_cores": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "attention": attention_kernel(config.model, device(), shape["sequence"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="every section at tiny sizes: runs on a CPU")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a side in compare")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds: a section that would end later is skipped")
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "runs", "gpu-smoke"))
    parser.add_argument("--only", help="comma-separated sections to run (default: all)")
    parser.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak (default: nanoflow.flops)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "fsdp":
            return fsdp_worker(args, rest[0])
        return train_worker(args, rest[0], int(rest[1]), int(rest[2]) if len(rest) > 2 else None)
    if not args.tiny and not cuda():
        # The 1B model on a CPU would take hours: say so instead of starting it.
        print("gpu_smoke: no CUDA device here: the 1B check needs a GPU (--tiny runs the same code on a CPU)",
              file=sys.stderr)
        sys.exit(2)
    started = time.perf_counter()
    shape = SHAPES["tiny" if args.tiny else "1b"]
    os.makedirs(args.out, exist_ok=True)
    results = {"tool": "bench/gpu_smoke.py", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "tiny": args.tiny, "budget_s": args.budget, "estimates_s": ESTIMATES, "sections": {}}
    path = os.path.join(args.out, "gpu_smoke.json")
    scratch = tempfile.mkdtemp(prefix="gpu-smoke-", dir=os.environ.get("SMOKE_SCRATCH"))
    # What a run sets before any CUDA work (the allocator's expandable segments), set before this process's first
    from nanoflow.parallel.runtime import set_environment

    set_environment(nanoflow.load_config(CONFIG, overrides_of(shape, 10)), Path(scratch), world_size=1)

    def write() -> None:
        results["elapsed_s"] = round(time.perf_counter() - started, 1)
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)

    results["machine"] = machine(args, shape)
    m = results["machine"]
    say(f"device {m['device']}, torch {m['torch']}, transformers {m['transformers']}, attention {m['attention']}")
    write()
    wanted = args.only.split(",") if args.only else list(ESTIMATES)
    sections = {"compare": lambda: compare(args, shape, m["peak_flops"]), "fsdp": lambda: fsdp(args, scratch),
                "resume": lambda: resume(args, scratch), "async_save": lambda: async_save(args, shape, scratch)}
    try:
        for name in (n for n in ESTIMATES if n in wanted):
            elapsed = time.perf_counter() - started
            if not args.tiny and elapsed + ESTIMATES[name] > args.budget:
                results["sections"][name] = {"skipped": f"would end past the {args.budget:.0f} s budget "
                                                        f"({elapsed:.0f} s gone, ~{ESTIMATES[name]} s needed)"}
                say(f"{name} skipped: over budget")
                continue
            began = time.perf_counter()
            try:
                results["sections"][name] = sections[name]()
            except Exception as error:   # one section's failure is a result; the others still run
                results["sections"][name] = {"error": f"{type(error).__name__}: {error}"}
                say(f"{name} FAILED: {type(error).__name__}: {error}")
            results["sections"][name]["seconds"] = round(time.perf_counter() - began, 1)
            write()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write()
    say(f"done in {results['elapsed_s']:.0f} s; results in {path}")


if __name__ == "__main__":
    main()
