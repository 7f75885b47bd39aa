"""bin/verify-resume's own work: it starts and kills real bin/train processes (tests/unit/test_verify.py: its kill
plan). One run of the command serves every test here: each checks another property of the same run."""

import subprocess

import pytest
from helpers import REPO, TINY
from process_helpers import run_command


@pytest.fixture(scope="module")
def verified(tmp_path_factory) -> subprocess.CompletedProcess:
    """bin/verify-resume on tiny.toml saved every 3 steps (saves 3, 6, 9, 12), 3 kills with seed 3: two in saves,
    one in a step (tests/unit/test_verify.py plans larger counts)."""
    return run_command("verify-resume", TINY.relative_to(REPO), "--set", "checkpoints.checkpoint_interval=3",
                       "--kills", "3", "--seed", "3", "--workdir", tmp_path_factory.mktemp("verify"), timeout=600)


@pytest.mark.slow
def test_verify_resume_performs_exactly_the_kills_asked(verified):
    assert verified.returncode == 0, verified.stdout + verified.stderr
    lines = verified.stdout.splitlines()   # verify_resume's log, one plain line each (cli.guarded)
    assert sum(": exit -9;" in line for line in lines) == 3
    assert lines[-1].startswith("PASS: after 3 kills")
    # The straight run's silence is bracketed: what comes, then how long it took (issue 30, item 25).
    assert lines[0].endswith("(its 12 steps, then 3 kills and a resume after each; each attempt is said when it ends)")
    assert lines[1].startswith("straight run: 12 steps done in "), lines[:3]
    assert sum("in the save of step" in line for line in lines) == 2 and sum("in step" in line for line in lines) == 1


@pytest.mark.slow
def test_verify_resume_prints_no_raw_python_warnings(verified):
    # Its kills land mid-step and mid-save; whatever the runs warn about comes out as plain lines (the plain line
    # itself is tested with guarded() in test_errors.py): no raw Python warning with its source file and line.
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "Warning:" not in verified.stderr, verified.stderr
    assert "CheckpointWarning" not in verified.stderr and "verify.py:" not in verified.stderr, verified.stderr
