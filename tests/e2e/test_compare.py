"""bin/compare: FLOPs with a shared trunk counted once, the gap to cosine, the figure, bad input."""

from __future__ import annotations

import json

import pytest
from helpers import quiet, tiny

from nanoflow.commands.cli import compare_main
from nanoflow.commands.compare import read_runs, shared_savings
from nanoflow.training.loop import train

PRETRAIN = ["data_stages.sft.start_training_step=100", "checkpoints.checkpoint_interval=2"]


def fake_eval(run, losses: dict[int, float]) -> None:
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "stage": "pretrain", "dataset": "held", "loss": v,
                                                        "tokens": 1}) + "\n" for s, v in losses.items()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    train(tiny(root / "trunk", *PRETRAIN, "tokens.train_steps=4", "optimizer.learning_rate_scheduler.lr_decay_style=\"constant\""),
          out=quiet(), fresh=True)
    train(tiny(root / "branch", *PRETRAIN, "tokens.train_steps=6", f'checkpoints.resume_checkpoint_path="{root / "trunk" / "2"}"'),
          out=quiet())
    train(tiny(root / "cosine", *PRETRAIN, "tokens.train_steps=6"), out=quiet(), fresh=True)
    fake_eval(root / "trunk", {2: 3.0, 4: 2.5})
    fake_eval(root / "branch", {4: 2.4, 6: 2.0})
    fake_eval(root / "cosine", {6: 2.25})
    return root


def test_flops_count_the_trunk_once(runs):
    trunk, branch, cosine = read_runs([str(runs / "trunk")]
                                      + [str(runs / "branch"), str(runs / "cosine")])
    # By hand: tiny's model (2 layers, hidden 32, intermediate 64, 4 heads, 2 kv, vocab 288), sequence 32,
    # global batch 4 → 128 tokens a step. N: q, o 32×32; k, v 32×16; the MLP 3·32×64; the head 288×32.
    n = 2 * (2 * 32 * 4 * 8 + 2 * 32 * 2 * 8 + 3 * 32 * 64) + 288 * 32
    per_step = 128 * (6 * n + 12 * 2 * 32 * 32)
    assert trunk.own_flops == trunk.flops == 4 * per_step
    assert branch.own_flops == 4 * per_step                 # steps 3–6, its own
    assert branch.flops == 6 * per_step                     # + the trunk's steps 1–2
    assert cosine.flops == 6 * per_step and cosine.cosine and not branch.cosine and not trunk.cosine
    separate, shared = shared_savings([trunk, branch, cosine])
    assert (separate, shared) == (6 * per_step, 8 * per_step)   # the trunk trained on past the branch point


