"""The sample order seen from another interpreter (tests/unit/test_data.py tests nanoflow.data in-process)."""

import json
import os
import subprocess
import sys

from helpers import REPO

from nanoflow.data import sample_order


def test_sample_order_is_the_same_in_another_process():
    # Python's hash() is salted per process; the order must not be.
    code = "from nanoflow.data import sample_order; print(sample_order(5, 'pretrain', 1000).take(range(20)).tolist())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=REPO)
    assert json.loads(out.stdout) == sample_order(5, "pretrain", 1000).take(range(20)).tolist()
