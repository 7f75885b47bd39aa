"""The declared parallel plan (nanoflow/parallel/plan.py): every module it names exists in the model, and applied
on a one-rank mesh each entry gives the parameter the placement it declares. Parity of whole layouts with one
process runs under torchrun in tests/e2e/test_parallel.py."""

import pytest
import torch
import torch.distributed as dist
from helpers import tiny

from nanoflow.model import Llama
from nanoflow.parallel.plan import (
    BY_HEAD,
    COLWISE,
    FULLY_SHARDED,
    HEAD_NORM_TP,
    LAYER_SP,
    LAYER_TP,
    LAYERS,
    RECOMPUTED,
    ROOT_SP,
    ROWWISE,
    apply_tensor_parallel,
    modules_named,
)

QWEN3 = ('model.model_type="qwen3"', "model.head_dim=16")


def model_of(tmp_path, *overrides: str) -> Llama:
    model = Llama(tiny(tmp_path, *overrides).model)
    model.reset_parameters(torch.Generator().manual_seed(0))
    return model


def test_a_pattern_names_the_model_or_each_decoder_layer_in_order(tmp_path):
    model = model_of(tmp_path)
    assert modules_named(model, "") == [model]
    assert modules_named(model, LAYERS) == list(model.model.layers) and len(model.model.layers) > 1
    assert modules_named(model, "model.layers.*.mlp") == [layer.mlp for layer in model.model.layers]
    assert modules_named(model, "model.layers") == [model.model.layers]
    assert RECOMPUTED == LAYERS and FULLY_SHARDED == (LAYERS, "")


def test_every_module_the_plan_names_is_in_the_model(tmp_path):
    # A renamed module would otherwise leave its weights unsharded without a word.
    model = model_of(tmp_path, *QWEN3)
    for layer in modules_named(model, LAYERS):
        for name, *_ in (*LAYER_TP, *HEAD_NORM_TP, *LAYER_SP):
            layer.get_submodule(name)
    for name, *_ in ROOT_SP:
        model.get_submodule(name)


@pytest.mark.parametrize("sequence", [False, True], ids=["tensor", "sequence"])
def test_each_entry_places_its_weights_as_declared(tmp_path, sequence):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = model_of(tmp_path, *QWEN3)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        apply_tensor_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), LAYER_TP + HEAD_NORM_TP,
                              sequence=sequence)
        expected = {COLWISE: "S(0)", ROWWISE: "S(1)", BY_HEAD: "R"}   # a linear's weight is [out, in]
        for layer in model.model.layers:
            for name, style in LAYER_TP + HEAD_NORM_TP:
                weight = layer.get_submodule(name).weight
                assert isinstance(weight, DTensor) and str(weight.placements[0]) == expected[style], name
            norm = layer.input_layernorm.weight
            assert isinstance(norm, DTensor) == sequence   # sequence parallelism: the norms are replicated DTensors
        assert not isinstance(model.model.embed_tokens.weight, DTensor)   # the embedding and head stay plain
    finally:
        dist.destroy_process_group()
