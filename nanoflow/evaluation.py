"""Evaluation: fixed eval sets scored by loss or exact match, during training and by bin/eval.

An eval set's samples are a pure function of the config and its data: `max_samples` of them, evenly
spaced over the set (its sources one after another, in config order; blend weights play no part),
so every evaluation, on any dp × tp, before and after a resume, scores the same samples. Data-parallel
rank r scores the r-th contiguous slice, padded to the same length on every rank (FSDP and tensor
parallelism need every rank in every forward), and the sums (loss, target tokens, right answers) are
added up over the replicas.

exact_match: an example is right when greedy decoding of its completion's length reproduces every
target token (the completion and its end-of-text, the tokens its loss is taken over; for a chat set, the
conversation up to its last assistant message, whose tokens are the targets: the prompt is the conversation
before it with the generation prompt, nanoflow.data.chat.ChatTemplate.answer). Greedy decoding
continues a right prefix with the argmax, so the decoded answer equals the target exactly when, at
each target position, the argmax given the true prefix is the true token: one teacher-forced forward
gives the verdict token-by-token decoding would, for every example of a batch at once
(tests/unit/test_evaluation.py decodes token by token and checks that both agree).

The model scores from its final hidden states a chunk of positions at a time (nanoflow.loss.token_scores, the
fused loss's chunks): the logits of a whole micro-batch, [rows × sequence × vocabulary], never exist.

Evaluation runs under torch.inference_mode and touches no parameter, moment or data order: a run
with evaluation trains the very weights a run without it trains.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math

import attrs
import numpy as np
import torch

from nanoflow.build import build_model
from nanoflow.config import Config, EvalDatasetArgs
from nanoflow.data.choices import ChoiceRequests, read_examples, requests, right_answers
from nanoflow.data.fingerprint import short_digest
from nanoflow.data.sources import IGNORE_INDEX, open_sources
from nanoflow.data.tokens import StageDataError
from nanoflow.io import read_init_weights
from nanoflow.observe.metrics import EVAL_FILE, MetricsLog
from nanoflow.parallel import threads
from nanoflow.parallel.agree import on_every_rank
from nanoflow.parallel.mesh import Topology, all_reduce_sum
from nanoflow.parallel.shards import load_weights, local_tensor
from nanoflow.run import Run, open_run
from nanoflow.schedule import Schedule, active_stage, stage_steps

log = logging.getLogger(__name__)


@attrs.frozen
class EvalSet:
    """The samples of one [[evaluation.datasets]] entry, as they are scored every time."""

    name: str
    metric: str                    # "loss" or "exact_match"
    input_ids: torch.Tensor        # [samples, sequence_length] int64
    labels: torch.Tensor           # the same shape; IGNORE_INDEX where no loss is taken
    micro_batch_size: int
    position_ids: torch.Tensor | None = None   # with document masking: restarting at 0 at each document
    data_fingerprint: str | None = None        # the short digest of its fingerprint (nanoflow.data.fingerprint)
    choices: ChoiceRequests | None = None      # multiple_choice: which example and choice each row asks about

    @property
    def answerable(self) -> int:
        """Examples with at least one target token: the denominator of accuracy."""
        return int((self.labels != IGNORE_INDEX).any(dim=1).sum())


def pick(total: int, max_samples: int) -> np.ndarray:
    """min(max_samples, total) indices evenly spaced over range(total): all of a small set, a spread of a large one."""
    count = min(max_samples, total)
    return (np.arange(count, dtype=np.int64) * total) // count


def load_eval_set(config: Config, entry: EvalDatasetArgs, tokenizer) -> EvalSet:
    """Open the entry's data (a stage's held-out tail, or its own dataset), take its fixed samples, close it."""
    sequence_length = config.eval_sequence_length(entry)
    if entry.metric == "multiple_choice":
        return load_choice_set(config, entry, tokenizer, sequence_length)
    if entry.held_out_of is not None:   # messages name the stage: it is that stage's data
        stage = next(s for s in config.data_stages if s.name == entry.held_out_of)
        dataset, label = stage.data.dataset, stage.name
    else:
        assert entry.dataset is not None   # exactly one of dataset and held_out_of (config.data_checks)
        dataset, label = entry.dataset, f"evaluation {entry.name}"
    masking = config.eval_document_masking(entry)
    named = open_sources(dataset, label, tokenizer, sequence_length, None, config.model.vocab_size,
                         config.tokenizer.accept_recorded_names or (), held_out=entry.held_out_of is not None,
                         document_masking=masking, answers=entry.metric == "exact_match")
    try:
        sizes = np.array([len(n.source) for n in named], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        picks = pick(int(bounds[-1]), entry.max_samples)
        which = np.searchsorted(bounds, picks, side="right") - 1
        inputs = np.empty((len(picks), sequence_length), np.int64)
        labels = np.empty_like(inputs)
        positions = np.tile(np.arange(sequence_length), (len(picks), 1)) if masking else None
        for k, n in enumerate(named):
            rows = np.flatnonzero(which == k)
            if rows.size:
                read = n.source.samples(picks[rows] - bounds[k])
                inputs[rows], labels[rows] = read.input_ids, read.labels
                if read.position_ids is not None:   # else one document a row: positions 0..seq-1
                    if positions is None:
                        positions = np.tile(np.arange(sequence_length), (len(picks), 1))
                    positions[rows] = read.position_ids
    finally:
        for n in named:
            n.source.close()
    top = int(max(inputs.max(), labels.max()))
    assert config.model.vocab_size is not None   # a complete [model]
    if top >= config.model.vocab_size:
        raise StageDataError(f'eval set "{entry.name}": token id {top} is outside model.vocab_size = '
                             f"{config.model.vocab_size} (was the data tokenized for another model?)")
    return EvalSet(entry.name, entry.metric, torch.from_numpy(inputs), torch.from_numpy(labels),
                   entry.micro_batch_size or config.tokens.micro_batch_size,
                   None if positions is None else torch.from_numpy(positions))


def load_choice_set(config: Config, entry: EvalDatasetArgs, tokenizer, sequence_length: int) -> EvalSet:
    """A multiple_choice set: a row per choice of each of its examples (nanoflow.data.choices)."""
    where = f"evaluation {entry.name}"
    context, choices, answer, delimiter = entry.choice_format
    examples = read_examples(entry.dataset, where, (context, choices, answer), entry.max_samples)
    asked = requests(examples, tokenizer, sequence_length, delimiter, config.parallelism.tp, where)
    top = int(asked.input_ids.max(initial=0))
    assert config.model.vocab_size is not None   # a complete [model]
    if top >= config.model.vocab_size:
        raise StageDataError(f'eval set "{entry.name}": token id {top} is outside model.vocab_size = '
                             f"{config.model.vocab_size}")
    return EvalSet(entry.name, entry.metric, torch.from_numpy(asked.input_ids), torch.from_numpy(asked.labels),
                   entry.micro_batch_size or config.tokens.micro_batch_size, choices=asked)


def load_eval_sets(config: Config, tokenizer, fingerprints: dict | None = None) -> list[EvalSet]:
    """The config's eval sets; each carries the short digest of its fingerprint in `fingerprints` ({name:
    fingerprint}: the run's, nanoflow.data.fingerprint.Fingerprints.evals), which their rows record."""
    if config.evaluation is None:
        return []
    fingerprints = fingerprints or {}
    return [attrs.evolve(load_eval_set(config, entry, tokenizer), data_fingerprint=short_digest(fingerprints[entry.name])
                         if entry.name in fingerprints else None) for entry in config.evaluation.datasets]


