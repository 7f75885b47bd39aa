"""The parallel plan: which module is laid out how, declared in one place, and the one function that applies it
with PyTorch's own APIs (DTensor's parallelize_module, FSDP2's fully_shard, torch.utils.checkpoint).

Module names are HF's, so a checkpoint's tensor names stay the same on every layout. The mesh and the process
group the plan runs on are nanoflow.parallel.mesh's.

Order (torchtitan's): tensor parallelism over "tp", then recomputation, then FSDP2 over "dp"; recomputation
wraps each layer's forward inside FSDP2's hooks, so that the all-gather is not redone in the recomputation.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from nanoflow.config import Config
from nanoflow.parallel.mesh import Topology, device
from nanoflow.parallel.runtime import compute_dtype

if TYPE_CHECKING:
    from nanoflow.model import Llama

# The layouts a module takes over the "tp" mesh dimension (the PyTorch style of each: _tp_style).
COLWISE = "colwise"          # split by output features: each rank holds whole heads, their biases with them
ROWWISE = "rowwise"          # split by input features; an all-reduce (a reduce-scatter by position under sequence
                             # parallelism) restores the full hidden state; its bias is added once, after it
BY_HEAD = "by_head"          # replicated weights (DTensors: each rank's gradient, from its own heads, is summed over
                             # tp) acting on [batch, positions, heads, head_dim] split by head
SEQUENCE = "sequence"        # replicated weights; input and output split by position
GATHER = "gather"            # its first input (the hidden state) gathered from a split by position; the rest as is
TO_SEQUENCE = "to_sequence"  # its output, whole on every rank, split by position

LAYERS = "model.layers.*"    # every decoder layer: a "*" stands for one name

# Tensor parallelism, in every one of LAYERS (names relative to the layer). Embeddings, norms and lm_head stay
# replicated: with a small vocabulary that costs less than sharding and keeps tied embeddings simple; at a large
# one it does not (docs/parallelism.md, "The head under tensor parallelism").
LAYER_TP: tuple[tuple[str, str], ...] = (
    ("self_attn.q_proj", COLWISE), ("self_attn.k_proj", COLWISE), ("self_attn.v_proj", COLWISE),
    ("self_attn.o_proj", ROWWISE),
    ("mlp.gate_proj", COLWISE), ("mlp.up_proj", COLWISE), ("mlp.down_proj", ROWWISE),
)
# Qwen3's per-head q/k norms (qk_norm = "head") act inside each head, on the heads a rank holds. (OLMo 2's span
# every head of the projection: config/ refuses an olmo2 model with tp > 1.)
HEAD_NORM_TP: tuple[tuple[str, str], ...] = (("self_attn.q_norm", BY_HEAD), ("self_attn.k_norm", BY_HEAD))

# Sequence parallelism (nanotron's tp_mode = "REDUCE_SCATTER"), on top of LAYER_TP: between the blocks the residual
# stream and the norms hold sequence_length / tp positions on each rank. Each attention or MLP block all-gathers
# its normed input by position, and its row-wise output projection reduce-scatters back to positions. With the
# number of positional inputs of each gathered module (attention: x, cos, sin, documents).
LAYER_SP: tuple[tuple[str, str, int], ...] = (
    ("input_layernorm", SEQUENCE, 1), ("self_attn", GATHER, 4),
    ("post_attention_layernorm", SEQUENCE, 1), ("mlp", GATHER, 1),
)
# ... and around the layers (names relative to the model): the embedding stays replicated and its output is split
# by position; lm_head stays replicated and its input is gathered.
ROOT_SP: tuple[tuple[str, str, int], ...] = (
    ("model.embed_tokens", TO_SEQUENCE, 1), ("model.norm", SEQUENCE, 1), ("lm_head", GATHER, 1),
)

# Recomputation (nanotron's recompute_layer; any layout, one process too): the modules whose forward is run again
# in backward instead of keeping its activations.
RECOMPUTED = LAYERS

# FSDP2 over "dp", in this order: each decoder layer, then the root (""): parameters, gradients and AdamW moments
# sharded. The loss is already the mean over the global batch's target tokens, so FSDP sums gradients.
FULLY_SHARDED: tuple[str, ...] = (LAYERS, "")

# Context parallelism is not built (docs/design.md, "Context parallelism"). It would enter here as a "cp" mesh
# dimension between "dp" and "tp": no module entries of its own (its ranks hold the same parameters), FULLY_SHARDED
# over dp × cp flattened, and the batch's buffers (input_ids, labels, position_ids) split on the sequence dimension.


def parallelize(model: Llama, topology: Topology, config: Config) -> Llama:
    """Apply the plan above to `model` over `topology`'s mesh, as `config` sets it (tp_mode, recompute_layer,
    qk_norm, dtype). Returns the same module, sharded; parameter names stay HF's."""
    parallelism = config.parallelism
    if topology.mesh is not None and topology.tp > 1:
        plan = LAYER_TP + (HEAD_NORM_TP if config.model.architecture.qk_norm == "head" else ())
        apply_tensor_parallel(model, topology.mesh["tp"], plan, sequence=parallelism.tp_mode == "REDUCE_SCATTER")
    if parallelism.recompute_layer:
        for module in modules_named(model, RECOMPUTED):
            recompute(module)
    if topology.mesh is not None and topology.dp > 1:
        shard_data_parallel(model, topology.mesh["dp"], compute_dtype(config.model.dtype, device()))
    return model


