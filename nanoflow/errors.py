"""Every user-facing error of nanoflow, and the exit status each one ends a command with.

bin/* print the message of a NanoflowError (no traceback) and exit with its `exit_status`; any
other exception is a bug and keeps its traceback (exit 1). The classes are all here, so this module
is the catalogue: `CATALOGUE` maps each class's name to its status, and the README's table of
statuses is tested against `STATUSES`. `without_credentials` masks the password of a URL in any message. The modules that raise an error import it from here (and
re-export it where it is part of their public names). This module imports nothing but `re`, so the pure
modules (schedule.py, config/) can raise these too.
"""

import re

EXIT_DONE = 0
EXIT_BUG = 1            # an exception nanoflow did not expect: a traceback, and an issue to file
EXIT_BAD_INPUT = 2      # a config, data, tokenizer or checkpoint to fix, a missing extra, a run folder in use
EXIT_DIVERGED = 3       # a non-finite loss or gradient norm: stopped before the update, the last good checkpoint kept
EXIT_STORAGE = 4        # storage failed mid-run: what was committed before stands; rerun to resume
EXIT_STOPPED = 75       # stopped by a signal after saving, or by a lost peer (sysexits' EX_TEMPFAIL): requeue, rerun
EXIT_INTERRUPTED = 130  # a second Ctrl-C: stopped at once without saving (the shell's 128 + SIGINT)

# Every status a command can end with, by its constant's name (the README's table lists exactly these).
STATUSES = {name: value for name, value in dict(globals()).items() if name.startswith("EXIT_")}

INTERRUPTED = "interrupted: stopped at once, without saving; the last committed checkpoint (if any) is untouched"


# The README's Quickstart install, which a command run outside nanoflow's environment names (bin/* carry a copy of
# not_installed's line, as they must say it when nanoflow itself cannot be imported; a test holds them equal).
QUICKSTART_INSTALL = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
                      "pip install -e '.[test]'")


def not_installed(module: str, python: str) -> str:
    """What a command says when `module` cannot be imported by the Python `python` that runs it: nanoflow or one of its
    dependencies is not installed there (the venv not activated?)."""
    return (f"no module named {module!r} in {python}: activate the venv nanoflow is installed in "
            f"(. .venv/bin/activate in the checkout), or install it as the README's Quickstart does: {QUICKSTART_INSTALL}")