def score(model: torch.nn.Module, eval_set: EvalSet, topology: Topology, dtype: str = "float32") -> dict:
    """{"loss", "tokens"} (+ "accuracy") of `model` on `eval_set`, the same on every rank."""
    from nanoflow.step import _autocast  # the training forward's precision, from the one place that sets it

    if eval_set.choices is not None:
        return score_choices(model, eval_set, topology, dtype)
    total = len(eval_set.input_ids)
    per_rank = math.ceil(total / topology.dp)
    start = min(topology.dp_rank * per_rank, total)
    ids, labels = eval_set.input_ids[start:start + per_rank], eval_set.labels[start:start + per_rank]
    positions = None if eval_set.position_ids is None else eval_set.position_ids[start:start + per_rank]
    padding = per_rank - len(ids)
    if padding:  # rows without targets: they count for nothing, but this rank runs the same forwards as the others
        ids = torch.cat([ids, torch.zeros(padding, ids.shape[1], dtype=ids.dtype)])
        labels = torch.cat([labels, torch.full((padding, labels.shape[1]), IGNORE_INDEX, dtype=labels.dtype)])
        if positions is not None:
            positions = torch.cat([positions, torch.arange(ids.shape[1]).expand(padding, -1)])
    target_device = next(model.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=target_device)   # loss, target tokens, right answers
    with torch.inference_mode():
        chunks = [None] * len(ids.split(eval_set.micro_batch_size)) if positions is None \
            else positions.split(eval_set.micro_batch_size)
        for x, y, where in zip(ids.split(eval_set.micro_batch_size), labels.split(eval_set.micro_batch_size), chunks,
                               strict=True):
            x, y = x.to(target_device), y.to(target_device)
            with _autocast(dtype, target_device):
                nll, argmax_right = model(x, y, ignore_index=IGNORE_INDEX, position_ids=where, scores=True)
            targets = y != IGNORE_INDEX
            # Each position's float32 value summed in float64: how the positions fall into micro-batches and
            # ranks moves the total by float64 roundings only, far below the float32 values' own
            sums[0] += nll.sum(dtype=torch.float64)
            sums[1] += targets.sum()
            if eval_set.metric == "exact_match":
                right = (argmax_right | ~targets).all(dim=1) & targets.any(dim=1)
                sums[2] += right.sum()
    loss, tokens, right = all_reduce_sum(sums, topology).tolist()
    result = {"loss": loss / max(tokens, 1), "tokens": int(tokens)}
    if eval_set.metric == "exact_match":
        result["accuracy"] = right / max(eval_set.answerable, 1)
        result["correct"] = int(right)
    return result


