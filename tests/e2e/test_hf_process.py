"""The HF export and import on S3, against the moto server (tests/unit/test_hf.py: the rest, in-process)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY
from support.hf import checked

from nanoflow import ConfigError
from nanoflow.interop.export import export_hf
from nanoflow.io import read_hf
from nanoflow.io.hf import HFWeights, is_hf_folder


def test_export_and_import_on_s3(trained, s3_bucket):
    run, state = trained
    export_hf(str(run), s3_bucket + "/hf", max_shard_size=20_000)
    assert is_hf_folder(s3_bucket + "/hf")
    _, tensors = read_hf(s3_bucket + "/hf")
    params = dict(state.model.named_parameters())
    assert set(tensors) == set(params)
    assert all(torch.equal(tensors[k], p.detach()) for k, p in params.items())
    weights = HFWeights(s3_bucket + "/hf")                     # box reads: ranged GETs of the rows
    assert all(torch.equal(weights.read("model", k, (1,) + (0,) * (p.dim() - 1), (2, *p.shape[1:])), p.detach()[1:3])
               for k, p in params.items())
    # An s3:// HF folder is checked against [model] by the same preflight as a local one, and by --plan.
    init = f"model.init_from={json.dumps(s3_bucket + '/hf')}"
    checked(run.parent, init)
    with pytest.raises(ConfigError, match=r"model.init_from: model.num_hidden_layers = 3, but s3://.*/hf/config.json"):
        checked(run.parent, init, "model.num_hidden_layers=3")
    from nanoflow.commands.cli import train_main

    assert train_main([str(TINY), "--plan", "--set", init, "--set", "model.num_hidden_layers=3"]) == 2


