"""The language-model loss from the final hidden states, without the logits of the whole batch.

`F.cross_entropy(lm_head(hidden).float(), labels)` holds [positions × vocab] logits in the model's
dtype, their float32 copy, the log-softmax saved for backward and its gradient: 4 × 8 × 4096 ×
128,256 bytes = 16.8 GB for the float32 copy alone. `cross_entropy_sum` takes the same matmul and
the same cross-entropy over chunks of positions instead. The forward keeps only each position's
log-sum-exp (one float32 a position); the backward computes each chunk's logits again, turns them
into their gradient and multiplies it into the hidden states' and the head's gradients, chunk by
chunk. So at most one chunk of logits (CHUNK_LOGITS elements) is alive at a time, forward or
backward, at the price of the head's forward matmul done twice.

The value and the gradients are those of the plain path up to float rounding (the head's gradient
is summed over chunks in float32): the logits are computed in the dtype autocast gives the matmul
(bfloat16 under `[model] dtype = "bfloat16"`), rounded there, then taken to float32, as
`lm_head(hidden).float()` does.
"""

from __future__ import annotations

import torch

CHUNK_LOGITS = 2**24  # logits per chunk: 64 MB in float32 (130 positions at vocabulary 128,256)


def cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                      chunk_logits: int | None = None) -> torch.Tensor:
    """Σ over target positions of −log softmax(hidden @ weight.T)[label], a float32 scalar.

    hidden [..., hidden_size], weight [vocab, hidden_size] (the lm_head's), labels [...] with
    `ignore_index` for positions that are no target (they add nothing, neither loss nor gradient);
    `chunk_logits`: the most logits a chunk holds (default CHUNK_LOGITS).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(hidden, DTensor):  # sequence parallelism leaves the final norm split by position: the head needs all
        hidden = hidden.full_tensor()
    positions = max(1, (chunk_logits or CHUNK_LOGITS) // weight.shape[0])
    return _ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), ignore_index, positions)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run the head's matmul in (the inputs' own one outside autocast)."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(tensors[0].dtype, tensors[1].dtype)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen here, once, for both passes
        return (hidden.to(dtype) @ weight.to(dtype).t()).float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, positions: int):
        dtype = _compute_dtype(hidden, weight)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        log_sum_exps = []
        for start in range(0, hidden.shape[0], positions):
            logits = _chunk_logits(hidden[start:start + positions], weight, dtype)
            targets = labels[start:start + positions]
            is_target = targets != ignore_index
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, torch.where(is_target, targets, 0)[:, None])[:, 0]
            total += torch.where(is_target, lse - picked, 0.0).sum()
            log_sum_exps.append(lse)
        ctx.save_for_backward(hidden, weight, labels, torch.cat(log_sum_exps))
        ctx.ignore_index, ctx.positions, ctx.dtype = ignore_index, positions, dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, log_sum_exps = ctx.saved_tensors
        dtype, positions = ctx.dtype, ctx.positions
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], positions):
            h = hidden[start:start + positions]
            targets = labels[start:start + positions]
            is_target = targets != ctx.ignore_index
            logits = _chunk_logits(h, weight, dtype)
            # d(lse − logit[label]) / d logits = softmax − one_hot(label), zero at ignored positions
            grad = logits.sub_(log_sum_exps[start:start + positions, None]).exp_()  # in place: one chunk alive
            grad.scatter_add_(1, torch.where(is_target, targets, 0)[:, None],
                              torch.full((h.shape[0], 1), -1.0, device=grad.device))
            grad *= (grad_total * is_target)[:, None]
            grad = grad.to(dtype)  # the gradient of `.float()` rounds back to the matmul's dtype, as the plain path
            with torch.autocast(hidden.device.type, enabled=False):
                if grad_hidden is not None:
                    grad_hidden[start:start + positions] = grad @ w
                if grad_weight is not None:
                    grad_weight += (grad.t() @ h.to(dtype)).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None
