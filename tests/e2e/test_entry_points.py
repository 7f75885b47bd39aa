"""Every bin/* command is also an installed console script ([project.scripts]), and both are thin: the
script names a nanoflow.commands.cli function, and bin/* only calls that same function (no sys.path games)."""

from __future__ import annotations

import importlib
import os
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
        assert f"from nanoflow.commands.cli import {function}\n" in text and f"    {function}()" in text, name
        assert "sys.path" not in text, name
        assert "except KeyboardInterrupt:" in text, f"bin/{name}: a Ctrl-C during its imports is a traceback"
        assert "except ModuleNotFoundError" in text, f"bin/{name}: run outside the venv it is a traceback"


def test_a_console_script_function_exits_with_the_front_ends_status(tmp_path):
    code = ("import sys; sys.argv = ['nanoflow-train', 'nope.toml']\n"
            "from nanoflow.commands.cli import train_command\ntrain_command()")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
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


def test_each_bin_command_outside_its_environment_says_what_to_do(tmp_path):
    """bin/* run by a Python that has not nanoflow (the venv not activated) or lacks a dependency of it: one line that
    names the missing module and the README's install command, exit status 2, no traceback (issue 30, item 24)."""
    from nanoflow import errors

    assert errors.QUICKSTART_INSTALL in (REPO / "README.md").read_text()
    # -S: no site-packages, as a system Python has none of nanoflow's; without PYTHONPATH nanoflow itself is missing,
    # with it (the checkout on the path) its first dependency is.
    for name in COMMANDS:
        for pythonpath, missing in ((None, "nanoflow"), (str(REPO), None)):
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            if pythonpath:
                env["PYTHONPATH"] = pythonpath
            result = subprocess.run([sys.executable, "-S", str(REPO / "bin" / name), "--help"], cwd=tmp_path, env=env,
                                    capture_output=True, text=True, timeout=600)
            lines = result.stderr.strip().splitlines()
            assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, (name, result)
            module = missing or lines[0].split("'")[1]
            assert module != "nanoflow" or missing, lines
            assert lines[0] == "error: " + errors.not_installed(module, sys.executable), (name, lines)


def test_a_dependency_missing_when_a_command_imports_it_is_the_same_line(capsys):
    from nanoflow import errors
    from nanoflow.commands import cli

    def needs(module):
        def work():
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
        return work

    assert cli.guarded(needs("torch")) == errors.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "error: " + errors.not_installed("torch", sys.executable) + "\n"
    import pytest
    with pytest.raises(ModuleNotFoundError):   # a module of nanoflow's own that is not there is a bug: its traceback
        cli.guarded(needs("nanoflow.nothing"))


def test_set_says_its_paths_are_relative_to_the_config_file(capsys):
    """--set checkpoints.checkpoints_path=runs/x next to schedules/x.toml is schedules/runs/x: every --set help says
    so (issue 30, item 25)."""
    import pytest

    from nanoflow.commands import cli

    for main in (cli.train_main, cli.eval_main, cli.verify_resume_main):
        with pytest.raises(SystemExit):
            main(["--help"])
        shown = " ".join(capsys.readouterr().out.split())
        assert "A path is relative to the config file, as the file's own paths are" in shown, (main, shown)
