"""Data loading: samples/s of each kind of source at sequence length 2048, seek cost at offset 0 vs 10**8
samples, and loader throughput as a multiple of what train_step consumes on the same machine.

    python bench/dataloader.py [--quick]

Everything is built in a temporary folder: two token folders of random ids (written with nanoflow's
writer), generated text files read as an HF "text" source, a generated SFT jsonl, a blend of the two
folders, and a moving blend of them (dataset_weights_end: the shares move over the whole stage). Each
loader reads whole global batches (32 × 2048 tokens) through `batch_at`, from steps
spread over the stage, so reads are random across the files as in training. The loaders and
train_step (the curriculum's model, schedules/curriculum.toml, at sequence length 2048) are timed in
the same rounds, the order flipped every round; the multiple is the median over rounds of that
round's slowest loader against that round's train_step, by wall time and by CPU seconds. The seek
test times `open_stage` + the first `batch_at` of a loader whose first batch starts at sample 0, and
of one whose first batch starts at sample 10**8, interleaved (the order flips every round) and
reported as medians. The loader's own cost is `batch_at` against a bare np.memmap read of the same
files, interleaved batch by batch (the order flipping), as the ratio of summed times and the median
of the paired batches, by wall time and by CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from benchlib import SMOKE_MODEL, parse  # noqa: E402  (bench/benchlib.py)

from nanoflow import init_state, load_config, train_step  # noqa: E402
from nanoflow.data import ByteTokenizer, open_stage, write_token_file  # noqa: E402
from nanoflow.schedule import Schedule  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEQ = 2048
MICRO, ACCUMULATION = 8, 4          # global batch 32
FAR = 10**8                         # the far offset of the seek test, in samples
BYTES = ByteTokenizer()


def write_folder(folder: Path, tokens: int, files: int, rng) -> None:
    per_file = tokens // files
    for k in range(files):
        docs = []
        left = per_file
        while left > 0:
            n = min(left, int(rng.integers(200, 4000)))
            docs.append(np.append(rng.integers(0, 256, n - 1, dtype=np.uint16), 256))
            left -= n
        write_token_file(folder, f"{k:05d}_unshuffled", docs, tokenizer_name="bytes", token_size=2)


def write_inputs(root: Path, scale: float, rng) -> None:
    write_folder(root / "web", int(48e6 * scale), 4, rng)
    write_folder(root / "code", int(16e6 * scale), 2, rng)
    words = np.array("the of and to in is that for it as with was on be by this are or at from".split())
    (root / "text").mkdir()
    for k in range(8):
        (root / "text" / f"{k}.txt").write_text(" ".join(rng.choice(words, int(200_000 * scale))))
    with open(root / "sft.jsonl", "w") as f:
        for _ in range(int(4000 * scale)):
            prompt = " ".join(rng.choice(words, int(rng.integers(20, 400))))
            f.write(json.dumps({"prompt": prompt, "completion": " ".join(rng.choice(words, 200))}) + "\n")


def config_text(root: Path, train_steps: int, seq: int = SEQ, micro: int = MICRO, accumulation: int = ACCUMULATION,
                only: str | None = None) -> str:
    stage = "\n[[data_stages]]\nname = {name!r}\nstart_training_step = {start}\n[data_stages.data.dataset]\n{body}\n"
    sources = {
        "token folder": f'dataset_folder = "{root / "web"}"',
        "blend of 2 folders (0.7/0.3)": f'dataset_folder = ["{root / "web"}", "{root / "code"}"]\n'
                                        "dataset_weights = [0.7, 0.3]",
        "moving blend 0.9/0.1→0.3/0.7": f'dataset_folder = ["{root / "web"}", "{root / "code"}"]\n'
                                       "dataset_weights = [0.9, 0.1]\ndataset_weights_end = [0.3, 0.7]",
        "HF text (cached tokens)": f'hf_dataset_or_datasets = "text"\nhf_data_files = "{root / "text"}/*.txt"',
        "SFT jsonl (cached tokens)": f'hf_dataset_or_datasets = "json"\nhf_data_files = "{root / "sft.jsonl"}"\n'
                                     'prompt_column_name = "prompt"\ncompletion_column_name = "completion"',
    }
    if only is not None:
        sources = {only: sources[only]}
    text = f"""
