"""Running bin/* as a real process (the one way the tests start a command), under torchrun too, and
signalling it at a moment the test chooses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO, TINY

PYTHON = sys.executable
TORCHRUN = (PYTHON, "-m", "torch.distributed.run")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def bin_command(name: str, *args, launcher=(PYTHON,)) -> list[str]:
    """The argv of bin/NAME with `args`, under `launcher` (this interpreter, or TORCHRUN and its options)."""
    return [*launcher, str(REPO / "bin" / name), *map(str, args)]


def run_command(name: str, *args, env: dict | None = None, cwd: Path | str = REPO, timeout: float = 600,
                launcher=(PYTHON,)) -> subprocess.CompletedProcess:
    """Run bin/NAME to its end in `cwd`, with this process's environment and `env` on top (a variable set to None
    there is removed); stdout and stderr are captured as text."""
    environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run(bin_command(name, *args, launcher=launcher), cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=timeout)


def without_reading_rights() -> tuple[str, ...]:
    """A launcher under which a file of mode 000 cannot be read: as root, root without the capabilities that let it
    read anything (setpriv); as anyone else, nothing more."""
    if os.geteuid() != 0:
        return (PYTHON,)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        import pytest

        pytest.skip("root reads any file; setpriv (util-linux) would drop that right, and is not installed")
    drop = "-dac_override,-dac_read_search"
    return (setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", PYTHON)


def sets(*overrides: str) -> list[str]:
    """`--set KEY=VALUE` for each override."""
    return [a for o in overrides for a in ("--set", o)]


def train_args(run: Path | str, *overrides: str, config: Path | str = TINY) -> list[str]:
    """bin/train's arguments for `config` (tiny.toml) writing its checkpoints to `run`, with `overrides`."""
    return [str(config), *sets(f"checkpoints.checkpoints_path={json.dumps(str(run))}", *overrides)]


def with_dispositions(ignored=()):
    """A preexec_fn that starts the child with every stop signal at its default disposition but those in
    `ignored` (SIG_IGN): what a test means to test, not whatever pytest inherited (a background job of a
    non-interactive shell ignores SIGINT)."""
    def preexec():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN if s in ignored else signal.SIG_DFL)
    return preexec


def signal_when_ready(command: list[str], ready, signum: int, *, cwd, env=None, timeout: float = 600, ignored=(),
                      confirm=None):
    """Start `command` (its stop signals at their default disposition, but `ignored`), poll ready(process)
    until it is true (the process still running, within `timeout` seconds), send `signum`, and wait for the
    end: (returncode, stdout, stderr). Never leaves it running.

    With `confirm`, the process is frozen (SIGSTOP) once ready, and confirm(process) decides, while nothing
    can move, whether this is the moment: if not, it is thawed and polling goes on. That closes the race
    between seeing a state and signalling in it (a busy machine may let the process run on in between)."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=with_dispositions(ignored))
    try:
        deadline = time.monotonic() + timeout
        while True:
            while not ready(process):
                assert process.poll() is None, f"{command[1]} exited early: {process.communicate()}"
                assert time.monotonic() < deadline, f"{command[1]} was not ready within {timeout} s"
                time.sleep(0.02)
            if confirm is None:
                break
            process.send_signal(signal.SIGSTOP)
            if confirm(process):
                break
            process.send_signal(signal.SIGCONT)
            assert time.monotonic() < deadline, f"{command[1]} was not confirmed ready within {timeout} s"
            time.sleep(0.02)
        # Popen.send_signal does nothing to a process that has ended: say so, rather than assert on a run
        # that never got the signal
        assert process.poll() is None, f"{command[1]} ended before the signal was sent: {process.communicate()}"
        process.send_signal(signum)
        if confirm is not None:
            process.send_signal(signal.SIGCONT)   # a stopped process acts on the signal once it runs again
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, stdout, stderr


# tiny.toml on every parallel layout: global batch 8 = micro 2 × accumulation × dp (the accumulation derived
# from the stated global batch), the SFT stage out of reach. adam_eps = 1e-6: AdamW's first updates are
# lr·g/(|g| + eps), so with the default 1e-8 a gradient element within rounding of 0 turns the different
# summation order of another layout into an update difference of up to lr·Δg/eps (well above 1e-5 for
# some data: it was seen while tiny trained on the repository's own, ever-changing sources); 1e-6 bounds it far
# below the tolerance, and every layout runs the same optimizer.
LAYOUT_STEPS = 4
COMMON = [f"tokens.train_steps={LAYOUT_STEPS}", "data_stages.sft.start_training_step=100", "tokens.micro_batch_size=2",
          "tokens.global_batch_size=8", "data_stages.sft.micro_batch_size=2", "checkpoints.checkpoint_interval=2",
          "optimizer.optimizer_factory.adam_eps=1e-6"]
LAYOUTS = {  # name: (dp, tp, tp_mode); REDUCE_SCATTER is sequence parallelism
    "dp1": (1, 1, "ALL_REDUCE"), "dp2": (2, 1, "ALL_REDUCE"), "tp2": (1, 2, "ALL_REDUCE"),
    "dp2tp2": (2, 2, "ALL_REDUCE"), "dp4": (4, 1, "ALL_REDUCE"),
    "tp2sp": (1, 2, "REDUCE_SCATTER"), "dp2tp2sp": (2, 2, "REDUCE_SCATTER"),
}


def layout_overrides(layout: str) -> list[str]:
    dp, tp, mode = LAYOUTS[layout]   # the accumulation follows from global_batch_size
    return [f"parallelism.dp={dp}", f"parallelism.tp={tp}", f'parallelism.tp_mode="{mode}"']


def run_layout(layout: str, run: Path, *overrides: str, script: str | None = None, args=(),
               timeout: float = 600) -> subprocess.CompletedProcess:
    """bin/train on tiny.toml in `layout` with COMMON and `overrides`, its checkpoints in `run`, under torchrun
    (this interpreter alone for one process); or the Python `script` (relative to the repository) with `args`."""
    dp, tp, _ = LAYOUTS[layout]
    launcher = (*TORCHRUN, "--nproc_per_node", str(dp * tp)) if dp * tp > 1 else (PYTHON,)
    # PYTHONFAULTHANDLER: a worker that dies of a signal prints every thread's Python stack in the failure report.
    env = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    if script is None:
        return run_command("train", *train_args(run, *COMMON, *layout_overrides(layout), *overrides),
                           launcher=launcher, env=env, timeout=timeout)
    return subprocess.run([*launcher, str(REPO / script), *map(str, args)], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def assert_every_rank_reports(stderr: str, message: str, ranks: int = 2) -> None:
    """Under torchrun, each of `ranks` workers said `message`, except those torchrun itself stopped once a first
    rank had failed (it sends the others SIGTERM at once: one that had not reached its report yet never makes it,
    whatever nanoflow does). At least one rank said it, and none fell silent any other way."""
    said, stopped = stderr.count(message), stderr.count(" closing signal SIGTERM")
    assert said >= 1 and said + stopped >= ranks, (said, stopped, stderr)


def run_in_process(name: str, *args, capsys) -> subprocess.CompletedProcess:
    """bin/NAME's work in this process, for a test of what the command decides rather than of the process: its main
    function on `args`, its exit status and what it printed (read through pytest's capsys)."""
    from nanoflow.commands import cli

    capsys.readouterr()   # what the test printed before is not the command's
    status = getattr(cli, name.replace("-", "_") + "_main")([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([name, *map(str, args)], status, out, err)
