"""The weight EMA under dp × tp: sharded like the weights, each rank writing its boxes, resumed on any layout."""

import pytest
import torch
from process_helpers import run_layout

from nanoflow import io

pytestmark = pytest.mark.slow

EMA = "optimizer.ema_decay=0.5"


def ema(run) -> dict[str, torch.Tensor]:
    return io.read_checkpoint(str(run), groups=("ema",)).groups["ema"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    for layout in ("dp1", "dp2tp2"):
        result = run_layout(layout, root / layout, EMA)
        assert result.returncode == 0, result.stdout + result.stderr
    return root


def test_a_dp2_tp2_ema_is_the_single_process_one_written_in_its_boxes(runs):
    meta = io.read_metadata(str(runs / "dp2tp2"))
    assert sorted(f for f in meta["files"] if f.startswith("ema/")) == [f"ema/rank{r:05d}.safetensors" for r in range(4)]
    assert len(meta["tensors"]["ema"]["model.layers.0.self_attn.q_proj.weight"]["shards"]) == 4
    reference, parallel = ema(runs / "dp1"), ema(runs / "dp2tp2")
    weights = io.read_model(str(runs / "dp1"))
    assert reference.keys() == parallel.keys() == weights.keys()
    for name in reference:
        assert parallel[name].dtype == torch.float32
        torch.testing.assert_close(parallel[name], reference[name], rtol=0, atol=1e-5, msg=name)
        assert not torch.equal(reference[name], weights[name]), name  # an average, not the weights


def test_a_sharded_ema_resumes_exactly_on_its_layout_and_closely_on_another(runs, tmp_path):
    start = f'checkpoints.resume_checkpoint_path="{runs / "dp2tp2" / "2"}"'
    for layout in ("dp2tp2", "tp2"):
        result = run_layout(layout, tmp_path / layout, EMA, start)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "step 2 done" in result.stdout
    straight, resumed = ema(runs / "dp2tp2"), ema(tmp_path / "dp2tp2")
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)
    other = ema(tmp_path / "tp2")
    for name in straight:
        torch.testing.assert_close(other[name], straight[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", [("2", "1"), ("1", "2")])
def test_the_ema_rows_of_a_sharded_run_are_the_single_process_ones(tmp_path, layout):
    """The EMA is swapped into FSDP2 / TP shards for its evaluation and swapped back: rows and weights as on one process."""
    import json
    import os

    from helpers import REPO
    from process_helpers import PYTHON, TORCHRUN, run_command
    from support.evaluation import rows_of, write_run

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    dp, tp = layout
    runs = {}
    for name, launcher, sets in (("one", (PYTHON,), []),
                                 ("sharded", (*TORCHRUN, "--nproc_per_node", "2"),
                                  ["--set", f"parallelism.dp={dp}", "--set", f"parallelism.tp={tp}",   # the same global batch
                                   "--set", f"tokens.batch_accumulation_per_replica={2 // int(dp)}"])):
        config = write_run(tmp_path / name)
        result = run_command("train", str(config), "--set", EMA, *sets, launcher=launcher, env=env, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        runs[name] = rows_of(tmp_path / name / "run" / "eval.jsonl")
    one, sharded = runs["one"], runs["sharded"]
    assert [(r["step"], r["dataset"], r.get("weights")) for r in sharded] == \
        [(r["step"], r["dataset"], r.get("weights")) for r in one]
    assert any(r.get("weights") == "ema" for r in one)
    for a, b in zip(one, sharded, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), json.dumps([a, b])
    weights, other = io.read_model(str(tmp_path / "one" / "run")), io.read_model(str(tmp_path / "sharded" / "run"))
    for name in weights:
        torch.testing.assert_close(other[name], weights[name], rtol=0, atol=1e-5, msg=name)