def choice_loglikelihoods(model: torch.nn.Module, eval_set: EvalSet, topology: Topology, dtype: str = "float32"
                          ) -> np.ndarray:
    """Every row's log-likelihood of its continuation (float64, rows in order), the same on every rank.

    Rank r scores the r-th contiguous slice of the rows and adds them into their places of a vector of all rows
    (zeros elsewhere), so the sum over the replicas is every row's own value, from which every rank picks alike."""
    from nanoflow.step import _autocast

    total = len(eval_set.input_ids)
    per_rank = math.ceil(total / topology.dp)
    start = min(topology.dp_rank * per_rank, total)
    ids, labels = eval_set.input_ids[start:start + per_rank], eval_set.labels[start:start + per_rank]
    mine = len(ids)
    if per_rank - mine:  # rows without targets, so this rank runs the same forwards as the others
        ids = torch.cat([ids, torch.zeros(per_rank - mine, ids.shape[1], dtype=ids.dtype)])
        labels = torch.cat([labels, torch.full((per_rank - mine, labels.shape[1]), IGNORE_INDEX, dtype=labels.dtype)])
    target_device = next(model.parameters()).device
    found = torch.zeros(total, dtype=torch.float64, device=target_device)
    with torch.inference_mode():
        row = start
        for x, y in zip(ids.split(eval_set.micro_batch_size), labels.split(eval_set.micro_batch_size), strict=True):
            x, y = x.to(target_device), y.to(target_device)
            with _autocast(dtype, target_device):
                nll, _ = model(x, y, ignore_index=IGNORE_INDEX, scores=True)
            real = max(0, min(len(x), start + mine - row))   # padding rows have no place in the vector
            found[row:row + real] = -nll[:real].sum(dim=1, dtype=torch.float64)
            row += len(x)
    return all_reduce_sum(found, topology).cpu().numpy()


