"""Checkpoint IO: the only package that reads or writes checkpoint bytes, on a local disk or on S3.

`checkpoint` holds the layout, the commit protocol and the readers; `store` reaches a local
folder or an s3:// prefix through smart_open.
"""

from nanoflow.io.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointWarning,
    latest,
    read_checkpoint,
    read_metadata,
    read_model,
    save_checkpoint,
)

__all__ = ["Checkpoint", "CheckpointError", "CheckpointWarning", "latest", "read_checkpoint", "read_metadata",
           "read_model", "save_checkpoint"]
