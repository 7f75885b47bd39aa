"""Every bin/* command is also an installed console script ([project.scripts]), and both are thin: the
script names a nanoflow.commands.cli function, and bin/* only calls that same function (no sys.path games)."""

from __future__ import annotations

import importlib
import subprocess
import sys

from helpers import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
COMMANDS = sorted(path.name for path in (REPO / "bin").iterdir() if path.is_file())


def test_each_bin_command_is_a_console_script_calling_the_same_function():
    assert sorted(SCRIPTS) == [f"nanoflow-{name}" for name in COMMANDS]
    for name in COMMANDS:
        module, _, function = SCRIPTS[f"nanoflow-{name}"].partition(":")
        assert module == "nanoflow.commands.cli" and callable(getattr(importlib.import_module(module), function))
        text = (REPO / "bin" / name).read_text()
        assert f"from nanoflow.commands.cli import {function}" in text and f"    {function}()" in text, name
        assert "sys.path" not in text, name
        assert "except KeyboardInterrupt:" in text, f"bin/{name}: a Ctrl-C during its imports is a traceback"


def test_a_console_script_function_exits_with_the_front_ends_status(tmp_path):
    code = ("import sys; sys.argv = ['nanoflow-train', 'nope.toml']\n"
            "from nanoflow.commands.cli import train_command\ntrain_command()")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "nope.toml: no such config file" in result.stderr, result.stderr


def test_help_calls_the_command_by_the_name_it_was_run_by(monkeypatch, capsys):
    import pytest

    from nanoflow.commands.cli import train_main

    for argv0, name in [("/venv/bin/nanoflow-train", "nanoflow-train"), (str(REPO / "bin" / "train"), "bin/train")]:
        monkeypatch.setattr(sys, "argv", [argv0, "--help"])
        with pytest.raises(SystemExit):
            train_main(["--help"])
        shown = capsys.readouterr().out
        assert shown.startswith(f"usage: {name} ") and f"Example: {name} schedules/" in shown, shown
