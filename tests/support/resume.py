"""What test_resume.py and its process-level tests share."""

import pytest
from helpers import quiet, tiny

from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.training.loop import train


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight")
    return train(tiny(run), out=quiet()), run


def restore(config, *, fresh: bool = False, out):
    return Checkpointer(config, out=out).restore(fresh=fresh)
