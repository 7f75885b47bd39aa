"""A hub name that cannot load offline, in a fresh interpreter (tests/unit/test_data_hf.py tests HF sources
in-process)."""

import os
import subprocess
import sys

from data_helpers import stage, write_config
from helpers import REPO


def test_a_hub_name_that_cannot_load_offline_names_the_stage(tmp_path):
    path = write_config(tmp_path, [stage("web", 1, {"hf_dataset_or_datasets": "someorg/no-such-dataset"})])
    code = ("import sys; from nanoflow.config import load_config; from nanoflow.data import ByteTokenizer, open_stage\n"
            "from nanoflow.schedule import Schedule\n"
            f"config = load_config({str(path)!r})\n"
            f"open_stage(config, 0, ByteTokenizer(), Schedule.from_config(config), cache_dir={str(tmp_path / 'c')!r})")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert out.returncode != 0
    assert ('stage "web" (dataset someorg/no-such-dataset): cannot load \'someorg/no-such-dataset\'' in out.stderr
            and "HF_DATASETS_OFFLINE is set" in out.stderr), out.stderr[-2000:]
