"""The root of nanoflow's user-facing errors and the exit status each kind maps to.

bin/* print the message of a NanoflowError (no traceback) and exit with its `exit_status`; any
other exception is a bug and keeps its traceback (exit 1). This module imports nothing, so the pure
modules (schedule.py, config/) can raise these too.
"""

EXIT_DONE = 0
EXIT_BUG = 1            # an exception nanoflow did not expect: a traceback, and an issue to file
EXIT_BAD_INPUT = 2      # a config, data, tokenizer or checkpoint to fix, or a run folder held by another run
EXIT_DIVERGED = 3       # a non-finite loss or gradient norm: stopped before the update, the last good checkpoint kept
EXIT_STORAGE = 4        # storage failed mid-run: what was committed before stands; rerun to resume
EXIT_STOPPED = 75       # stopped by a signal after saving (sysexits' EX_TEMPFAIL): requeue, rerun to resume
EXIT_INTERRUPTED = 130  # a second Ctrl-C: stopped at once without saving (the shell's 128 + SIGINT)

INTERRUPTED = "interrupted: stopped at once, without saving; the last committed checkpoint (if any) is untouched"


def exit_interrupted() -> None:
    """Ctrl-C while bin/* imports nanoflow.commands.cli: the one line and the status of a Ctrl-C at any later moment."""
    import sys
    print(INTERRUPTED, file=sys.stderr)
    raise SystemExit(EXIT_INTERRUPTED)


class NanoflowError(Exception):
    """A problem the user can act on; the message names the file, the stage, the key or the path."""

    exit_status = EXIT_BAD_INPUT