def apply_tensor_parallel(model: Llama, tp_mesh: DeviceMesh, plan: tuple[tuple[str, str], ...], *,
                          sequence: bool) -> None:
    """`plan` in every decoder layer over `tp_mesh`; with `sequence`, LAYER_SP and ROOT_SP too."""
    from torch.distributed.tensor.parallel import parallelize_module

    for layer in modules_named(model, LAYERS):
        around = {name: _tp_style(style, sequence, inputs) for name, style, inputs in LAYER_SP} if sequence else {}
        parallelize_module(layer, tp_mesh, {**around, **{name: _tp_style(style, sequence) for name, style in plan}})
    if sequence:
        parallelize_module(model, tp_mesh, {name: _tp_style(style, sequence, inputs) for name, style, inputs in ROOT_SP})


def _tp_style(style: str, sequence: bool, inputs: int = 1) -> Any:
    """The PyTorch ParallelStyle of one entry of the plan: a new one each time (a style is applied to one module)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    styles: dict[str, Callable[[], Any]] = {
        COLWISE: ColwiseParallel,
        ROWWISE: (lambda: RowwiseParallel(output_layouts=Shard(1))) if sequence else RowwiseParallel,
        BY_HEAD: lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
        SEQUENCE: SequenceParallel,
        GATHER: lambda: PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (inputs - 1),
                                           desired_input_layouts=(Replicate(),) + (None,) * (inputs - 1),
                                           use_local_output=True),
        TO_SEQUENCE: lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    }
    return styles[style]()


def shard_data_parallel(model: Llama, mesh: DeviceMesh, dtype: str) -> None:
    """FSDP2 over `mesh` on FULLY_SHARDED, in its order. Under bfloat16 the gathered weights are bf16 and the
    gradients are reduced in float32. The root does not cast its floating-point inputs (cast_forward_inputs):
    the one it gets is the loss's grad_scale, whose float32 value decides the gradients' rounding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype = torch.bfloat16 if dtype == "bfloat16" else None
    for module in [m for pattern in FULLY_SHARDED for m in modules_named(model, pattern)]:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                      cast_forward_inputs=module is not model)
        sharded = fully_shard(module, mesh=mesh, mp_policy=policy)   # the same module, now an FSDPModule too
        sharded.set_gradient_divide_factor(1.0)
        sharded.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def modules_named(model: torch.nn.Module, pattern: str) -> list[torch.nn.Module]:
    """The modules of `model` whose names match `pattern`, in the model's order: "" is the model itself, and each
    "*" stands for one name ("model.layers.*": each decoder layer, not their submodules)."""
    atoms = pattern.split(".") if pattern else []

    def matches(name: str) -> bool:
        parts = name.split(".") if name else []
        return len(parts) == len(atoms) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms, strict=True))

    return [module for name, module in model.named_modules() if matches(name)]


def recompute(layer: torch.nn.Module) -> None:
    """nanotron's recompute_layer: the layer keeps only its inputs for backward and runs its forward
    again there (torch.utils.checkpoint, non-reentrant). The layer's own forward is wrapped, not the
    module, so its parameters keep their names, FSDP2's hooks stay outside the recomputed region (its
    all-gather is not redone in the recomputation: the backward already holds the gathered weights)
    and a compiled layer (`[model] compile`) traces the checkpoint as one of its own operators."""
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward

    def recomputed(*args):
        return checkpoint(forward, *args, use_reentrant=False)

    layer.forward = recomputed
