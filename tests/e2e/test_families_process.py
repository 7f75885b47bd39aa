"""Each model family in real processes: bin/verify-resume passes on one process; under torchrun (gloo, dp=2 × tp=2;
olmo2 dp=4) the run matches the single-process one and a stopped run resumes to the same bits; that checkpoint
exports to a folder of the family that transformers loads, and bin/eval's loss is transformers' on the same
eval samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import TINY, tiny
from process_helpers import COMMON, TORCHRUN, run_command

from nanoflow import io, load_config
from nanoflow.commands.verify import first_difference
from nanoflow.data import load_run_tokenizer
from nanoflow.evaluation import load_eval_set
from nanoflow.interop.nanotron import to_toml

pytestmark = pytest.mark.slow

# tiny.toml's model as each family, with what sets the family apart switched on (q/k/v and o biases, a q/k norm
# per head or over the projection, head_dim ≠ hidden / heads, a window no sequence reaches, a layer without RoPE,
# norms after the blocks), and the 4-process layout it runs on (olmo2 has no tensor parallelism)
FAMILIES = {
    "qwen2": (['model.model_type="qwen2"'], (2, 2)),
    "qwen3": (['model.model_type="qwen3"', "model.head_dim=16", "model.attention_bias=true"], (2, 2)),
    "mistral": (['model.model_type="mistral"', "model.head_dim=12", "model.sliding_window=64"], (2, 2)),
    "smollm3": (['model.model_type="smollm3"', "model.no_rope_layer_interval=2", "model.attention_bias=true"],
                (2, 2)),
    "olmo2": (['model.model_type="olmo2"', "model.head_dim=12", "model.attention_bias=true"], (4, 1)),
}
WORDS = TINY.parent / "data" / "words" / "pretrain.txt"
ENV = {"OMP_NUM_THREADS": "1"}


def family_config(tmp_path: Path, family: str) -> Path:
    """tiny.toml as `family` (COMMON's 4 steps, saved every 2) with an eval set, written out whole (paths absolute)."""
    raw = tiny(tmp_path / "unused", *COMMON, *FAMILIES[family][0]).to_dict()
    raw["evaluation"] = {"datasets": [{"name": "words", "max_samples": 6, "dataset": {
        "hf_dataset_or_datasets": "text", "hf_data_files": [str(WORDS)]}}]}
    path = tmp_path / f"{family}.toml"
    path.write_text(to_toml(raw))
    return path


def train(config: Path, run: Path, *extra: str, layout=(1, 1)):
    dp, tp = layout
    launcher = (*TORCHRUN, "--nproc_per_node", str(dp * tp)) if dp * tp > 1 else None
    args = [str(config), "--set", f"checkpoints.checkpoints_path={json.dumps(str(run))}",
            "--set", f"parallelism.dp={dp}", "--set", f"parallelism.tp={tp}", *extra]
    result = run_command("train", *args, env=ENV, **({"launcher": launcher} if launcher else {}))
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_resumes_exactly_on_one_process_and_on_4_processes_and_exports_what_bin_eval_scores(tmp_path,
                                                                                                        family):
    config = family_config(tmp_path, family)
    verified = run_command("verify-resume", config, "--kills", "2", "--seed", "1", "--workdir", tmp_path / "verify",
                           env=ENV)
    assert verified.returncode == 0 and "PASS" in verified.stdout, verified.stdout + verified.stderr
    single = tmp_path / "verify" / "straight"

    layout = FAMILIES[family][1]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(config, straight, layout=layout)
    train(config, stopped, "--until-step", "2", layout=layout)
    assert io.read_metadata(str(stopped))["step"] == 2
    resumed = train(config, stopped, layout=layout)
    assert "resum" in resumed.stdout
    assert first_difference(io.read_checkpoint(str(straight)), io.read_checkpoint(str(stopped))) is None
    ours, reference = io.read_model(str(straight)), io.read_model(str(single))
    assert ours.keys() == reference.keys()
    for name in ours:   # another layout: the same model to float rounding
        torch.testing.assert_close(ours[name], reference[name], rtol=0, atol=1e-5, msg=name)

    exported = run_command("export", straight, tmp_path / "hf")
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family
    scored = run_command("eval", straight, config)
    assert scored.returncode == 0, scored.stderr
    row = json.loads(scored.stdout.strip().splitlines()[-1])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    settings = load_config(config)
    samples = load_eval_set(settings, settings.evaluation.datasets[0], load_run_tokenizer(settings))
    with torch.no_grad():
        logits = model(samples.input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), samples.labels.flatten(), ignore_index=-100,
                                             reduction="sum") / (samples.labels != -100).sum()
    assert row["dataset"] == "words" and row["loss"] == pytest.approx(loss.item(), abs=1e-5)
