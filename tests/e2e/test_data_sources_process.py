"""Full token and datasets caches, on a real tmpfs mounted for the test (tests/unit/test_data_sources.py: the
sources)."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
from data_helpers import BYTES

from nanoflow.data import open_stage
from nanoflow.data.tokens import StageDataError
from nanoflow.schedule import Schedule

# ---------------------------------------------------------------------------------------------
# held_out_samples at least the source's samples (issue 21, item 12)


@contextlib.contextmanager
def small_disk(path, size: str):
    """A real full disk: a tmpfs of `size` mounted at `path` (root only), unmounted again whatever happens."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_under_the_token_cache_names_the_cache_and_leaves_nothing_behind(tmp_path, rows):
    tokens = tmp_path / "cache" / "nanoflow-tokens"
    with small_disk(tokens, "16k"):
        with pytest.raises(StageDataError, match=r"cannot write the token cache .*nanoflow-tokens/\w+\.npy: No space "
                                                 r"left on device; the tokens need [\d,]+ bytes there: free space"):
            open_stage(rows, 0, BYTES, Schedule.from_config(rows), cache_dir=str(tmp_path / "cache"))
        assert os.listdir(tokens) == []


def test_a_full_datasets_cache_is_said_and_the_data_files_are_not_blamed(tmp_path, rows):
    with small_disk(tmp_path / "cache", "64k"):
        with pytest.raises(StageDataError) as caught:
            open_stage(rows, 0, BYTES, Schedule.from_config(rows), cache_dir=str(tmp_path / "cache"))
    message = str(caught.value)
    assert f"`datasets` cannot write its cache under {tmp_path / 'cache'} (No space left on device" in message
    assert "the data files are fine" in message and "cannot be read" not in message
