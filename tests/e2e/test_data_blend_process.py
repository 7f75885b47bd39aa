"""A blend's memory over stage switches, measured in a fresh interpreter (tests/unit/test_data_blend.py tests blends
in-process)."""

import subprocess
import sys
import textwrap

import numpy as np
from data_helpers import stage, write_folder
from helpers import REPO

# ---------------------------------------------------------------------------------------------
# Memory across stage switches

MEMORY_SCRIPT = textwrap.dedent("""
    import gc, sys
    import numpy as np
    from nanoflow.config import load_config
    from nanoflow.data import ByteTokenizer, open_stage
    from nanoflow.schedule import Schedule

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    config = load_config(sys.argv[1])
    after = []
    peak = 0
    for index in range(len(config.data_stages)):
        loader = open_stage(config, index, ByteTokenizer(), Schedule.from_config(config), cache_dir=sys.argv[2])
        n = sum(len(p.source) for p in loader.parts)
        for start in range(0, n, 256):
            loader.samples(start, 256)
        peak = max(peak, rss())
        loader.close()
        del loader
        gc.collect()
        after.append(rss())
    print(peak, *after)
""")


def test_memory_after_five_stage_switches_stays_where_it_was_after_the_first(tmp_path):
    rng = np.random.default_rng(0)
    for name in "xy":                                  # 2 × 8M tokens, 16 MB each on disk
        write_folder(tmp_path / name, [rng.integers(0, 256, 1 << 20).astype(np.uint16) for _ in range(8)], files=2)
    (tmp_path / "text.txt").write_text("".join(chr(97 + i % 26) for i in range(2_000_000)))
    text = {"hf_dataset_or_datasets": "text", "hf_data_files": str(tmp_path / "text.txt")}
    # The HF stage first, so that the libraries it imports (datasets, pyarrow) are in the first measurement.
    stages = [stage(f"s{i}", 1 + 10 * i, source) for i, source in
              enumerate([text, {"dataset_folder": str(tmp_path / "x")}, {"dataset_folder": str(tmp_path / "y")},
                         {"dataset_folder": [str(tmp_path / "x"), str(tmp_path / "y")]}, text,
                         {"dataset_folder": str(tmp_path / "y")}])]
    from data_helpers import write_config
    path = write_config(tmp_path, stages, sequence_length=1024, train_steps=60)
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path), str(tmp_path / "cache")],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr
    peak, first, *rest = map(int, out.stdout.split())
    mib = 1 << 20
    assert peak - first > 12 * mib                     # the measurement sees a mapped folder while it is read ...
    assert rest[-1] - first < 4 * mib, (first, rest)   # ... and the stages' data is gone after each switch
