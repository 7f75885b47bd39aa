"""Checkpoint IO: the only package that reads or writes checkpoint bytes, on a local disk or on S3.

`checkpoint` holds the layout, the commit protocol and the readers; `store` reaches a local
folder or an s3:// prefix through smart_open; `hf` exports checkpoints as transformers Llama
folders and reads such folders back (for `[model] init_from`).
"""

from nanoflow.io.checkpoint import (
    Block,
    Checkpoint,
    CheckpointReader,
    CheckpointError,
    CheckpointWarning,
    latest,
    open_checkpoint,
    read_checkpoint,
    read_metadata,
    read_model,
    save_checkpoint,
)
from nanoflow.io.hf import export_hf, read_hf, read_init_weights

__all__ = ["Block", "Checkpoint", "CheckpointError", "CheckpointReader", "CheckpointWarning", "latest",
           "open_checkpoint", "read_checkpoint", "read_metadata", "read_model", "save_checkpoint",
           "export_hf", "read_hf", "read_init_weights"]
