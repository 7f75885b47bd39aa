"""nanoflow's train_step next to its peers, each in its own virtual environment, interleaved round by round.

    python bench/peers.py [--vocab 288 50304] [--steps 40] [--peers hf olmo-core litgpt] [--no-install]
    python bench/peers.py --smoke --here        # seconds: a tiny shape, peers importable here only
    python bench/peers.py --compile ...         # every side's whole model torch.compile'd

Peers: HF transformers' LlamaForCausalLM in a plain PyTorch loop, OLMo-core's Transformer trained by its
TransformerTrainModule, litgpt's GPT under Lightning Fabric. Each is installed on first use into its own
venv under $NANOFLOW_PEERS_CACHE (default ~/.cache/nanoflow-peers/<peer>): a fresh `python -m venv`
with this interpreter's torch release and the peer's pinned packages, nothing of this repository. A peer
that cannot be installed or built is reported with the reason and left out; the rest go on.

Every side starts from the same weights (nanoflow's initialisation, written once in HF's names and
converted by each peer's own code), trains on the same batches at the same learning rate each step
(nanoflow's schedule), 1 torch thread, in a process of its own (bench/peer_steps.py) that waits on
its stdin while another side steps, so the sides never share a core. The order of the sides rotates
every step; the first --warmup steps are not timed. Prints, per vocabulary and peer, the peer's
tokens/s ÷ nanoflow's (above 1: the peer is faster), the same ratio by CPU seconds a step (steadier on
loaded cores, where a step's wall time is mostly waiting for a core) and the largest difference of the
losses over all steps (they should agree to about 1e-6: the same arithmetic in float32).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import venv

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG = os.path.join(REPO, "schedules", "curriculum.toml")
CACHE = os.environ.get("NANOFLOW_PEERS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanoflow-peers"))

# name: (what is timed, the packages beside torch, the import that proves the venv works)
PEERS = {
    "hf": ("HF LlamaForCausalLM loop", ["transformers"], "import transformers"),
    "olmo-core": ("OLMo-core 3.0.0 train module", ["ai2-olmo-core==3.0.0"], "import olmo_core.train"),
    "litgpt": ("litgpt 0.5.13 + Fabric", ["litgpt==0.5.13", "lightning"], "import litgpt, lightning"),
}
NOT_ON_CPU = {
    "torchtitan": "torchtitan 0.3.0 does not train on a CPU: it needs triton (no CPU build), calls "
                  "torch._C._cuda_setDevice at start-up, and its flex attention has no CPU backward",
}
TOLERANCE = 1e-5   # largest |loss difference| still counted as the same arithmetic
THREADS = 1        # torch threads a side (--threads)


def shape_of(args, vocab: int) -> dict:
    if args.smoke:
        hidden, intermediate, layers, heads, sequence, batch = 32, 64, 1, 2, 16, 2
    else:
        hidden, intermediate, layers, heads, sequence, batch = 256, 688, 4, 4, 256, 8
    steps = args.steps
    overrides = [
        f"model.vocab_size={vocab}", f"model.hidden_size={hidden}", f"model.intermediate_size={intermediate}",
        f"model.num_hidden_layers={layers}", f"model.num_attention_heads={heads}", f"model.num_key_value_heads={heads}",
        "model.max_position_embeddings=512", "model.tie_word_embeddings=false",
        f"tokens.sequence_length={sequence}", f"tokens.micro_batch_size={batch}",
        "tokens.batch_accumulation_per_replica=1", f"tokens.train_steps={steps}",
        f"data_stages.anneal.start_training_step={steps + 1}", f"data_stages.sft.start_training_step={steps + 2}",
        f"optimizer.learning_rate_scheduler.lr_warmup_steps={max(1, steps // 4)}",
        f"optimizer.learning_rate_scheduler.lr_decay_starting_step={steps // 2}",
        f"optimizer.learning_rate_scheduler.lr_decay_steps={steps - steps // 2}",
        "optimizer.learning_rate_scheduler.lr_decay_style=cosine",
        f"model.compile={str(args.compile).lower()}",
    ]
    return {"vocab": vocab, "hidden": hidden, "intermediate": intermediate, "layers": layers, "heads": heads,
            "kv_heads": heads, "sequence": sequence, "positions": 512, "batch": batch, "steps": steps,
            "nanoflow_config": CONFIG, "nanoflow_overrides": overrides, "compile": args.compile}


def write_fixtures(folder: str, shape: dict) -> list[float]:
    """shape.json, weights (nanoflow's initialisation, HF names), batches; returns each step's LR."""
    import torch

    import nanoflow
    from nanoflow.lr import scheduled_lr

    config = nanoflow.load_config(CONFIG, overrides=shape["nanoflow_overrides"])
    state = nanoflow.init_state(config)
    factory, scheduler = config.optimizer.optimizer_factory, config.optimizer.learning_rate_scheduler
    shape.update(norm_eps=config.model.rms_norm_eps, rope_theta=config.model.rope_theta,
                 weight_decay=config.optimizer.weight_decay, beta1=factory.adam_beta1, beta2=factory.adam_beta2,
                 adam_eps=factory.adam_eps, clip=config.optimizer.max_grad_norm, lr=scheduler.learning_rate)
    with open(os.path.join(folder, "shape.json"), "w") as f:
        json.dump(shape, f)
    index, offset = {}, 0
    with open(os.path.join(folder, "weights.bin"), "wb") as f:
        for name, tensor in state.model.state_dict().items():
            data = tensor.detach().float().contiguous().numpy().tobytes()
            index[name] = (offset, list(tensor.shape))
            f.write(data)
            offset += len(data)
    with open(os.path.join(folder, "weights.json"), "w") as f:
        json.dump(index, f)
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, shape["vocab"], (shape["steps"], shape["batch"], shape["sequence"] + 1),
                           generator=generator, dtype=torch.int64)
    with open(os.path.join(folder, "batches.bin"), "wb") as f:
        f.write(tokens.numpy().tobytes())
    return [scheduled_lr(step, config, state.schedule, 0) for step in range(1, shape["steps"] + 1)]


# ---------------------------------------------------------------------------------------------
# Venvs

def peer_python(peer: str, args) -> tuple[str | None, str]:
    """The interpreter that runs `peer`, or None and why not."""
    if args.here:
        check = subprocess.run([sys.executable, "-c", PEERS[peer][2]], capture_output=True, text=True)
        if check.returncode == 0:
            return sys.executable, "this interpreter"
        return None, f"not importable here ({_last_line(check.stderr)}); run without --here to install it"
    import torch

    release = torch.__version__.split("+")[0]
    folder = os.path.join(CACHE, peer)
    python = os.path.join(folder, "bin", "python")
    # Written once the install and its import check succeeded: later runs skip the check (a minute of imports
    # on busy cores); a venv broken since then fails when its worker starts, and is reported there.
    marker = os.path.join(folder, "nanoflow-peer.json")
    wanted = {"torch": release, "packages": PEERS[peer][1]}
    if os.path.exists(python) and os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == wanted:
                return python, folder
    if os.path.exists(python) and _imports(python, PEERS[peer][2]):
        with open(marker, "w") as f:
            json.dump(wanted, f)
        return python, folder
    if args.no_install:
        return None, f"not installed in {folder} (--no-install)"
    print(f"installing {peer} into {folder} (torch=={release} {' '.join(PEERS[peer][1])}) …", flush=True)
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(folder)
    except Exception as e:  # noqa: BLE001 - any failure only leaves this peer out
        return None, f"could not create a venv in {folder}: {e}"
    install = subprocess.run([python, "-m", "pip", "install", "-q", f"torch=={release}", *PEERS[peer][1]],
                             capture_output=True, text=True)
    if install.returncode != 0:
        return None, f"pip could not install it: {_last_line(install.stderr)}"
    if not _imports(python, PEERS[peer][2]):
        return None, f"installed, but `{PEERS[peer][2]}` fails in {folder}"
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return python, folder


def _imports(python: str, statement: str) -> bool:
    return subprocess.run([python, "-c", statement], capture_output=True).returncode == 0


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip() and not line.startswith("WARNING: Location")]
    return lines[-1].strip() if lines else "no message"


# ---------------------------------------------------------------------------------------------
# Workers

class Worker:
    def __init__(self, peer: str, python: str, folder: str, log):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(OMP_NUM_THREADS=str(THREADS), PEERS_THREADS=str(THREADS), PYTHONUNBUFFERED="1")
        if peer == "nanoflow":
            env["PYTHONPATH"] = REPO
        self.peer = peer
        self.process = subprocess.Popen([python, os.path.join(HERE, "peer_steps.py"), peer, folder], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.ready = None

    def wait_ready(self) -> None:
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.peer}'s worker stopped (exit {self.process.wait()})")
        return json.loads(line)

    def step(self, index: int, lr: float) -> dict:
        self.process.stdin.write(f"step {index} {lr!r}\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            except OSError:
                pass
            self.process.wait(timeout=60)


def compare(args, vocab: int, pythons: dict[str, str], work: str) -> list[dict]:
    shape = shape_of(args, vocab)
    folder = os.path.join(work, f"vocab{vocab}")
    os.makedirs(folder)
    lrs = write_fixtures(folder, shape)
    workers, rows = {}, []
    log_path = os.path.join(work, f"vocab{vocab}.log")
    with open(log_path, "w") as log:
        try:
            for peer in ["nanoflow", *pythons]:   # all start at once: the imports overlap, the steps never do
                workers[peer] = Worker(peer, sys.executable if peer == "nanoflow" else pythons[peer], folder, log)
            for peer in list(workers):
                try:
                    workers[peer].wait_ready()
                except (RuntimeError, json.JSONDecodeError) as e:
                    log.flush()
                    rows.append({"peer": peer, "failed": f"{e}: {_last_line(open(log_path).read())}"})
                    workers.pop(peer).close()
                    if peer == "nanoflow":
                        raise SystemExit(f"nanoflow's side did not start: {rows[-1]['failed']}") from None
            results = {peer: [] for peer in workers}
            order = list(workers)
            for index in range(shape["steps"]):
                turn = order[index % len(order):] + order[:index % len(order)]
                for peer in (turn if index % 2 == 0 else turn[::-1]):
                    try:
                        results[peer].append(workers[peer].step(index, lrs[index]))
                    except (RuntimeError, OSError, json.JSONDecodeError) as e:
                        log.flush()
                        rows.append({"peer": peer, "failed": f"step {index + 1}: {e}: {_last_line(open(log_path).read())}"})
                        workers.pop(peer).close()
                        order.remove(peer)
                        results.pop(peer)
        finally:
            for worker in workers.values():
                worker.close()
    ours = results["nanoflow"]
    ours_s = statistics.median(r["seconds"] for r in ours[args.warmup:])
    tokens = shape["batch"] * shape["sequence"]
    for peer, theirs in results.items():
        seconds = statistics.median(r["seconds"] for r in theirs[args.warmup:])
        cpu = statistics.median(r["cpu"] for r in theirs[args.warmup:])
        ours_cpu = statistics.median(r["cpu"] for r in ours[args.warmup:])
        gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(theirs, ours, strict=True))
        rows.append({"peer": peer, "version": workers[peer].ready["version"], "seconds": seconds,
                     "nanoflow_seconds": ours_s, "speed": ours_s / seconds, "tokens_per_s": tokens / seconds,
                     "loss_gap": gap, "first_loss": theirs[0]["loss"], "last_loss": theirs[-1]["loss"],
                     "cpu": cpu, "cpu_speed": ours_cpu / cpu})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=None, help="vocabularies (default 288 50304)")
    parser.add_argument("--steps", type=int, default=None, help="steps per side, warm-up included (default 40)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not timed (default 2)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--no-install", action="store_true", help="only peers whose venv is already there")
    parser.add_argument("--here", action="store_true", help="run peers in this interpreter, no venvs (a smoke check)")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, vocab 288, 4 steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a side (default 1)")
    parser.add_argument("--compile", action="store_true",
                        help="every side compiles its whole model (nanoflow: [model] compile = true); warm-up ≥ 2")
    args = parser.parse_args(argv)
    args.vocab = args.vocab or ([288] if args.smoke else [288, 50304])
    args.steps = args.steps or (4 if args.smoke else 40)
    args.warmup = min(args.warmup, args.steps - 1)
    global THREADS
    THREADS = args.threads

    import torch
    load = os.getloadavg()
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPU cores "
          f"({platform.machine()}), {THREADS} torch thread{'s' * (THREADS > 1)} a side, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"- load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the start", flush=True)
    pythons = {}
    for peer in args.peers:
        python, where = peer_python(peer, args)
        if python is None:
            print(f"{peer}: left out: {where}", flush=True)
        else:
            pythons[peer] = python
            print(f"{peer}: {python} ({where})", flush=True)
    for peer, reason in NOT_ON_CPU.items():
        print(f"{peer}: not run: {reason}", flush=True)
    table = {}
    with tempfile.TemporaryDirectory(prefix="nanoflow-peers-") as work:
        for vocab in args.vocab:
            shape = shape_of(args, vocab)
            print(f"\nvocab {vocab:,}: hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} heads, "
                  f"sequence {shape['sequence']}, batch {shape['batch']}, {args.steps} steps "
                  f"({args.warmup} untimed)", flush=True)
            for row in compare(args, vocab, pythons, work):
                table[(vocab, row["peer"])] = row
                if "failed" in row:
                    print(f"  {row['peer']}: failed: {row['failed']}", flush=True)
                    continue
                agree = "agree" if row["loss_gap"] <= TOLERANCE else "DIFFER"
                print(f"  {row['peer']} ({row['version']}): {row['seconds']:.4f} s a step, {row['tokens_per_s']:,.0f} "
                      f"tokens/s; tokens/s ÷ nanoflow's = {row['speed']:.3f}; losses {agree}: max |Δ| "
                      f"{row['loss_gap']:.2e} over {args.steps} steps ({row['first_loss']:.4f} → {row['last_loss']:.4f}); "
                      f"CPU {row['cpu']:.4f} s a step, nanoflow's CPU s ÷ this = {row['cpu_speed']:.3f}",
                      flush=True)
    load = os.getloadavg()
    print(f"\n- load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end\n")
    names = [p for p in args.peers if any((v, p) in table for v in args.vocab)]
    print("| vocab | " + " | ".join(PEERS[p][0] for p in names) + " | nanoflow train_step |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for vocab in args.vocab:
        cells = []
        for peer in names:
            row = table.get((vocab, peer))
            cells.append("—" if row is None or "failed" in row else f"{row['speed']:.3f}")
        print(f"| {vocab:,} | " + " | ".join(cells) + " | 1 |")
    print("\nthe same by CPU seconds a step (the steadier figure on loaded cores):")
    for vocab in args.vocab:
        cells = []
        for peer in names:
            row = table.get((vocab, peer))
            cells.append("—" if row is None or "failed" in row else f"{row['cpu_speed']:.3f}")
        print(f"| {vocab:,} | " + " | ".join(cells) + " | 1 |")
    bad = [key for key, row in table.items() if "failed" not in row and row["loss_gap"] > TOLERANCE]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
