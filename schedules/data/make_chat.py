"""Writes the chat demo's data and its tokenizer: conversations that swap made-up words, and a small BPE of ours.

    python schedules/data/make_chat.py        # rewrites every file in schedules/data/chat/

The skill: asked to swap two words, answer with them in the other order, as the assistant of a chat.

    chat.jsonl            {"messages": [...]}: 3,000 conversations for the SFT stage; a third open with a system
                          message, half go on with a second request (so the loss is on several assistant turns)
    chat_heldout.jsonl    the same task on words that no training file holds (the eval set: the last answer,
                          exact match)
    tokenizer/            tokenizer.json (byte-level BPE, 512 ids, trained here with `tokenizers`),
                          tokenizer_config.json (end-of-text <|endoftext|>) and chat_template.jinja (ChatML)

The words are make_words.py's spare pool (its "reserve": in no file of schedules/data/words/), so neither the
pretraining prose nor the glossary holds a chat word. The tokenizer is trained on the pretraining prose and the
training conversations, deterministically (one thread, a fixed order), so the committed files can be regenerated
byte for byte (tests/unit/test_chat_demo_data.py checks it).
"""

import json
import os
import random
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"   # before `tokenizers` loads: its trainer's merges do not depend on threads then

HERE = Path(__file__).parent
OUT = HERE / "chat"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512
TRAIN, HELD_OUT = 3000, 200
SYSTEM = "You swap words."
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ASK = ["swap {a} {b}", "Swap {a} and {b}.", "please swap {a} {b}"]


def words() -> list[str]:
    """make_words.py's spare pool: 4,000 words that no file of the default curriculum holds."""
    import sys

    sys.path.insert(0, str(HERE))
    from make_words import shares

    return shares()["reserve"]


def conversation(pool: list[str], rng: random.Random) -> list[dict]:
    a, b, c, d = rng.sample(pool, 4)
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
    messages += [{"role": "user", "content": rng.choice(ASK).format(a=a, b=b)}, {"role": "assistant", "content": f"Swapped: {b} {a}"}]
    if rng.random() < 1 / 2:
        messages += [{"role": "user", "content": rng.choice(ASK).format(a=c, b=d)},
                     {"role": "assistant", "content": f"Swapped: {d} {c}"}]
    return messages


def conversations() -> dict[str, list[list[dict]]]:
    pool = words()
    train_words, held_out_words = pool[:3200], pool[3200:]
    rng = random.Random(7)
    return {"chat.jsonl": [conversation(train_words, rng) for _ in range(TRAIN)],
            "chat_heldout.jsonl": [conversation(held_out_words, rng) for _ in range(HELD_OUT)]}


def rendered(messages: list[dict]) -> str:
    """The ChatML rendering (the template's), for training the tokenizer on what it will encode."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def tokenizer_json(chats: list[list[dict]]) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    prose = (HERE / "words" / "pretrain.txt").read_text()
    tokenizer.train_from_iterator(prose.split("\n\n") + [rendered(chat) for chat in chats], trainer)
    return tokenizer.to_str(pretty=True)


def files() -> dict[str, str]:
    """Every file's path under chat/ and its content."""
    chats = conversations()
    out = {name: "".join(json.dumps({"messages": chat}) + "\n" for chat in rows) for name, rows in chats.items()}
    out["tokenizer/tokenizer.json"] = tokenizer_json(chats["chat.jsonl"])
    out["tokenizer/tokenizer_config.json"] = json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False, "model_max_length": 512}, indent=2) + "\n"
    out["tokenizer/chat_template.jinja"] = TEMPLATE
    return out


if __name__ == "__main__":
    for name, text in files().items():
        path = OUT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path} ({len(text.encode()):,} bytes)")
