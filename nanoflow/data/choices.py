"""Multiple-choice eval sets: rows of (context, choices, answer), the requests lm-evaluation-harness makes of
them, and its acc and acc_norm.

lm-eval (0.4: a zero-shot task of output_type multiple_choice, on its HF model) scores each choice by the
log-likelihood of `target_delimiter + choice` given the context: the sum of the log-probabilities of the
continuation's tokens. Its tokens are split off as lm-eval's `_encode_pair` does: the context's trailing
whitespace moves to the continuation, the whole text and the context are encoded as transformers encodes by
default (the tokenizer's post-processor: a Llama tokenizer's BOS), and the continuation is what the whole has
past the context's tokens; an empty context is the BOS (else the end-of-text) token. A request longer than
sequence_length + 1 tokens loses its first tokens, as lm-eval's do past the model's max_length.

acc: the choice of highest log-likelihood is the answer; acc_norm: the highest log-likelihood per character of
the choice (lm-eval's `len(choice)`, the choice without the delimiter); ties go to the first, as numpy's argmax.
"""

from __future__ import annotations

import attrs
import numpy as np

from nanoflow.data.hf_datasets import load_rows, missing_column
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.data.tokens import StageDataError


@attrs.frozen
class Example:
    context: str
    choices: tuple[str, ...]
    answer: int


@attrs.frozen(eq=False)
class ChoiceRequests:
    """One row per (example, choice), the examples' rows one after another."""

    input_ids: np.ndarray   # [requests, width] int64: context + continuation without its last token, padded
    labels: np.ndarray      # the continuation's tokens where they are predicted; IGNORE_INDEX elsewhere
    example: np.ndarray     # [requests] the example each row asks about
    lengths: np.ndarray     # [requests] the choice's length in characters: acc_norm's divisor
    gold: np.ndarray        # [examples] the index of each example's right choice

    @property
    def gold_rows(self) -> np.ndarray:
        """The row of each example's right choice."""
        starts = np.searchsorted(self.example, np.arange(len(self.gold)))
        return starts + self.gold


def read_examples(dataset, where: str, columns: tuple[str, str, str], max_samples: int) -> list[Example]:
    """`max_samples` rows evenly spaced over the dataset (all of a smaller one), as Examples."""
    rows = load_rows(dataset, where)
    missing = missing_column(rows.column_names, list(columns), where)
    if missing is not None:
        raise missing
    total = len(rows)
    if total == 0:
        raise StageDataError(f"{where}: no rows")
    count = min(max_samples, total)
    picks = (np.arange(count, dtype=np.int64) * total) // count   # as the other eval sets pick theirs
    context, choices, answer = columns
    table = rows.select(picks.tolist()).select_columns(list(columns)).to_dict()
    return [_example(c, o, a, f"{where}: row {int(i)}", columns)
            for i, c, o, a in zip(picks, table[context], table[choices], table[answer], strict=True)]


def _example(context, choices, answer, where: str, columns: tuple[str, str, str]) -> Example:
    if not isinstance(context, str):
        raise StageDataError(f'{where}: column "{columns[0]}" holds {type(context).__name__}, expected text')
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise StageDataError(f'{where}: column "{columns[1]}" holds {choices!r}, expected a list of texts')
    index = answer
    if isinstance(answer, str):   # the choice's text, or its index written as text (lm-eval reads both)
        index = choices.index(answer) if answer in choices else int(answer) if answer.isdigit() else None
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(choices):
        raise StageDataError(f'{where}: column "{columns[2]}" holds {answer!r}, expected the index of one of its '
                             f"{len(choices)} choices (0 to {len(choices) - 1}) or one choice's text")
    return Example(context, tuple(choices), index)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's HF model splits them (the module docstring)."""
    prefix_id = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if context == "":
        tokens = tokenizer.encode(continuation)
        return ([prefix_id], tokens) if tokens[0] != prefix_id else (tokens[:1], tokens[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    prefix = tokenizer.bos_token if tokenizer.bos_id is not None else tokenizer.eos_token

    def encode(text: str) -> list[int]:   # a text that starts with the prefix token gets no second one
        return tokenizer.encode(text) if text.startswith(prefix) else tokenizer.encode_with_specials(text)

    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head):]


def requests(examples: list[Example], tokenizer, sequence_length: int, delimiter: str, multiple: int = 1,
             where: str = "the set") -> ChoiceRequests:
    """Every choice of every example as a row of `sequence_length` tokens at most: its width is the longest
    request's, rounded up to a multiple of `multiple` (tensor parallelism's sequence split)."""
    rows, example, lengths = [], [], []
    for k, item in enumerate(examples):
        for choice in item.choices:
            head, tail = encode_pair(tokenizer, item.context, delimiter + choice)
            if not tail or len(tail) > sequence_length:
                raise StageDataError(f"{where}: example {k}, choice {choice!r}: {len(tail)} continuation tokens; "
                                     f"a choice needs 1 to sequence_length = {sequence_length}")
            rows.append(((head + tail)[-(sequence_length + 1):], len(tail)))
            example.append(k)
            lengths.append(len(choice))
    width = max(len(tokens) - 1 for tokens, _ in rows)
    width = -(-width // multiple) * multiple
    input_ids = np.zeros((len(rows), width), np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, np.int64)
    for r, (tokens, count) in enumerate(rows):
        size = len(tokens) - 1
        input_ids[r, :size] = tokens[:-1]
        labels[r, size - count:size] = tokens[-count:]
    return ChoiceRequests(input_ids, labels, np.asarray(example, np.int64), np.asarray(lengths, np.float64),
                          np.asarray([item.answer for item in examples], np.int64))


def right_answers(loglikelihoods: np.ndarray, asked: ChoiceRequests) -> tuple[int, int]:
    """(examples acc counts right, examples acc_norm counts right), from each row's log-likelihood."""
    starts = np.searchsorted(asked.example, np.arange(len(asked.gold) + 1))
    right = right_norm = 0
    for k, gold in enumerate(asked.gold):
        lls = loglikelihoods[starts[k]:starts[k + 1]]
        right += int(np.argmax(lls) == gold)
        right_norm += int(np.argmax(lls / asked.lengths[starts[k]:starts[k + 1]]) == gold)
    return right, right_norm
