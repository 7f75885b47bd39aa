"""Restarts that resume themselves, in real torchrun processes (gloo on CPU): a worker killed by SIGKILL
mid-run is restarted by `torchrun --max-restarts`, resumes from the latest committed checkpoint and ends
bit-identical to an uninterrupted run; and two launchers on one machine ("nodes" on loopback, c10d
rendezvous) train dp=2 together, bit-identical to one launcher's dp=2 run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from helpers import REPO, TINY
from process_helpers import TORCHRUN, bin_command

from nanoflow import io
from nanoflow.commands.verify import first_difference

pytestmark = pytest.mark.slow

STEPS = 40   # ~50 ms a step at dp=2 on an idle CPU: the kill lands well before the end even when polled slowly
KILL_AFTER = 6   # the kill comes once this step is in metrics.jsonl: after the checkpoint of step 4, mid-interval
COMMON = [f"tokens.train_steps={STEPS}", "checkpoints.checkpoint_interval=4", "parallelism.dp=2"]
TIMEOUT = 300    # per launch, generous for a loaded machine; a hung run is killed, never left behind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(run_dir: Path, log: Path, *launcher: str) -> subprocess.Popen:
    """torchrun `launcher` … bin/train tiny dp=2 into run_dir, its output (both streams) into `log`."""
    sets = [a for o in [*COMMON, f'checkpoints.checkpoints_path="{run_dir}"'] for a in ("--set", o)]
    # LOGLEVEL=INFO: torchrun says when it restarts the worker group. PYTHONFAULTHANDLER: a worker that dies of a
    # signal prints its Python stacks.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "LOGLEVEL": "INFO",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        return subprocess.Popen(bin_command("train", TINY, *sets, launcher=(*TORCHRUN, *launcher)), cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (torchrun starts each worker in a session of its own, so a process group
    does not reach them)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def worker_of_rank(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of the bin/train worker with RANK=`rank` among the launcher's children, if it runs now."""
    for pid in children(launcher.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def stop(*launchers: subprocess.Popen) -> None:
    """Kill the launchers and every process they started (by pid), if still running, and reap the launchers."""
    for launcher in launchers:
        for pid in [*descendants(launcher.pid), launcher.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()


def finish(launcher: subprocess.Popen, log: Path) -> str:
    """Wait for the launcher to end on its own within TIMEOUT; its output. Raises (after killing it all) if it
    does not, or if it fails."""
    try:
        code = launcher.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        stop(launcher)
        pytest.fail(f"torchrun did not finish within {TIMEOUT} s:\n{log.read_text()}")
    output = log.read_text()
    assert code == 0, f"torchrun exited with {code}:\n{output}"
    return output


def steps_logged(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> io.Checkpoint:
    """The uninterrupted run: one launcher, two workers, dp=2; its final checkpoint (weights and AdamW moments)."""
    root = tmp_path_factory.mktemp("reference")
    launcher = torchrun(root / "run", root / "torchrun.log", "--standalone", "--nproc_per_node=2")
    try:
        finish(launcher, root / "torchrun.log")
    finally:
        stop(launcher)
    checkpoint = io.read_checkpoint(str(root / "run"))
    assert checkpoint.metadata["step"] == STEPS
    return checkpoint


def wait_for_kill_point(launcher: subprocess.Popen, run_dir: Path, log: Path) -> None:
    """Until the run under `launcher` has logged KILL_AFTER steps; its torchrun log in the failure if it never does."""
    deadline = time.monotonic() + TIMEOUT
    while steps_logged(run_dir) < KILL_AFTER:
        assert launcher.poll() is None, f"torchrun ended before step {KILL_AFTER}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"step {KILL_AFTER} not reached within {TIMEOUT} s:\n{log.read_text()}"
        time.sleep(0.01)


@pytest.mark.parametrize("rank", [0, 1])   # rank 0 holds the run lock and commits; rank 1 only writes its shards
def test_a_worker_killed_mid_run_is_restarted_and_resumes_exactly(reference, tmp_path, rank):
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    launcher = torchrun(run_dir, log, "--standalone", "--nproc_per_node=2", "--max-restarts=2")
    try:
        wait_for_kill_point(launcher, run_dir, log)
        victim = worker_of_rank(launcher, rank)
        assert victim is not None, f"no worker of rank {rank} under torchrun:\n{log.read_text()}"
        os.kill(victim, signal.SIGKILL)
        killed_after = steps_logged(run_dir)
        assert killed_after < STEPS, "the run was over before the kill: make it longer"
        output = finish(launcher, log)
    finally:
        stop(launcher)
    assert "will restart worker group" in output, output     # torchrun saw the failure and restarted
    resumed = [line for line in output.splitlines() if "resuming from" in line]
    assert len(resumed) == 1, output                         # the restarted workers resumed, once
    step = int(resumed[0].split(": step ")[1].split()[0])
    assert KILL_AFTER - 4 <= step < killed_after, resumed[0]    # the latest committed checkpoint, not step 0
    if rank == 0:  # the killed holder's lock record was left behind: the restarted rank 0 took it over
        assert "taking over" in output and "its process is gone" in output, output
    assert f"step {STEPS}/{STEPS}" in output
    problem = first_difference(io.read_checkpoint(str(run_dir)), reference)
    assert problem is None, problem


def test_a_signal_to_torchrun_saves_and_the_same_command_resumes_exactly(reference, tmp_path):
    """docs/slurm.md's recipe, short of SLURM: the warning signal goes to the launcher, which forwards it
    (--signals-to-handle); the workers save and stop; the requeued job's same command resumes."""
    run_dir = tmp_path / "run"
    launcher = ["--standalone", "--nproc_per_node=2", "--max-restarts=2",
                "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    first = torchrun(run_dir, tmp_path / "first.log", *launcher)
    try:
        wait_for_kill_point(first, run_dir, tmp_path / "first.log")
        first.send_signal(signal.SIGUSR1)
        code = first.wait(TIMEOUT)
    finally:
        stop(first)
    output = (tmp_path / "first.log").read_text()
    assert code != 0 and "will restart worker group" not in output, output   # stopped, not restarted
    stopped = [line for line in output.splitlines() if line.startswith("stopped by SIGUSR1 after step ")]
    assert len(stopped) == 1, output
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert KILL_AFTER <= step < STEPS and (run_dir / "latest.txt").read_text().strip() == str(step)
    second = torchrun(run_dir, tmp_path / "second.log", *launcher)
    try:
        output = finish(second, tmp_path / "second.log")
    finally:
        stop(second)
    assert f"resuming from {run_dir}/{step}: step {step} done" in output, output
    problem = first_difference(io.read_checkpoint(str(run_dir)), reference)
    assert problem is None, problem


def wait_listening(port: int, process, log, timeout: float = 600) -> None:
    """Until something accepts connections on 127.0.0.1:`port` (the store `process` hosts), however busy the machine."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert process.poll() is None, f"the first launcher exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"nothing listens on port {port}: {log.read_text()[-3000:]}"
        time.sleep(0.05)


def test_two_launchers_on_loopback_train_dp2_together(reference, tmp_path):
    run_dir = tmp_path / "run"
    nodes, logs = two_nodes(run_dir, tmp_path, "together")
    try:
        outputs = [finish(node, log) for node, log in zip(nodes, logs, strict=True)]
    finally:
        stop(*nodes)
    for node, output in enumerate(outputs):   # each launcher was one node of two (torchrun's own report)
        assert "group_world_size=2" in output and f"group_rank={node}" in output, output
    assert sum(f"step {STEPS}/{STEPS}" in output for output in outputs) == 1   # rank 0 reports, on one of them
    problem = first_difference(io.read_checkpoint(str(run_dir)), reference)
    assert problem is None, problem
    meta = io.read_metadata(str(run_dir))
    assert meta["topology"] == {"dp": 2, "tp": 1, "world_size": 2}


def two_nodes(run_dir: Path, tmp_path: Path, name: str) -> tuple[list[subprocess.Popen], list[Path]]:
    """Two launchers on loopback (c10d rendezvous, one worker each) training dp=2 into run_dir."""
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id={rdzv_id}", "--local-addr=127.0.0.1"]
    logs = [tmp_path / f"{name}-node0.log", tmp_path / f"{name}-node1.log"]
    nodes = [torchrun(run_dir, logs[0], *launcher)]
    try:
        wait_listening(port, nodes[0], logs[0])   # the first launcher hosts the rendezvous store; the second joins it
    except BaseException:
        stop(*nodes)
        raise
    nodes.append(torchrun(run_dir, logs[1], *launcher))
    return nodes, logs


@pytest.mark.parametrize("lost", [1, 0])   # node 0 hosts the rendezvous store and rank 0 (the lock, the commits)
def test_losing_a_node_ends_the_survivor_with_one_line_and_a_requeue_status_and_the_rerun_resumes(
        reference, tmp_path, lost):
    from nanoflow.errors import EXIT_STOPPED

    run_dir = tmp_path / "run"
    nodes, logs = two_nodes(run_dir, tmp_path, "first")
    try:
        wait_for_kill_point(nodes[0], run_dir, logs[0])
        stop(nodes[lost])                                       # its agent and its worker, SIGKILL: the node is gone
        survivor, log = nodes[1 - lost], logs[1 - lost]
        try:
            survivor.wait(TIMEOUT)                              # it ends on its own, never hangs
        except subprocess.TimeoutExpired:
            pytest.fail(f"the survivor did not end within {TIMEOUT} s:\n{log.read_text()}")
    finally:
        stop(*nodes)
    output = log.read_text()
    # No traceback of the worker's (torch prints an uncaught one with "[rank0]:" before each line), no gloo message;
    # torchrun's own report of a failed worker (its ChildFailedError) is the launcher's, and says the exit code.
    assert not [line for line in output.splitlines() if line.startswith("[rank")], output
    assert "pair.cc" not in output and "gloo" not in output.lower(), output
    said = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "lost" in said[0] and "run the same command again" in said[0], output
    assert f"exitcode  : {EXIT_STOPPED}" in output, output   # torchrun's report: the worker's status, requeue-able
    committed = int((run_dir / "latest.txt").read_text())
    assert committed >= 4
    nodes, logs = two_nodes(run_dir, tmp_path, "rerun")
    try:
        outputs = [finish(node, log) for node, log in zip(nodes, logs, strict=True)]
    finally:
        stop(*nodes)
    assert any(f"resuming from {run_dir}/{committed}: step {committed} done" in o for o in outputs), outputs
    problem = first_difference(io.read_checkpoint(str(run_dir)), reference)
    assert problem is None, problem
