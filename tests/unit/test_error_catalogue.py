"""The error catalogue: every NanoflowError is defined in nanoflow/errors.py with one of the documented exit
statuses, the README's table lists exactly those statuses, and a missing optional extra or a bad nanotron
config ends a command with its message and status 2. In-process: no command is started as a process."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from helpers import REPO

from nanoflow import errors
from nanoflow.commands import cli

PACKAGE = REPO / "nanoflow"


def defined_errors() -> dict[str, str]:
    """{class name: the module file defining it} of every class in the package that derives, by its bases'
    names, from NanoflowError (read from the source; nothing is imported)."""
    bases, where = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))}
                bases.setdefault(node.name, set()).update(names)
                where.setdefault(node.name, set()).add(str(path.relative_to(REPO)))
    found, grown = {"NanoflowError"}, True
    while grown:
        more = {name for name, of in bases.items() if of & found} - found
        found |= more
        grown = bool(more)
    return {name: ", ".join(sorted(where[name])) for name in found}


def test_every_error_class_of_the_package_is_in_the_catalogue():
    found = defined_errors()
    assert len(found) >= 25 and "StorageLostError" in found and "MissingExtraError" in found
    assert {name: path for name, path in found.items() if path != "nanoflow/errors.py"} == {}
    assert set(errors.CATALOGUE) == set(found)


def test_each_error_ends_with_a_documented_status():
    documented = set(errors.STATUSES.values())
    assert {name: status for name, status in errors.CATALOGUE.items() if status not in documented} == {}
    assert errors.CATALOGUE["StorageLostError"] == errors.EXIT_STORAGE
    assert errors.CATALOGUE["DivergedError"] == errors.EXIT_DIVERGED
    assert errors.CATALOGUE["MissingExtraError"] == errors.EXIT_BAD_INPUT
    # exit 4 has one class: storage lost once training began, whatever was being written
    assert [name for name, status in errors.CATALOGUE.items() if status == errors.EXIT_STORAGE] == ["StorageLostError"]


def status_table() -> tuple[Path, list[int]]:
    """The statuses of the table of exit statuses (its header: | status | meaning | what to do |), wherever the
    README or docs/ keep it."""
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.fullmatch(r"\|\s*status\s*\|\s*meaning\s*\|.*", line):
                rows = []
                for row in lines[i + 2:]:
                    if not row.startswith("|"):
                        break
                    rows.append(int(row.split("|")[1]))
                return path, rows
    raise AssertionError("no table of exit statuses (| status | meaning | ...) in README.md or docs/")


def test_the_documented_statuses_are_the_catalogue_s():
    path, rows = status_table()
    assert rows == sorted(errors.STATUSES.values()), path
    assert rows == [0, 1, 2, 3, 4, 75, 130]


# ---------------------------------------------------------------------------------------------
# A missing optional extra: exit 2 and the pip command, never a traceback (the module masked in sys.modules)

def without(monkeypatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)   # importing it raises ImportError, as when not installed


MATPLOTLIB = ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg")
HINT = "which is not installed: pip install '.[report]' in the nanoflow checkout (or pip install matplotlib)"


def test_bin_report_without_matplotlib_is_exit_2_with_the_hint(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "stage": "pretrain", "loss": 5.0, "lr": 0.01,
                                                   "grad_norm": 1.0, "tokens": 128, "elapsed": 0.5}) + "\n")
    without(monkeypatch, *MATPLOTLIB)
    assert cli.report_main([str(run)]) == errors.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == f"error: drawing needs matplotlib, {HINT}\n"
    assert not (run / "report.png").exists()


def test_compare_s_picture_without_matplotlib_is_the_same_error(tmp_path, monkeypatch):
    from nanoflow.commands.compare import plot

    without(monkeypatch, *MATPLOTLIB)
    with pytest.raises(errors.MissingExtraError, match=re.escape(HINT)) as caught:
        plot([], tmp_path / "compare.png", dataset="held")
    assert caught.value.exit_status == errors.EXIT_BAD_INPUT and caught.value.extra == "report"
    assert not (tmp_path / "compare.png").exists()


def test_a_tokenizer_json_without_tokenizers_names_the_extra(tmp_path, monkeypatch):
    from nanoflow.data.tokenizer import HFTokenizer

    without(monkeypatch, "tokenizers")
    with pytest.raises(errors.MissingExtraError) as caught:
        HFTokenizer(tmp_path / "tokenizer.json")
    assert str(caught.value) == (f"loading the tokenizer {tmp_path / 'tokenizer.json'} needs tokenizers, which is not "
                                 "installed: pip install '.[tokenizers]' in the nanoflow checkout "
                                 "(or pip install tokenizers)")


def test_a_missing_package_is_not_blamed_on_the_file_the_command_was_given(capsys):
    def work():
        raise errors.MissingExtraError("drawing", "matplotlib", "report")

    assert cli.guarded(work, where="run.toml") == errors.EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"error: drawing needs matplotlib, {HINT}\n"


def test_convert_nanotron_config_without_pyyaml_is_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.yaml").write_text("general: {}\n")
    without(monkeypatch, "yaml")
    assert cli.convert_nanotron_config_main([str(tmp_path / "config.yaml")]) == errors.EXIT_BAD_INPUT
    assert capsys.readouterr().err == ("error: reading YAML needs pyyaml, which is not installed: "
                                       "pip install pyyaml\n")


# ---------------------------------------------------------------------------------------------
# convert-nanotron-config raises like every command: guarded prints the one line and returns the status

def test_the_converter_raises_a_nanoflow_error_that_is_still_a_value_error():
    from nanoflow.interop.nanotron import convert

    with pytest.raises(errors.NanotronConfigError, match="a nanotron config is a YAML mapping at the top level") as e:
        convert(["not", "a", "mapping"])
    assert isinstance(e.value, ValueError) and e.value.exit_status == errors.EXIT_BAD_INPUT


@pytest.mark.parametrize("text, named", [(None, "No such file or directory"), ("a: [b\n", "while parsing"),
                                         ("- 1\n", "a nanotron config is a YAML mapping at the top level")])
def test_an_unreadable_nanotron_config_is_one_line_naming_the_file_and_exit_2(tmp_path, capsys, text, named):
    path = tmp_path / "config.yaml"
    if text is not None:
        path.write_text(text)
    assert cli.convert_nanotron_config_main([str(path)]) == errors.EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {path}: ") and named in err and "Traceback" not in err


def test_a_url_s_credentials_are_masked_in_any_text():
    from nanoflow.errors import without_credentials

    assert without_credentials("see http://nanoflow:s3cr3t@127.0.0.1:9000/b and https://tok@host/x") == \
        "see http://***@127.0.0.1:9000/b and https://***@host/x"
    assert without_credentials('"http://a:b@c@host/x".') == '"http://***@host/x".'   # the last @ ends the user part
    unchanged = "s3://bucket/run/4 at http://127.0.0.1:9000/a@b, mail me@host.org"
    assert without_credentials(unchanged) == unchanged


def test_a_broken_collective_is_a_lost_peer_with_the_requeue_status():
    import torch.distributed as dist

    from nanoflow.parallel.mesh import lost_peer

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:4515: Connection reset by peer. This is typically caused by a remote worker "
                        "hanging or bugs in the application. Check the logs of the remote worker before reporting an "
                        "error. GLHF!")
    found = lost_peer(gloo)
    assert found is not None and found.exit_status == errors.EXIT_STOPPED == 75
    assert "(Read error [127.0.0.1]:4515: Connection reset by peer)" in str(found) and "GLHF" not in str(found)
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("raised while handling it") from e
    except ValueError as wrapped:
        assert lost_peer(wrapped) is not None
    assert lost_peer(dist.DistNetworkError("Connection was likely closed")) is not None
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None   # a bug stays a bug
    assert lost_peer(ValueError("gloo/transport/x] looks like it, but is no RuntimeError")) is None
