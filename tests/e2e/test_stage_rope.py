"""A stage's own RoPE through whole runs: a stage switch that changes rope_theta trains through it (on one process
and sharded over dp × tp) and resumes across it bit for bit; evaluation in the loop and bin/eval score with the RoPE
of the stage being trained; bin/export writes the last trained stage's RoPE, which transformers loads with
nanoflow's logits, for every family. (The RoPE math itself, against transformers: tests/unit/test_rope.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import quiet, tiny
from process_helpers import run_layout
from run_helpers import assert_same_training_state, metrics
from support.evaluation import rows_of, write_run

from nanoflow import io, load_config
from nanoflow.config import FAMILIES, stage_rope
from nanoflow.evaluation import evaluate, evaluate_checkpoint, load_checkpoint_weights, load_eval_sets
from nanoflow.interop.export import export_hf
from nanoflow.io import read_init_weights
from nanoflow.parallel.mesh import SINGLE
from nanoflow.run import open_run
from nanoflow.training.loop import train

# tiny: "pretrain" trains steps 1–7 at rope_theta 10,000, "sft" steps 8–12 at 500,000
EXTEND = ("data_stages.sft.rope_theta=500000.0",)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    out = quiet()
    state = train(tiny(folder, *EXTEND), out=out)
    said = out.getvalue()   # each stage's RoPE, as the stages differ in it
    assert 'stage "pretrain": steps 1–7, global batch 4, sequence length 32, rope θ 10,000\n' in said
    assert 'stage "sft": steps 8–12, global batch 8, sequence length 24, rope θ 500,000\n' in said
    return folder, state


@pytest.mark.parametrize("k", [7, 9])
def test_a_run_whose_stage_switch_changes_rope_theta_resumes_across_it_bit_for_bit(straight, tmp_path, k):
    """Stopped at the last step before the switch and after it, resumed: every weight and moment torch.equal to the
    run trained straight through."""
    _, reference = straight
    train(tiny(tmp_path, *EXTEND, "checkpoints.checkpoint_interval=100"), until_step=k, out=quiet())
    resumed = train(tiny(tmp_path, *EXTEND), out=quiet())
    assert_same_training_state(reference, resumed)
    assert (resumed.model.model.rope_theta, reference.model.model.rope_theta) == (500000.0, 500000.0)


def test_the_new_rope_trains_from_the_stages_first_step(straight, tmp_path):
    """Against the same run without the stage's rope_theta: the same losses up to step 7, another from step 8."""
    folder, _ = straight
    train(tiny(tmp_path), out=quiet())
    extended, plain = metrics(folder), metrics(tmp_path)
    assert all(extended[step]["loss"] == plain[step]["loss"] for step in range(1, 8))
    assert extended[8]["loss"] != plain[8]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2tp2", "tp2sp"])
def test_a_rope_switch_trains_the_same_under_fsdp_and_tensor_parallelism(tmp_path, layout):
    """The stage's RoPE reaches the model under FSDP2 and DTensor wrapping: a switch at step 3 gives the losses and
    weights one process gives, and not the weights of a run without it."""
    switch = ["data_stages.sft.start_training_step=3", "data_stages.sft.rope_theta=500000.0",
              'data_stages.sft.rope_scaling={rope_type = "yarn", factor = 2.0, original_max_position_embeddings = 16}']
    for name, extra in ((layout, switch), ("dp1", switch), ("plain", ["data_stages.sft.start_training_step=3"])):
        result = run_layout("dp1" if name == "plain" else name, tmp_path / name, *extra)
        assert result.returncode == 0, result.stdout + result.stderr
    one, sharded, plain = (metrics(tmp_path / name) for name in ("dp1", layout, "plain"))
    assert sorted(one) == sorted(sharded) == [1, 2, 3, 4]
    for step in one:
        assert sharded[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-5), step
    assert one[2]["loss"] == plain[2]["loss"] and one[3]["loss"] != plain[3]["loss"]
    weights = {name: io.read_model(str(tmp_path / name)) for name in ("dp1", layout, "plain")}
    for key, tensor in weights["dp1"].items():
        torch.testing.assert_close(weights[layout][key], tensor, rtol=0, atol=1e-5, msg=key)
    assert max((weights["plain"][k] - t).abs().max().item() for k, t in weights["dp1"].items()) > 1e-3


def test_eval_sets_are_scored_with_the_rope_of_the_stage_being_trained(tmp_path):
    """eval.jsonl's rows (the loop's) and bin/eval's of the same checkpoints agree, each with its step's stage's
    RoPE; the sft step scored with pretrain's RoPE would give another loss."""
    config = load_config(write_run(tmp_path, steps=6, sft_start=5, interval=3), ["data_stages.sft.rope_theta=500000.0"])
    train(config, out=quiet())
    rows = {(row["step"], row["dataset"]): row for row in rows_of(tmp_path / "run" / "eval.jsonl")}
    for step, stage in ((3, "pretrain"), (6, "sft")):
        by_bin_eval = evaluate_checkpoint(str(tmp_path / "run" / str(step)), config)
        assert [row["stage"] for row in by_bin_eval] == [stage, stage]
        assert by_bin_eval == [rows[(step, row["dataset"])] for row in by_bin_eval]
    run = open_run(config, join=False)
    path = str(tmp_path / "run" / "6")
    model = load_checkpoint_weights(run.config, SINGLE, read_init_weights(path), path, stage=0)
    assert model.model.rope_theta == stage_rope(run.config, 0).theta == 10000.0
    with_pretrains = evaluate(model, load_eval_sets(run.config, run.tokenizer), SINGLE, 6, "sft")
    assert with_pretrains[0]["loss"] != rows[(6, "text")]["loss"]


FAMILY_KEYS = {"llama": [], "qwen2": [], "qwen3": ["model.head_dim=4"], "mistral": [],
               "smollm3": ["model.no_rope_layer_interval=2"], "olmo2": []}


@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_the_last_trained_stages_rope_and_transformers_computes_it(tmp_path, family):
    """A run that extends its context in stage "sft" (rope_theta and YaRN) exports, from its last step, the sft
    stage's RoPE — transformers' logits are nanoflow's past original_max_position_embeddings — and from a step of
    "pretrain", pretrain's."""
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    config = tiny(tmp_path / "run", f'model.model_type="{family}"', *FAMILY_KEYS[family], "tokens.train_steps=9",
                  "data_stages.sft.rope_theta=500000.0",
                  "data_stages.sft.rope_scaling={" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in yarn.items()) + "}")
    state = train(config, out=quiet())
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["rope_parameters"] == {**yarn, "rope_theta": 500000.0} and exported["rope_scaling"] == yarn
    assert exported["rope_theta"] == 500000.0 and exported["nanoflow"]["step"] == 9
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert reloaded.model.rotary_emb.attention_scaling != 1.0
    ids = torch.randint(0, 288, (2, 64), generator=torch.Generator().manual_seed(0))   # positions up to 64 > 32
    with torch.no_grad():
        ours, theirs = state.model(ids), reloaded(ids).logits
    assert ours.abs().max() > 0.1 and (ours - theirs).abs().max().item() <= 1e-5

    export_hf(str(tmp_path / "run" / "4"), str(tmp_path / "hf4"))   # a checkpoint of "pretrain"
    exported = json.loads((tmp_path / "hf4" / "config.json").read_text())
    assert exported["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert exported["rope_scaling"] is None
