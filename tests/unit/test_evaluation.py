"""Evaluation (issue 14): fixed eval sets, held-out windows, exact match, eval.jsonl across a kill -9 and a resume,
evaluation that never changes training, bin/eval on run and step folders, and the sharded score on dp=2 / tp=2."""

from __future__ import annotations

import io as text_io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from data_helpers import BYTES
from helpers import REPO, SMALL_MODEL_TOML, TINY
from nanoflow.config import ConfigError, load_config
from nanoflow.build import build_model
from nanoflow.data import write_token_file
from nanoflow.data.loader import StageLoader
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.evaluation import EvalSet, load_eval_set, pick, score
from nanoflow.observe.metrics import MEASURED
from nanoflow.parallel.mesh import SINGLE
from process_helpers import bin_command, run_command, signal_when_ready, TORCHRUN

PYTHON = sys.executable
SUMS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(1, 5) for b in range(1, 3)]

# A two-stage run: packed text that holds its last 10 windows out, then SFT sums; evaluated on both.
CONFIG = SMALL_MODEL_TOML + """
[general]
seed = 3
[tokens]
sequence_length = 32
train_steps = {steps}
micro_batch_size = 2
batch_accumulation_per_replica = 2
[optimizer.learning_rate_scheduler]
learning_rate = 3e-3
[checkpoints]
checkpoints_path = "{run}"
checkpoint_interval = 3
[[data_stages]]
name = "pretrain"
start_training_step = 1
[data_stages.data.dataset]
hf_dataset_or_datasets = "text"
hf_data_files = "corpus.txt"
held_out_samples = 10
[[data_stages]]
name = "sft"
start_training_step = {sft_start}
sequence_length = 16
[data_stages.data.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = "sums.jsonl"
prompt_column_name = "prompt"
completion_column_name = "completion"
"""
EVALUATION = """
[evaluation]
interval = {interval}
[[evaluation.datasets]]
name = "text"
held_out_of = "pretrain"
[[evaluation.datasets]]
name = "sums"
metric = "exact_match"
max_samples = 7
sequence_length = 16
[evaluation.datasets.dataset]
hf_dataset_or_datasets = "json"
hf_data_files = "sums.jsonl"
prompt_column_name = "prompt"
completion_column_name = "completion"
"""


def write_run(folder: Path, *, steps: int = 6, sft_start: int = 5, interval: int | None = 3, run: str = "run",
              evaluation: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}"
                                                 for i in range(300)))
    (folder / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in SUMS))
    text = CONFIG.format(steps=steps, sft_start=sft_start, run=run)
    if evaluation:
        text += EVALUATION.format(interval=interval).replace("interval = None\n", "")
    path = folder / f"{run}.toml"
    path.write_text(text)
    return path


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "OMP_NUM_THREADS": "1"}


