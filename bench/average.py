"""Peak memory of bin/average against one model's bytes: does it hold about one model plus one tensor?

    python bench/average.py [--k K] [--hidden H --intermediate I --layers L] [--dir DIR]
    python bench/average.py --smoke        # a 2-layer model, K = 2: seconds, any machine

The checkpoints: K steps of schedules/tiny.toml's Llama made bigger (by default 512 hidden, 1408
intermediate, 8 layers, 8 heads: about 26 M parameters, 104 MB in float32), one committed checkpoint a
step, trained on one sequence a step (the model, not the activations, is what is measured).

The average runs in a fresh process started with MALLOC_MMAP_THRESHOLD_=65536 (so that a freed tensor
leaves the resident set at once instead of staying in malloc's pool), whose resident set's peak is
reset (`echo 5 > /proc/self/clear_refs`) once torch and nanoflow are imported; the figure is then
VmHWM − VmRSS before the average: what `nanoflow.checkpoint.average.average_checkpoints` itself took,
reading K checkpoints tensor by tensor and writing the result. It is printed against one model's bytes
and against one model plus its largest tensor (the streaming target).

One line each starts with "average: " (the last one: "average: peak …").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..")
sys.path.insert(0, REPO)  # this checkout's nanoflow, also without `pip install -e .`
from benchlib import one_thread, status  # noqa: E402  (bench/benchlib.py)

CONFIG = os.path.join(REPO, "schedules", "tiny.toml")
MB = 1e6



def make_checkpoints(run: str, args) -> None:
    """K committed checkpoints (steps 1..K) of the bigger model, one a step."""
    import io

    from nanoflow.config import load_config
    from nanoflow.training.loop import train

    heads = max(1, args.hidden // 64)
    config = load_config(CONFIG, [
        f"model.hidden_size={args.hidden}", f"model.intermediate_size={args.intermediate}",
        f"model.num_hidden_layers={args.layers}", f"model.num_attention_heads={heads}",
        f"model.num_key_value_heads={heads}", "tokens.sequence_length=32", "tokens.micro_batch_size=1",
        "tokens.global_batch_size=1", f"tokens.train_steps={args.k}", "data_stages.sft.start_training_step=100000",
        f"checkpoints.checkpoints_path={json.dumps(run)}", "checkpoints.checkpoint_interval=1"])
    train(config, out=io.StringIO(), fresh=True)


def worker(run: str, out: str, k: int) -> dict:
    """In the measured process: the average of the last K checkpoints, and the peak it took."""
    import torch  # noqa: F401  (imported before the baseline, like everything the average uses)

    from nanoflow import io
    from nanoflow.checkpoint.average import average_checkpoints

    rss = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")             # VmHWM := VmRSS: the peak from here on
    average_checkpoints(run, out, last=k)
    peak = status("VmHWM")
    tensors = io.read_metadata(out)["tensors"]["model"]
    sizes = [4 * _count(entry["shape"]) if entry["dtype"] == "float32" else _bytes(entry) for entry in tensors.values()]
    return {"rss_before": rss, "peak": peak, "model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
            "tensors": len(sizes)}


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bytes(entry: dict) -> int:
    import torch
    return _count(entry["shape"]) * torch.empty(0, dtype=getattr(torch, entry["dtype"])).element_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="checkpoints averaged (default 4)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer 64-hidden model, K = 2 (a smoke test)")
    parser.add_argument("--worker", nargs=3, metavar=("RUN", "OUT", "K"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], int(args.worker[2]))))
        return 0
    if args.smoke:
        args.k, args.hidden, args.intermediate, args.layers = 2, 64, 128, 2
        one_thread()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run, out = os.path.join(tmp, "run"), os.path.join(tmp, "avg")
        make_checkpoints(run, args)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
               "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", run, out, str(args.k)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout + done.stderr, file=sys.stderr)
            return 1
        r = json.loads(done.stdout.strip().splitlines()[-1])
    taken = r["peak"] - r["rss_before"]
    model, largest = r["model_bytes"], r["largest_tensor_bytes"]
    print(f"average: {args.k} checkpoints of {model / 4 / 1e6:.1f} M parameters ({r['tensors']} tensors): one model "
          f"{model / MB:.1f} MB, its largest tensor {largest / MB:.1f} MB")
    print(f"average: resident set before the average {r['rss_before'] / MB:.0f} MB (torch and nanoflow imported)")
    print(f"average: peak {taken / MB:.1f} MB above it = {taken / model:.2f} × one model = "
          f"{taken / (model + largest):.2f} × (one model + its largest tensor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
