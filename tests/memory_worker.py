"""Gradients of one loss on one batch, by the plain path (full float32 logits) or nanoflow's (fused
chunked loss, optionally recomputed layers), on one process or on every rank of a torchrun layout.

    torchrun --nproc_per_node=N tests/memory_worker.py OUT.safetensors DP TP TP_MODE VARIANT [TIED]

Run by torchrun it writes, on rank 0, every parameter's full gradient (gathered from its shards) and
the loss, so a test compares them with a single-process reference.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from helpers import TINY  # noqa: E402 - tests/ is on sys.path: this script's folder, or pytest's

import nanoflow  # noqa: E402
from nanoflow.model import Llama  # noqa: E402
from nanoflow.parallel.mesh import Topology, init_topology  # noqa: E402
from nanoflow.parallel.plan import parallelize  # noqa: E402

VARIANTS = ("plain", "chunked", "recompute")  # recompute: the chunked loss and recompute_layer = true


def config_for(dp: int = 1, tp: int = 1, tp_mode: str = "ALL_REDUCE", recompute: bool = False, tied: bool = True,
               layers: int = 2):
    return nanoflow.load_config(TINY, [
        f"parallelism.dp={dp}", f"parallelism.tp={tp}", f'parallelism.tp_mode="{tp_mode}"',
        f"parallelism.recompute_layer={'true' if recompute else 'false'}",
        f"model.tie_word_embeddings={'true' if tied else 'false'}", f"model.num_hidden_layers={layers}"])


def batch(config, rows: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and labels, a quarter of the labels masked (-100), one row fully masked."""
    generator = torch.Generator().manual_seed(seed)
    seq, vocab = config.tokens.sequence_length, config.model.vocab_size
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels[torch.rand(rows, seq, generator=generator) < 0.25] = -100
    labels[-1] = -100
    return ids, labels


def gradients(config, topology: Topology, variant: str, ids, labels, chunk_logits: int = 1000):
    """(loss, {name: full gradient}) of mean cross-entropy over the batch's target tokens, this rank's
    dp slice of `ids`/`labels` on a sharded model (the whole batch on one process)."""
    import nanoflow.loss

    model = Llama(config.model)
    model.reset_parameters(torch.Generator().manual_seed(config.general.seed))
    model = parallelize(model, topology, config)
    count = (labels != -100).sum()
    rows = ids.shape[0] // topology.dp
    ids, labels = (t[topology.dp_rank * rows:(topology.dp_rank + 1) * rows] for t in (ids, labels))
    if variant == "plain":
        logits = model(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    else:
        default, nanoflow.loss.CPU_CHUNK_BYTES = nanoflow.loss.CPU_CHUNK_BYTES, 4 * chunk_logits  # several chunks
        model.loss_method = "fused"  # not "auto": these logits are small enough for the plain path
        try:
            loss = model(ids, labels, grad_scale=torch.ones(()) / count)  # as train_step calls it
        finally:
            nanoflow.loss.CPU_CHUNK_BYTES = default
    loss = loss / count
    loss.backward()
    total = loss.detach().clone()
    if topology.dp > 1:
        torch.distributed.all_reduce(total, group=topology.dp_group)
    return total, {name: _full(p.grad) for name, p in model.named_parameters()}


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main() -> None:
    from safetensors.torch import save_file

    out, dp, tp, mode, variant = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    tied = len(sys.argv) < 7 or sys.argv[6] == "tied"
    config = config_for(dp, tp, mode, recompute=variant == "recompute", tied=tied)
    topology = init_topology(config)
    loss, grads = gradients(config, topology, variant, *batch(config))
    if topology.rank == 0:
        save_file({"loss": loss, **{f"grad.{k}": v.contiguous() for k, v in grads.items()}}, out)
    from nanoflow.parallel.mesh import exit_process, shutdown
    shutdown()
    exit_process(0)


if __name__ == "__main__":
    main()