def train_process(config: Path, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_command("train", str(config), *extra, env=env(), timeout=timeout)


def eval_process(*args: str, launcher=(PYTHON,), timeout: float = 180) -> subprocess.CompletedProcess:
    return run_command("eval", *args, launcher=launcher, env=env(), timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Held-out samples


def test_held_out_windows_are_never_in_a_training_batch(tmp_path):
    # One document of distinct tokens: a token's value is its position in the stream, so targets name windows.
    stream = np.arange(250)
    write_token_file(tmp_path / "tokens", "00000_unshuffled", [np.append(stream, BYTES.eos_id)],
                     tokenizer_name="bytes", token_size=2)
    path = write_run(tmp_path)
    text = path.read_text().replace('hf_dataset_or_datasets = "text"\nhf_data_files = "corpus.txt"\n'
                                    "held_out_samples = 10",
                                    f'dataset_folder = "{tmp_path / "tokens"}"\nheld_out_samples = 5')
    text = text.replace("sequence_length = 32\ntrain", "sequence_length = 8\ntrain")
    path.write_text(text)
    config = load_config(path, ["tokens.train_steps=40", "data_stages.sft.start_training_step=40"])
    windows = (len(stream) + 1 - 1) // 8                       # 31 windows of 8 targets; the last 5 held out
    trained = set()
    with StageLoader(config, 0, BYTES) as loader:             # every sample of the stage: 39 steps × 4, 6 epochs
        for step in loader.steps:
            for rank in range(2):
                trained.update(loader.batch_at(step, rank, 2)["labels"].flatten().tolist())
    held = load_eval_set(config, config.evaluation.datasets[0], BYTES)
    evaluated = set(held.labels.flatten().tolist())
    assert len(held.labels) == 5
    assert trained.isdisjoint(evaluated)
    assert trained == set(range(1, (windows - 5) * 8 + 1))    # training reads all the rest, and nothing else
    assert evaluated == set(range((windows - 5) * 8 + 1, windows * 8 + 1))


def test_held_out_sft_rows_are_the_last_rows_and_never_trained(tmp_path):
    path = write_run(tmp_path)
    path.write_text(path.read_text().replace('completion_column_name = "completion"\n',
                                             'completion_column_name = "completion"\nheld_out_samples = 3\n', 1)
                    + '[[evaluation.datasets]]\nname = "sums-held"\nheld_out_of = "sft"\nmetric = "exact_match"\n')
    config = load_config(path, ["tokens.train_steps=20"])
    held = load_eval_set(config, config.evaluation.datasets[2], BYTES)
    prompts = {bytes(row[:4].tolist()).decode() for row in held.input_ids}
    assert prompts == {row["prompt"] for row in SUMS[-3:]}
    with StageLoader(config, 1, BYTES) as loader:
        seen = {bytes(row[:4].tolist()).decode() for step in loader.steps for row in loader.batch_at(step)["input_ids"]}
    assert seen == {row["prompt"] for row in SUMS[:-3]}


def test_held_out_samples_enters_the_data_fingerprint(tmp_path):
    from nanoflow.data.fingerprint import fingerprint_changes, stage_fingerprint

    path = write_run(tmp_path)
    with_held = stage_fingerprint(load_config(path), 0, BYTES)
    without = stage_fingerprint(load_config(path, ["data_stages.pretrain.data.dataset.held_out_samples=20"]), 0, BYTES)
    assert fingerprint_changes({"pretrain": with_held}, {"pretrain": without}) == [
        'stage "pretrain": held_out_samples: was 10, now 20']


def test_fixed_samples_are_evenly_spread_and_all_of_a_small_set():
    assert pick(5, 128).tolist() == [0, 1, 2, 3, 4]
    assert pick(100, 4).tolist() == [0, 25, 50, 75]


# ---------------------------------------------------------------------------------------------
# Exact match


def greedy(model, prompt: list[int], length: int) -> list[int]:
    """Token-by-token greedy decoding, the definition exact match is taken against."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(length):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def test_exact_match_counts_the_answers_greedy_decoding_gets_right(tmp_path):
    config = load_config(write_run(tmp_path))
    model = build_model(config)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 5).tolist() for _ in range(6)]
    answers = [greedy(model, p, 3) for p in prompts]
    # Right: the model's own greedy answer. Wrong: its first, middle or last token changed.
    cases = [(answers[0], True), (answers[1], True), (answers[2], True),
             ([(answers[3][0] + 1) % 256, *answers[3][1:]], False),
             ([answers[4][0], (answers[4][1] + 1) % 256, answers[4][2]], False),
             ([*answers[5][:2], (answers[5][2] + 1) % 256], False)]
    width = 12
    inputs = torch.zeros(len(cases), width, dtype=torch.long)
    labels = torch.full((len(cases), width), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, (answer, _)) in enumerate(zip(prompts, cases)):
        sequence = torch.tensor(prompt + answer)
        inputs[row, :len(sequence) - 1] = sequence[:-1]
        labels[row, len(prompt) - 1:len(sequence) - 1] = sequence[len(prompt):]
    result = score(model, EvalSet("hand", "exact_match", inputs, labels, micro_batch_size=4), SINGLE)
    assert result["correct"] == 3 and result["accuracy"] == 0.5
    assert result["tokens"] == 18
    for (answer, right), prompt in zip(cases, prompts):   # the verdict is the decoder's, case by case
        alone = score(model, EvalSet("one", "exact_match", *_row(prompt, answer, width), 1), SINGLE)
        assert alone["correct"] == right == (greedy(model, prompt, 3) == answer)


def _row(prompt, answer, width):
    sequence = torch.tensor(prompt + answer)
    inputs = torch.zeros(1, width, dtype=torch.long)
    labels = torch.full((1, width), IGNORE_INDEX, dtype=torch.long)
    inputs[0, :len(sequence) - 1] = sequence[:-1]
    labels[0, len(prompt) - 1:len(sequence) - 1] = sequence[len(prompt):]
    return inputs, labels


# ---------------------------------------------------------------------------------------------
# In the loop


def test_evaluation_never_changes_training_and_writes_a_row_per_step_and_set(tmp_path):
    from nanoflow.training.loop import train

    config = load_config(write_run(tmp_path))
    with_eval = train(config, fresh=True, out=text_io.StringIO())
    without = train(attrs.evolve(config, evaluation=None, checkpoints=attrs.evolve(
        config.checkpoints, checkpoints_path=str(tmp_path / "plain"))), fresh=True, out=text_io.StringIO())
    a, b = dict(with_eval.model.named_parameters()), dict(without.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert rows_of(tmp_path / "run" / "metrics.jsonl") == [
        {**m, **{k: n[k] for k in MEASURED}} for m, n in zip(rows_of(tmp_path / "plain" / "metrics.jsonl"),
                                                        rows_of(tmp_path / "run" / "metrics.jsonl"))]
    rows = rows_of(tmp_path / "run" / "eval.jsonl")
    # interval 3, and each stage's last step (4: pretrain's, 6: sft's and the run's)
    assert [(r["step"], r["stage"], r["dataset"]) for r in rows] == [
        (3, "pretrain", "text"), (3, "pretrain", "sums"), (4, "pretrain", "text"), (4, "pretrain", "sums"),
        (6, "sft", "text"), (6, "sft", "sums")]
    assert all(r["tokens"] == 10 * 32 for r in rows if r["dataset"] == "text")   # the 10 held-out windows
    assert all(set(r) == {"step", "stage", "dataset", "loss", "tokens", "accuracy", "correct"}
               for r in rows if r["dataset"] == "sums")
    assert not (tmp_path / "plain" / "eval.jsonl").exists()


def test_a_progress_line_per_evaluation(tmp_path):
    from nanoflow.training.loop import train

    config = load_config(write_run(tmp_path), ["tokens.train_steps=4", "data_stages.sft.start_training_step=10"])
    out = text_io.StringIO()   # train(out=) sends every message of the run there (nanoflow/console.py)
    train(config, fresh=True, out=out)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("eval step")]
    assert len(lines) == 2 and lines[0].startswith("eval step 3 (pretrain): text loss ")
    assert " sums loss " in lines[1] and " exact " in lines[1]


def test_tensorboard_gets_the_eval_curves(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nanoflow.training.loop import train

    train(load_config(write_run(tmp_path)), fresh=True, out=text_io.StringIO())
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/sums/accuracy")] == [3, 4, 6]
    assert [e.step for e in events.Scalars("eval/text/loss")] == [3, 4, 6]


def test_report_draws_the_eval_curves(tmp_path):
    pytest.importorskip("matplotlib")
    from nanoflow.training.loop import train
    from nanoflow.observe.metrics import read_eval
    from nanoflow.commands.report import write_report

    train(load_config(write_run(tmp_path)), fresh=True, out=text_io.StringIO())
    run = tmp_path / "run"
    with open(run / "eval.jsonl", "a") as f:
        f.write('{"step": 7, "sta')   # a line cut by a kill is skipped
    assert [r["step"] for r in read_eval(run)] == [3, 3, 4, 4, 6, 6]
    path, _ = write_report(run)
    assert path.stat().st_size > 0


def test_the_eval_panel_shows_its_axes_whole_and_hides_no_curve_under_its_legend(tmp_path):
    pytest.importorskip("matplotlib")
    from nanoflow.training.loop import train
    from nanoflow.observe.metrics import read_eval, read_metrics
    from nanoflow.commands.report import draw, stage_spans

    train(load_config(write_run(tmp_path)), fresh=True, out=text_io.StringIO())
    run = tmp_path / "run"
    metrics = read_metrics(run)
    figure = draw(metrics, stage_spans(metrics), title="t", eval_rows=read_eval(run))
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    inside = figure.bbox
    eval_ax = figure.axes[3]
    accuracy_ax = next(ax for ax in figure.axes[4:] if ax.get_ylabel() == "exact match %")
    label = accuracy_ax.yaxis.label.get_window_extent(renderer)
    assert inside.x0 <= label.x0 and label.x1 <= inside.x1, (label, inside)   # the label is in the picture
    ticks = [t for t in accuracy_ax.get_yticklabels() if t.get_text() and 0 <= t.get_position()[1] <= 100]
    assert "100" in [t.get_text().replace("−", "-") for t in ticks]
    for tick in ticks:   # every tick label (100 among them) whole inside the picture
        box = tick.get_window_extent(renderer)
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, tick
    legend = eval_ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(eval_ax.get_window_extent(renderer)) and legend.x1 <= inside.x1, legend
    assert not legend.overlaps(label)


# ---------------------------------------------------------------------------------------------
# Resume, and bin/eval: real processes


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of 8 steps evaluated at every step; checkpoints at 3, 6 and 8."""
    folder = tmp_path_factory.mktemp("reference")
    config = write_run(folder, steps=8, sft_start=6, interval=1)
    result = train_process(config)
    assert result.returncode == 0, result.stderr
    return folder, config


def test_eval_rows_are_identical_across_a_kill_9_and_a_resume(reference, tmp_path):
    folder, _ = reference
    config = write_run(tmp_path, steps=8, sft_start=6, interval=1)
    log = tmp_path / "run" / "eval.jsonl"

    def past_step_4(_process):
        return log.exists() and any(json.loads(line)["step"] >= 5 for line in log.read_text().splitlines()[:-1])

    code, _, _ = signal_when_ready(bin_command("train", str(config)), past_step_4, signal.SIGKILL, cwd=REPO,
                                   env=env(), timeout=120)
    assert code == -signal.SIGKILL
    committed = int((tmp_path / "run" / "latest.txt").read_text())
    assert max(json.loads(line)["step"] for line in log.read_text().splitlines()[:-1]) > committed  # rows to drop
    result = train_process(config)
    assert result.returncode == 0, result.stderr
    assert rows_of(log) == rows_of(folder / "run" / "eval.jsonl")   # the same floats, and no row twice


def test_bin_eval_on_a_run_folder_and_a_step_folder_prints_the_rows_training_wrote(reference):
    folder, config = reference
    written = rows_of(folder / "run" / "eval.jsonl")
    result = eval_process(str(folder / "run"))   # the latest checkpoint, on the config it recorded
    assert result.returncode == 0, result.stderr
    assert list(map(json.loads, result.stdout.splitlines())) == [r for r in written if r["step"] == 8]
    result = eval_process(str(folder / "run" / "3"), str(config))
    assert result.returncode == 0, result.stderr
    assert list(map(json.loads, result.stdout.splitlines())) == [r for r in written if r["step"] == 3]


def test_bin_eval_errors_are_clean_exit_2(reference, tmp_path):
    folder, config = reference
    (tmp_path / "empty").mkdir()
    result = eval_process(str(tmp_path / "empty"))
    assert result.returncode == 2 and "no intact committed checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
    result = eval_process(str(folder / "run"), "--set", "evaluation.intervall=2")
    assert result.returncode == 2 and "intervall" in result.stderr and "Traceback" not in result.stderr
    result = eval_process(str(folder / "run"), str(config), "--set", "evaluation.datasets.sums.metric=bleu")
    assert result.returncode == 2 and "metric" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("2", "1"), ("1", "2")])
