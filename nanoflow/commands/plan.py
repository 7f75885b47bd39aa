"""The plan of a run as text: what `bin/train CONFIG --plan` prints. Reads the config and the tokenizer, and an SFT
stage's rows (tokenized into the cache training reads, when they are not there yet), to count their lengths."""

from __future__ import annotations

from nanoflow.config import NanosetDatasetsArgs, locate_source, stage_rope, untrained_splits
from nanoflow.data.sources import sft_summaries
from nanoflow.lr import scheduled_lr
from nanoflow.observe import plan_figure
from nanoflow.observe.plan_figure import shown_path
from nanoflow.schedule import consumed_samples, consumed_tokens, stage_steps


def render_plan(run) -> str:
    """The plan of `run` (nanoflow.run.open_run(config, join=False)), with a line naming its tokenizer and that
    tokenizer's special tokens."""
    config, schedule = run.config, run.schedule
    samples = consumed_samples(schedule, schedule.train_steps)
    tokens = consumed_tokens(schedule, schedule.train_steps)
    ropes = [stage_rope(config, i) for i in range(len(schedule.stages))]
    per_stage = len(set(ropes)) > 1   # a column only when a stage changes it; else one line says it
    header = ("stage", "steps", "n steps", "global batch", "seq len", *(("rope",) if per_stage else ()), "samples",
              "tokens", "lr first → last")
    rows = []
    for i, stage in enumerate(schedule.stages):
        steps = stage_steps(schedule, i)
        if steps:
            first, last = steps[0], steps[-1]
            own = " (own)" if config.data_stages[i].learning_rate_scheduler is not None else ""
            lr = f"{scheduled_lr(first, config, schedule):.3g} → {scheduled_lr(last, config, schedule):.3g}{own}"
            span = f"{first}–{last}"
        else:
            lr, span = "not reached", f"{stage.start_step}– (after train_steps)"
        rows.append((stage.name, span, f"{len(steps):,}", f"{stage.global_batch_size:,}",
                     f"{stage.sequence_length:,}", *((ropes[i].describe(),) if per_stage else ()), f"{samples[i]:,}",
                     f"{tokens[i]:,}", lr))
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    left = {0, 1, 5} if per_stage else {0, 1}   # the names, spans and RoPEs; the numbers align right

    def line(cells) -> str:
        return "  ".join(cell.ljust(w) if c in left else cell.rjust(w)
                         for c, (cell, w) in enumerate(zip(cells, widths, strict=True)))

    model = config.model
    out = [
        f"{config.general.project}/{config.general.run}: {schedule.train_steps:,} steps, "
        f"{len(schedule.stages)} stage{'s' * (len(schedule.stages) != 1)}, dp={config.parallelism.dp} tp={config.parallelism.tp}"
        + (" (sequence parallel)" if config.parallelism.tp_mode == "REDUCE_SCATTER" else ""),
        f"model: {_family(model)}{model.num_hidden_layers} layers × {model.hidden_size} hidden, "
        f"{model.num_attention_heads} heads ({model.num_key_value_heads} kv), vocab {model.vocab_size}, {model.dtype}",
        _tokenizer_line(run.tokenizer),
        *([] if per_stage else [f"rope: {ropes[0].describe()}, in every stage"]),
        "",
        line(header),
        line(["─" * w for w in widths]),
        *(line(r) for r in rows),
        "",
        f"total: {sum(samples):,} samples, {sum(tokens):,} tokens",
        *_reading_lines(config),
        *_sft_lines(run),
        *untrained_splits(config),
        f"checkpoints: {shown_path(config.checkpoints.checkpoints_path)} every {config.checkpoints.checkpoint_interval} steps",
    ]
    return "\n".join(out)


def _family(model) -> str:
    """A family other than Llama, named first: "qwen3 (head_dim 128), "."""
    if model.model_type == "llama":
        return ""
    head = "" if model.head_dim * model.num_attention_heads == model.hidden_size else f" (head_dim {model.head_dim})"
    return f"{model.model_type}{head}, "


_SAMPLE_BY = {"document": "each text file one document", "line": "each line one document",
              "paragraph": "each paragraph one document"}


def _reading_lines(config) -> list[str]:
    """How the stages and eval sets read their text, where it is worth saying: the text builder's sample_by (what
    a document is), and document masking (each document attends to itself only, its positions from 0)."""
    lines = []
    for i, stage in enumerate(config.data_stages):
        dataset, parts = stage.data.dataset, []
        if not isinstance(dataset, NanosetDatasetsArgs) and not dataset.is_sft and \
                any(locate_source(dataset, name).builder == "text" for name, _ in dataset.weighted_names()):
            parts.append(f'sample_by = "{dataset.sample_by}" ({_SAMPLE_BY[dataset.sample_by]})')
        if config.stage_tokens(i).document_masking:
            parts.append("document masking")
        if parts:
            lines.append(f'stage "{stage.name}": ' + ", ".join(parts))
    for entry in config.evaluation.datasets if config.evaluation is not None else ():
        if config.eval_document_masking(entry):
            lines.append(f'eval set "{entry.name}": document masking')
    return lines


def _sft_lines(run) -> list[str]:
    """For each SFT stage, from its tokenized rows: its samples, those longer than a row and what is done with
    them, and the share of padding one sample a row and packed."""
    lines = []
    for i, stage in enumerate(run.config.data_stages):
        dataset = stage.data.dataset
        if isinstance(dataset, NanosetDatasetsArgs) or not dataset.is_sft:
            continue
        seq = run.schedule.stages[i].sequence_length
        for spec, s in sft_summaries(dataset, stage.name, run.tokenizer, seq):
            label = f"{spec.builder}: " + ", ".join(map(shown_path, spec.files)) if spec.files else spec.name
            kind = "conversations" if dataset.is_chat else "prompt/completion rows"
            too_long = (f"{s.overlong:,} longer than sequence_length + 1 = {seq + 1} tokens, "
                        + ("left out" if dataset.overlong_samples == "drop" else "cut to it keeping their start")
                        + f' (overlong_samples = "{dataset.overlong_samples}")') if s.overlong else \
                f"none longer than sequence_length + 1 = {seq + 1} tokens"
            packed = f"{s.padding_packed:.1%} packed into {s.windows_packed:,} windows"
            padding = (f"padding {packed} (packing = true), {s.padding_unpacked:.1%} one a row" if dataset.packing else
                       f"padding {s.padding_unpacked:.1%} one a row, {packed} with packing = true")
            lines.append(f'stage "{stage.name}" ({label}): {s.samples:,} {kind} trained on; {too_long}; {padding}')
    return lines


def source_shares(run, step: int) -> dict[str, float] | None:
    """The share of each source of the blend in the samples of global step `step` (nanoflow.observe.plan_figure's,
    for an opened run)."""
    return plan_figure.source_shares(run.config, run.schedule, step)


def _tokenizer_line(tokenizer) -> str:
    bos = f", bos {tokenizer.bos_token} = {tokenizer.bos_id}" if tokenizer.bos_token is not None else ""
    return f"tokenizer: {shown_path(tokenizer.name)}, {tokenizer.vocab_size:,} ids, eos {tokenizer.eos_token} = " \
           f"{tokenizer.eos_id}{bos}"
