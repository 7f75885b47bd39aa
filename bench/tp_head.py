"""What does the replicated output head cost under tensor parallelism? The head + loss against the rest of a step.

    python bench/tp_head.py [--rounds N] [--positions P] [--hidden H] [--vocab V] [--layers L]

Under tp, nanoflow shards the decoder layers over the tp ranks and replicates the embedding, the output head and
the loss: every tp rank multiplies the whole [positions × hidden] × [hidden × vocab] head. This measures what that
costs at a Llama 3.2 1B shape (hidden 2,048, intermediate 8,192, 32 heads over 8 kv heads, 16 layers, vocabulary
128,256), scaled down in positions and in layers so that a CPU runs it: one decoder layer's forward + backward
and the head's forward + backward through the fused loss (nanoflow.loss.cross_entropy_sum), on the same
positions, one thread, alternating round by round (the order flips every round); the medians of each one's CPU
seconds (the thread's own time: other processes on the cores do not count). A step of L layers then costs
L × layer + head; on t tp ranks the replicated head makes it L × layer / t + head, against (L × layer + head) / t
with the head sharded by vocabulary. The FLOP count of the same (nanoflow.flops' convention) is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from benchlib import load_average, machine_line, one_thread, parse  # bench/benchlib.py (puts the checkout on the path)


def shape(hidden: int, vocab: int, layers: int) -> SimpleNamespace:
    heads = max(2, hidden // 64)
    return SimpleNamespace(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
                           max_position_embeddings=1 << 16, rms_norm_eps=1e-5, rope_theta=500_000.0,
                           tie_word_embeddings=False, initializer_range=0.02)


def flops(cfg: SimpleNamespace, positions: int) -> tuple[float, float]:
    """(one layer's, the head's) training FLOPs over `positions` positions of one row."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    layer = 6 * (2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size) + 12 * h * positions
    return layer * positions, 6.0 * cfg.vocab_size * h * positions


def timings(cfg: SimpleNamespace, positions: int, rounds: int) -> tuple[float, float]:
    """Median CPU seconds of (one layer's forward + backward, the head + loss's forward + backward)."""
    import torch

    from nanoflow.loss import cross_entropy_sum
    from nanoflow.model import DecoderLayer, rope_cos_sin

    generator = torch.Generator().manual_seed(0)
    layer = DecoderLayer(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02, generator=generator)
    head = torch.nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02)
    x = torch.randn(1, positions, cfg.hidden_size, generator=generator, requires_grad=True)
    labels = torch.randint(0, cfg.vocab_size, (1, positions), generator=generator)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, torch.device("cpu"))

    def run_layer():
        layer(x, cos, sin).sum().backward()

    def run_head():
        cross_entropy_sum(x, head, labels, -100).backward()

    spent: dict[str, list[float]] = {"layer": [], "head": []}
    runs = {"layer": run_layer, "head": run_head}
    run_layer(), run_head()   # warm-up
    for r in range(rounds):
        for name in ("layer", "head") if r % 2 == 0 else ("head", "layer"):
            start = time.thread_time()
            runs[name]()
            spent[name].append(time.thread_time() - start)
    return statistics.median(spent["layer"]), statistics.median(spent["head"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--layers", type=int, default=16)
    args = parse(parser, argv, rounds=1, positions=16, hidden=128, vocab=1024, layers=2)
    one_thread()
    import torch

    torch.set_num_threads(1)
    print(machine_line())
    print(load_average())
    cfg = shape(args.hidden, args.vocab, args.layers)
    layer_s, head_s = timings(cfg, args.positions, args.rounds)
    layer_f, head_f = flops(cfg, args.positions)
    step_s, step_f = args.layers * layer_s + head_s, args.layers * layer_f + head_f
    print(f"hidden {args.hidden:,}, vocabulary {args.vocab:,}, {args.layers} layers, {args.positions} positions, "
          f"1 thread, {args.rounds} rounds: a layer {layer_s:.3f} CPU s, head + loss {head_s:.3f} CPU s")
    print(f"head + loss / step = {head_s / step_s:.3f} of the CPU time (FLOPs say {head_f / step_f:.3f})")
    print("| tp | replicated head: CPU s a rank | sharded by vocabulary | replicated / sharded | by FLOPs |")
    print("|---|---|---|---|---|")
    for tp in (1, 2, 4, 8):
        replicated, sharded = args.layers * layer_s / tp + head_s, step_s / tp
        by_flops = (args.layers * layer_f / tp + head_f) / (step_f / tp)
        print(f"| {tp} | {replicated:.2f} | {sharded:.2f} | {replicated / sharded:.3f} | {by_flops:.3f} |")
    print(load_average())


if __name__ == "__main__":
    main()