[model]
vocab_size = 288
hidden_size = 128
intermediate_size = 384
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = {seq}
tie_word_embeddings = true
[tokens]
sequence_length = {seq}
train_steps = {train_steps * len(sources)}
micro_batch_size = {micro}
batch_accumulation_per_replica = {accumulation}
[optimizer.learning_rate_scheduler]
learning_rate = 3e-3
"""
    for i, (name, body) in enumerate(sources.items()):
        text += stage.format(name=name, start=1 + i * train_steps, body=body)
    return text


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(started: tuple[float, float]) -> tuple[float, float]:
    """(wall s, CPU s of the process's threads) since `started` (clocks())."""
    wall, cpu = clocks()
    return wall - started[0], cpu - started[1]


def loaders_against_train_step(loaders: dict, step, rounds: int, batches: int, rng) -> tuple[dict, dict]:
    """Each loader's batch_at over `batches` steps spread over its stage (random places in the data), and one
    train_step (`step`), timed in the same rounds, the order flipped every round. ({name: [samples/s]}, {name:
    [samples per CPU s]}) a round each, the name "train_step" counting samples of sequence length too."""
    names = [*loaders, "train_step"]
    wall: dict = {name: [] for name in names}
    cpu: dict = {name: [] for name in names}
    for loader in loaders.values():
        loader.batch_at(loader.steps.start)   # warm: pages of the first files, numpy paths
    step()                                    # warm: the first step's allocations
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if name == "train_step":
                started = clocks()
                samples = step()
            else:
                loader = loaders[name]
                steps = rng.choice(np.arange(loader.steps.start, loader.steps.stop), batches, replace=False)
                started = clocks()
                for s in steps:
                    loader.batch_at(int(s))
                samples = batches * loader.stage.global_batch_size
            seconds, cpu_seconds = since(started)
            wall[name].append(samples / seconds)
            cpu[name].append(samples / cpu_seconds)
    return wall, cpu


def multiple(rates: dict) -> tuple[str, float]:
    """(the slowest loader by median, the median over rounds of the round's slowest loader / train_step)."""
    loaders = [name for name in rates if name != "train_step"]
    slowest = min(loaders, key=lambda name: statistics.median(rates[name]))
    per_round = [min(rates[name][r] for name in loaders) / rates["train_step"][r] for r in range(len(rates["train_step"]))]
    return slowest, statistics.median(per_round)


def seek_seconds(config, index: int, schedule, start_sample: int, cache: str, repeats: int = 5) -> float:
    """Mean seconds of open_stage + the batch_at of the step whose batch starts at `start_sample`."""
    stage = schedule.stages[index]
    step = stage.start_step + start_sample // stage.global_batch_size
    total = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        loader = open_stage(config, index, BYTES, schedule, cache_dir=cache)
        loader.batch_at(step)
        total += time.perf_counter() - started
        loader.close()
    return total / repeats


def against_memmap(root: Path, seq: int, rows: int, batches: int, rng, profile: bool) -> tuple[dict, str]:
    """For batches of rows × seq from the token folder, the two interleaved batch by batch (the order flipping):
    {"loader", "bare": samples/s; "wall", "cpu": loader / bare by summed times; "paired wall", "paired cpu": the
    median over batches of bare's time / the loader's}; with `profile`, the loader's top functions by own time.

    The bare side is what a batch costs at the least: `rows` random windows of seq + 1 tokens sliced from a
    np.memmap of one of the same .ds files, stacked, widened to int64, shifted into inputs and labels."""
    (root / f"memmap{seq}.toml").write_text(config_text(root, 10**6, seq, rows, 1, only="token folder"))
    config = load_config(root / f"memmap{seq}.toml")
    loader = open_stage(config, 0, BYTES, Schedule.from_config(config))
    maps = [np.memmap(path, dtype=np.uint16, mode="r") for path in sorted((root / "web").glob("*.ds"))]

    def bare() -> dict:
        tokens = maps[int(rng.integers(len(maps)))]
        starts = rng.integers(0, len(tokens) - seq - 1, rows)
        window = torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int64))
        return {"input_ids": window[:, :-1], "labels": window[:, 1:]}

    steps = rng.integers(1, 10**6, batches)
    loader.batch_at(int(steps[0]))
    bare()
    seconds: dict = {"loader": [], "bare": []}
    cpu_seconds: dict = {"loader": [], "bare": []}
    for i, step in enumerate(steps):
        for side in (("loader", "bare") if i % 2 == 0 else ("bare", "loader")):
            started = clocks()
            loader.batch_at(int(step)) if side == "loader" else bare()
            wall, cpu = since(started)
            seconds[side].append(wall)
            cpu_seconds[side].append(cpu)
    # process_time ticks finer than a batch here, yet a batch may read 0 CPU s: those pairs say nothing
    cpu_pairs = [b / a for a, b in zip(cpu_seconds["loader"], cpu_seconds["bare"], strict=True) if a > 0 and b > 0]
    figures = {"loader": batches * rows / sum(seconds["loader"]), "bare": batches * rows / sum(seconds["bare"]),
               "wall": sum(seconds["bare"]) / sum(seconds["loader"]),
               "cpu": sum(cpu_seconds["bare"]) / sum(cpu_seconds["loader"]),
               "paired wall": statistics.median(b / a for a, b in zip(seconds["loader"], seconds["bare"], strict=True)),
               "paired cpu": statistics.median(cpu_pairs) if cpu_pairs else float("nan")}
    top = ""
    if profile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for step in steps:
            loader.batch_at(int(step))
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(8)
        top = "\n".join(line for line in text.getvalue().splitlines() if line.strip()[:1].isdigit())
    loader.close()
    return figures, top


