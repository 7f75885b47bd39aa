"""bin/train refuses changed data with exit 2 (tests/unit/test_fingerprint.py: fingerprints in-process)."""

from process_helpers import run_command
from support.fingerprint import run
from nanoflow import io


def test_bin_train_exits_2_naming_the_change_without_a_traceback(run):
    (run.parent / "corpus" / "b.txt").write_text("changed")
    result = run_command("train", str(run), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "b.txt: was 2200 bytes" in result.stderr and "Traceback" not in result.stderr
    assert io.read_metadata(str(run.parent / "checkpoints"))["step"] == 4   # nothing trained, nothing saved