def score_choices(model: torch.nn.Module, eval_set: EvalSet, topology: Topology, dtype: str = "float32") -> dict:
    """A multiple_choice set's {"loss", "tokens"} (over the right choices' continuation tokens), "accuracy" and
    "accuracy_norm" (lm-eval's acc and acc_norm) with their counts, and its "examples"."""
    asked = eval_set.choices
    assert asked is not None   # a multiple_choice set (score's dispatch)
    lls = choice_loglikelihoods(model, eval_set, topology, dtype)
    right, right_norm = right_answers(lls, asked)
    gold = asked.gold_rows
    tokens = int((eval_set.labels[torch.from_numpy(gold)] != IGNORE_INDEX).sum())
    examples = len(asked.gold)
    return {"loss": float(-lls[gold].sum()) / max(tokens, 1), "tokens": tokens, "accuracy": right / examples,
            "correct": right, "accuracy_norm": right_norm / examples, "correct_norm": right_norm,
            "examples": examples}


def evaluate(model: torch.nn.Module, sets: list[EvalSet], topology: Topology, step: int, stage: str,
             dtype: str = "float32", ema: bool = False) -> list[dict]:
    """One row per eval set, as eval.jsonl holds them, and a progress line saying them. With `ema` (the model
    holds the weight EMA), each row's dataset is "<name>@ema" and it says "weights": "ema": its own series
    wherever rows are drawn by dataset (the report, bin/compare, TensorBoard)."""
    tag = {"weights": "ema"} if ema else {}
    rows = [{"step": step, "stage": stage, "dataset": s.name + "@ema" * ema, **tag, **score(model, s, topology, dtype)}
            | ({"data_fingerprint": s.data_fingerprint} if s.data_fingerprint is not None else {}) for s in sets]
    log.info(f"eval step {step} ({stage}){' EMA weights' * ema}: " + "  ".join(
        f"{r['dataset']} loss {r['loss']:.4f}" + (
            f" acc {r['accuracy']:.1%} acc_norm {r['accuracy_norm']:.1%}" if "accuracy_norm" in r
            else f" exact {r['accuracy']:.1%}" if "accuracy" in r else "")
        for r in rows))
    return rows


def is_due(config: Config, schedule: Schedule, step: int) -> bool:
    """Every evaluation.interval steps, and at each stage's last step (the run's end among them). Not at a stop
    by a signal: the rows stay a function of the step, so a resumed run writes what an unbroken one writes."""
    if config.evaluation is None:
        return False
    interval = config.evaluation.interval
    last_of_stage = stage_steps(schedule, active_stage(schedule, step))[-1]
    return (interval is not None and step % interval == 0) or step == last_of_stage


class Evaluator:
    """The loop's evaluation: `maybe_run(state)` after each step evaluates when it is due, writes the rows to
    <run>/eval.jsonl (rank 0) and TensorBoard, and says them. Does nothing without [evaluation]."""

    def __init__(self, run: Run, start_step: int, views: tuple = ()):
        # views: what else shows the rows (TensorBoard, W&B), each by its write_eval(row)
        self.config, self.topology, self.views = run.config, run.topology, tuple(views)
        # Rank 0 writes the rows: it alone hashes the sets' files (once for the run: its checkpoints record them too)
        self.sets = load_eval_sets(run.config, run.tokenizer, run.fingerprints.evals() if run.topology.is_main else None)
        # eval.jsonl: metrics.jsonl's own writer, with its truncation of the rows after the resumed step
        self.rows = MetricsLog(run.folder / EVAL_FILE, start_step, run.topology.is_main and bool(self.sets))

    def __enter__(self) -> Evaluator:
        self.rows.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.rows.__exit__(*exc)

    def maybe_run(self, state) -> list[dict]:
        if not self.sets or not is_due(self.config, state.schedule, state.step):
            return []
        stage = state.schedule.stages[active_stage(state.schedule, state.step)].name
        rows = evaluate(state.model, self.sets, self.topology, state.step, stage, self.config.model.dtype)
        if state.ema is not None:
            with ema_weights(state.model, state.ema):
                rows += evaluate(state.model, self.sets, self.topology, state.step, stage, self.config.model.dtype,
                                 ema=True)
        for row in rows:
            self.rows.write(row)
            for view in self.views:
                view.write_eval(row)
        return rows


