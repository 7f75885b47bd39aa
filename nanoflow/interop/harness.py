"""bin/eval --lm-eval: EleutherAI's lm-evaluation-harness on a checkpoint, through the HF export.

The checkpoint is exported (nanoflow.interop.export) to a temporary folder that lm-eval's HF model loads, in
float32 as saved; the folder is gone afterwards. Tasks are named as lm-eval's own --tasks names them: its task
and group names, YAML files of tasks of one's own, or a folder of them; resolved before anything is exported.
"""

from __future__ import annotations

import logging
import tempfile

from nanoflow.errors import ConfigError, MissingExtraError
from nanoflow.interop.export import export_hf

log = logging.getLogger(__name__)


def require_lm_eval():
    """The lm_eval package, or the error that says how to install it (exit 2, before any work)."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401 - its HF model, which needs the [hf] extra (accelerate)
        from lm_eval.config.evaluate_config import EvaluatorConfig  # noqa: F401 - the API this module uses
    except ImportError:
        raise MissingExtraError("bin/eval --lm-eval", "'lm-eval[hf]'", "lm-eval") from None
    return lm_eval


def resolve_tasks(tasks: str, include_path: str | None = None):
    """(task list, task manager) as lm-eval's command line resolves TASKS: names, *.yaml files, a folder."""
    require_lm_eval()
    from lm_eval.config.evaluate_config import EvaluatorConfig

    config = EvaluatorConfig(tasks=tasks, include_path=include_path)
    try:
        manager = config.process_tasks()
    except (ValueError, OSError) as e:
        raise ConfigError(f"--lm-eval {tasks}: {e}") from None
    if not config.tasks:
        raise ConfigError(f"--lm-eval {tasks}: no tasks found")
    return config.tasks, manager


def run_lm_eval(checkpoint: str, tasks: str, *, include_path: str | None = None, batch_size: int = 16,
                device: str | None = None, log_samples: bool = False) -> tuple[list[dict], dict]:
    """lm-eval's results on `checkpoint`: one row per task ({"step", "task", "samples", metric: value, ...},
    metric names without lm-eval's ",none" filter suffix) and lm-eval's whole result dict."""
    lm_eval = require_lm_eval()
    resolved, manager = resolve_tasks(tasks, include_path)
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="nanoflow-lm-eval-") as folder:
        summary = export_hf(checkpoint, folder)
        log.info(f"exported step {summary['step']} of {checkpoint}; lm-eval on {device}: {tasks}")
        results = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": folder, "dtype": "float32"},
                                          tasks=resolved, task_manager=manager, batch_size=batch_size,
                                          device=device, log_samples=log_samples)
    rows = []
    for task, values in results["results"].items():
        row = {"step": summary["step"], "task": task}
        counts = results.get("n-samples", {}).get(task)
        if counts:
            row["samples"] = counts.get("effective")
        for key, value in values.items():
            if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
                continue
            row[key.removesuffix(",none")] = value
        rows.append(row)
    return rows, results