def without_credentials(text: str) -> str:
    """`text` with the user:password of every URL in it masked (http://user:pass@host → http://***@host): what the
    message channel (nanoflow/console.py), the error line of bin/* and every storage error pass their text through,
    so that a password in AWS_ENDPOINT_URL is never shown, logged or recorded."""
    return re.sub(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#'\"<>]*@", r"\1***@", text)


def exit_interrupted() -> None:
    """Ctrl-C while bin/* imports nanoflow.commands.cli: the one line and the status of a Ctrl-C at any later moment."""
    import sys
    print(INTERRUPTED, file=sys.stderr)
    raise SystemExit(EXIT_INTERRUPTED)


class NanoflowError(Exception):
    """A problem the user can act on; the message names the file, the stage, the key or the path."""

    exit_status = EXIT_BAD_INPUT


# ---------------------------------------------------------------------------------------------
# Exit 2, bad input: the config and its schedule

class ConfigError(NanoflowError, ValueError):
    """A configuration that cannot run. The message names the file, the stage and the key."""


class ScheduleError(NanoflowError, ValueError):
    """A schedule that cannot be trained. `stage` and `key` name the culprit when there is one."""

    def __init__(self, message: str, *, stage: str | None = None, key: str | None = None):
        super().__init__(message)
        self.stage = stage
        self.key = key


class ScheduleDriftError(ScheduleError):
    """The part of the schedule that has already been trained differs from what a checkpoint recorded."""


class LRChangedError(NanoflowError):
    """The config gives the next step of a begun stage another LR than the checkpoint's config did."""


class MissingExtraError(NanoflowError):
    """A package a command needs is not installed (an optional extra such as matplotlib, or a dependency removed
    since); the message names it and the pip command that adds it."""

    def __init__(self, needs: str, package: str, extra: str | None = None):
        # The extras are pyproject.toml's optional dependencies, installed from the checkout: `pip install '.[report]'`.
        hint = f"pip install {package}" if extra is None else \
            f"pip install '.[{extra}]' in the nanoflow checkout (or pip install {package})"
        super().__init__(f"{needs} needs {package}, which is not installed: {hint}")
        self.package = package
        self.extra = extra


# ---------------------------------------------------------------------------------------------
# Exit 2: data and tokenizers

class TokenizerError(ConfigError):
    """A tokenizer that cannot be loaded or lacks a token the run needs; the message names the file and the key."""


class StageDataError(ConfigError):
    """Data a stage cannot train on (a missing column, too few samples, a folder of another tokenizer, ...),
    found when the stage's loader opens, before its first step. A ConfigError, so bin/train reports it
    as one: a message naming the stage and the path, exit status 2."""


class TokenFolderError(StageDataError):
    """A token folder or file that cannot be read: missing, empty, truncated or inconsistent."""


class SampleReadError(NanoflowError, RuntimeError):
    """A sample that could not be read once training ran (an unreadable file, a token id outside the vocabulary):
    the message names the stage, the sample, the source and the file."""


class DataChangedError(NanoflowError, ValueError):
    """A stage that has begun would resume on other data, another tokenizer or another seed (exit status 2)."""


class PrepareError(NanoflowError, ValueError):
    """Inputs or an output folder that bin/prepare cannot use; the message names the culprit."""


# ---------------------------------------------------------------------------------------------
# Exit 2: checkpoints, storage and the run folder found unusable before training

class CheckpointError(NanoflowError, RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, damaged, or not what was asked for."""


class DamagedCheckpointError(CheckpointError):
    """A committed checkpoint whose bytes cannot be read back as recorded: a file missing, short,
    unreadable, or not matching its checksum. An older intact checkpoint may be used instead."""


class RunLockedError(CheckpointError):
    """The run folder is held by another live run."""


class LockLostError(CheckpointError):
    """The lock this run held was taken over (its lease had lapsed): this run must not write again."""


class HFFormatError(CheckpointError):
    """A folder that is not a readable HF Llama folder."""


class StoreError(NanoflowError, OSError):
    """Storage that cannot be reached, read or written; the message names the path and the cause."""


class TensorFileError(NanoflowError, ValueError):
    """Bytes that are not a well-formed safetensors file."""


class RunFolderError(NanoflowError, OSError):
    """A run folder that is not a folder, cannot be created or written, or has no room for a checkpoint."""


class LinkError(NanoflowError):   # no OSError: a writer's `except OSError` must not take it for a failed write
    """A file or folder nanoflow was about to write is a symlink it did not make: refused, nothing written
    through it (nanoflow.io.files)."""


class MetricsError(NanoflowError, ValueError):
    """A run folder without usable metrics."""


# ---------------------------------------------------------------------------------------------
# Exit 2: what the other commands are given

class AverageError(NanoflowError):
    """Checkpoints that cannot be averaged, or a selection of them that names none or too many."""


class CompareError(NanoflowError):
    """A run folder bin/compare cannot read: no eval.jsonl, no checkpoint."""


class PlotError(NanoflowError):
    """A figure cannot be written where a command was told (--plot, --out, --output): a missing folder, a format
    matplotlib does not write, a folder named."""


class NanotronConfigError(NanoflowError, ValueError):
    """A nanotron YAML config that cannot be read or converted (not YAML, not a mapping, a model that is no Llama)."""


# ---------------------------------------------------------------------------------------------
# Exit 3 and 4: the run stopped mid-way

class DivergedError(NanoflowError, FloatingPointError):
    """A non-finite loss or gradient norm: the step's update was not applied and nothing was saved."""

    exit_status = EXIT_DIVERGED


class StorageLostError(NanoflowError):   # no OSError: an `except OSError` must not take it for a retryable write
    """Storage failed once training had begun (a checkpoint or a metrics line that could not be written, a full
    disk): not the config's fault, and what was committed before stands; the same command resumes."""

    exit_status = EXIT_STORAGE


# ---------------------------------------------------------------------------------------------
# Exit 75: stopped, to be requeued

class PeerLostError(NanoflowError):   # no RuntimeError: an `except RuntimeError` must not take it for a bug of torch's
    """Another process of the run went away under torchrun (its node lost, its worker killed): the connection to
    it broke in a collective. Nothing after the last committed checkpoint was saved; the same command resumes."""

    exit_status = EXIT_STOPPED


# Every error class above, by name, with the status it ends a command with.
CATALOGUE = {name: value.exit_status for name, value in dict(globals()).items()
             if isinstance(value, type) and issubclass(value, NanoflowError)}
