"""bin/train CONFIG --plan --plot PNG: the plan drawn over global steps, from the config alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import REPO, TINY

from nanoflow import load_config
from nanoflow.commands import cli
from nanoflow.commands.plan import source_shares
from nanoflow.commands.plan_plot import PANELS, plan_figure, plan_steps
from nanoflow.lr import scheduled_lr
from nanoflow.run import open_run
from nanoflow.schedule import Schedule

COOLDOWNS = REPO / "schedules" / "cooldowns.toml"
BRANCH = ["data_stages.cooldown.start_training_step=9"]   # stable 1–8, cooldown (own LR, batch 8, length 24) 9–12
PNG = b"\x89PNG\r\n\x1a\n"


def test_the_figure_has_a_panel_each_for_lr_batch_length_and_shares_with_the_plans_values():
    config = load_config(COOLDOWNS, BRANCH)
    figure = plan_figure(open_run(config, join=False))
    axes = figure.axes
    assert [ax.get_ylabel() for ax in axes] == list(PANELS)
    assert {t.get_text() for t in axes[0].texts} == {"stable", "cooldown"}
    schedule = Schedule.from_config(config)
    drawn = [(x, y) for line in axes[0].get_lines() if line.get_color() == "tab:orange" for x, y in zip(*line.get_data(), strict=True)]
    assert drawn == [(s, scheduled_lr(s, config, schedule)) for s in range(1, 13)]
    assert drawn[-1][1] == 1e-4                                       # the cooldown's own floor at its last step
    batch, length = (ax.patches[-1].get_data()[0] for ax in axes[1:3])   # stairs: values per step
    assert list(batch) == [4] * 8 + [8] * 4 and list(length) == [32] * 8 + [24] * 4
    assert [h.get_label() for h in axes[3].patches if not h.get_label().startswith("_") and h.get_label()] == \
        ["text: schedules/data/words/pretrain.txt", "json: schedules/data/words/reverse.jsonl"]


def test_source_shares_are_the_normalised_weights_of_the_stage_training_the_step(tmp_path):
    pretrain = 'hf_dataset_or_datasets = "text"\nhf_data_files = "data/words/pretrain.txt"'
    assert pretrain in TINY.read_text()
    text = TINY.read_text().replace(pretrain, 'hf_dataset_or_datasets = { "data/words/pretrain.txt" = 3.0, '
                                              '"data/words/anneal.txt" = 1.0 }')
    (tmp_path / "blend.toml").write_text(text.replace('"data/', f'"{REPO}/schedules/data/'))
    config = load_config(tmp_path / "blend.toml")
    run = open_run(config, join=False)
    shares = source_shares(run, 7)
    assert [Path(name).name for name in shares] == ["pretrain.txt", "anneal.txt"]
    assert list(shares.values()) == [0.75, 0.25]
    assert list(source_shares(run, 8).values()) == [1.0]


def test_a_long_run_is_sampled_but_every_stage_switch_is_drawn():
    config = load_config(COOLDOWNS, ["tokens.train_steps=1000003", "data_stages.cooldown.start_training_step=777777"])
    steps = plan_steps(Schedule.from_config(config))
    assert len(steps) <= 2100 and {1, 777776, 777777, 1000003} <= set(steps)


def test_plan_plot_writes_a_png_and_says_where(tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert cli.train_main([str(COOLDOWNS), "--plan", "--plot", str(out), *sum((["--set", o] for o in BRANCH), [])]) == 0
    assert out.read_bytes()[:8] == PNG and f"wrote {out}" in capsys.readouterr().out


def test_missing_matplotlib_is_one_clean_error_and_no_file(tmp_path, capsys, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)   # import of it raises ImportError, as when not installed
    out = tmp_path / "plan.png"
    assert cli.train_main([str(COOLDOWNS), "--plan", "--plot", str(out)]) == 2   # a missing extra is bad input, not a bug
    err = capsys.readouterr().err
    assert "error: drawing needs matplotlib, which is not installed: pip install '.[report]'" in err
    assert "Traceback" not in err and not out.exists()


def test_plot_without_plan_and_an_unwritable_path_are_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.train_main([str(COOLDOWNS), "--plot", str(tmp_path / "x.png")])
    assert stop.value.code == 2 and "--plot draws the plan: give --plan too" in capsys.readouterr().err
    assert cli.train_main([str(COOLDOWNS), "--plan", "--plot", str(tmp_path / "no" / "x.png")]) == 2
    captured = capsys.readouterr()   # said before the plan's checks: no plan printed
    assert f"no folder {tmp_path / 'no'}" in captured.err and captured.out == "", captured


def test_the_plan_counts_its_stages_in_words_that_agree(tmp_path):
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    from helpers import TINY

    from nanoflow.commands.plan import render_plan
    from nanoflow.config import load_config
    from nanoflow.interop.nanotron import to_toml

    raw = tomllib.loads(TINY.read_text())
    raw["data_stages"] = raw["data_stages"][:1]   # pretrain alone
    for stage in raw["data_stages"]:
        stage["data"]["dataset"]["hf_data_files"] = str(TINY.parent / stage["data"]["dataset"]["hf_data_files"])
    one = tmp_path / "one.toml"
    one.write_text(to_toml(raw))
    assert ", 1 stage, dp=" in render_plan(open_run(load_config(one), join=False)).splitlines()[0]
    assert ", 2 stages, dp=" in render_plan(open_run(load_config(TINY), join=False)).splitlines()[0]


def test_the_length_panel_writes_each_reached_stages_rope_at_its_start():
    config = load_config(COOLDOWNS, [*BRANCH, "data_stages.cooldown.rope_theta=500000.0"])
    length_panel = plan_figure(open_run(config, join=False)).axes[2]
    assert [(t.get_text(), t.xy) for t in length_panel.texts] == [("θ 10,000", (0.5, 32)), ("θ 500,000", (8.5, 24))]
    unreached = load_config(COOLDOWNS, ["data_stages.cooldown.rope_theta=500000.0"])   # cooldown after train_steps
    assert [t.get_text() for t in plan_figure(open_run(unreached, join=False)).axes[2].texts] == ["θ 10,000"]


def test_the_plan_says_the_rope_of_every_stage():
    from helpers import TINY

    from nanoflow.commands.plan import render_plan

    same = render_plan(open_run(load_config(TINY), join=False)).splitlines()
    assert "rope: θ 10,000, in every stage" in same and not any("rope" in line for line in same[5:])
    extended = render_plan(open_run(load_config(TINY, [
        "data_stages.sft.rope_theta=500000.0",
        'data_stages.sft.rope_scaling={rope_type = "yarn", factor = 2.0, original_max_position_embeddings = 32}']),
        join=False)).splitlines()
    assert not any(line.startswith("rope:") for line in extended)
    header = next(line for line in extended if line.startswith("stage"))
    assert header.split() == ["stage", "steps", "n", "steps", "global", "batch", "seq", "len", "rope", "samples",
                              "tokens", "lr", "first", "→", "last"]
    column = header.index("rope")
    rows = {line.split()[0]: line[column:].split("  ")[0] for line in extended if line.startswith(("pretrain", "sft"))}
    assert rows == {"pretrain": "θ 10,000", "sft": "θ 500,000, yarn ×2 of 32"}
