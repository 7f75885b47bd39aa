"""How torch runs in this process: settled once, by nanoflow.run.open_run, before any CUDA work.

- The compute dtype: `[model] dtype = "auto"` becomes bfloat16 autocast on a CUDA device (float32 master
  weights and AdamW moments) and float32 on a CPU, and the run's config carries the resolved value, so a
  checkpoint records it and a resume compares it.
- Determinism (`[general] deterministic`): torch's deterministic algorithms, cuBLAS's fixed workspace
  (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts: so before any CUDA work) and cuDNN's deterministic
  kernels without autotuning. torch's fill of uninitialised memory that deterministic mode turns on is left
  off (as torchtitan does): nanoflow fills every tensor it leaves unset before reading it.
- CUDA defaults a GPU user expects: TF32 for float32 matmuls (the bf16 run's few float32 ones), the caching
  allocator's expandable segments, NCCL's flight recorder dumping each rank's last collectives to
  <run folder>/flight_recorder/ when a collective times out.
- Attention: scaled_dot_product_attention's kernels tried in ATTENTION_PRIORITY order; `attention_kernel`
  says which one a model's shapes get, for the start-up header.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import attrs
import torch

from nanoflow.config import Config

CUBLAS_WORKSPACE = ":4096:8"            # cuBLAS's deterministic setting, as torch's documentation gives it
FLIGHT_RECORDER_ENTRIES = 20_000        # collectives each rank remembers for a dump (torchtitan's default)
# flash first (it takes grouped-query attention on sm80–sm90), cuDNN before the math kernel: where flash cannot
# run (Blackwell, float32) cuDNN still can, also with GQA, while torch's own order tries it last of all.
# The memory-efficient kernel refuses GQA in torch 2.13: where it is the only fused kernel left, nanoflow.attention
# repeats k and v to every query head for it (the reasons and torch's source lines are there).
ATTENTION_PRIORITY = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def compute_dtype(dtype: str, device: torch.device) -> Literal["float32", "bfloat16"]:
    """`[model] dtype` as it runs on `device`: "auto" is bfloat16 on CUDA and float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return "bfloat16" if dtype == "bfloat16" else "float32"


def resolved(config: Config, device: torch.device) -> Config:
    """`config` with `[model] dtype` resolved for `device` (the same object when there is nothing to resolve)."""
    dtype = compute_dtype(config.model.dtype, device)
    if dtype == config.model.dtype:
        return config
    return attrs.evolve(config, model=attrs.evolve(config.model, dtype=dtype))


def set_environment(config: Config, run_folder: Path, world_size: int) -> None:
    """The environment torch reads when CUDA, cuBLAS or NCCL start: call before any of them does. A variable the
    user has set is left as it is."""
    if not torch.cuda.is_available():
        return
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in allocator:   # fewer fragmentation OOMs when shapes change (stage switches)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [allocator, "expandable_segments:True"]))
    if config.general.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if world_size > 1:
        dumps = flight_recorder_folder(run_folder)   # made by the training loop, once the run folder is checked
        # torch 2.7+ reads the TORCH_FR_* names, earlier releases the TORCH_NCCL_* ones: both are set
        for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
            os.environ.setdefault(name, str(FLIGHT_RECORDER_ENTRIES))
        for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
            os.environ.setdefault(name, str(dumps / "rank_"))   # torch appends the rank
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        # 3 = tear the process down without NCCL's clean-up: the watchdog's abort (1) would not leave the
        # flight recorder time to write its dump
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")


def flight_recorder_folder(run_folder: Path) -> Path:
    return run_folder / "flight_recorder"


def make_flight_recorder_folder(run_folder: Path) -> None:
    """Make the folder NCCL's flight recorder dumps into, when this process set it up (set_environment)."""
    folder = flight_recorder_folder(run_folder)
    if os.environ.get("TORCH_FR_DUMP_TEMP_FILE") == str(folder / "rank_"):
        folder.mkdir(parents=True, exist_ok=True)


def set_torch(config: Config) -> None:
    """torch's process-wide switches for this run: set again by every run opened, so a second run in one process
    (tests, notebooks) gets its own."""
    deterministic = config.general.deterministic
    torch.use_deterministic_algorithms(deterministic)
    # a property of the module's own class, which torch's stubs do not declare
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def attention_kernels():
    """A context in which scaled_dot_product_attention tries its kernels in ATTENTION_PRIORITY order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in ATTENTION_PRIORITY], set_priority=True)


def attention_kernel(model_config, device: torch.device, sequence_length: int) -> str:
    """The kernel scaled_dot_product_attention runs for the model's causal attention on `device`, as torch's own
    dispatcher decides it for these shapes and this compute dtype (grouped heads included: where the grouped call
    would take the math kernel and repeated k and v a fused one, nanoflow.attention repeats them, and says so)."""
    from nanoflow.attention import grouped_heads_plan

    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads   # Qwen3 states its own
    dtype = torch.bfloat16 if compute_dtype(model_config.dtype, device) == "bfloat16" else torch.float32
    length = min(sequence_length, 1024)   # the kernels' rules do not depend on the length beyond a few rows
    with attention_kernels():
        name, repeated = grouped_heads_plan(heads, kv_heads, head_dim, dtype, device, length)
    grouped = f", grouped-query {heads}/{kv_heads} heads" if kv_heads != heads else ""
    if repeated:
        grouped += f", k and v repeated to {heads} heads: the grouped call would take the math kernel"
    return f"{name} ({str(dtype).removeprefix('torch.')}, head_dim {head_dim}{grouped})"
