"""The language-model loss from the final hidden states: plain, or fused so that the logits of the
whole micro-batch never exist.

`F.cross_entropy(lm_head(hidden).float(), labels)` (the plain path) holds [positions × vocab]
logits in the model's dtype, their float32 copy, the log-softmax saved for backward and its
gradient: 4 × 8 × 4096 × 128,256 bytes = 16.8 GB for the float32 copy alone.

`cross_entropy_sum` (the fused path) does the same matmul and cross-entropy over chunks of positions
and, in the forward pass, turns each chunk's logits at once into their gradient (softmax − one-hot,
zero at ignored positions) and multiplies it into the hidden states' and the head's gradients: three
matmuls a chunk, as the plain path, and one chunk of logits alive at a time. A chunk is sized in bytes
for the device (`chunk_bytes`): its float32 logits, 128 MiB on a CPU, up to 2 GiB on a GPU (few chunks: each
chunk's head gradient is a pass over the head's whole size, and each chunk launches its kernels). The
chunk's tensors are made once a call and reused; its log-sum-exp is torch's, its temporary in blocks of
rows on a CPU (`SCRATCH_BYTES`: few blocks, since on busy cores each operation waits for all its threads), the
whole chunk on a GPU. The head's gradient is summed over chunks in float32, into one
buffer (in place: no product of the head's size is made beyond the matmul's own). Backward only scales the
kept gradients by the incoming one. Given `grad_scale` — the gradient the caller's backward will bring (the
step's 1 / target tokens) — the chunk's gradient is scaled before it is rounded and multiplied, as
autograd orders it, and backward multiplies by exactly 1: the gradients are those of the former chunked
loss (which redid the head's matmul in backward) bit for bit.

The value and the gradients are those of the plain path up to float rounding (the head's gradient
is summed over chunks in float32): the logits are computed in the dtype autocast gives the matmul
(bfloat16 under `[model] dtype = "bfloat16"`), rounded there, then taken to float32, as
`lm_head(hidden).float()` does.

`lm_loss` takes either; the model takes the fused one (`Llama.loss_method`). The plain path holds many
times the fused path's memory at a large vocabulary (BENCHMARKS.md, "Fused loss"), and the fused one
keeps the former chunked loss's bits, which the default curriculum's skill depends on, so nothing
chooses the plain path by itself: it stays as the reference the tests hold the fused one to.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

CPU_CHUNK_BYTES = 2**27    # float32 logits a chunk on a CPU: 128 MiB (261 positions at vocabulary 128,256)
GPU_CHUNK_BYTES = 2**31    # ... on a GPU, or 1/32 of its memory if less: 2 GiB (4,186 positions at 128,256)
SCRATCH_BYTES = 2**25      # float32 a block of the fused loss's logsumexp takes: 32 MiB (few, for busy threads)
METHODS = ("fused", "plain")


def chunk_bytes(device: torch.device) -> int:
    """The bytes of float32 logits a chunk of the fused loss holds on `device` (a fixed figure for a kind of
    device: the chunks decide how the head's gradient is summed, so a run keeps them from step to step)."""
    if device.type != "cuda":
        return CPU_CHUNK_BYTES
    index = torch.cuda.current_device() if device.index is None else device.index
    return min(GPU_CHUNK_BYTES, _device_memory(index) // 32)


@functools.cache
def _device_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).total_memory


def chunk_positions(vocab_size: int, device: torch.device) -> int:
    """Positions a chunk of the fused loss takes on `device`."""
    return max(1, chunk_bytes(device) // (4 * vocab_size))


def describe(vocab_size: int, method: str = "fused") -> str:
    """The path `lm_loss` takes, in words (the start-up header's)."""
    _check(method)
    if method == "plain":
        return "plain cross-entropy over the whole micro-batch's logits"
    cpu = chunk_positions(vocab_size, torch.device("cpu"))
    gpu = max(1, GPU_CHUNK_BYTES // (4 * vocab_size))
    return (f"fused linear cross-entropy, chunks of {cpu:,} positions on a CPU ({CPU_CHUNK_BYTES >> 20} MiB of "
            f"float32 logits), up to {gpu:,} on a GPU")


def _check(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"loss method {method!r}: expected one of {', '.join(METHODS)}")


def lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
            grad_scale: torch.Tensor | None = None, method: str = "fused") -> torch.Tensor:
    """Σ over target positions of −log softmax(hidden @ weight.T)[label], by the fused or the plain path."""
    _check(method)
    if method == "plain":
        return plain_cross_entropy_sum(hidden, weight, labels, ignore_index)
    return cross_entropy_sum(hidden, weight, labels, ignore_index, grad_scale=grad_scale)


def plain_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            ignore_index: int) -> torch.Tensor:
    """The same sum through the whole micro-batch's logits, as `F.cross_entropy(lm_head(hidden).float())`."""
    hidden, weight = _whole(hidden), _whole(weight)
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index, reduction="sum")


def cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                      chunk_logits: int | None = None, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over target positions of −log softmax(hidden @ weight.T)[label], a float32 scalar (fused path).

    hidden [..., hidden_size], weight [vocab, hidden_size] (the lm_head's), labels [...] with
    `ignore_index` for positions that are no target (they add nothing, neither loss nor gradient);
    `chunk_logits`: the most logits a chunk holds (default: chunk_bytes of the device's, in float32);
    `grad_scale`: the gradient the result's backward is expected to receive (any other is right too, up to
    rounding).
    """
    hidden, weight = _whole(hidden), _whole(weight)
    vocab = weight.shape[0]
    positions = chunk_positions(vocab, hidden.device) if chunk_logits is None else max(1, chunk_logits // vocab)
    wanted = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    scale = torch.ones((), dtype=torch.float32, device=hidden.device) if grad_scale is None \
        else grad_scale.detach().to(device=hidden.device, dtype=torch.float32)
    return _FusedCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), ignore_index, positions,
                                    scale, wanted)


def token_scores(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                 chunk_logits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, without gradients: −log softmax(hidden @ weight.T)[label] (float32, 0 where the label is
    `ignore_index`) and whether the argmax of the logits is the label, both of labels' shape.

    Evaluation's scores, over the fused path's chunks (`chunk_logits` as `cross_entropy_sum`'s): one chunk of
    logits alive at a time, never the whole batch's. Each position's values are those of `F.cross_entropy(...,
    reduction="none")` and `argmax` on `lm_head(hidden).float()`: the same matmul in the same dtype, the same
    row-wise functions, a chunk of rows at a time.
    """
    hidden, weight = _whole(hidden), _whole(weight)
    vocab = weight.shape[0]
    positions = chunk_positions(vocab, hidden.device) if chunk_logits is None else max(1, chunk_logits // vocab)
    dtype = _compute_dtype(hidden, weight)
    flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()
    nll = torch.empty(flat_labels.shape, dtype=torch.float32, device=hidden.device)
    right = torch.empty(flat_labels.shape, dtype=torch.bool, device=hidden.device)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        for start in range(0, flat_hidden.shape[0], positions):
            logits = (flat_hidden[start:start + positions].to(dtype) @ w.t()).float()
            targets = flat_labels[start:start + positions]
            nll[start:start + positions] = F.cross_entropy(logits, targets, ignore_index=ignore_index,
                                                           reduction="none")
            right[start:start + positions] = logits.argmax(dim=-1) == targets
            del logits   # before the next chunk's are made
    return nll.view(labels.shape), right.view(labels.shape)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (sequence parallelism leaves the final norm split by position; a sharded
    head is gathered), through autograd, so its gradient goes back to the shards; a tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run the head's matmul in (the inputs' own one outside autocast)."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(tensors[0].dtype, tensors[1].dtype)


def logsumexp_block_rows(rows: int, vocab_size: int, device: torch.device) -> int:
    """Rows of a chunk the fused loss's logsumexp takes at once: SCRATCH_BYTES of them on a CPU (at least 2),
    the whole chunk on a GPU (one kernel a step; its caching allocator reuses the memory anyway)."""
    return rows if device.type == "cuda" else max(2, SCRATCH_BYTES // (4 * vocab_size))


class _ChunkBuffers:
    """The fused loss's per-chunk tensors, made once a call and reused by every chunk.

    A fresh chunk-sized tensor is memory the allocator maps anew (it is above the size malloc keeps for
    reuse) and the kernel zeroes page by page as it is first written; made once, every later chunk writes
    into memory already mapped. Each step is the one torch takes with its own temporaries (the same kernels
    on the same values), so the results are theirs bit for bit.
    """

    def __init__(self, rows: int, head_shape: torch.Size, dtype: torch.dtype, device: torch.device):
        vocab = head_shape[0]
        self.float_logits = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        # exp(logits − max), logsumexp's temporary, a few rows at a time (at least 2: see `logsumexp`)
        self.block_rows = logsumexp_block_rows(rows, vocab, device)
        self.shifted = torch.empty((min(rows, self.block_rows + 1), vocab), dtype=torch.float32, device=device)
        # The matmul's own dtype, where it is below float32: its logits, then the rounded gradient.
        self.low = None if dtype == torch.float32 else torch.empty((rows, vocab), dtype=dtype, device=device)
        self.low_head: torch.Tensor | None = None   # the head's size: made by the second chunk, if one comes

    def logits(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`(h @ w.t()).float()` into the buffer."""
        rows = h.shape[0]
        if self.low is None:
            return torch.mm(h, w.t(), out=self.float_logits[:rows])
        return self.float_logits[:rows].copy_(torch.mm(h, w.t(), out=self.low[:rows]))

    def logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """`torch.logsumexp(logits, dim=-1)`: its steps, with its temporary a block of rows at a time.

        Each row's sum is torch's alike for any block of 2 rows or more (a row is summed whole by one
        thread; only a reduction to a single value is split across threads), so a block never has one row
        where the chunk has more.
        """
        rows = logits.shape[0]
        maxes = logits.amax(dim=-1, keepdim=True)
        maxes.masked_fill_(maxes.abs() == math.inf, 0)
        sums = torch.empty(rows, dtype=torch.float32, device=logits.device)
        start = 0
        while start < rows:
            end = min(start + self.block_rows, rows)
            end = rows if rows - end == 1 else end   # no block of one row left behind
            shifted = torch.sub(logits[start:end], maxes[start:end], out=self.shifted[:end - start]).exp_()
            torch.sum(shifted, dim=-1, out=sums[start:end])
            start = end
        return sums.log_().add_(maxes[:, 0])

    def rounded(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad.to(dtype)`: itself in float32, else a copy into the buffer."""
        return grad if self.low is None else self.low[:grad.shape[0]].copy_(grad)

    def product(self, grad: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """`out[:] = grad @ w`, straight into `out` where the dtypes agree."""
        if out.dtype == grad.dtype:
            torch.mm(grad, w, out=out)
        else:
            out.copy_(grad @ w)

    def head_product(self, grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """`grad.t() @ h` in the matmul's dtype below float32, into the buffer."""
        if self.low_head is None:
            self.low_head = grad.new_empty((grad.shape[1], h.shape[1]))
        return torch.mm(grad.t(), h, out=self.low_head)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, positions: int, scale, wanted: bool):
        dtype = _compute_dtype(hidden, weight)
        want_hidden = wanted and ctx.needs_input_grad[0]
        want_weight = wanted and ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = None  # float32, summed over chunks
        buffers = _ChunkBuffers(min(positions, hidden.shape[0]), weight.shape, dtype, hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen above, once
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], positions):
                h = hidden[start:start + positions].to(dtype)
                logits = buffers.logits(h, w)
                targets = labels[start:start + positions]
                is_target = targets != ignore_index
                safe_targets = torch.where(is_target, targets, 0)[:, None]
                lse = buffers.logsumexp(logits)
                picked = logits.gather(1, safe_targets)[:, 0]
                total += torch.where(is_target, lse - picked, 0.0).sum()
                if not (want_hidden or want_weight):
                    continue
                # d(lse − logit[label]) / d logits = softmax − one_hot(label), zero at ignored positions
                grad = logits.sub_(lse[:, None]).exp_()  # in place: one chunk alive
                grad.scatter_add_(1, safe_targets, torch.full((h.shape[0], 1), -1.0, device=grad.device))
                grad *= (scale * is_target)[:, None]
                grad = buffers.rounded(grad)  # the gradient of `.float()` rounds back to the matmul's dtype
                if grad_hidden is not None:   # want_hidden
                    buffers.product(grad, w, grad_hidden[start:start + positions])
                if want_weight:
                    if grad_weight is None:
                        grad_weight = (grad.t() @ h).float()
                    elif dtype == torch.float32:
                        grad_weight.addmm_(grad.t(), h)  # into the sum: no product of the head's size made
                    else:  # the matmul's own bf16 product, added in float32 in place (no float32 copy of it)
                        grad_weight += buffers.head_product(grad, h)
        if want_weight and grad_weight is None:  # no positions at all
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        # Gradients, not activations: held from this forward to the backward, which frees them.
        ctx.grads, ctx.scale, ctx.weight_dtype = (grad_hidden, grad_weight), scale, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError("the fused cross-entropy's backward ran twice (its gradients are freed by the first)")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        ratio = grad_total / ctx.scale  # exactly 1 where the caller said what its backward brings
        if grad_hidden is not None:
            grad_hidden.mul_(ratio.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(ratio).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None
