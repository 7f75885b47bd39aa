"""What a user watches on a long run: tokens/s over a recent window, an ETA that weighs each stage by its own
step cost, MFU against the device's peak, peak memory, and a start-up header (nanoflow/observe/progress.py, flops.py)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import tiny
from torch import nn

import nanoflow.observe.progress
from nanoflow import init_state
from nanoflow.flops import flops_per_token, gpu_peak, matmul_parameters
from nanoflow.model import Llama
from nanoflow.observe.metrics import Throughput
from nanoflow.observe.progress import FlopsAndPeak, Progress, cpu_matmul_peak, peak_memory

# schedules/tiny.toml by hand: hidden 32, 4 heads of 8, 2 kv heads, intermediate 64, 2 layers, vocabulary 288, tied.
TINY_N = 2 * (32 * 32 + 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) + 288 * 32     # q, o, k+v, gate/up/down; the head
TINY_FLOPS_32 = 6 * TINY_N + 12 * 2 * 32 * 32                               # a token at sequence length 32
TINY_FLOPS_24 = 6 * TINY_N + 12 * 2 * 32 * 24


def records(step: int, stage: str, tokens: int, seconds: list[float], elapsed: float = 0.0) -> list[dict]:
    """Synthetic step records from `step` on, each taking its `seconds`, as the loop writes them."""
    rows = []
    for offset, s in enumerate(seconds):
        elapsed += s
        rows.append({"step": step + offset, "stage": stage, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0,
                     "tokens": tokens, "elapsed": elapsed})
    return rows


def test_the_flops_count_is_the_hand_count_and_n_is_the_models_matmul_weights(tmp_path):
    config = tiny(tmp_path / "run")
    assert TINY_N == 27_648
    assert matmul_parameters(config.model) == TINY_N
    assert flops_per_token(config.model, 32) == TINY_FLOPS_32 == 190_464
    assert flops_per_token(config.model, 24) == TINY_FLOPS_24 == 184_320
    for tied in (True, False):   # N is the linear layers' weights, the head's included, counted from the real model
        untied = tiny(tmp_path / "run", f"model.tie_word_embeddings={str(tied).lower()}").model
        model = Llama(untied)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        assert matmul_parameters(untied) == linear
    assert sum(p.numel() for p in Llama(config.model).parameters()) == TINY_N + 5 * 32   # + the norms


def test_gpu_peaks_by_the_names_cuda_reports():
    # Half of each datasheet's "with sparsity" BF16 figure: H100 SXM 1,979, PCIe 1,513, NVL 1,671; H200 SXM 1,979,
    # NVL 1,671 TFLOPS; HGX B200 4.5 and GB200 NVL72 5 PFLOPS a GPU
    assert gpu_peak("NVIDIA H100 80GB HBM3") == 989.5e12
    assert gpu_peak("NVIDIA H100 PCIe") == 756.5e12
    assert gpu_peak("NVIDIA H100 NVL") == 835.5e12
    assert gpu_peak("NVIDIA H200") == 989.5e12
    assert gpu_peak("NVIDIA H200 NVL") == 835.5e12
    assert gpu_peak("NVIDIA GH200 480GB") == 989.5e12
    assert gpu_peak("NVIDIA B200") == 2250e12
    assert gpu_peak("NVIDIA GB200") == 2500e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak("NVIDIA L40S") == 362.05e12
    assert gpu_peak("NVIDIA A10G") == 125e12
    assert gpu_peak("NVIDIA GeForce GTX 1080") is None


def test_the_rate_follows_a_change_of_speed_the_mean_since_start_hides():
    progress = Progress(train_steps=1000, start_step=0, live=False, interval=10_000)
    slow = records(1, "a", 1000, [1.0] * 100)                              # 1,000 tokens/s for 100 s
    fast = records(101, "a", 1000, [0.5] * 80, elapsed=slow[-1]["elapsed"])  # then 2,000 tokens/s
    since_start = Throughput()
    for m in slow:
        progress.step_done(m)
        since_start.add(m)
    assert slow[-1]["tokens_per_s"] == 1000.0
    for m in fast[:10]:
        progress.step_done(m)
        since_start.add(m)
    # the last 30 s: 10 fast steps (5 s) and the 25 slow ones before them
    assert fast[9]["tokens_per_s"] == pytest.approx(35 * 1000 / 30, abs=0.1)
    for m in fast[10:]:
        progress.step_done(m)
        since_start.add(m)
    assert fast[-1]["tokens_per_s"] == 2000.0                                # the window holds only fast steps
    assert since_start.rate == pytest.approx(180_000 / 140)                  # the mean: 1,286, far from 2,000


def test_the_eta_weighs_each_remaining_stage_by_its_own_step_cost(tmp_path):
    state = init_state(tiny(tmp_path / "run"))   # pretrain 1–7: 4 × 32 tokens a step; sft 8–12: 8 × 24
    costs = FlopsAndPeak.of(state)
    pretrain, sft = 4 * 32 * TINY_FLOPS_32, 8 * 24 * TINY_FLOPS_24
    assert costs.stage_flops == (pretrain, sft)
    progress = Progress(12, 0, live=False, interval=1000, costs=costs)
    for m in records(1, "pretrain", 128, [0.5, 0.5, 0.5]):
        progress.step_done(m)
    # 4 pretrain steps left at 0.5 s, and 5 sft steps, each costing sft / pretrain as much as a pretrain step
    assert progress.eta(3) == pytest.approx(4 * 0.5 + 5 * 0.5 * sft / pretrain)
    assert progress.eta(3) == pytest.approx(2.0 + 2.5 * 35_389_440 / 24_379_392)   # 5.63 s, not 9 × 0.5
    for m in records(4, "pretrain", 128, [0.5] * 4, elapsed=1.5) + records(8, "sft", 192, [0.9], elapsed=3.5):
        progress.step_done(m)
    assert progress.eta(8) == pytest.approx(4 * 0.9)   # in sft: its own measured pace, for its own 4 steps left


def test_mfu_is_the_model_flops_a_second_over_the_peak(tmp_path):
    state = init_state(tiny(tmp_path / "run"))
    costs = FlopsAndPeak(state.schedule, (4 * 32 * TINY_FLOPS_32, 8 * 24 * TINY_FLOPS_24), 1e9, torch.device("cpu"),
                         "test")
    progress = Progress(12, 0, live=False, interval=1000, costs=costs)
    rows = records(1, "pretrain", 128, [0.25, 0.25]) + records(8, "sft", 192, [0.5], elapsed=0.5)
    for m in rows:
        progress.step_done(m)
    assert rows[1]["mfu"] == round(128 * TINY_FLOPS_32 / 0.25 / 1e9, 5)                     # 0.09752
    assert rows[2]["mfu"] == round((2 * 128 * TINY_FLOPS_32 + 192 * TINY_FLOPS_24) / 1.0 / 1e9, 5)
    assert rows[2]["tokens_per_s"] == (2 * 128 + 192) / 1.0


def test_the_cpu_peak_is_read_off_the_threads_cpu_time_not_the_wall_clock(monkeypatch):
    # A product on shared cores: descheduled for two thirds of its wall time. The peak is the machine's
    # (what the thread computed while it ran), not a third of it, which would make MFU read 3× too high.
    clock = {"wall": 0.0, "cpu": 0.0}

    def product_ran():   # each product: 1 ms of the thread's CPU time in 3 ms of wall time
        clock["cpu"] += 1e-3
        clock["wall"] += 3e-3

    class Clock:
        @staticmethod
        def thread_time():
            return clock["cpu"]

        @staticmethod
        def perf_counter():
            return clock["wall"]

    class Matrix:
        def __matmul__(self, other):
            product_ran()

    monkeypatch.setattr(nanoflow.observe.progress, "time", Clock)
    monkeypatch.setattr(nanoflow.observe.progress.torch, "randn", lambda *shape, generator: Matrix())
    threads = torch.get_num_threads()
    assert cpu_matmul_peak(64, 32, 16, budget=0.05) == pytest.approx(threads * 2 * 64 * 32 * 16 / 1e-3)


def test_the_cpu_peak_and_the_peak_memory_are_measured():
    peak = cpu_matmul_peak(256, 256, 256, budget=0.05)
    assert math.isfinite(peak) and peak > 1e8   # any CPU of this century does 0.1 GFLOP/s
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert peak_memory(torch.device("cpu")) >= 0.99 * resident   # the kernel's counters lag by a few pages