@contextlib.contextmanager
def ema_weights(model: torch.nn.Module, ema: dict[str, torch.Tensor]):
    """The model holding the weight EMA inside the block, its own weights back, bit for bit, after it. Swapped in
    place, shard by shard (no second model: under FSDP2 and TP the EMA is sharded as the weights are); the
    weights are float32, so the copy back is exact."""
    _reshard(model)
    params = dict(model.named_parameters())
    kept = {name: local_tensor(p).clone() for name, p in params.items()}
    try:
        with torch.no_grad():
            for name, p in params.items():
                local_tensor(p).copy_(local_tensor(ema[name]))
        yield model
    finally:
        _reshard(model)
        with torch.no_grad():
            for name, p in params.items():
                local_tensor(p).copy_(kept[name])


def _reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 module back to its sharded parameters: the root keeps its gathered ones after a forward without
    backward (an evaluation), and the swap works on the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# ---------------------------------------------------------------------------------------------
# bin/eval: a committed checkpoint, evaluated without training

def load_checkpoint_weights(config: Config, topology: Topology, reader, path: str, stage: int = 0) -> torch.nn.Module:
    """The model of `config` on `topology` with stage `stage`'s RoPE, its weights read from `reader` (each rank
    reads only its own boxes)."""
    model = build_model(config, topology, init=False, stage=stage)
    on_every_rank(lambda: load_weights(model, reader, path), topology)
    return model


def evaluate_checkpoint(path: str, config: Config | None = None, overrides=(), topology: Topology | None = None
                        ) -> list[dict]:
    """Evaluate the checkpoint at `path` on `config`'s eval sets (default: the config the checkpoint recorded,
    with `overrides` applied as --set does), its run opened on `topology` (nanoflow.run.open_run). The rows are
    those training writes to eval.jsonl at that step."""
    from nanoflow.config import ConfigError, config_from_dict

    reader = read_init_weights(path)  # a run folder's latest intact checkpoint, or a step folder; local or s3://
    metadata = getattr(reader, "metadata", None)
    if metadata is None:
        raise ConfigError(f"{path}: an HF model folder, not a nanoflow checkpoint; bin/eval reads checkpoints")
    if config is None:
        config = config_from_dict(metadata["config"], f"{path} (its recorded config)", list(overrides))
    if config.evaluation is None:
        raise ConfigError(f"{path}: the config has no [evaluation] datasets to evaluate on; pass a CONFIG that has "
                          "[[evaluation.datasets]], or add them with --set")
    step = int(metadata["step"])
    if threads.chosen():   # the checkpoint's count: the rows training wrote, bit for bit
        count, line = threads.choose(metadata.get("threads"))
        threads.apply(count)
        log.info(line)
    names = [entry.name for entry in config.evaluation.datasets]
    log.info(f"evaluating {reader.path} (step {step}) on {len(names)} eval set{'s' * (len(names) != 1)}: "
             f"{', '.join(names)}; reading the data and the weights")   # minutes can pass before its rows
    run = open_run(config, topology=topology)
    config = run.config   # its [model] complete
    sets = load_eval_sets(config, run.tokenizer, run.fingerprints.evals() if run.topology.is_main else None)
    schedule = run.schedule
    index = active_stage(schedule, min(step, schedule.train_steps))   # evaluated with the RoPE it trained with
    model = load_checkpoint_weights(config, run.topology, reader, path, index)
    log.info(f"scoring {sum(len(s.input_ids) for s in sets):,} samples" + "".join(
        f"; {s.name}: greedy answers to {len(s.input_ids):,} prompts" for s in sets if s.metric == "exact_match")
        + "".join(f"; {s.name}: {len(s.input_ids):,} choices of {len(s.choices.gold):,} questions"
                  for s in sets if s.choices is not None))
    return evaluate(model, sets, run.topology, step, schedule.stages[index].name, config.model.dtype)


def format_rows(rows: list[dict]) -> str:
    return "\n".join(json.dumps(row) for row in rows)
