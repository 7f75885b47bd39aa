"""Start-up before any training: a bad config answers before torch is imported, and a config file that is
not a config file (a folder, binary, too deep) is one line with exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

# A child interpreter, so that this test's own imports (torch, through conftest) do not count.
_REPORT_TORCH = """
import sys
from nanoflow.commands import cli
status = cli.train_main(sys.argv[1:])
print("torch imported" if "torch" in sys.modules else "torch not imported", status)
"""

@pytest.mark.parametrize("extra", [[], ["--plan"]])
def test_a_bad_config_is_reported_before_torch_is_imported(tmp_path, extra):
    config = tmp_path / "bad.toml"
    config.write_text("[tokens]\ntrian_steps = 10\n")
    result = subprocess.run([sys.executable, "-c", _REPORT_TORCH, str(config), *extra], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert "unknown key 'trian_steps'" in result.stderr, result.stderr
    assert result.stdout.split() == ["torch", "not", "imported", "2"], result.stdout + result.stderr


def test_the_remote_question_and_the_converter_load_without_torch():
    # "Is this a URL?" is asked by the nanotron converter and the study runner before any training:
    # answering it must not cost torch's start-up.
    probe = "import sys, nanoflow.io.store, nanoflow.interop.nanotron; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def _deep(levels: int) -> bytes:
    return b"a = " + b"[" * levels + b"]" * levels + b"\n"


@pytest.mark.parametrize("case, expected", [
    ("folder", "is a folder, not a config file"),
    ("binary", "not a text file"),
    ("latin-1", "not UTF-8"),
    ("deep", "nested too deeply"),
])
def test_a_config_path_that_is_no_config_file_is_one_line_and_exit_2(tmp_path, capsys, case, expected):
    from nanoflow.commands import cli
    path = tmp_path / "config.toml"
    if case == "folder":
        path.mkdir()
    elif case == "binary":
        path.write_bytes(b"\x00\x01\x02\xff\xfe" * 100)
    elif case == "latin-1":
        path.write_bytes('[general]\nproject = "caf\xe9"\n'.encode("latin-1"))
    else:
        path.write_bytes(_deep(20000))
    assert cli.train_main([str(path), "--plan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]   # nothing written beside it


@pytest.mark.parametrize("key, value", [("model.hidden_size", 1048576), ("model.num_hidden_layers", 100000000)])
def test_an_impossible_model_size_is_refused_before_building_with_both_numbers(tmp_path, capsys, key, value):
    from helpers import TINY

    from nanoflow.commands import cli
    folder = tmp_path / "run"
    status = cli.train_main([str(TINY), "--set", f"{key}={value}", "--set", f"checkpoints.checkpoints_path={folder}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "parameters" in err and "bytes" in err and "this machine has" in err and f"{key.split('.')[1]} = {value}" in err, err
    assert "Traceback" not in err and not folder.exists(), err


_CTRL_C_WHILE_IMPORTING = """
import runpy, sys

class CtrlC:  # a Ctrl-C that lands while bin/train imports nanoflow.commands.cli
    def find_spec(self, name, path=None, target=None):
        if name == "nanoflow.commands.cli":
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
sys.argv = ["bin/train", "schedules/tiny.toml"]
runpy.run_path("bin/train", run_name="__main__")
"""

@pytest.mark.parametrize("command", ["train", "eval", "export", "prepare", "report", "verify-resume",
                                     "convert-nanotron-config", "preview"])
def test_ctrl_c_while_bin_imports_is_one_line_and_130(command):
    script = _CTRL_C_WHILE_IMPORTING.replace("bin/train", f"bin/{command}")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip().splitlines() == ["interrupted: stopped at once, without saving; the last committed "
                                                  "checkpoint (if any) is untouched"], result.stderr


def test_plan_says_it_opens_the_data_before_the_silence_on_stderr_alone(capsys):
    """--plan opens every source as training would, which takes a while on large data: one line on stderr says so
    first; stdout holds the plan alone (issue 30, item 25)."""
    from helpers import TINY
    from process_helpers import run_in_process

    result = run_in_process("train", TINY, "--plan", capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == ("--plan: opening the tokenizer and the data of 2 stages, as "
                                             "training would (a large source takes a while)"), result.stderr
    assert "--plan: opening" not in result.stdout and result.stdout.startswith("nanoflow/tiny:"), result.stdout
