"""Data- and tensor-parallel training in real processes (torchrun, gloo on CPU), and checkpoints that
resume on another layout."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from process_helpers import COMMON, LAYOUT_STEPS, assert_every_rank_reports, layout_overrides, run_layout

from nanoflow import io
from nanoflow.commands.verify import first_difference

pytestmark = pytest.mark.slow

STEPS = LAYOUT_STEPS


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def assert_close_weights(a: dict, b: dict, atol: float = 1e-5):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def runs(layout_run):
    """Every layout trains the same 4 steps of the same schedule; each run dir holds checkpoints 2 and 4."""
    for layout in ("dp1", "dp2", "tp2", "dp2tp2", "tp2sp", "dp2tp2sp"):
        root = layout_run(layout).parent
    return root


@pytest.mark.parametrize("layout", ["dp2", "tp2", "dp2tp2", "tp2sp", "dp2tp2sp"])
def test_parallel_layouts_match_single_process(runs, layout):
    reference, parallel = losses(runs / "dp1"), losses(runs / layout)
    assert parallel.keys() == reference.keys() == set(range(1, STEPS + 1))
    for step in reference:
        assert parallel[step] == pytest.approx(reference[step], abs=1e-5), f"loss of step {step}"
    assert_close_weights(io.read_model(str(runs / layout)), io.read_model(str(runs / "dp1")))


@pytest.mark.parametrize("layout", ["dp2tp2", "dp2tp2sp"])
def test_a_dp_by_tp_run_prints_no_torch_warning_from_each_rank(runs, layout):
    """DTensor warned once per rank that the gradient norm is made whole by two all-reduces (issue 30, item 25);
    nanoflow drops that one warning, with its reason (nanoflow/parallel/mesh.py), and prints its own lines once."""
    said = (runs / f"{layout}.log").read_text()
    assert "sequential all_reduce" not in said and "[rank" not in said, said
    assert said.count("saved step 4:") == 1, said


def test_each_rank_writes_only_its_own_shards(runs):
    meta = io.read_metadata(str(runs / "dp2tp2"))
    assert meta["topology"] == {"dp": 2, "tp": 2, "world_size": 4}
    model_files = sorted(f for f in meta["files"] if f.startswith("model/"))
    assert model_files == [f"model/rank{r:05d}.safetensors" for r in range(4)]
    q = meta["tensors"]["model"]["model.layers.0.self_attn.q_proj.weight"]
    assert len(q["shards"]) == 4                               # a 2 × 2 split of the rows
    assert sum(s["shape"][0] * s["shape"][1] for s in q["shards"]) == q["shape"][0] * q["shape"][1]
    norm = meta["tensors"]["model"]["model.norm.weight"]
    assert len(norm["shards"]) == 2                            # split over dp, written once per tp replica group


@pytest.mark.parametrize("target", ["dp1", "dp4", "tp2", "dp2", "tp2sp"])
def test_resume_a_dp2_tp2_checkpoint_on_another_layout(runs, tmp_path, target):
    resumed = tmp_path / target
    result = run_layout(target, resumed, f'checkpoints.resume_checkpoint_path="{runs / "dp2tp2" / "2"}"')
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming from" in result.stdout and "step 2 done" in result.stdout
    reference = losses(runs / "dp1")
    for step, loss in losses(resumed).items():
        assert step > 2 and loss == pytest.approx(reference[step], abs=1e-5), f"loss of step {step}"
    assert_close_weights(io.read_model(str(resumed)), io.read_model(str(runs / "dp1")))


@pytest.mark.parametrize("target", ["dp1", "tp2", "dp4", "dp2tp2sp"])
def test_weights_and_moments_read_back_exactly_on_any_layout(runs, tmp_path, target):
    source = runs / "dp2tp2" / "2"
    result = run_layout(target, tmp_path, script="tests/resave_worker.py",
                 args=[str(source), str(tmp_path / "resaved"), *COMMON, *layout_overrides(target)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert first_difference(io.read_checkpoint(str(source)), io.read_checkpoint(str(tmp_path / "resaved"))) is None


def test_world_size_that_does_not_match_dp_times_tp_fails_clearly_on_every_rank(tmp_path):
    result = run_layout("dp2", tmp_path, "parallelism.dp=1", timeout=600)
    assert result.returncode != 0
    assert_every_rank_reports(result.stderr, "parallelism.dp × parallelism.tp = 1 × 1")   # no hang
    assert "]: Traceback" not in result.stderr   # a message from each rank, not a stack (torchrun adds its own)


def test_tp_that_does_not_divide_the_kv_heads_fails_clearly_on_every_rank(tmp_path):
    result = run_layout("tp2", tmp_path, "model.num_key_value_heads=1", timeout=600)
    assert result.returncode != 0
    assert_every_rank_reports(result.stderr, "model.num_key_value_heads = 1 is not divisible by parallelism.tp = 2")
    assert "]: Traceback" not in result.stderr


def test_a_checkpoint_that_does_not_fit_the_model_fails_clearly_on_every_rank(runs, tmp_path):
    result = run_layout("dp2", tmp_path, f'checkpoints.resume_checkpoint_path="{runs / "dp2tp2"}"',
                 "model.intermediate_size=96", timeout=600)
    assert result.returncode != 0
    assert_every_rank_reports(result.stderr, "model.intermediate_size was 64, the config now says 96")


def test_a_box_is_read_from_the_files_of_the_shards_it_overlaps_only(runs):
    folder = runs / "dp2tp2" / "2"
    name = "model.layers.0.self_attn.q_proj.weight"
    full = io.read_model(str(folder))[name]
    shards = io.read_metadata(str(folder))["tensors"]["model"][name]["shards"]
    boxes = [(shard["offset"], shard["shape"], {shard["file"]}) for shard in shards]
    first, second = sorted(shards, key=lambda s: s["offset"])[:2]   # a box across two neighbouring row blocks
    rows = first["shape"][0] // 2
    boxes.append(([first["offset"][0] + rows, 0], [rows + second["shape"][0] // 2, full.shape[1]],
                  {first["file"], second["file"]}))
    for offset, shape, files in boxes:
        reader = io.CheckpointReader(str(folder))
        touched, read_range = set(), reader.store.read_range
        reader.store.read_range = (lambda f, start, length, touched=touched, read_range=read_range:
                                   touched.add(f) or read_range(f, start, length))
        box = reader.read("model", name, offset, shape)
        assert torch.equal(box, full[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]])
        assert touched == files, (offset, shape)


def test_damage_seen_by_one_rank_falls_back_on_every_rank(runs, tmp_path):
    run_dir = tmp_path / "dp2"
    shutil.copytree(runs / "dp2", run_dir)
    damaged = run_dir / "4" / "model" / "rank00001.safetensors"   # read by rank 1 alone on this layout
    data = bytearray(damaged.read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    damaged.write_bytes(bytes(data))
    result = run_layout("dp2", run_dir, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"warning: {run_dir}/4 is damaged" in result.stdout and "rank00001.safetensors is damaged" in result.stdout
    assert f"resuming from {run_dir}/2: step 2 done" in result.stdout
    reference = losses(runs / "dp1")
    resumed = losses(run_dir)   # the copied log holds steps 1–4; the resumed run rewrote 3 and 4
    assert resumed.keys() == set(range(1, STEPS + 1))
    for step in (3, 4):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-5), f"loss of step {step}"
    assert_close_weights(io.read_model(str(run_dir)), io.read_model(str(runs / "dp1")))


MASKED = ["tokens.document_masking=true", 'data_stages.pretrain.data.dataset.sample_by="paragraph"']


def test_document_masking_trains_the_same_on_fsdp_tensor_and_sequence_parallel_layouts(tmp_path):
    # The documents reach every rank's attention whole (sequence parallelism gathers the positions there), and
    # FSDP2 passes the position ids through: the same losses and weights as one process.
    for layout in ("dp1", "tp2", "dp2tp2sp"):
        result = run_layout(layout, tmp_path / layout, *MASKED)
        assert result.returncode == 0, f"{layout}:\n{result.stdout}\n{result.stderr}"
    rows = [json.loads(line) for line in (tmp_path / "dp1" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["target_tokens"] < r["tokens"] for r in rows)   # documents met in the windows: targets masked
    reference = losses(tmp_path / "dp1")
    for layout in ("tp2", "dp2tp2sp"):
        parallel = losses(tmp_path / layout)
        assert parallel.keys() == reference.keys() == set(range(1, STEPS + 1))
        for step in reference:
            assert parallel[step] == pytest.approx(reference[step], abs=1e-5), f"{layout}: loss of step {step}"
        assert_close_weights(io.read_model(str(tmp_path / layout)), io.read_model(str(tmp_path / "dp1")))
