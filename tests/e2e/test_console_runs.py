"""The one message channel over a whole run: under train(out=...) every message goes to `out`, none to stdout
(tests/unit/test_console.py: the rest)."""

from __future__ import annotations

import io as text_io

import pytest
from helpers import tiny

from nanoflow.training.loop import train


@pytest.mark.parametrize("live", [False, True])
def test_under_out_every_message_goes_to_out_and_none_to_stdout(tmp_path, capsys, live):
    out = text_io.StringIO()
    config = tiny(tmp_path / "run", "tokens.train_steps=9")   # sft (from step 8) reached, and a stage not reached?
    state = train(config, out=out, progress=live)
    assert state.step == 9
    text = out.getvalue()
    assert 'stage "pretrain"' in text and 'stage "sft"' in text and "saved step 9" in text and "done: 9 steps" in text
    assert ("\r" in text) == live   # the bar, when live, is drawn on `out` too
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    assert "warning" not in captured.err and "stage" not in captured.err, captured.err

