"""Export of a trained run refuses a config.json that is a link (tests/unit/test_files.py: every other writer)."""

from __future__ import annotations

from nanoflow.commands.cli import export_main
from nanoflow.errors import EXIT_BAD_INPUT


def test_export_refuses_a_config_json_that_is_a_link(trained, tmp_path, capsys):
    run, _ = trained
    out, target = tmp_path / "hf", tmp_path / "mine.json"
    out.mkdir()
    target.write_text("{}")
    (out / "config.json").symlink_to(target)
    assert export_main([str(run), str(out)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out}/config.json" in err and "symlink" in err, err
    assert target.read_text() == "{}" and (out / "config.json").is_symlink()

