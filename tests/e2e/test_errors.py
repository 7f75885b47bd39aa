"""User errors end as one message and a documented exit status, never a traceback, and lose nothing.

The front ends run as real subprocesses (bin/*); every run writes into pytest's tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import EOS, stage, write_config, write_folder
from helpers import REPO, quiet, tiny
from helpers import TINY as TINY_FILE
from process_helpers import bin_command, run_command, signal_when_ready, with_dispositions, without_reading_rights

from nanoflow import errors, load_config
from nanoflow.commands import cli
from nanoflow.config import ConfigError
from nanoflow.config.load import looks_local
from nanoflow.schedule import Schedule

TINY = str(TINY_FILE.relative_to(REPO))   # as typed at the repository root, where bin/* run here


def run_arg(path: Path) -> list[str]:
    return ["--set", f"checkpoints.checkpoints_path={json.dumps(str(path))}"]


def assert_clean_failure(result: subprocess.CompletedProcess, status: int, *culprits: str) -> None:
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    assert "error:" in result.stderr or "interrupted:" in result.stderr, result.stderr
    for culprit in culprits:
        assert culprit in result.stderr, (culprit, result.stderr)


def checkpoint_bytes(run_folder: Path, step: int) -> dict[str, str]:
    """Every file of one step folder, by its sha256."""
    folder = run_folder / str(step)
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def committed_step(run_folder: Path) -> int:
    return int((run_folder / "latest.txt").read_text())


# ---------------------------------------------------------------------------------------------
# One mapping for every front end

class _Diverged(errors.NanoflowError):
    exit_status = errors.EXIT_DIVERGED


@pytest.mark.parametrize("error, status", [(ConfigError("bad key"), errors.EXIT_BAD_INPUT),
                                           (_Diverged("loss is nan"), errors.EXIT_DIVERGED),
                                           (KeyboardInterrupt(), errors.EXIT_INTERRUPTED)])
def test_guarded_turns_an_error_into_its_status_and_one_message(error, status, capsys):
    def work():
        raise error

    assert cli.guarded(work, where="run.toml") == status
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    if isinstance(error, errors.NanoflowError):
        assert err == f"error: run.toml: {error}\n"
    else:
        assert err.startswith("interrupted: stopped at once, without saving")


def test_guarded_prints_nanoflow_messages_as_plain_lines(capsys):
    def work():
        logging.getLogger("nanoflow.io.checkpoint").warning("runs/x: using runs/x/4; skipped: runs/x/8 is incomplete")
        logging.getLogger("nanoflow.training.loop").info("saved step 4: runs/x/4")
        logging.getLogger("someone.else").warning("someone else's")
        return 0

    assert cli.guarded(work) == 0
    out, err = capsys.readouterr()
    assert out == "warning: runs/x: using runs/x/4; skipped: runs/x/8 is incomplete\nsaved step 4: runs/x/4\n"
    assert "someone else's" not in out   # not ours: left to the logging setup of whoever logged it


@pytest.mark.parametrize("front_end", ["export", "report", "prepare", "verify-resume", "train",
                                       "convert-nanotron-config", "preview"])
def test_every_front_end_exits_2_with_a_message_naming_the_culprit(tmp_path, front_end):
    missing = str(tmp_path / "no_such_thing")
    args = {"export": [missing, str(tmp_path / "out")],
            "report": [missing],
            "prepare": [missing + ".txt", "--output", str(tmp_path / "tokens")],
            "verify-resume": [TINY, "--set", "tokens.trian_steps=3"],
            "train": [TINY, "--plan", "--set", "model.dtype=bf16"],
            "convert-nanotron-config": [missing + ".yaml"],
            "preview": [TINY, "--set", "tokens.document_masking=yes"]}[front_end]
    culprit = {"verify-resume": "trian_steps", "train": "model.dtype", "preview": "tokens.document_masking"}.get(
        front_end, "no_such_thing")
    assert_clean_failure(run_command(front_end, *args), errors.EXIT_BAD_INPUT, culprit)


@pytest.mark.slow
def test_storage_lost_mid_run_exits_4_and_the_committed_checkpoint_stands(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "4").write_text("a file where step 4's folder must go: its save fails")
    result = run_command("train", TINY, *run_arg(folder), "--set", "checkpoints.checkpoint_interval=2")
    assert_clean_failure(result, errors.EXIT_STORAGE, f"{folder}/4", "the last committed checkpoint stands: run "
                                                                     "the same command again to resume")
    assert "saved step 2:" in result.stdout and committed_step(folder) == 2
    intact = checkpoint_bytes(folder, 2)
    assert intact and (folder / "4").is_file()

    again = run_command("train", TINY, *run_arg(folder), "--set", "checkpoints.checkpoint_interval=2")
    assert_clean_failure(again, errors.EXIT_STORAGE)
    assert f"resuming from {folder}/2" in again.stdout
    assert checkpoint_bytes(folder, 2) == intact and committed_step(folder) == 2


@pytest.mark.slow
def test_storage_unreadable_before_the_first_step_exits_2(tmp_path):
    (tmp_path / "notes.txt").write_text("a file where the run folder's parent must be")
    folder = tmp_path / "notes.txt" / "run"   # cannot be created, so nothing can be read or written there
    result = run_command("train", TINY, *run_arg(folder))
    assert_clean_failure(result, errors.EXIT_BAD_INPUT, str(folder))
    assert "step 1/" not in result.stdout and not (folder / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# A bad sample found mid-run

@pytest.mark.slow
def test_a_bad_sample_mid_run_saves_nothing_and_names_stage_sample_and_file(tmp_path):
    # One token id beyond the vocabulary deep in the file: start-up's checks do not reach it, the batch that
    # reads it does, steps into the run.
    tokens = tmp_path / "tokens"
    write_folder(tokens, [np.full(70_000, 7), np.array([9, 290, EOS]), np.full(100, 8)])
    config = write_config(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(tokens)})], sequence_length=64,
                          micro_batch_size=8, accumulation=1, train_steps=150, seed=7)  # seed 7: the bad
    # sample comes in step 10
    command = [str(config), "--set", "checkpoints.checkpoint_interval=1", "--set", "checkpoints.keep=2"]
    folder = tmp_path / "checkpoints"

    result = run_command("train", *command)
    assert_clean_failure(result, errors.EXIT_BAD_INPUT, 'stage "pretrain": sample', "00000_unshuffled.ds",
                         "token id 290 is outside model.vocab_size = 288")
    last = committed_step(folder)
    assert 1 < last < 150, result.stdout
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 1))          # the failing step trained nothing, and saved nothing
    assert not (folder / str(last + 1)).exists()
    intact = checkpoint_bytes(folder, last)

    again = run_command("train", *command)                 # the rerun resumes, meets the same sample, fails the same
    assert_clean_failure(again, errors.EXIT_BAD_INPUT, "token id 290")
    assert f"resuming from {folder}/{last}: step {last} done" in again.stdout
    assert committed_step(folder) == last and checkpoint_bytes(folder, last) == intact


def test_a_token_file_cut_short_under_the_loader_is_a_data_error_not_a_crash(tmp_path):
    from data_helpers import BYTES, documents, load

    from nanoflow.data import SampleReadError, open_stage

    write_folder(tmp_path / "tokens", documents(np.random.default_rng(0), 3000, 0, 200), files=2)
    config = load(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(tmp_path / "tokens")})], sequence_length=64,
                  micro_batch_size=8, accumulation=1)
    with open_stage(config, 0, BYTES, Schedule.from_config(config)) as loader:
        loader.batch_at(1)
        for path in (tmp_path / "tokens").glob("*.ds"):   # a mapped file read past its new end would be SIGBUS
            os.truncate(path, path.stat().st_size // 3)
        with pytest.raises(SampleReadError, match=r'stage "pretrain": sample \d+ \(dataset_folder .*tokens.*\): '
                                            r'TokenFolderError: .*_unshuffled\.ds: \d+ bytes now, \d+ when the run '
                                            r'opened it: the file changed under the run'):
            for step in loader.steps[1:]:
                loader.batch_at(step)


@pytest.mark.slow
def test_a_token_file_cut_short_mid_run_exits_2_and_keeps_the_checkpoint(tmp_path):
    from data_helpers import documents

    tokens = tmp_path / "tokens"
    write_folder(tokens, documents(np.random.default_rng(0), 3000, 0, 200), files=2)
    config = write_config(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(tokens)})], sequence_length=64,
                          micro_batch_size=8, accumulation=1, train_steps=400)
    folder = tmp_path / "checkpoints"
    process = subprocess.Popen(bin_command("train", str(config), "--set", "checkpoints.checkpoint_interval=2"),
                               cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        while "saved step 2:" not in (line := process.stdout.readline()):
            assert line, process.communicate()
        intact = checkpoint_bytes(folder, 2)
        for path in tokens.glob("*.ds"):
            os.truncate(path, path.stat().st_size // 3)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert_clean_failure(result, errors.EXIT_BAD_INPUT, 'stage "pretrain": sample', "_unshuffled.ds",
                         "changed under the run")
    assert committed_step(folder) == 2 and checkpoint_bytes(folder, 2) == intact
    assert "saved step" not in stdout


# ---------------------------------------------------------------------------------------------
# Enum typos: the allowed values and the nearest one


# ---------------------------------------------------------------------------------------------
# Files the user cannot read (as root, the launcher drops the capabilities that let root read anything)

def _token_run(tmp_path: Path, train_steps: int = 4) -> tuple[Path, Path]:
    from data_helpers import documents

    tokens = tmp_path / "tokens"
    write_folder(tokens, documents(np.random.default_rng(0), 300, 0, 200), files=2)
    config = write_config(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(tokens)})], train_steps=train_steps)
    return config, tokens


@pytest.mark.parametrize("suffix", [".ds", ".ds.index", ".ds.metadata"])
def test_a_token_file_the_user_cannot_read_is_one_line_naming_it(tmp_path, suffix):
    config, tokens = _token_run(tmp_path)
    unreadable = tokens / f"00001_unshuffled{suffix}"
    unreadable.chmod(0)
    for extra in ([], ["--plan"]):   # --plan opens the folder as the run's start-up does
        result = run_command("train", config, *extra, cwd=tmp_path, launcher=without_reading_rights())
        assert_clean_failure(result, errors.EXIT_BAD_INPUT, f"{unreadable}: cannot be read: Permission denied")
        assert result.stderr.strip().splitlines()[-1].startswith("error:"), result.stderr
        assert "error:" not in "".join(result.stderr.strip().splitlines()[:-1]), result.stderr
    assert not (tmp_path / "checkpoints" / "latest.txt").exists()


def test_plan_finds_a_hub_name_that_is_no_cached_set_and_tokenizes_nothing(tmp_path):
    # Offline, as on a cluster node: a name that is no builder, folder or hub set in the cache stops the run at
    # start-up, so --plan says so; a good plan reads the first rows only (no token cache is written).
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache"),
               "HF_HOME": str(tmp_path / "hf")}
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(200)))
    rows = stage("pretrain", 1, {"hf_dataset_or_datasets": "json", "hf_data_files": str(tmp_path / "rows.jsonl")})
    typo = stage("web", 3, {"hf_dataset_or_datasets": "jsno", "hf_data_files": str(tmp_path / "rows.jsonl")})
    config = write_config(tmp_path, [rows, typo], train_steps=6)
    result = run_command("train", config, "--plan", cwd=tmp_path, env=offline)
    assert_clean_failure(result, errors.EXIT_BAD_INPUT, 'stage "web" (dataset jsno): cannot load \'jsno\'',
                         "HF_DATASETS_OFFLINE is set")
    assert result.stdout == ""
    good = run_command("train", write_config(tmp_path, [rows], train_steps=6, name="good.toml"), "--plan",
                       cwd=tmp_path, env=offline)
    assert good.returncode == 0 and "opening stage \"pretrain\" (json files" in good.stderr, good.stderr
    assert not list(tmp_path.rglob("nanoflow-tokens"))   # nothing tokenized


def test_a_token_file_unreadable_at_a_resume_is_one_line_naming_it(tmp_path):
    config, tokens = _token_run(tmp_path)
    first = run_command("train", config, "--until-step", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    unreadable = tokens / "00000_unshuffled.ds"
    unreadable.chmod(0)   # the resume hashes it (the data fingerprint) before the stage opens
    result = run_command("train", config, cwd=tmp_path, launcher=without_reading_rights())
    assert_clean_failure(result, errors.EXIT_BAD_INPUT, f"{unreadable}: cannot be read: Permission denied")
    assert committed_step(tmp_path / "checkpoints") == 2


@pytest.mark.parametrize("name", ["notes.txt", "docs.jsonl"])
def test_a_prepare_input_the_user_cannot_read_is_one_line_naming_it(tmp_path, name):
    path = tmp_path / name
    path.write_text('{"text": "hello"}\n' if name.endswith(".jsonl") else "hello\n")
    path.chmod(0)
    result = run_command("prepare", path, "--output", tmp_path / "out", cwd=tmp_path, launcher=without_reading_rights())
    assert_clean_failure(result, errors.EXIT_BAD_INPUT, f"{path}: cannot be read: Permission denied")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("override, key, nearest", [
    ("optimizer.learning_rate_scheduler.lr_decay_style=cosin", "lr_decay_style", "cosine"),
    ("optimizer.learning_rate_scheduler.lr_warmup_style=linar", "lr_warmup_style", "linear"),
    ("model.dtype=bf16", "model.dtype", "bfloat16"),
    ("parallelism.tp_mode=ALLREDUCE", "parallelism.tp_mode", "ALL_REDUCE"),
    ("parallelism.tp_mode=reduce_scatter", "parallelism.tp_mode", "REDUCE_SCATTER"),
])
def test_an_enum_typo_names_the_key_the_allowed_values_and_the_nearest(override, key, nearest):
    with pytest.raises(ConfigError) as caught:
        load_config(REPO / TINY, [override])
    message = str(caught.value)
    assert key in message and f"(did you mean {nearest!r}?)" in message, message
    assert "expected one of " in message and "unknown error" not in message and "Literal" not in message
    allowed = message.partition("expected one of ")[2].partition(" (did")[0]
    assert repr(nearest) in allowed.split(", ")


def test_an_enum_value_far_from_every_allowed_one_lists_them_without_a_guess():
    with pytest.raises(ConfigError, match=r"lr_decay_style: 'zzz' is not allowed: expected one of 'linear', "
                                          r"'cosine', '1-sqrt', 'constant'$"):
        load_config(REPO / TINY, ["optimizer.learning_rate_scheduler.lr_decay_style=zzz"])


# ---------------------------------------------------------------------------------------------
# A mistyped local data path: an error at once, never minutes of hub retries

def test_what_looks_like_a_local_path(tmp_path):
    (tmp_path / "data").mkdir()
    for name in ("data/arithmetc.jsonl", "corpus.txt", "./corpus", "a/b/c", "/abs/path", "data/*.txt",
                 "data/myset", "~/corpus"):
        assert looks_local(name, tmp_path), name
    for name in ("HuggingFaceFW/fineweb", "wikitext", "allenai/c4"):   # hub ids: "name" or "namespace/name"
        assert not looks_local(name, tmp_path), name


@pytest.mark.parametrize("case", ["name", "blend-key", "hub-name-with-files"])
def test_a_mistyped_local_path_is_an_immediate_error_naming_stage_and_path(tmp_path, case):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "arithmetic.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    dataset = {"name": {"hf_dataset_or_datasets": "data/arithmetc.jsonl", "prompt_column_name": "prompt",
                        "completion_column_name": "completion"},
               "blend-key": {"hf_dataset_or_datasets": {"data/arithmetic.jsonl": 1.0, "data/arithmetc.jsonl": 1.0},
                             "prompt_column_name": "prompt", "completion_column_name": "completion"},
               "hub-name-with-files": {"hf_dataset_or_datasets": "someone/dataset",
                                       "hf_data_files": "data/arithmetc.jsonl"}}[case]
    config = write_config(tmp_path, [stage("sft", 1, dataset)])
    started = time.monotonic()
    result = run_command("train", str(config), "--plan", env={"HF_DATASETS_OFFLINE": "0", "HF_HUB_OFFLINE": "0"})
    assert_clean_failure(result, errors.EXIT_BAD_INPUT, 'stage "sft"', str(tmp_path / "data" / "arithmetc.jsonl"))
    assert time.monotonic() - started < 20            # no hub retries (they took ~23 s before any message)
    assert not (tmp_path / "checkpoints").exists()


def test_the_hub_is_not_tried_for_a_missing_absolute_path(tmp_path):
    from nanoflow.config import DatasetArgs
    from nanoflow.data.hf_datasets import hf_specs, load_rows
    from nanoflow.data.tokens import StageDataError

    missing = str(tmp_path / "nowhere" / "set")
    with pytest.raises(StageDataError, match=f'stage "sft".*{missing} does not exist'):
        load_rows(DatasetArgs(hf_dataset_or_datasets=missing), "sft")
    with pytest.raises(StageDataError, match=f'stage "sft".*hf_data_files: {tmp_path}/x.jsonl matches no file'):
        load_rows(hf_specs(DatasetArgs(hf_dataset_or_datasets="someone/dataset",
                                       hf_data_files=str(tmp_path / "x.jsonl")))[0], "sft")


# ---------------------------------------------------------------------------------------------
# Stops: Ctrl-C at start-up, a signal after saving, a finished run, --fresh

def _big_text_config(tmp_path: Path) -> Path:
    """A run whose start-up (tokenizing a 40 MB text file) takes seconds, and says so before it begins."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "big.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 1_000_000)
    return write_config(tmp_path, [stage("pretrain", 1, {"hf_dataset_or_datasets": "text",
                                                         "hf_data_files": str(corpus / "*.txt")}),
                                   stage("late", 500, {"hf_dataset_or_datasets": "text",
                                                       "hf_data_files": str(corpus / "*.txt")})])


