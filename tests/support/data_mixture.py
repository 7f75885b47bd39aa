"""What test_data_mixture.py and its whole-run tests share: the token folders of a moving mixture and its stages
(`folders` is a module fixture, registered in tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import documents, stage, write_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    rng = np.random.default_rng(11)
    for name, (low, high) in {"a": (0, 100), "b": (100, 200), "c": (200, 256)}.items():
        write_folder(root / name, documents(rng, 300, low, high, length=(40, 120)), files=2)
    return root


def moving_stages(folders, **pretrain_data):
    a, b, c = (str(folders / n) for n in "abc")
    return [
        stage("pretrain", 1, {"dataset_folder": [a, b, c], "dataset_weights": [0.8, 0.2, 0.0],
                              "dataset_weights_end": [0.2, 0.3, 0.5]}, data={"seed": 4, **pretrain_data}),
        stage("anneal", 9, {"dataset_folder": [c, b], "dataset_weights": [1, 1]}, data={"continue_from": "pretrain"}),
    ]

