"""What several bench/ scripts share: the curriculum's Llama at a chosen size with AdamW moments, and the
lines that say on what machine and under what load a figure was measured."""

from __future__ import annotations

import datetime
import os
import platform
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)  # this checkout's nanoflow, also without `pip install -e .`
CONFIG = os.path.join(REPO, "schedules", "curriculum.toml")
# --smoke's model and batch for the scripts that run the curriculum's: steps of milliseconds, so that a smoke
# run costs its processes' start-up and little more
SMOKE_MODEL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
               "model.num_attention_heads=2", "model.num_key_value_heads=2"]
SMOKE_SHAPE = [*SMOKE_MODEL, "tokens.sequence_length=32", "tokens.micro_batch_size=2",
               "data_stages.sft.micro_batch_size=2"]


def curriculum_at(hidden: int, intermediate: int, layers: int, heads: int = 8):
    """The curriculum's config with its Llama at this size."""
    import nanoflow

    return nanoflow.load_config(CONFIG, overrides=[
        f"model.hidden_size={hidden}", f"model.intermediate_size={intermediate}",
        f"model.num_hidden_layers={layers}", f"model.num_attention_heads={heads}", f"model.num_key_value_heads={heads}",
    ])


def state_with_moments(hidden: int, intermediate: int, layers: int, heads: int = 8):
    """(config, TrainState) of the curriculum's Llama at this size; one AdamW step on small random gradients
    has made every exp_avg and exp_avg_sq, so a checkpoint of it holds what a real one holds."""
    import torch

    import nanoflow

    config = curriculum_at(hidden, intermediate, layers, heads)
    state = nanoflow.init_state(config)
    generator = torch.Generator().manual_seed(0)
    for p in state.model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return config, state


def machine_line() -> str:
    import torch

    return (f"{datetime.date.today().isoformat()}; {os.cpu_count()} CPU cores ({platform.machine()}), "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, Python {platform.python_version()}")


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min)"


def filesystem(path: str) -> str:
    """The mount `path` lies on, as "type on device" (from /proc/mounts)."""
    try:
        best = ("", "unknown filesystem")
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, kind = line.split()[:3]
                if os.path.realpath(path).startswith(mount) and len(mount) >= len(best[0]):
                    best = (mount, f"{kind} on {device}")
        return best[1]
    except OSError:
        return "unknown filesystem"


def parse(parser, argv=None, **smallest):
    """`parser`'s arguments plus --smoke, which makes `smallest` the defaults: the setting in which
    tests/e2e/test_bench.py runs the script (seconds; its figures mean nothing, only that it runs)."""
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: checks that the script runs")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smallest)
        args = parser.parse_args(argv)
        one_thread()
    return args


def one_thread() -> None:
    """One intra-op thread here and in every process started from here (OMP_NUM_THREADS is inherited). On
    --smoke's tiny shapes a second thread only adds waits, and where the cores are busy (a shared machine,
    overlapping smoke processes) a descheduled thread stalls every operator: seconds for a step of milliseconds."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def status(key: str) -> int:
    """A /proc/self/status memory figure (VmHWM, VmRSS, …) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