@pytest.mark.slow
@pytest.mark.parametrize("signum, status, line", [
    (signal.SIGINT, errors.EXIT_INTERRUPTED, errors.INTERRUPTED),
    (signal.SIGTERM, errors.EXIT_STOPPED, "stopped by SIGTERM during start-up, before any step was trained"),
    (signal.SIGUSR1, errors.EXIT_STOPPED, "stopped by SIGUSR1 during start-up, before any step was trained"),
])
def test_a_signal_during_start_up_stops_at_once_with_one_line(tmp_path, signum, status, line):
    """The child starts with the signal at its default disposition (signal_when_ready), whatever pytest inherited."""
    config = _big_text_config(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}

    def started(process) -> bool:
        # Said just before the data loads and tokenizes, which takes seconds: the signal, sent at once, lands
        # in that start-up.
        first = process.stdout.readline()
        assert 'stage "late" starts after train_steps' in first, first
        return True

    returncode, stdout, stderr = signal_when_ready(bin_command("train", str(config)), started,
                                                   signum, cwd=REPO, env=env)
    assert returncode == status, (stdout, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith(line), stderr
    assert "step 1/" not in stdout and not (tmp_path / "checkpoints" / "latest.txt").exists()


@pytest.mark.slow
def test_a_ctrl_c_inherited_as_ignored_is_ignored_for_the_whole_run(tmp_path):
    """The rule for an inherited SIG_IGN (docs/resume.md, "Signals"): honoured at start-up and in the loop alike."""
    config = _big_text_config(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    process = subprocess.Popen(bin_command("train", str(config), "--set", "logging.iteration_step_info_interval=1"),
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=with_dispositions(ignored=[signal.SIGINT]))
    try:
        assert 'stage "late" starts after train_steps' in process.stdout.readline()
        process.send_signal(signal.SIGINT)   # in start-up
        lines = []
        while not any(line.split()[:2] == ["step", "2/20"] for line in lines):
            line = process.stdout.readline()
            assert line, (lines, process.stderr.read())
            lines.append(line)
        process.send_signal(signal.SIGINT)   # in the loop, twice
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "done: 20 steps" in stdout and "stopped by" not in stdout, stdout


@pytest.mark.slow
def test_a_signal_stop_after_saving_exits_75(tmp_path):
    folder = tmp_path / "run"
    command = bin_command("train", TINY, *run_arg(folder), "--set", "tokens.train_steps=400",
               "--set", "data_stages.sft.start_training_step=390", "--set", "checkpoints.checkpoint_interval=1000")
    metrics = folder / "metrics.jsonl"
    returncode, stdout, stderr = signal_when_ready(
        command, lambda _: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, signal.SIGTERM, cwd=REPO)
    assert returncode == errors.EXIT_STOPPED, (stdout, stderr)
    assert "stopped by SIGTERM" in stdout and "Traceback" not in stderr
    stopped = committed_step(folder)
    assert 2 <= stopped < 400


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_a_signal_just_after_done_leaves_a_finished_run_at_exit_0(tmp_path, signum):
    folder = tmp_path / "run"
    process = subprocess.Popen(bin_command("train", TINY, *run_arg(folder)), cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=with_dispositions())
    try:
        for line in process.stdout:
            if line.startswith("done:"):
                break
        process.send_signal(signum)   # twice: a second Ctrl-C would be an interrupt, were the run not finished
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert line.startswith("done: 12 steps"), line
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "interrupted" not in stderr, stderr
    assert committed_step(folder) == 12


@pytest.mark.slow
def test_a_finished_run_exits_0_and_a_rerun_says_only_nothing_to_do(tmp_path):
    folder = tmp_path / "run"
    finished = run_command("train", TINY, *run_arg(folder))
    assert finished.returncode == 0 and "done: 12 steps" in finished.stdout, finished.stdout + finished.stderr
    again = run_command("train", TINY, *run_arg(folder))
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"nothing to do: {folder}/12 has all 12 steps done"], again.stdout


@pytest.mark.slow
def test_fresh_says_which_checkpoints_it_ignores_and_keeps_them(tmp_path):
    from nanoflow.training.loop import train

    folder = tmp_path / "run"
    # The checkpoints --fresh finds, trained in this process: only the --fresh run is the command under test.
    first = train(tiny(folder, "tokens.train_steps=6", "checkpoints.checkpoint_interval=2"), out=quiet(),
                  progress=False)
    assert first.step == 6
    before = {step: checkpoint_bytes(folder, step) for step in (2, 4, 6)}
    fresh = run_command("train", TINY, *run_arg(folder), "--set", "tokens.train_steps=1", "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    line = next(line for line in fresh.stdout.splitlines() if line.startswith("--fresh"))
    assert f"checkpoints.checkpoints_path = {folder}" in line and "steps 2, 4, 6" in line, line
    assert "not deleted" in line
    assert "resuming" not in fresh.stdout
    assert {step: checkpoint_bytes(folder, step) for step in (2, 4, 6)} == before


@pytest.mark.slow
def test_until_step_is_a_planned_stop_not_a_signal(tmp_path):
    import io as text_io

    from nanoflow.training.loop import train

    out = text_io.StringIO()
    state = train(load_config(REPO / TINY, [f'checkpoints.checkpoints_path="{tmp_path / "run"}"']), until_step=2,
                  out=out, progress=False)
    assert state.step == 2 and committed_step(tmp_path / "run") == 2
    assert "stopped after step 2 of 12 as asked (until_step = 2)" in out.getvalue()
    assert "SIG" not in out.getvalue()