def test_table_gap_and_png(runs, tmp_path, capsys):
    png = tmp_path / "c.png"
    assert compare_main([str(runs / "trunk"), str(runs / "branch"), str(runs / "cosine"), "--output", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isalpha()}
    assert table["branch"][-1] == "-0.2500"                  # 2.0 − 2.25
    assert table["cosine"][-1] == "—" and table["trunk"][-1] == "—"


def test_a_run_without_eval_jsonl_exits_2(runs, tmp_path, capsys):
    assert compare_main([str(runs / "cosine"), str(tmp_path), "--output", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no eval.jsonl" in err and str(tmp_path) in err


def test_a_moved_study_named_by_relative_paths(runs, tmp_path, monkeypatch, capsys):
    # The branch records the trunk's absolute step folder; its copy elsewhere still finds the trunk's copy.
    import shutil
    for name in ("trunk", "branch", "cosine"):
        shutil.copytree(runs / name, tmp_path / "moved" / name)
    monkeypatch.chdir(tmp_path / "moved")
    trunk, branch, cosine = read_runs(["trunk", "branch/", "./cosine"])
    original = read_runs([str(runs / n) for n in ("trunk", "branch", "cosine")])
    assert branch.origin == ("trunk", 2) and branch.flops == original[1].flops and branch.own_flops == original[1].own_flops
    assert shared_savings([trunk, branch, cosine]) == shared_savings(original)
    # The original and the copy named together: each branch counts the trunk beside it.
    both = read_runs(["trunk", "branch", str(runs / "trunk"), str(runs / "branch")])
    assert both[1].origin == ("trunk", 2) and both[3].origin == (str(runs / "trunk"), 2)
    assert compare_main(["trunk", "branch", "cosine", "--output", "c.png"]) == 0
    assert "-0.2500" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Issue 30, items 10, 2, 16: clean errors (exit 2, one line naming the file and line), checked before any work;
# a figure written exactly where it is said to be; a FLOPs count that says when it does not know.

def copied(runs, tmp_path, *names):
    import shutil
    for name in names:
        shutil.copytree(runs / name, tmp_path / name)
    return [str(tmp_path / name) for name in names]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("output, words", [
    ("missing/c.png", "no folder"),
    ("c.notaformat", "cannot write .notaformat"),
    ("a-folder", "is a folder"),
])
def test_output_is_checked_before_any_run_is_read(tmp_path, capsys, output, words):
    (tmp_path / "a-folder").mkdir()
    # No run folder exists at all: the --output error comes first, before any reading.
    assert compare_main([str(tmp_path / "nowhere"), "--output", str(tmp_path / output)]) == 2
    err = one_line(capsys)
    assert f"--output {tmp_path / output}" in err and words in err, err


def test_output_without_a_suffix_is_written_exactly_there_as_png(runs, tmp_path, capsys):
    assert compare_main([str(runs / "cosine"), "--output", str(tmp_path / "figure")]) == 0
    assert (tmp_path / "figure").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "figure.png").exists()
    assert f"wrote {tmp_path / 'figure'}" in capsys.readouterr().out


@pytest.mark.parametrize("content, words", [
    (b'[1, 2]\n{"step": 4}\n', "eval.jsonl:1: not a JSON object"),
    (b'{"step": 6, "stage": "pretrain", "loss": 2.0, "tokens": 1}\n', "eval.jsonl:1: no dataset"),
    (b'{"step": 6, "stage": "pretrain", "dataset": "held", "loss": null, "tokens": 1}\n', "eval.jsonl:1: loss is null"),
    (b'{"step": "six", "stage": "pretrain", "dataset": "held", "loss": 2.0, "tokens": 1}\n', "eval.jsonl:1: step is"),
    (b'{"step": 6, "stage": "pretrain", "dataset": "held", "loss": 2.0, "tokens": 1}\n\xff\xfe\n', "not UTF-8"),
])
def test_a_malformed_eval_jsonl_names_the_file_and_the_line(runs, tmp_path, capsys, content, words):
    (cosine,) = copied(runs, tmp_path, "cosine")
    (tmp_path / "cosine" / "eval.jsonl").write_bytes(content)
    assert compare_main([cosine, "--output", str(tmp_path / "c.png")]) == 2
    err = one_line(capsys)
    assert words in err and str(tmp_path / "cosine") in err, err


@pytest.mark.parametrize("content, words", [
    (b'{"step": 5, "stage": "pretrain", "loss": 1.0, "lr": 0.01}\n', "metrics.jsonl:1: no tokens"),
    (b'"a string"\n', "metrics.jsonl:1: not a JSON object"),
])
def test_a_malformed_metrics_jsonl_names_the_file_and_the_line(runs, tmp_path, capsys, content, words):
    (cosine,) = copied(runs, tmp_path, "cosine")
    (tmp_path / "cosine" / "metrics.jsonl").write_bytes(content)
    assert compare_main([cosine, "--output", str(tmp_path / "c.png")]) == 2
    assert words in one_line(capsys)


@pytest.mark.parametrize("name", ["eval.jsonl", "metrics.jsonl"])
def test_a_record_that_is_a_folder_is_named(runs, tmp_path, capsys, name):
    (cosine,) = copied(runs, tmp_path, "cosine")
    (tmp_path / "cosine" / name).unlink()
    (tmp_path / "cosine" / name).mkdir()
    assert compare_main([cosine, "--output", str(tmp_path / "c.png")]) == 2
    err = one_line(capsys)
    assert f"{tmp_path / 'cosine' / name}: cannot read it" in err, err


def test_a_run_dir_that_is_a_file_is_named(tmp_path, capsys):
    (tmp_path / "run").write_text("not a folder")
    assert compare_main([str(tmp_path / "run"), "--output", str(tmp_path / "c.png")]) == 2
    assert f"{tmp_path / 'run'} is a file, not a run folder" in one_line(capsys)


def test_a_dataset_no_run_has_is_an_error_naming_those_there_are(runs, tmp_path, capsys):
    assert compare_main([str(runs / "cosine"), "--output", str(tmp_path / "c.png"), "--dataset", "hled"]) == 2
    err = one_line(capsys)
    assert "--dataset hled" in err and "held" in err, err
    assert not (tmp_path / "c.png").exists()


def test_a_branch_without_metrics_has_no_flops_count_and_says_so(runs, tmp_path, capsys):
    trunk, branch, cosine = copied(runs, tmp_path, "trunk", "branch", "cosine")
    (tmp_path / "branch" / "metrics.jsonl").unlink()
    assert compare_main([trunk, branch, cosine, "--output", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalpha()}
    assert table["branch"][2] == "n/a" and table["trunk"][2] != "n/a", out   # never the trunk's count alone
    assert f"{branch} has no metrics.jsonl" in out and "saved" not in out, out


# The figure of a whole study: 15 runs (issue 30, item 25)

STUDY = ["trunk", "wsd-1sqrt-40", "wsd-linear-40", "wsd-1sqrt-80", "wsd-linear-80", "wsd-1sqrt-160",
         "wsd-linear-160", "wsd-1sqrt-160-decay5", "wsd-1sqrt-160-decay10", "wsd-1sqrt-160-decay40", "cosine-40",
         "cosine-80", "cosine-160", "trunk-avg-80", "trunk-avg-160"]   # schedules/wsd_vs_cosine/study.toml's


def study_runs():
    from nanoflow.commands.compare import RunResult

    runs = []
    for i, name in enumerate(STUDY):
        end = int(next((p for p in name.split("-") if p.isdigit()), 160))
        points = [(s, 3.0 - s / 100 - i / 1000) for s in range(10, end + 1, 10)]
        runs.append(RunResult(name=name, path=f"runs/{name}", steps=end, own_flops=1.0, flops=1.0, origin=None,
                              cosine=name.startswith("cosine"), evals={"prose": points},
                              flops_at={s: s * 1e9 for s, _ in points}))
    return runs


def test_a_study_of_fifteen_runs_is_drawn_by_family_with_each_line_named_at_its_end(tmp_path):
    from nanoflow.commands.compare import draw, family

    assert [family(n) for n in ("trunk", "wsd-1sqrt-160-decay5", "cosine-40", "trunk-avg-80")] == \
        ["trunk", "wsd-1sqrt", "cosine", "trunk-avg"]
    runs = study_runs()
    by_step, by_flops = draw(runs, "prose").axes
    lines = {line.get_gid(): line for line in by_step.get_lines()}
    assert sorted(lines) == sorted(STUDY)
    looks = {name: (line.get_color(), line.get_linestyle(), line.get_marker()) for name, line in lines.items()}
    assert len(set(looks.values())) == len(STUDY)   # no two runs drawn alike
    colors = {}
    for name, (color, _, _) in looks.items():
        colors.setdefault(family(name), set()).add(color)
    assert all(len(c) == 1 for c in colors.values()), colors             # a family shares its colour
    assert len({c.pop() for c in colors.values()}) == len(colors)       # and no other family has it
    # Each line is named at its end, in its colour, on the step panel; the legend lists the families.
    labels = {text.get_text(): text for text in by_step.texts}
    for run in runs:
        assert run.name in labels, run.name
        assert labels[run.name].get_color() == looks[run.name][0]
        assert labels[run.name].xy[0] == run.evals["prose"][-1][0]
    assert [t.get_text() for t in by_step.get_legend().get_texts()] == list(dict.fromkeys(map(family, STUDY)))
    # Names at one step never overlap: at least 2.5 % of the panel's height apart.
    low, high = by_step.get_ylim()
    ends: dict = {}
    for text in by_step.texts:
        ends.setdefault(text.xy[0], []).append(text.xyann[1] if text.xyann else text.xy[1])
    for heights in ends.values():
        heights.sort()
        assert all(b - a >= 0.025 * (high - low) - 1e-9 for a, b in zip(heights, heights[1:], strict=False)), heights
