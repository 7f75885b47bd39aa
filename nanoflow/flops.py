"""Model FLOPs: the arithmetic a training step asks of the model, and the devices' peaks it is measured against.

Model FLOPs utilisation (MFU) = the model FLOPs a second the run achieves / what the devices could do at peak. The
count is the usual one (Kaplan et al. 2020, the PaLM paper's appendix B): per token, 6·N for the forward and
backward matmuls of the N weights that multiply activations, plus 12·layers·hidden·sequence for attention's
scores and weighted sums (QKᵀ and AV, forward and backward, without halving for the causal mask). What the
run repeats or skips for its own reasons — recomputed layers, masked attention — does not change the count, so
MFU compares runs of one model fairly. No torch and no IO here: observe/progress.py measures, this counts.
"""

from __future__ import annotations

# Dense (no 2:4 sparsity) bf16 tensor-core peaks in FLOP/s, from NVIDIA's datasheets (which print the sparse
# figure, twice these), by a piece of the name torch.cuda.get_device_name() reports ("NVIDIA H100 80GB HBM3",
# "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB" …). Tried in this order: the more specific names first. The NVL and
# PCIe boards run at lower clocks than the SXM ones; a GB200's Blackwell runs faster than an HGX B200's.
GPU_BF16_PEAKS = (
    ("GH200", 989.5e12),      # Grace Hopper: the H100 SXM's Hopper
    ("GB200", 2500e12),       # per Blackwell GPU (the NVL72 sheet: 5 PFLOPS sparse)
    ("H200 NVL", 835.5e12),
    ("H200", 989.5e12),       # SXM
    ("H100 NVL", 835.5e12),
    ("H100 PCIe", 756.5e12),
    ("H100", 989.5e12),       # SXM (HBM3)
    ("B200", 2250e12),        # HGX B200 (4.5 PFLOPS sparse)
    ("A100", 312e12),
    ("L40S", 362.05e12),
    ("A10G", 125e12),      # the A10's datasheet figure; AWS lists no separate one
    ("A10", 125e12),
    ("L4", 121e12),
)


def gpu_peak(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of a GPU by its name, None for one not in the table."""
    for piece, peak in GPU_BF16_PEAKS:
        if piece.lower() in device_name.lower():
            return peak
    return None


def matmul_parameters(model) -> int:
    """N: the weights that multiply activations — every linear layer's, the output head's included; not the
    input embedding (a lookup; when tied to the head, the shared matrix counts once, as the head) nor the norms.

    `model`: the complete [model] config (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, vocab_size)."""
    hidden, heads, head_dim = model.hidden_size, model.num_attention_heads, model.head_dim
    attention = 2 * hidden * heads * head_dim + 2 * hidden * model.num_key_value_heads * head_dim  # q, o; k, v
    mlp = 3 * hidden * model.intermediate_size  # gate, up, down
    return model.num_hidden_layers * (attention + mlp) + model.vocab_size * hidden  # + the output head


def flops_per_token(model, sequence_length: int) -> int:
    """Training FLOPs (forward + backward) per token at `sequence_length`: 6·N + 12·layers·heads·head_dim·sequence
    (heads × head_dim is hidden_size unless head_dim is stated otherwise)."""
    width = model.num_attention_heads * model.head_dim
    return 6 * matmul_parameters(model) + 12 * model.num_hidden_layers * width * sequence_length