def test_bin_eval_under_torchrun_gives_the_single_process_rows(reference, layout):
    folder, _ = reference
    dp, tp = layout
    single = [r for r in rows_of(folder / "run" / "eval.jsonl") if r["step"] == 8]
    result = eval_process(str(folder / "run"), "--set", f"parallelism.dp={dp}", "--set", f"parallelism.tp={tp}",
                          launcher=(*TORCHRUN, "--nproc_per_node", "2"), timeout=240)
    assert result.returncode == 0, result.stderr
    rows = list(map(json.loads, result.stdout.splitlines()))
    assert [(r["dataset"], r["tokens"], r.get("correct")) for r in rows] == \
        [(r["dataset"], r["tokens"], r.get("correct")) for r in single]
    for row, expected in zip(rows, single):
        assert row["loss"] == pytest.approx(expected["loss"], abs=1e-5)


UNEVEN_SCORE = """
import json, sys
import torch
import torch.nn.functional as F
from nanoflow.build import build_model
from nanoflow.config import load_config
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.evaluation import EvalSet, score
from nanoflow.parallel.mesh import init_topology

config = load_config(sys.argv[1], [f"parallelism.dp={sys.argv[2]}", "model.num_hidden_layers=1"])
topology = init_topology(config)
model = build_model(config, topology)
ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(3))
labels = torch.full_like(ids, IGNORE_INDEX)
labels[:2, 1:] = ids[:2, 1:]   # rank 0's rows (of dp = 2): 23 targets each
labels[2:, -1] = ids[2:, -1]   # rank 1's rows: one target each, like a short answer
result = score(model, EvalSet("uneven", "loss", ids, labels, micro_batch_size=2), topology)
if topology.dp == 1:   # what a mean of the per-batch (per-rank) means would say instead
    with torch.inference_mode():
        per_batch = [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).item()
                     for x, y in zip(ids.split(2), labels.split(2))]
    result["mean_of_batch_means"] = sum(per_batch) / len(per_batch)
if topology.is_main:
    print("RESULT", json.dumps(result))
# leave as nanoflow's commands do: a gloo worker left to the interpreter's teardown can abort (parallel.exit_process)
from nanoflow.parallel.mesh import exit_process, shutdown
shutdown()
exit_process(0)
"""


