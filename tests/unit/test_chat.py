"""Chat rows: rendered and tokenized as transformers' apply_chat_template does, the assistant's tokens as its
assistant_masks (or, without {% generation %} blocks, what each assistant message adds), and every refusal named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from chat_helpers import (
    CHATML,
    CHATML_GENERATION,
    CONVERSATIONS,
    DEFAULT_SYSTEM,
    LLAMA3,
    MISTRAL,
    REASONING,
    chat_tokenizer,
)
from data_helpers import stage, write_config

from nanoflow.config import load_config
from nanoflow.data import StageDataError, load_tokenizer, open_stage
from nanoflow.data.chat import ChatError, ChatTemplate, as_messages
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.schedule import Schedule

PREFIX_TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "default_system": DEFAULT_SYSTEM}
ALL_TEMPLATES = {**PREFIX_TEMPLATES, "chatml_generation": CHATML_GENERATION, "reasoning": REASONING}   # mistral: below


def both(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder)), ChatTemplate(load_tokenizer(folder))


@pytest.mark.parametrize("jinja_file", [False, True], ids=["in_tokenizer_config", "chat_template_jinja"])
@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_rendering_and_tokens_equal_transformers(tmp_path, name, jinja_file):
    hf, ours = both(chat_tokenizer(tmp_path / name, ALL_TEMPLATES[name], jinja_file=jinja_file))
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            assert ours.render(as_messages(conversation), add_generation_prompt=prompt) == \
                hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
        ids, targets = ours.tokens(conversation)
        assert ids == list(hf.apply_chat_template(conversation, tokenize=True)["input_ids"])
        assert len(targets) == len(ids)


def test_a_tokenizer_that_adds_a_bos_itself_gets_it_once_as_transformers_does(tmp_path):
    from tokenizers import Tokenizer, processors

    folder = chat_tokenizer(tmp_path / "llama3", LLAMA3)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = raw.token_to_id("<|begin_of_text|>")
    raw.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    raw.save(str(folder / "tokenizer.json"))
    hf, ours = both(folder)
    ids, _ = ours.tokens(CONVERSATIONS[1])
    assert ids == list(hf.apply_chat_template(CONVERSATIONS[1], tokenize=True)["input_ids"])
    assert ids.count(bos) == 1 and ids[0] == bos


def test_generation_blocks_give_exactly_transformers_assistant_masks(tmp_path):
    hf, ours = both(chat_tokenizer(tmp_path / "gen", CHATML_GENERATION))
    assert ours.marks_generation
    for conversation in CONVERSATIONS:
        expected = hf.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        ids, targets = ours.tokens(conversation)
        assert ids == list(expected["input_ids"])
        assert [int(t) for t in targets] == list(expected["assistant_masks"])
        assert sum(targets) > 0


def _turn_texts(hf, ids, targets) -> list[str]:
    """The target tokens, decoded run by run."""
    runs, run = [], []
    for token, target in zip(ids + [None], targets + [False], strict=True):
        if target:
            run.append(token)
        elif run:
            runs.append(hf.decode(run))
            run = []
    return runs


@pytest.mark.parametrize("name", sorted(PREFIX_TEMPLATES))
def test_without_generation_blocks_each_assistant_message_is_what_it_adds_after_the_generation_prompt(tmp_path, name):
    hf, ours = both(chat_tokenizer(tmp_path / name, PREFIX_TEMPLATES[name]))
    assert not ours.marks_generation
    for conversation in CONVERSATIONS:
        ids, targets = ours.tokens(conversation)
        assistant = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
        expected = []
        for i in assistant:   # transformers' own renderings, with and without the message
            before = hf.apply_chat_template(conversation[:i], tokenize=False, add_generation_prompt=True) \
                if i else hf.apply_chat_template(conversation[:1], tokenize=False)[:0]
            through = hf.apply_chat_template(conversation[:i + 1], tokenize=False)
            assert through.startswith(before)
            expected.append(through[len(before):])
        assert _turn_texts(hf, ids, targets) == expected
        _, last = ours.tokens(conversation, "last")
        assert _turn_texts(hf, ids, last) == expected[-1:]
        assert all(t for t, u in zip(targets, last, strict=True) if u)


def test_a_mistral_shape_trains_on_each_answer_and_its_end_of_text_and_refuses_roles_out_of_turn(tmp_path):
    import jinja2

    hf, ours = both(chat_tokenizer(tmp_path / "mistral", MISTRAL))
    alternating = [CONVERSATIONS[0], CONVERSATIONS[1][1:], CONVERSATIONS[2]]
    for conversation in alternating:
        for prompt in (False, True):   # it has no generation prompt: the same text either way
            assert ours.render(as_messages(conversation), add_generation_prompt=prompt) == \
                hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
        ids, targets = ours.tokens(conversation)
        assert ids == list(hf.apply_chat_template(conversation, tokenize=True)["input_ids"])
        assert ids.count(hf.convert_tokens_to_ids("<|begin_of_text|>")) == 1
        assert _turn_texts(hf, ids, targets) == [m["content"] + "<|endoftext|>" for m in conversation
                                                 if m["role"] == "assistant"]
    words = "Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(jinja2.exceptions.TemplateError, match=words):
        hf.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    with pytest.raises(ChatError, match="the chat template refuses it: " + words):
        ours.tokens(CONVERSATIONS[1])


def test_chatml_without_blocks_trains_on_what_the_blocks_mark_and_the_newline_after_the_end_of_turn(tmp_path):
    _, plain = both(chat_tokenizer(tmp_path / "plain", CHATML))
    hf, marked = both(chat_tokenizer(tmp_path / "marked", CHATML_GENERATION))
    newline = hf.encode("\n", add_special_tokens=False)
    for conversation in CONVERSATIONS:
        ids, by_delta = plain.tokens(conversation)
        same, by_blocks = marked.tokens(conversation)
        assert ids == same
        extra = [i for i, (a, b) in enumerate(zip(by_delta, by_blocks, strict=True)) if a != b]
        assert all(not by_blocks[i] and by_delta[i] and [ids[i]] == newline for i in extra)
        assert len(extra) == sum(m["role"] == "assistant" for m in conversation)


def test_a_template_that_rerenders_earlier_turns_is_refused_not_guessed(tmp_path):
    hf, ours = both(chat_tokenizer(tmp_path / "reasoning", REASONING))
    thinking = [{"role": "user", "content": "reverse abc"},
                {"role": "assistant", "content": "cba", "reasoning_content": "c, b, a"},
                {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "ok"}]
    assert "<think>" not in hf.apply_chat_template(thinking, tokenize=False)            # dropped once a user follows
    assert "<think>" in hf.apply_chat_template(thinking[:2], tokenize=False)
    with pytest.raises(ChatError, match="assistant message 1 differently once more follows.*generation"):
        ours.tokens(thinking)
    ids, last = ours.tokens(thinking, "last")   # the last turn alone is a prefix-extension
    assert ids == list(hf.apply_chat_template(thinking, tokenize=True)["input_ids"])
    assert _turn_texts(hf, ids, last) == ["ok<|im_end|>\n"]


def test_the_environment_is_transformers(tmp_path):
    template = (
        "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m.role == 'skip' %}{% continue %}{% endif %}"
        "{%- set ns.n = ns.n + 1 %}{{ m | tojson }}{{ dict(a=1) | tojson }}{{ m.content | tojson(indent=1) }}"
        "{%- if loop.index > 3 %}{% break %}{% endif %}{%- endfor %}{{ ns.n }}{{ eos_token }}{{ bos_token }}"
        "{{ strftime_now('%Y') }}")
    hf, ours = both(chat_tokenizer(tmp_path / "env", template))
    conversation = [{"role": "user", "content": "ü <b>&</b>"}, {"role": "skip", "content": "x"},
                    {"role": "assistant", "content": "1", "tool_calls": None}, *CONVERSATIONS[1]]
    assert ours.render(as_messages(conversation)) == hf.apply_chat_template(conversation, tokenize=False)
    escape = "{% set ns = namespace() %}{% set ns.__class__ = 1 %}"
    _, refused = both(chat_tokenizer(tmp_path / "escape", escape))
    with pytest.raises(ChatError, match="cannot set '__class__'"):
        refused.render([{"role": "user", "content": "x"}])


def test_the_end_of_turn_token_is_the_special_token_after_an_assistant_message(tmp_path):
    for name, template, token in [("chatml", CHATML, "<|im_end|>"), ("llama3", LLAMA3, "<|eot_id|>"),
                                  ("eos", "{% for m in messages %}{{ m.content + eos_token }}{% endfor %}",
                                   "<|endoftext|>"), ("none", "{% for m in messages %}{{ m.content }}{% endfor %}", None)]:
        hf, ours = both(chat_tokenizer(tmp_path / name, template))
        assert ours.end_of_turn_ids() == ([] if token is None else [hf.convert_tokens_to_ids(token)])


def test_answer_is_the_last_assistant_message_after_the_prompt_with_the_generation_prompt(tmp_path):
    hf, ours = both(chat_tokenizer(tmp_path / "chatml", CHATML_GENERATION))
    conversation = CONVERSATIONS[2]   # ends with a user message: the answer is the assistant message before it
    ids, targets = ours.answer(conversation)
    prompt = list(hf.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=True)["input_ids"])
    assert ids[:len(prompt)] == prompt and targets.index(True) == len(prompt)
    assert hf.decode([t for t, m in zip(ids, targets, strict=True) if m]) == "ok 👍<|im_end|>"


# ---------------------------------------------------------------------------------------------
# A stage of chat rows

def chat_stage(tmp_path, rows, folder, **dataset):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    path = write_config(tmp_path, [stage("sft", 1, {"hf_dataset_or_datasets": "json",
                                                    "hf_data_files": str(tmp_path / "chat.jsonl"),
                                                    "messages_column_name": "messages", **dataset})],
                        tokenizer=str(folder), vocab_size=416, sequence_length=48, micro_batch_size=2, accumulation=1)
    return load_config(path)


def open_chat(config, tmp_path):
    return open_stage(config, 0, load_tokenizer(config.tokenizer.tokenizer_name_or_path), Schedule.from_config(config),
                      cache_dir=str(tmp_path / "cache"))


def test_a_chat_stage_trains_on_the_assistant_tokens_of_transformers_tokens(tmp_path):
    folder = chat_tokenizer(tmp_path / "tok", CHATML_GENERATION)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    rows = CONVERSATIONS * 2
    with open_chat(chat_stage(tmp_path, rows, folder), tmp_path) as loader:
        source = loader.parts[0].source
        for i, row in enumerate(rows):
            expected = hf.apply_chat_template(row, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = list(expected["input_ids"])[:49], list(expected["assistant_masks"])[:49]
            inputs, labels, positions = source.sample(i)
            assert positions is None
            assert inputs.tolist() == (ids + [hf.convert_tokens_to_ids("<|endoftext|>")] * 48)[:48]
            assert labels.tolist() == ([t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:], strict=True)]
                                       + [IGNORE_INDEX] * 48)[:48]


@pytest.mark.parametrize("row, problem", [
    ("hello", r'row 1 \(from 0\) of column "messages": expected a non-empty list of \{role, content\} messages, got "hello"'),
    ([], r"row 1 .*expected a non-empty list"),
    (["hi"], r'row 1 .*message 0 is "hi", expected a \{role, content\} table'),
    ([{"role": "user"}], r'row 1 .*message 0 has no text "content" \(missing\)'),
    ([{"role": 3, "content": "x"}], r'row 1 .*message 0 has no text "role" \(a int\)'),
    ([{"role": "tool", "content": "x"}], r"row 1 .*the chat template refuses it: Only system, user and assistant "
                                         r"roles are supported, not tool"),
])
def test_a_bad_row_is_named_by_stage_file_and_row(tmp_path, row, problem):
    folder = chat_tokenizer(tmp_path / "tok", DEFAULT_SYSTEM)
    config = chat_stage(tmp_path, [CONVERSATIONS[0], row], folder)
    with pytest.raises(StageDataError, match=r'stage "sft" \(json files .*chat\.jsonl\): ' + problem):
        open_chat(config, tmp_path)


def test_a_tokenizer_without_a_template_is_named(tmp_path):
    folder = chat_tokenizer(tmp_path / "tok", None)
    with pytest.raises(StageDataError, match=r'stage "sft" \(json files .*chat\.jsonl\): the tokenizer .*tok has no '
                                             r"chat template \(neither a chat_template.jinja nor"):
        open_chat(chat_stage(tmp_path, CONVERSATIONS, folder), tmp_path)


def test_messages_read_as_text_say_which_key_reads_them(tmp_path):
    chat_stage(tmp_path, CONVERSATIONS, chat_tokenizer(tmp_path / "tok", CHATML))
    text = (tmp_path / "run.toml").read_text()
    (tmp_path / "run.toml").write_text(text.replace('messages_column_name = "messages"', 'text_column_name = "messages"'))
    with pytest.raises(StageDataError, match='column "messages" holds list values, expected text \\(a column of chat '
                                             "messages is read with messages_column_name\\)"):
        open_chat(load_config(tmp_path / "run.toml"), tmp_path)


def test_the_sft_keys_are_refused_where_they_mean_nothing(tmp_path):
    from nanoflow.config import ConfigError

    text = {"hf_dataset_or_datasets": "json", "hf_data_files": str(tmp_path / "chat.jsonl")}
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0], "text": "x"}) + "\n")
    for dataset, message in [
        ({"messages_column_name": "messages", "prompt_column_name": "p", "completion_column_name": "c"},
         "a chat stage reads one column of messages"),
        ({"assistant_turns": "last"}, 'assistant_turns = "last" chooses among the assistant turns of chat rows'),
        ({"packing": True}, "packing = true shapes SFT samples: it needs messages_column_name"),
        ({"overlong_samples": "drop"}, 'overlong_samples = "drop" shapes SFT samples'),
    ]:
        path = write_config(tmp_path, [stage("s", 1, {**text, **dataset})])
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_chat_rows_are_cached_with_their_template(tmp_path):
    folder = chat_tokenizer(tmp_path / "tok", CHATML)
    config = chat_stage(tmp_path, CONVERSATIONS, folder)
    with open_chat(config, tmp_path) as loader:
        first = loader.samples(0, 3)["input_ids"]
    (folder / "tokenizer_config.json").write_text(
        (folder / "tokenizer_config.json").read_text().replace("message['content']", "message['content'] | upper"))
    with open_chat(config, tmp_path) as loader:   # another template: other tokens, not the cached ones
        assert not np.array_equal(loader.samples(0, 3)["input_ids"], first)
    assert len(list((tmp_path / "cache" / "nanoflow-tokens").glob("*.rows.npy"))) == 2


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION], ids=["by_difference", "by_generation_blocks"])
def test_a_chat_exact_match_set_scores_the_last_answer_after_the_prompt_with_the_generation_prompt(tmp_path, template):
    from nanoflow.evaluation import load_eval_set

    folder = chat_tokenizer(tmp_path / "tok", template)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    chat_stage(tmp_path, CONVERSATIONS, folder)
    (tmp_path / "run.toml").write_text((tmp_path / "run.toml").read_text() + (
        '\n[evaluation]\n[[evaluation.datasets]]\nname = "chat"\nmetric = "exact_match"\nsequence_length = 64\n'
        f'[evaluation.datasets.dataset]\nhf_dataset_or_datasets = "json"\nhf_data_files = "{tmp_path / "chat.jsonl"}"\n'
        'messages_column_name = "messages"\n'))
    config = load_config(tmp_path / "run.toml")
    eval_set = load_eval_set(config, config.evaluation.datasets[0], load_tokenizer(folder))
    end_of_turn = hf.convert_tokens_to_ids("<|im_end|>")
    for row, inputs, labels in zip(CONVERSATIONS, eval_set.input_ids, eval_set.labels, strict=True):
        last = max(i for i, m in enumerate(row) if m["role"] == "assistant")
        prompt = list(hf.apply_chat_template(row[:last], add_generation_prompt=True, tokenize=True)["input_ids"])
        whole = list(hf.apply_chat_template(row[:last + 1], tokenize=True)["input_ids"])
        answer = whole[len(prompt):whole.index(end_of_turn, len(prompt)) + 1]   # up to where generation stops
        assert hf.decode(answer) == row[last]["content"] + "<|im_end|>"
        sequence = prompt + answer
        assert inputs[:len(sequence) - 1].tolist() == sequence[:-1]
        assert labels.tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + answer + \
            [IGNORE_INDEX] * (64 - len(sequence) + 1)
    assert eval_set.answerable == len(CONVERSATIONS)


