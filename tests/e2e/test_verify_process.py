"""verify_resume's own work: it starts and kills real bin/train processes (tests/unit/test_verify.py: its kill plan)."""

import logging

import pytest

from helpers import TINY
from nanoflow.commands.verify import verify_resume


@pytest.mark.slow
def test_verify_resume_performs_exactly_the_kills_asked(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nanoflow")
    ok = verify_resume(str(TINY), ["checkpoints.checkpoint_interval=3"], tmp_path, kills=5, seed=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "nanoflow.commands.verify"]
    assert ok, "\n".join(lines)
    assert sum(": exit -9;" in line for line in lines) == 5
    assert lines[-1].startswith("PASS: after 5 kills")
    assert sum("in the save of step" in line for line in lines) == 3 and sum("in step" in line for line in lines) == 2