def train_stepper(model: list[str]):
    """One train_step of the curriculum's model at sequence length 2048 on a fixed batch of 2 samples, a call;
    it returns the samples it consumed."""
    held = [init_state(curriculum_at_2048(model))]
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 256, (2, SEQ), generator=generator)}
    batch["labels"] = torch.roll(batch["input_ids"], -1, 1)

    def step() -> int:
        held[0], _ = train_step(held[0], batch)
        return 2
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller data set and fewer rounds")
    parser.add_argument("--profile", action="store_true", help="where the loader's time goes against a bare memmap read")
    parser.add_argument("--scale", type=float, default=None, help=argparse.SUPPRESS)
    args = parse(parser, None, quick=True, scale=0.02)
    # batches: each loader's a round of the interleaved rounds against train_step (one step a round)
    scale, rounds, batches, repeats = (0.1, 3, 4, 5) if args.quick else (1.0, 15, 8, 5)
    if args.smoke:
        rounds, batches, repeats = 1, 2, 1
    scale = args.scale or scale
    if not args.smoke:   # --smoke keeps benchlib's one thread
        torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench-dataloader-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        write_inputs(root, scale, rng)
        train_steps = FAR // (MICRO * ACCUMULATION) + 10           # every stage reaches sample 10**8
        (root / "run.toml").write_text(config_text(root, train_steps))
        config = load_config(root / "run.toml")
        schedule = Schedule.from_config(config)
        cache = str(root / "hf-cache")
        print(f"inputs written in {time.perf_counter() - started:.1f}s; python {platform.python_version()}, "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads")

        loaders, first_open = {}, {}
        for index, stage in enumerate(config.data_stages):
            opened = time.perf_counter()
            loaders[stage.name] = open_stage(config, index, BYTES, schedule, cache_dir=cache)  # HF: tokenized here
            first_open[stage.name] = time.perf_counter() - opened
        model = SMOKE_MODEL if args.smoke else []   # the curriculum's model, in --smoke a smaller one
        wall, cpu = loaders_against_train_step(loaders, train_stepper(model), rounds, batches, rng)
        print(f"\n{rounds} rounds of {batches} batches of each loader and one train_step, the order flipping; medians")
        print(f"{'source':<30} {'samples':>10} {'first open':>11} {'samples/s':>10} {'tokens/s':>12} "
              f"{'per batch':>10}")
        for index, (name, loader) in enumerate(loaders.items()):
            rate = statistics.median(wall[name])
            build = schedule.stages[index].global_batch_size / rate
            size = sum(len(p.source) for p in loader.parts)
            print(f"{name:<30} {size:>10,} {first_open[name]:>10.2f}s {rate:>10,.0f} {rate * SEQ:>12,.0f} "
                  f"{build * 1e3:>8.2f}ms")
            loader.close()

        print(f"\nseek: open_stage + first batch_at, median of {rounds} rounds of {repeats}")
        print(f"{'source':<30} {'offset 0':>10} {'offset 1e8':>11} {'1e8 / 0':>8}")
        ratios = []
        for index, stage in enumerate(config.data_stages):
            times = {0: [], FAR: []}
            for r in range(rounds):
                for offset in ((0, FAR) if r % 2 == 0 else (FAR, 0)):
                    times[offset].append(seek_seconds(config, index, schedule, offset, cache, repeats))
            near, far = statistics.median(times[0]), statistics.median(times[FAR])
            ratios.append(far / near)
            print(f"{stage.name:<30} {near * 1e3:>8.2f}ms {far * 1e3:>9.2f}ms {far / near:>8.3f}")

        print("\nthe loader's own cost: batch_at of the token folder / a bare np.memmap read of the same files, "
              "interleaved batch by batch")
        for seq, rows in ((256, 8), (SEQ, 32)):
            got, top = against_memmap(root, seq, rows, 5 if args.smoke else 300, rng, args.profile)
            print(f"  {rows} × {seq}: loader {got['loader']:,.0f} samples/s, bare memmap {got['bare']:,.0f} samples/s: "
                  f"loader / bare = {got['wall']:.2f} (median of paired batches {got['paired wall']:.2f}; "
                  f"by CPU s {got['cpu']:.2f}, paired {got['paired cpu']:.2f})")
            if top:
                print("  the loader's top functions by own time (ncalls tottime percall cumtime percall):")
                print("\n".join("    " + line.strip() for line in top.splitlines()))

        loop_steps = 1 if args.smoke else 3 if args.quick else 10
        print(f"\ntraining loop (curriculum model, token folder, 2 × {SEQ} tokens a step, {loop_steps} steps):")
        for workers in (0, 2):
            wait, step_time = training_loop(root, workers, loop_steps, model)
            print(f"  num_loading_workers = {workers}: waits {wait * 1e3:.2f}ms a step in batch_at, "
                  f"step {step_time * 1e3:.0f}ms")
        slowest, paired = multiple(wall)
        _, paired_cpu = multiple(cpu)
        print(f"\ntrain_step (curriculum model, 2 × {SEQ} tokens a step): {statistics.median(wall['train_step']) * SEQ:,.0f} "
              f"tokens/s, {statistics.median(cpu['train_step']) * SEQ:,.0f} tokens per CPU s")
        print(f"slowest loader ({slowest}): {statistics.median(wall[slowest]) * SEQ:,.0f} tokens/s; each round's "
              f"slowest loader = {paired:,.0f}× what train_step consumes, median of paired rounds (by CPU s "
              f"{paired_cpu:,.0f}×; target >= 20×); seek ratio worst {max(ratios):.3f} (target <= 1.2)")


def training_loop(root: Path, workers: int, steps: int, model: list[str]) -> tuple[float, float]:
    """(mean seconds a step waits in batch_at, mean seconds a step takes) for the curriculum's model training
    on the token folder at sequence length 2048, 2 samples a step, with `workers` background loading threads."""
    config = curriculum_at_2048([*model, f'data_stages.0.data.dataset={{dataset_folder = "{root / "web"}"}}',
                                 f"data_stages.0.data.num_loading_workers={workers}", "tokens.train_steps=200"])
    state = init_state(config)
    loader = open_stage(config, 0, BYTES, state.schedule)
    waits, started = [], None
    for step in range(1, steps + 2):
        t = time.perf_counter()
        batch = loader.batch_at(step)
        if step == 2:                     # step 1 warms up (and starts the workers)
            started = t
        if step >= 2:
            waits.append(time.perf_counter() - t)
        state, _ = train_step(state, batch)
    total = time.perf_counter() - started
    loader.close()
    return statistics.mean(waits), total / steps


def curriculum_at_2048(extra: list[str]):
    return load_config(REPO / "schedules" / "curriculum.toml", [
        f"model.max_position_embeddings={SEQ}", f"tokens.sequence_length={SEQ}", "tokens.micro_batch_size=2",
        "tokens.batch_accumulation_per_replica=1", "checkpoints.checkpoints_path=/tmp/unused-bench-run", *extra])


if __name__ == "__main__":
    main()
