"""The one message channel (nanoflow/console.py): what bin/* print, what train(out=...) captures, a live bar, ranks."""

from __future__ import annotations

import io as text_io
import logging

from nanoflow import console
from nanoflow.commands import cli


def test_messages_while_a_bar_is_open_are_written_above_it():
    from tqdm import tqdm

    out = text_io.StringIO()
    with console.routed(out):
        bar = tqdm(total=3, file=out, ascii=True, mininterval=0)
        bar.update(1)
        logging.getLogger("nanoflow.training.loop").warning("stage x not reached")
        bar.close()
    text = out.getvalue()
    before, message, after = text.partition("warning: stage x not reached\n")
    assert message, text
    assert "1/3" in before and before.endswith("\r")   # the bar was cleared for the line (not written after it) …
    assert "1/3" in after                              # … and drawn again below it


def test_only_rank_0_prints(monkeypatch, capsys):
    def work():
        logging.getLogger("nanoflow.training.loop").info("saved step 2: run/2")
        logging.getLogger("nanoflow.io.checkpoint").warning("something skipped")
        return 0

    monkeypatch.setenv("RANK", "1")
    assert cli.guarded(work) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert cli.guarded(work) == 0
    assert capsys.readouterr().out == "saved step 2: run/2\nwarning: something skipped\n"


def test_routed_restores_the_logging_set_up_before(caplog):
    caplog.set_level(logging.INFO, logger="nanoflow")
    out = text_io.StringIO()
    with console.routed(out):
        logging.getLogger("nanoflow.x").info("to out")
    logging.getLogger("nanoflow.x").info("to caplog")
    assert out.getvalue() == "to out\n"
    assert [r.getMessage() for r in caplog.records] == ["to caplog"]
