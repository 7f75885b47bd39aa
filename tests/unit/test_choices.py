"""Multiple-choice eval sets: rows read and asked as lm-evaluation-harness asks them, acc and acc_norm as it
counts them, their config checked (the in-loop numbers against lm-eval's own: tests/e2e/test_choices_runs.py)."""

from __future__ import annotations

import numpy as np
import pytest
from support.choices import write_choice_run

from nanoflow.config import ConfigError, load_config
from nanoflow.data.choices import ChoiceRequests, Example, encode_pair, requests, right_answers
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.data.tokenizer import ByteTokenizer
from nanoflow.errors import StageDataError

BYTES = ByteTokenizer()


def test_the_contexts_trailing_space_goes_to_the_continuation_and_an_empty_context_is_the_end_of_text():
    assert encode_pair(BYTES, "fox ", " jumps") == (list(b"fox"), list(b"  jumps"))
    assert encode_pair(BYTES, "", " fox") == ([BYTES.eos_id], list(b" fox"))


def test_a_request_is_context_and_continuation_less_its_last_token_with_the_continuation_as_targets():
    asked = requests([Example("ab", ("c", "de"), 1)], BYTES, sequence_length=8, delimiter=" ")
    assert asked.input_ids.shape == (2, 4)   # the longer request, "ab de" less its last token
    assert asked.input_ids[0, :3].tolist() == list(b"ab ") and asked.input_ids[1].tolist() == list(b"ab d")
    assert asked.labels[0].tolist() == [IGNORE_INDEX, ord(" "), ord("c"), IGNORE_INDEX]
    assert asked.labels[1].tolist() == [IGNORE_INDEX, ord(" "), ord("d"), ord("e")]
    assert asked.gold_rows.tolist() == [1]
    # Longer than sequence_length + 1: the first tokens go, as lm-eval cuts at the model's max_length
    cut = requests([Example("abcdef", ("gh",), 0)], BYTES, sequence_length=4, delimiter=" ")
    assert cut.input_ids.tolist() == [list(b"ef g")]
    assert cut.labels.tolist() == [[IGNORE_INDEX, ord(" "), ord("g"), ord("h")]]


def test_acc_takes_the_likeliest_choice_and_acc_norm_the_likeliest_per_character_ties_to_the_first():
    asked = ChoiceRequests(np.zeros((5, 1)), np.zeros((5, 1)), np.array([0, 0, 0, 1, 1]),
                           np.array([1.0, 10.0, 4.0, 3.0, 3.0]), np.array([1, 1]))
    # example 0: "a" at -2 is likeliest; per character "a…" (10 characters) at -5 is
    assert right_answers(np.array([-2.0, -5.0, -6.0, -1.0, -1.0]), asked) == (0 + 0, 1 + 0)
    assert right_answers(np.array([-9.0, -5.0, -6.0, -1.0, -0.5]), asked) == (1 + 1, 1 + 1)


def test_acc_norm_divides_by_characters_as_lm_eval_does_not_by_bytes():
    # "é" is one character and two bytes: by bytes (-1 against -1.05 a byte) the first, right, choice would win
    examples = [Example("x", ("éé", "ab"), 0)]
    asked = requests(examples, BYTES, sequence_length=16, delimiter=" ")
    assert asked.lengths.tolist() == [2.0, 2.0]
    assert right_answers(np.array([-4.0, -2.1]), asked) == (0, 0)


def test_answers_by_index_by_text_and_refused_out_of_range():
    from nanoflow.data.choices import _example

    columns = ("c", "o", "a")
    assert _example("q", ["x", "y"], 1, "row", columns).answer == 1
    assert _example("q", ["x", "y"], "y", "row", columns).answer == 1
    assert _example("q", ["x", "y"], "1", "row", columns).answer == 1
    for bad in (2, -1, "z", True, None):
        with pytest.raises(StageDataError, match='column "a" holds'):
            _example("q", ["x", "y"], bad, "row", columns)
    with pytest.raises(StageDataError, match='column "o" holds'):
        _example("q", "x y", 0, "row", columns)


@pytest.mark.parametrize(("override", "expected"), [
    ("evaluation.datasets.choices.metric='loss'", 'context_column_name: a multiple_choice key; this set\'s metric '
                                                  'is "loss"'),
    ("evaluation.datasets.choices.dataset.prompt_column_name='ctx'", "prompt/completion columns are for SFT sets"),
])
def test_bad_multiple_choice_config_names_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(write_choice_run(tmp_path), [override])
    assert expected in str(caught.value)


def test_a_missing_column_is_named(tmp_path):
    from nanoflow.data.tokenizer import load_run_tokenizer
    from nanoflow.evaluation import load_eval_sets

    config = load_config(write_choice_run(tmp_path), ["evaluation.datasets.choices.answer_column_name='gold'"])
    with pytest.raises(StageDataError, match='evaluation choices.*no column "gold"; the columns are ctx, options, '
                                             'label'):
        load_eval_sets(config, load_run_tokenizer(config))


def test_the_columns_enter_the_eval_fingerprint(tmp_path):
    from nanoflow.data.fingerprint import eval_fingerprint, short_digest

    config = load_config(write_choice_run(tmp_path))
    other = load_config(tmp_path / "run.toml", ["evaluation.datasets.choices.target_delimiter=''"])
    digest = [short_digest(eval_fingerprint(c, c.evaluation.datasets[0], BYTES)) for c in (config, other)]
    assert digest[0] != digest[1]


def test_the_plan_opens_a_multiple_choice_set_by_its_own_columns(tmp_path, capsys):
    from process_helpers import run_in_process

    config = write_choice_run(tmp_path)
    result = run_in_process("train", config, "--plan", capsys=capsys)
    assert result.returncode == 0, result.stderr   # not "no column text", the column a text set would read
    result = run_in_process("train", config, "--plan", "--set", "evaluation.datasets.choices.context_column_name='q'",
                            capsys=capsys)
    assert result.returncode == 2 and 'no column "q"; the columns are ctx, options, label' in result.stderr
