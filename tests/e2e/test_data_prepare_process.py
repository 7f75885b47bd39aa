"""bin/prepare with two processes writes what one writes (tests/unit/test_data_prepare.py: in-process)."""

import os

import pytest
from process_helpers import run_command

from nanoflow.data.prepare import prepare


@pytest.mark.slow
def test_bin_prepare_with_several_processes_writes_the_same_folder(tmp_path, inputs):
    files, jsonl = inputs
    prepare([*files, jsonl], str(tmp_path / "one"), text_column="content", docs_per_shard=2, num_proc=1)
    result = run_command("prepare", *files, jsonl, "--output", tmp_path / "two", "--text-column", "content",
                         "--num-proc", "2", "--docs-per-shard", "2", timeout=600)
    assert result.returncode == 0, result.stderr
    assert "16 documents" in result.stdout and "8 files" in result.stdout and "verified" in result.stdout
    for name in sorted(os.listdir(tmp_path / "one")):
        if name != "prepare.json":
            assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    bad = run_command("prepare", jsonl, "--output", str(tmp_path / "three"), timeout=600)
    assert bad.returncode == 2 and 'no column "text"' in bad.stderr and "Traceback" not in bad.stderr




def test_bin_prepare_on_a_zst_file_without_zstandard_is_one_line_naming_the_package(tmp_path):
    from data_helpers import zstd_frame

    try:
        import zstandard  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("zstandard is installed here: the file reads")
    path = tmp_path / "docs.jsonl.zst"
    path.write_bytes(zstd_frame(b'{"text": "hello"}\n{"text": "world"}\n'))
    result = run_command("prepare", path, "--output", tmp_path / "out", cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{path}: a Zstandard file; reading it needs the zstandard package" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
