"""Checkpoint IO: the only package that reads or writes checkpoint bytes, on a local disk or on S3.

`checkpoint` holds the layout, the commit protocol and how committed checkpoints are found; `files`
writes every local file whole and never through a link;
`lock` keeps a run folder to one writer; `marker` seals and checks the commit marker; `reader` reads
any box of a saved tensor by byte ranges, checking every shard it uses; `store` reaches a local
folder or an s3:// prefix (with bounded retries); `tensorfile` writes and parses safetensors files
without copies; `hf` is the transformers Llama folder: its files, and reading such folders back (for
`[model] init_from`; nanoflow.interop.export writes checkpoints as such folders).
"""

import importlib

# Each public name → the module that defines it, imported on first use: `nanoflow.io.store` (the one spelling
# of "is this a URL?") is then importable without torch, by the converter and the config's commands.
_HOMES = {
    "checkpoint": ("Block", "CheckpointError", "DamagedCheckpointError", "checkpoints_to_try", "latest",
                   "read_metadata", "save_checkpoint"),
    "hf": ("read_hf", "read_init_weights"),
    "lock": ("LockLostError", "RunLock", "RunLockedError", "confirm_held"),
    "reader": ("Checkpoint", "CheckpointReader", "open_checkpoint", "read_checkpoint", "read_model"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME_OF[name]}"), name)
    globals()[name] = value
    return value
