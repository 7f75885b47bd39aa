"""The long-context demo, shortened (schedules/long_context.toml at a few % of its steps and batches): the extension
stage — 4× the sequence length, a new rope_theta, document masking — is what makes the positions past pretraining's
64 usable, as its eval sets measure. The full demo's numbers: docs/stages.md#the-demo-scheduleslong_contexttoml."""

from __future__ import annotations

import json

from helpers import REPO, quiet

from nanoflow import load_config
from nanoflow.observe.metrics import read_eval
from nanoflow.training.loop import train

DEMO = REPO / "schedules" / "long_context.toml"
SHORT = ["tokens.train_steps=100", "data_stages.long.start_training_step=61", "tokens.micro_batch_size=8",
         "data_stages.long.micro_batch_size=4", "evaluation.interval=1000",   # evaluated at steps 60 and 100 only
         *(f"evaluation.datasets.{name}.max_samples=32" for name in ("passkey_short", "passkey_long", "beyond"))]


def test_the_extension_stage_makes_the_positions_past_pretraining_usable(tmp_path):
    config = load_config(DEMO, [f"checkpoints.checkpoints_path={json.dumps(str(tmp_path / 'run'))}", *SHORT])
    out = quiet()
    train(config, out=out)
    assert 'stage "long": steps 61–100, global batch 4, sequence length 256, rope θ 160,000' in out.getvalue()
    rows = {(row["step"], row["dataset"]): row for row in read_eval(tmp_path / "run")}
    assert sorted(rows) == sorted((step, name) for step in (60, 100) for name in ("passkey_short", "passkey_long",
                                                                                  "beyond"))
    # The loss on held-out bytes 65–255 (positions pretraining never saw): measured 1.23 before the
    # extension and 0.39 after its 40 steps; at least halved on any machine.
    before, after = rows[(60, "beyond")]["loss"], rows[(100, "beyond")]["loss"]
    assert after < 0.5 * before, (before, after)
