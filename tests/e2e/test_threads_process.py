"""Intra-op threads (nanoflow.parallel.threads): bin/train chooses a count when a run starts and a resume keeps the
count the run trained with, so that it stays bit for bit; OMP_NUM_THREADS is the user's and only said when it
differs (issue 30, item 23)."""

from __future__ import annotations

import json
import re

import pytest
from process_helpers import run_command, train_args
from run_helpers import assert_same_checkpoint

from nanoflow import io

# tiny.toml widened until one and two threads train different bits (a reduction over more elements than one
# thread's grain), the SFT stage out of reach.
WIDE = ["model.hidden_size=128", "model.intermediate_size=384", "tokens.sequence_length=256",
        "model.max_position_embeddings=256", "tokens.micro_batch_size=8", "tokens.global_batch_size=16",
        "data_stages.sft.start_training_step=100", "tokens.train_steps=4", "checkpoints.checkpoint_interval=2"]


def train(run, *args, threads: int | None):
    result = run_command("train", *train_args(run, *WIDE), *args, env={"OMP_NUM_THREADS": threads and str(threads)})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.mark.slow
def test_a_resume_keeps_the_thread_count_the_run_trained_with_bit_for_bit(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, threads=1)
    train(two, threads=2)
    assert io.read_metadata(str(one))["threads"] == 1 and io.read_metadata(str(two))["threads"] == 2

    # Started with one thread, resumed without OMP_NUM_THREADS: bin/train takes the recorded count, whatever this
    # machine's CPUs and load would choose.
    run = tmp_path / "run"
    train(run, "--until-step", "2", threads=1)
    said = train(run, threads=None)
    assert "intra-op threads: 1, the count the run trained with" in said, said
    assert_same_checkpoint(one / "4", run / "4")

    # Resumed with another count set by the user: taken, and said, since it is not bit for bit.
    other = tmp_path / "other"
    train(other, "--until-step", "2", threads=2)
    said = train(other, threads=1)
    assert ("this run trained with 2 intra-op threads and resumes with 1 (OMP_NUM_THREADS=1): sums split over threads "
            "round differently") in said, said


@pytest.mark.slow
def test_a_fresh_run_without_omp_num_threads_chooses_from_the_cpus_and_load_and_records_it(tmp_path):
    said = train(tmp_path / "run", threads=None)
    found = re.search(r"intra-op threads: (\d+) \((\d+) CPUs? available, load average [\d.]+; OMP_NUM_THREADS sets "
                      r"another count\); a resume keeps it, bit for bit", said)
    assert found, said
    assert 1 <= int(found.group(1)) <= int(found.group(2))
    assert io.read_metadata(str(tmp_path / "run"))["threads"] == int(found.group(1))
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
