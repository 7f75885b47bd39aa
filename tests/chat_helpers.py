"""Chat templates in the shapes of real ones, written here, and a small BPE tokenizer folder to render them with.

The templates follow the published ones' structure (not their every feature): ChatML as Qwen2 writes it, Meta's
Llama 3 Instruct template, a ChatML template with a default system prompt that rejects unknown roles (Qwen2.5's
shape), Mistral's [INST] template whose roles must alternate, ChatML with `{% generation %}` blocks (TRL's training templates), and a Qwen3-shaped template that drops
the reasoning of earlier turns (so a conversation does not render as a prefix of its continuation).
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

DEFAULT_SYSTEM = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant who reverses words.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Only system, user and assistant roles are supported, not ' + message['role']) }}
    {%- endif %}
    {%- if not (message['role'] == 'system' and loop.first) %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CHATML_GENERATION = """\
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

REASONING = """\
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {%- set thought = message.get('reasoning_content', '') %}
        {%- if loop.index0 > ns.last_query and thought %}
            {{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + message['content'] + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | tojson + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral's shape: [INST] ... [/INST], each answer ended by the end-of-text token, no generation prompt, roles that
# must alternate (a system message refused).
MISTRAL = """{{- bos_token }}
{%- for message in messages %}
{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- if message.role == 'user' %}{{- '[INST] ' + message.content + ' [/INST]' }}
{%- elif message.role == 'assistant' %}{{- message.content + eos_token }}
{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}
{%- endif %}
{%- endfor %}"""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "default_system": DEFAULT_SYSTEM,
             "chatml_generation": CHATML_GENERATION, "reasoning": REASONING, "mistral": MISTRAL}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "reverse qhm"}, {"role": "assistant", "content": "mhq"}],
    [{"role": "system", "content": "You reverse words."}, {"role": "user", "content": "reverse abc"},
     {"role": "assistant", "content": "cba"}, {"role": "user", "content": "and  xyz ?"},
     {"role": "assistant", "content": " zyx \n"}],
    [{"role": "user", "content": "Héllo — ünïcode ✓"}, {"role": "assistant", "content": "ok 👍"},
     {"role": "user", "content": "bye"}],
]


def chat_texts() -> list[str]:
    words = "reverse the word words system user assistant You are a helpful who qhm mhq abc cba and xyz zyx ok bye"
    return [words, "Hello there, how are you? I am fine.", "\n\n<think>\nthought\n</think>\n\n"] * 20


def chat_tokenizer(folder: Path, template: str | None = CHATML, *, jinja_file: bool = False,
                   config: dict | None = None, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer folder (tokenizer.json + tokenizer_config.json) with SPECIALS, its eos
    <|endoftext|> and bos <|begin_of_text|>, and `template` in tokenizer_config.json or, `jinja_file`, in
    chat_template.jinja beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(chat_texts(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                "bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": False, **(config or {})}
    if template is not None and not jinja_file:
        settings["chat_template"] = template
    if template is not None and jinja_file:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return folder
