"""The weight EMA ([optimizer] ema_decay): its update, its save and exact resume, a resume that starts one."""

import torch
from helpers import quiet, tiny

from nanoflow import io
from nanoflow.build import init_state
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.training.loop import train

DECAY = "optimizer.ema_decay=0.75"


def test_the_ema_is_the_recurrence_over_the_weights_after_each_step(tmp_path):
    config = tiny(tmp_path, DECAY)
    state = init_state(config)
    expected = {name: p.detach().clone() for name, p in state.model.named_parameters()}
    assert all(torch.equal(state.ema[name], expected[name]) for name in expected)  # starts at the initial weights
    from nanoflow.build import stage_data
    from nanoflow.step import train_step
    with stage_data(state) as loader:
        for step in (1, 2, 3):
            state, _ = train_step(state, loader.batch_at(step))
            for name, p in state.model.named_parameters():
                expected[name] = expected[name].lerp(p.detach(), 0.25)
    for name, p in state.model.named_parameters():
        assert state.ema[name].dtype == torch.float32
        assert torch.equal(state.ema[name], expected[name]), name
        assert not torch.equal(state.ema[name], p), name  # it lags the weights


def test_no_ema_without_ema_decay(tmp_path):
    assert init_state(tiny(tmp_path)).ema is None
    train(tiny(tmp_path), until_step=4, out=quiet())
    assert "ema" not in io.read_metadata(str(tmp_path))["tensors"]


def test_the_ema_is_saved_and_a_resume_across_the_stage_switch_equals_a_straight_run(tmp_path):
    straight = train(tiny(tmp_path / "straight", DECAY), out=quiet())
    saved = io.read_checkpoint(str(tmp_path / "straight"), groups=("ema",)).groups["ema"]
    assert set(saved) == set(straight.ema)
    assert all(torch.equal(saved[name], straight.ema[name]) for name in saved)
    assert (tmp_path / "straight" / "12" / "ema").is_dir()
    train(tiny(tmp_path / "resumed", DECAY, "checkpoints.checkpoint_interval=100"), until_step=9, out=quiet())
    resumed = train(tiny(tmp_path / "resumed", DECAY), out=quiet())
    for name, p in straight.model.named_parameters():
        assert torch.equal(resumed.ema[name], straight.ema[name]), name
        assert torch.equal(dict(resumed.model.named_parameters())[name], p), name


def test_a_checkpoint_without_an_ema_resumed_with_ema_decay_starts_it_from_its_weights(tmp_path):
    train(tiny(tmp_path), until_step=5, out=quiet())
    out = quiet()
    state = Checkpointer(tiny(tmp_path, DECAY), out=out).restore()
    assert state.step == 5
    weights = io.read_model(str(tmp_path))
    assert all(torch.equal(state.ema[name], weights[name]) for name in weights)
    assert "holds no weight EMA; the EMA starts from its weights at step 5" in out.getvalue()


def test_the_in_loop_eval_scores_the_ema_beside_the_weights_and_leaves_training_alone(tmp_path):
    import io as text_io

    from support.evaluation import rows_of, write_run

    from nanoflow.config import load_config
    from nanoflow.evaluation import ema_weights, evaluate, load_eval_sets
    from nanoflow.run import open_run

    config = load_config(write_run(tmp_path), ["optimizer.ema_decay=0.5"])
    plain = load_config(write_run(tmp_path / "plain", evaluation=False), ["optimizer.ema_decay=0.5"])
    state = train(config, fresh=True, out=text_io.StringIO())
    without = train(plain, fresh=True, out=text_io.StringIO())
    for name, p in without.model.named_parameters():  # evaluating the EMA swapped it in and out, bit for bit
        assert torch.equal(dict(state.model.named_parameters())[name], p), name
        assert torch.equal(state.ema[name], without.ema[name]), name
    rows = rows_of(tmp_path / "run" / "eval.jsonl")
    assert [(r["step"], r["dataset"], r.get("weights")) for r in rows if r["step"] == 6] == [
        (6, "text", None), (6, "sums", None), (6, "text@ema", "ema"), (6, "sums@ema", "ema")]
    raw, ema = rows[-4], rows[-2]
    assert raw["loss"] != ema["loss"] and raw["tokens"] == ema["tokens"]
    # The EMA rows are what the EMA weights score, recomputed here.
    run = open_run(config)
    sets = load_eval_sets(run.config, run.tokenizer)
    with ema_weights(state.model, state.ema):
        again = evaluate(state.model, sets, run.topology, 6, "sft", ema=True)
    assert [r["loss"] for r in again] == [r["loss"] for r in rows[-2:]]