@pytest.mark.slow
def test_evaluation_over_two_data_parallel_ranks_weighs_every_token_once(tmp_path):
    # torchtitan #4167: averaging the ranks' (or the batches') own means weighs a token of a short batch more.
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_SCORE)

    def scored(dp: int, launcher) -> dict:
        result = subprocess.run([*launcher, str(script), str(TINY), str(dp)], cwd=tmp_path, env=env(),
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return json.loads(result.stdout.split("RESULT ", 1)[1].splitlines()[0])

    one = scored(1, (PYTHON,))
    two = scored(2, (*TORCHRUN, "--nproc_per_node", "2"))
    assert one["tokens"] == two["tokens"] == 2 * 23 + 2
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert abs(one["mean_of_batch_means"] - one["loss"]) > 0.01, one   # the case tells the two averages apart


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("override, expected", [
    ("evaluation.datasets.text.held_out_of=nope", 'held_out_of: no stage is named "nope"'),
    ("data_stages.pretrain.data.dataset.held_out_samples=0", "held_out_samples"),
    ("evaluation.datasets.text.metric=exact_match", 'metric = "exact_match" needs prompt/completion data'),
    ("evaluation.datasets.sums.name=text", 'names must be unique'),
    ("evaluation.datasets.text.sequence_length=16", 'cuts its windows (and so the held-out ones) at 32'),
    ("evaluation.datasets.sums.sequence_length=128", "exceeds model.max_position_embeddings = 64"),
    ("evaluation.datasets.text.dataset={hf_dataset_or_datasets='text', hf_data_files='corpus.txt'}",
     "give exactly one of"),
    ("evaluation.datasets.sums.dataset.held_out_samples=2", "an eval set reads all of its dataset"),
    ("evaluation.datasets.sums.dataset.hf_data_files=missing.jsonl", "missing.jsonl matches no file"),
    ("evaluation.datasets=[]", "no [[evaluation.datasets]]"),
])
def test_bad_evaluation_config_names_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(write_run(tmp_path), [override])
    assert expected in str(caught.value)
    assert "run.toml" in str(caught.value)


def test_stages_sharing_a_source_must_hold_out_the_same(tmp_path):
    path = write_run(tmp_path)
    sft = ('hf_dataset_or_datasets = "json"\nhf_data_files = "sums.jsonl"\nprompt_column_name = "prompt"\n'
           'completion_column_name = "completion"\n')
    assert sft in path.read_text()
    path.write_text(path.read_text().replace(sft, 'hf_dataset_or_datasets = "text"\nhf_data_files = "corpus.txt"\n', 1))
    with pytest.raises(ConfigError, match='stage "pretrain" reads the same source with held_out_samples = 10'):
        load_config(path)
    assert load_config(path, ["data_stages.sft.data.dataset.held_out_samples=10"])   # the same reservation: fine


def test_no_held_out_stage_reserves_nothing(tmp_path):
    path = write_run(tmp_path)
    path.write_text(path.read_text().replace("held_out_samples = 10\n", ""))
    with pytest.raises(ConfigError, match='stage "pretrain" reserves nothing; set its data.dataset.held_out_samples'):
        load_config(path)
