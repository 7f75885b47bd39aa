"""Checkpoint IO: the only package that reads or writes checkpoint bytes, on a local disk or on S3.

`checkpoint` holds the layout, the commit protocol and how committed checkpoints are found;
`lock` keeps a run folder to one writer; `marker` seals and checks the commit marker; `reader` reads
any box of a saved tensor by byte ranges, checking every shard it uses; `store` reaches a local
folder or an s3:// prefix (with bounded retries); `tensorfile` writes and parses safetensors files
without copies; `hf` is the transformers Llama folder: its files, and reading such folders back (for
`[model] init_from`; nanoflow.interop.export writes checkpoints as such folders).
"""

from nanoflow.io.checkpoint import (
    Block,
    CheckpointError,
    DamagedCheckpointError,
    checkpoints_to_try,
    latest,
    read_metadata,
    save_checkpoint,
)
from nanoflow.io.hf import read_hf, read_init_weights
from nanoflow.io.lock import LockLostError, RunLock, RunLockedError, confirm_held
from nanoflow.io.reader import Checkpoint, CheckpointReader, open_checkpoint, read_checkpoint, read_model

__all__ = ["Block", "Checkpoint", "CheckpointError", "CheckpointReader", "DamagedCheckpointError",
           "LockLostError", "RunLock", "RunLockedError", "checkpoints_to_try", "confirm_held", "latest", "open_checkpoint", "read_checkpoint", "read_metadata", "read_model",
           "save_checkpoint", "read_hf", "read_init_weights"]