def test_bin_export_ema_writes_the_ema_as_the_hf_weights(tmp_path):
    import json

    from safetensors.torch import load_file

    from nanoflow.commands.cli import export_main

    state = train(tiny(tmp_path / "run", DECAY), until_step=4, out=quiet())
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf"), "--ema"]) == 0
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == state.ema.keys()
    assert all(torch.equal(written[name], state.ema[name]) for name in written)
    assert not torch.equal(written["model.norm.weight"], state.model.model.norm.weight)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["nanoflow"]["weights"] == "ema"


def test_bin_export_ema_of_a_checkpoint_without_one_says_so(tmp_path, capsys):
    from nanoflow.commands.cli import export_main

    train(tiny(tmp_path / "run"), until_step=4, out=quiet())
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf"), "--ema"]) != 0
    said = capsys.readouterr().err
    assert "saved by a run without [optimizer] ema_decay" in said and "Traceback" not in said
    assert not (tmp_path / "hf" / "config.json").exists()


def test_bin_average_ema_is_the_mean_of_the_saved_emas(tmp_path):
    from nanoflow.commands.cli import average_main

    train(tiny(tmp_path / "run", DECAY, "checkpoints.checkpoint_interval=2"), until_step=6, out=quiet())
    assert average_main([str(tmp_path / "run"), str(tmp_path / "avg"), "--steps", "4,6", "--ema"]) == 0
    emas = [io.read_checkpoint(str(tmp_path / "run" / s), groups=("ema",)).groups["ema"] for s in ("4", "6")]
    averaged = io.read_model(str(tmp_path / "avg"))
    assert averaged.keys() == emas[0].keys()
    for name in averaged:
        torch.testing.assert_close(averaged[name], (emas[0][name] + emas[1][name]) / 2, rtol=0, atol=1e-6)
    assert [a.get("weights") for a in io.read_metadata(str(tmp_path / "avg"))["averaged_from"]] == ["ema", "ema"]
    assert average_main([str(tmp_path / "run"), str(tmp_path / "avg2"), "--last", "2"]) == 0  # the weights: other numbers
    assert not torch.equal(io.read_model(str(tmp_path / "avg2"))["model.norm.weight"], averaged["model.norm.weight"])


def test_a_stage_of_its_own_decay_keeps_the_ema_on_the_weights_before_it(tmp_path):
    from nanoflow.build import stage_data
    from nanoflow.step import train_step

    config = tiny(tmp_path, "data_stages.sft.ema_decay=0.5")   # sft starts at step 8; pretrain: decay 0
    assert config.keeps_ema and [config.stage_ema_decay(i) for i in (0, 1)] == [0.0, 0.5]
    state = init_state(config)
    for step in range(1, 10):
        if step in (1, 8):
            loader = stage_data(state)
        state, _ = train_step(state, loader.batch_at(step))
        weights = {name: p.detach() for name, p in state.model.named_parameters()}
        if step <= 7:   # pretrain: the EMA is the weights
            assert all(torch.equal(state.ema[name], weights[name]) for name in weights), step
            expected = {name: w.clone() for name, w in weights.items()}
        else:           # sft: decay 0.5 from pretrain's last weights
            expected = {name: expected[name].lerp(w, 0.5) for name, w in weights.items()}
            assert all(torch.equal(state.ema[name], expected[name]) for name in weights), step
            assert not all(torch.equal(state.ema[name], weights[name]) for name in weights), step
    assert tiny(tmp_path, "optimizer.ema_decay=0.9").stage_ema_decay(1) == 0.9
    assert not tiny(tmp_path).keeps_ema


def test_verify_resumes_first_difference_sees_the_ema():
    from nanoflow.commands.verify import first_difference
    from nanoflow.io.reader import Checkpoint

    one = {"w": torch.zeros(2)}
    a = Checkpoint("a", {"step": 3}, {"model": one, "optimizer": {}, "ema": {"w": torch.zeros(2)}})
    b = Checkpoint("b", {"step": 3}, {"model": one, "optimizer": {}, "ema": {"w": torch.tensor([0.0, 1e-7])}})
    assert first_difference(a, a) is None
    assert first_difference(a, b).startswith("ema/w differs")
    assert first_difference(a, Checkpoint("c", {"step": 3}, {"model": one, "optimizer": {}})) == \
        "ema/w is missing from the second run"
