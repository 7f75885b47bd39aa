"""What test_async_save.py and its process-level tests share."""

import json
from pathlib import Path

from nanoflow.io.marker import METADATA, SEAL

ASYNC = "checkpoints.async_save=true"


def committed_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name) for p in run.glob(f"*/{METADATA}"))


def comparable_metadata(step_folder: Path) -> dict:
    """A step's metadata without what differs between two runs of the same training: when it was committed (and
    so its seal), the token of its history (drawn when each run started), where the run folder is, and whether it
    was saved asynchronously."""
    meta = json.loads((step_folder / METADATA).read_text())
    del meta["created"], meta[SEAL], meta["lineage"]["history"]
    del meta["config"]["checkpoints"]["checkpoints_path"], meta["config"]["checkpoints"]["async_save"]
    return meta
