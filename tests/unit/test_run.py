"""nanoflow.run: the run's fixed facts are worked out once (open_run) and handed on, never worked out again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import REPO, quiet, tiny

from nanoflow import Checkpointer
from nanoflow.config import ConfigError
from nanoflow.data import TokenizerError
from nanoflow.parallel.mesh import SINGLE
from nanoflow.run import Run, as_run, open_run

PACKAGE = REPO / "nanoflow"


def calls_of(attribute: str, owner: str) -> list[str]:
    """Each `owner.attribute(...)` call in nanoflow's source, as "path:line"."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attribute
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == owner):
                found.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}")
    return found


def test_the_schedule_is_built_by_open_run_and_the_config_checks_alone():
    sites = calls_of("from_config", "Schedule")   # found in both: a walk that found nothing would fail here
    assert {site.partition(":")[0] for site in sites} == {"run.py", "config/checks.py"}, sites
    assert len([s for s in sites if s.startswith("run.py")]) == 1


def test_remote_is_asked_in_one_place():
    # Any spelling of the bare separator counts ("://" in, not in, partition("://")): the question is asked once.
    spelled = [f"{path.relative_to(PACKAGE)}" for path in PACKAGE.rglob("*.py")
               if '"://"' in path.read_text() or "'://'" in path.read_text()]
    assert spelled == ["io/store.py"]


def test_a_missing_init_from_is_refused_when_the_run_opens(tmp_path):
    with pytest.raises(ConfigError, match=f"model.init_from: {tmp_path / 'absent'} does not exist"):
        open_run(tiny(tmp_path, f'model.init_from="{tmp_path / "absent"}"'), join=False)


def test_open_run_without_joining_is_a_single_process_and_checks_the_tokenizer(tmp_path):
    run = open_run(tiny(tmp_path), join=False)
    assert run.topology is SINGLE and run.schedule.train_steps == 12 and as_run(run) is run
    with pytest.raises(TokenizerError, match="model.vocab_size = 100 is smaller than the tokenizer's vocabulary"):
        open_run(tiny(tmp_path, "model.vocab_size=100"), join=False)


def test_the_run_folder_is_the_local_checkpoints_path_or_keyed_by_the_s3_place(tmp_path):
    local = open_run(tiny(tmp_path / "here"), join=False)
    assert local.folder == tmp_path / "here" and not local.is_remote
    remote = Run(tiny("s3://bucket/team/run-1/"), local.schedule, local.tokenizer)
    assert remote.folder == Path("runs", "s3", "bucket", "team", "run-1") and remote.is_remote


def test_the_runs_fingerprints_are_one_object_shared_by_its_checkpointer(tmp_path):
    run = open_run(tiny(tmp_path), join=False)
    assert run.fingerprints is run.fingerprints
    assert Checkpointer(run, out=quiet()).run.fingerprints is run.fingerprints


def decisions(function: ast.FunctionDef) -> int:
    """The branch points of a function: if/for/while/except/with-less conditionals and each extra and/or."""
    count = 0
    for node in ast.walk(function):
        if isinstance(node, (ast.If, ast.For, ast.While, ast.ExceptHandler, ast.IfExp, ast.comprehension)):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
    return count


def test_the_training_loop_is_short_and_linear():
    tree = ast.parse((PACKAGE / "training" / "loop.py").read_text())
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "run_loop")
    assert 1 + decisions(loop) < 8   # its cyclomatic complexity: stop, save and storage rules live elsewhere


def test_the_start_up_sequence_is_one_function_in_its_documented_order():
    tree = ast.parse((PACKAGE / "training" / "loop.py").read_text())
    sequence = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "open_training")
    calls = [node.func.id if isinstance(node.func, ast.Name) else node.func.attr
             for node in sorted((n for n in ast.walk(sequence) if isinstance(n, ast.Call)),
                                key=lambda n: (n.lineno, n.col_offset))
             if isinstance(node.func, ast.Name | ast.Attribute)]   # in the order they are written
    order = ["load_config", "as_run", "locked", "restore", "_prepare_folder", "Training"]
    assert [name for name in calls if name in order] == order   # docs/design.md, "Shape", lists the same order
    assert 1 + decisions(sequence) < 5   # read top to bottom: no branch but a path's loading and a run already done


# ---------------------------------------------------------------------------------------------
# The intra-op thread count nanoflow chooses (nanoflow.parallel.threads; issue 30, item 23)

@pytest.mark.parametrize("available, cpus, load, expected", [
    (2, 2, 0.1, 2),     # two idle cores: both
    (2, 2, 1.0, 1),     # the other core busy
    (2, 2, 4.3, 1),     # both busy (the case the issue measured): one, never none
    (16, 16, 0.0, 16),
    (4, 64, 32.0, 2),   # four CPUs of a half-busy 64-CPU host
    (1, 8, 0.0, 1),
])
def test_the_count_is_the_available_cpus_the_load_leaves_idle(available, cpus, load, expected):
    from nanoflow.parallel.threads import count_for
    assert count_for(available, cpus, load) == expected


def test_available_cpus_are_the_affinity_within_a_cgroup_quota(monkeypatch):
    from nanoflow.parallel import threads
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    files = {}

    def read(path):
        if path not in files:
            raise FileNotFoundError(path)
        return files[path]

    monkeypatch.setattr(threads, "_read", read)
    assert threads._cgroup_quota() is None and threads.available_cpus() == 6
    for cpu_max, quota, available in [("max 100000", None, 6), ("250000 100000", 2.5, 3), ("150000 100000", 1.5, 2)]:
        files["/sys/fs/cgroup/cpu.max"] = cpu_max   # cgroup v2; docker run --cpus 2.5 writes "250000 100000"
        assert threads._cgroup_quota() == quota
        assert threads.available_cpus() == available
    del files["/sys/fs/cgroup/cpu.max"]
    files.update({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "100000", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"})
    assert threads._cgroup_quota() == 1.0 and threads.available_cpus() == 1   # cgroup v1


def test_nanoflow_chooses_only_for_a_front_end_and_never_over_omp_num_threads(monkeypatch):
    from nanoflow.parallel import threads
    monkeypatch.setattr(threads, "_choosing", False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert not threads.chosen()                 # a library user's count is theirs
    threads.choose_by_default()
    assert threads.chosen()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert not threads.chosen()                 # the user's
    assert threads.choose(5)[0] == 5            # a resumed run's count, when nanoflow chooses
