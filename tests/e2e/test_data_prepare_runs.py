"""schedules/blend.toml trained on bin/prepare's output, straight and resumed, bit for bit
(tests/unit/test_data_prepare.py: bin/prepare itself)."""

from __future__ import annotations

import io as text_io
import json
from pathlib import Path

from helpers import REPO

from nanoflow import load_config


def blend_config(root: Path, run: Path, *extra: str):
    return load_config(REPO / "schedules" / "blend.toml", [
        f"data_stages.pretrain.data.dataset.dataset_folder={json.dumps([str(root / 'code'), str(root / 'prose')])}",
        f"checkpoints.checkpoints_path={json.dumps(str(run))}", "checkpoints.checkpoint_interval=100",
        "tokens.train_steps=12", "data_stages.anneal.start_training_step=6", "data_stages.sft.start_training_step=10",
        "tokens.sequence_length=32", "tokens.micro_batch_size=2", "data_stages.sft.micro_batch_size=4",
        "model.num_hidden_layers=1", "model.hidden_size=32", "model.intermediate_size=64",
        f"data_stages.sft.data.dataset.hf_data_files={json.dumps(str(root / 'sft.jsonl'))}", *extra])


def test_blend_schedule_trains_on_prepared_folders_and_resumes_bit_exactly(blend_folders, tmp_path):
    from run_helpers import assert_same_training_state

    from nanoflow.training.loop import train

    out = text_io.StringIO()
    straight = train(blend_config(blend_folders, tmp_path / "straight"), out=out, progress=False)
    log = out.getvalue()
    assert 'stage "pretrain"' in log and 'stage "anneal"' in log and 'stage "sft"' in log
    assert log.count("sft.jsonl wrapped around (10 samples an epoch)") == 1      # the loop passes the loader's log
    for k in (3, 7):                                # mid pretrain (workers prefetching), mid anneal
        run = tmp_path / f"stop{k}"
        train(blend_config(blend_folders, run), until_step=k, out=text_io.StringIO(), progress=False)
        resumed = train(blend_config(blend_folders, run), out=text_io.StringIO(), progress=False)
        assert_same_training_state(straight, resumed)

