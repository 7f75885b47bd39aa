"""What a step trains on: `bin/preview CONFIG [--step N | --stage NAME] [--rows K] [--json]`.

The rows are read as training reads them (the stage's StageLoader.batch_at, the whole global batch: under
dp = D, rank d trains rows d·B/D to (d+1)·B/D − 1), with no model and no process group. A row is shown as
the text of its window: input_ids, then the last label (the token the last input predicts), decoded in runs
so that multi-byte characters stay whole, with these marks:

    ⟦…⟧   no loss on these tokens: nothing predicts them (a row's first token; an SFT prompt, its
          padding; the first token after an end-of-text token under document masking)
    ‖     a new document starts here: its position id is 0 (document masking only)
    ↵     a newline in the text (the line goes on below); ⇥ a tab
    <|endoftext|>   a special token, as the tokenizer spells it; a run of one repeated: <|endoftext|>×12
"""

from __future__ import annotations

import json

import torch

from nanoflow.config import ConfigError
from nanoflow.data import open_stage
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.run import open_run
from nanoflow.schedule import Schedule, active_stage, stage_steps

NO_LOSS_OPEN, NO_LOSS_CLOSE, NEW_DOCUMENT = "⟦", "⟧", "‖"
LEGEND = (f"{NO_LOSS_OPEN}…{NO_LOSS_CLOSE} no loss on these tokens · {NEW_DOCUMENT} a document starts (position 0) · "
          "↵ newline · ⇥ tab")


def step_of(schedule: Schedule, step: int | None, stage: str | None) -> int:
    """The step to show: `step`, else the first step of stage `stage`, else step 1."""
    if stage is not None:
        names = [s.name for s in schedule.stages]
        if stage not in names:
            raise ConfigError(f'--stage {stage}: no such stage (stages: {", ".join(names)})')
        index = names.index(stage)
        steps = stage_steps(schedule, index)
        if not steps:
            raise ConfigError(f"--stage {stage}: not reached; it starts at step {schedule.stages[index].start_step}, "
                              f"after tokens.train_steps = {schedule.train_steps}")
        return steps[0]
    step = 1 if step is None else step
    if not 1 <= step <= schedule.train_steps:
        raise ConfigError(f"--step {step}: the run trains steps 1 to {schedule.train_steps} (tokens.train_steps)")
    return step


def preview(config, step: int | None = None, stage: str | None = None, rows: int | None = None):
    """(stage name, step, rows shown, rows in the batch, the tokenizer, the batch) of the step to show."""
    run = open_run(config, join=False)   # the checks --plan passes, in this process alone: no model is built
    schedule, tokenizer = run.schedule, run.tokenizer
    step = step_of(schedule, step, stage)
    index = active_stage(schedule, step)
    with open_stage(config, index, tokenizer, schedule) as loader:
        batch = loader.batch_at(step)
    total = len(batch["input_ids"])
    shown = total if rows is None else min(rows, total)
    return schedule.stages[index].name, step, shown, total, tokenizer, batch


def json_rows(step: int, batch: dict[str, torch.Tensor], shown: int) -> list[str]:
    """One JSON object per row: step, row, input_ids, labels, position_ids (0..seq-1 where the batch has none)."""
    seq = batch["input_ids"].shape[1]
    positions = batch.get("position_ids")
    return [json.dumps({"step": step, "row": row, "input_ids": batch["input_ids"][row].tolist(),
                        "labels": batch["labels"][row].tolist(),
                        "position_ids": list(range(seq)) if positions is None else positions[row].tolist()})
            for row in range(shown)]


def _shown_text(text: str) -> str:
    return text.replace("\t", "⇥").replace("\r", "\\r").replace("\n", "↵\n    ")


def render_row(tokenizer, input_ids: list[int], labels: list[int], position_ids: list[int] | None) -> str:
    """A row's window as text with its marks (the module docstring)."""
    tokens = list(input_ids) + ([labels[-1]] if labels[-1] != IGNORE_INDEX else [])
    # token j (j >= 1) is a target when the prediction from token j - 1 is: labels[j - 1] != IGNORE_INDEX
    target = [False] + [label != IGNORE_INDEX for label in labels][:len(tokens) - 1]
    starts = [False] + [p == 0 for p in position_ids[1:]] + [False] if position_ids is not None else []
    specials = tokenizer.special_tokens()
    pieces, run, loss_open = [], [], False

    def flush():
        if run:
            pieces.append(_shown_text(tokenizer.decode(run)))
            run.clear()

    j = 0
    while j < len(tokens):
        if starts and starts[j]:
            flush()
            pieces.append(NEW_DOCUMENT)
        if target[j] == loss_open:   # the loss state changes here
            flush()
            pieces.append(NO_LOSS_CLOSE if loss_open else NO_LOSS_OPEN)
            loss_open = not loss_open
        token = tokens[j]
        if token in specials:
            flush()
            repeat = 1
            while (j + repeat < len(tokens) and tokens[j + repeat] == token and target[j + repeat] == target[j]
                   and not (starts and starts[j + repeat])):
                repeat += 1
            pieces.append(specials[token] + f"×{repeat}" if repeat > 3 else specials[token] * repeat)
            j += repeat
            continue
        run.append(token)
        j += 1
    flush()
    if loss_open:
        pieces.append(NO_LOSS_CLOSE)
    return "".join(pieces)


def render(stage: str, step: int, shown: int, total: int, tokenizer, batch: dict[str, torch.Tensor]) -> str:
    seq = batch["input_ids"].shape[1]
    positions = batch.get("position_ids")
    masking = "document masking" if positions is not None else "no document masking"
    out = [f'step {step} · stage "{stage}" · rows 0–{shown - 1} of {total} · {seq} tokens a row · {masking}', LEGEND]
    for row in range(shown):
        labels = batch["labels"][row].tolist()
        row_positions = None if positions is None else positions[row].tolist()
        documents = "" if row_positions is None else \
            f" · {sum(p == 0 for p in row_positions[1:]) + 1} document" + "s" * any(p == 0 for p in row_positions[1:])
        targets = sum(label != IGNORE_INDEX for label in labels)
        out += ["", f"row {row} · {targets} of {seq} predictions are targets{documents}",
                "    " + render_row(tokenizer, batch["input_ids"][row].tolist(), labels, row_positions)]
    return "\n".join(out)
