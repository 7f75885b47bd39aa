"""GPU smoke benchmark: a ~1B-parameter Llama, bf16 autocast and torch.compile, a few steps; tokens/s and MFU.

    bash bench/gpu_smoke.sh            # on a machine with a CUDA GPU
    python bench/gpu_smoke.py --tiny   # the same code path, a tiny model, on any machine

MFU = achieved model FLOP/s ÷ the chip's dense bf16 peak. Model FLOPs per token: 6 × parameters
(forward and backward of every matmul) + 12 × layers × hidden × sequence length (attention scores
and values), as in the PaLM appendix's accounting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # works without `pip install -e .`

import torch  # noqa: E402

import nanoflow  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "schedules", "curriculum.toml")
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense, no sparsity

ONE_B = ["model.vocab_size=32768", "model.hidden_size=2048", "model.intermediate_size=5632",
         "model.num_hidden_layers=20", "model.num_attention_heads=32", "model.num_key_value_heads=8",
         "model.max_position_embeddings=2048", "tokens.sequence_length=2048", "tokens.micro_batch_size=4",
         "tokens.batch_accumulation_per_replica=1"]
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
        "tokens.sequence_length=64", "tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path on a CPU")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak (default: by device name)")
    args = parser.parse_args()

    overrides = [*(TINY if args.tiny else ONE_B), "model.dtype=bfloat16",
                 f"model.compile={'false' if args.no_compile else 'true'}",
                 f"tokens.train_steps={args.steps + args.warmup}", "checkpoints.checkpoints_path='/tmp/gpu_smoke'"]
    config = nanoflow.load_config(CONFIG, overrides)
    state = nanoflow.init_state(config)
    params = sum(p.numel() for p in state.model.parameters())
    rows, seq = config.tokens.micro_batch_size, config.tokens.sequence_length
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, config.model.vocab_size, (rows, seq), generator=generator),
             "labels": torch.randint(0, config.model.vocab_size, (rows, seq), generator=generator)}
    device = next(state.model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    for _ in range(args.warmup):
        state, _ = nanoflow.train_step(state, batch)
    sync()
    started = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = nanoflow.train_step(state, batch)
    sync()
    elapsed = time.perf_counter() - started

    tokens_per_s = args.steps * rows * seq / elapsed
    m = config.model
    flops_per_token = 6 * params + 12 * m.num_hidden_layers * m.hidden_size * seq
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    print(f"device {name}, torch {torch.__version__}, {params / 1e9:.2f}B parameters, batch {rows}×{seq}, "
          f"bf16, compile={not args.no_compile}")
    print(f"step {elapsed / args.steps * 1e3:.0f} ms, {tokens_per_s:,.0f} tokens/s, "
          f"{flops_per_token * tokens_per_s / 1e12:.1f} model TFLOP/s"
          + (f", MFU {flops_per_token * tokens_per_s / (peak * 1e12):.1%} of {peak:.0f} TFLOP/s" if peak else
             ", MFU: unknown peak (pass --peak-tflops)")
          + f", final loss {metrics['loss']:.3f}")
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
