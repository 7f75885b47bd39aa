"""Chat conversations: rendered with the tokenizer's chat template as transformers' `apply_chat_template` renders
them, tokenized as it tokenizes them, and which of their tokens are the assistant's (the SFT targets).

Rendering. A template runs in jinja2's immutable sandbox with the options and names transformers gives it:
trim_blocks and lstrip_blocks, the loop controls (break, continue), the `{% generation %}` tag, a `tojson` filter
that does not escape HTML and keeps non-ASCII text, and the globals `raise_exception`, `strftime_now`, a `dict`
that only builds dicts and a `namespace` that refuses underscore names. Its variables are the messages,
`tools` and `documents` (None), `add_generation_prompt`, and the tokenizer's named special tokens (`bos_token`,
`eos_token`, ...: `HFTokenizer.template_tokens`). Messages are taken as transformers takes them: keys whose value
is None dropped (a table's missing fields), a message's reasoning under the names templates read.

Tokens. The rendered text is encoded with no special tokens added (the template writes its own BOS), which is
`apply_chat_template(messages, tokenize=True)`.

Assistant tokens. A template with `{% generation %}` blocks marks the assistant's text itself: a token is the
assistant's when its characters overlap a block's, which is transformers' `assistant_masks`
(`return_assistant_tokens_mask=True`). A template without them marks nothing, so an assistant message's tokens are
those its message adds to the rendering: the conversation before it rendered with the generation prompt (the
text a model is given to answer), then with the message; its tokens are what lies between the two. That is exact
for a template that renders a conversation as a prefix of its continuation (ChatML, Llama 3, Mistral, a default
system prompt: each message's text depends on earlier ones only) — the tokens the model is trained to write are
what it writes after the generation prompt, and the end-of-turn token and what follows it up to the next message
belong to them. A template that re-renders earlier messages (Qwen3 drops the reasoning of past turns) is not,
and a conversation it renders so is refused (ChatError), never guessed at.
"""

from __future__ import annotations

import functools
import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime

from nanoflow.errors import MissingExtraError

REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")   # the first is what templates read
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = "nanoflowprobe"   # an assistant message's text, to find what the template writes after it


class ChatError(ValueError):
    """A conversation that cannot be rendered, or whose assistant tokens cannot be told; the caller names where."""


# ---------------------------------------------------------------------------------------------
# The template environment

_spans: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("nanoflow_generation_spans",
                                                                                 default=None)


def _environment():
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise MissingExtraError("rendering a chat template", "jinja2", "tokenizers") from None

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body, and where spans are being recorded,
        records the body's (start, end) in characters of the text rendered so far."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            text = caller()
            recording = _spans.get()
            if recording is not None:
                chunks, spans = recording
                start = sum(map(len, chunks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class OnlyDicts:   # `dict` in a template builds dicts and nothing else (no attribute reaches the type)
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):   # no underscore names: nothing of Python's internals
        def __init__(*args, **kwargs):
            self, values = args[0], dict(*args[1:], **kwargs)
            for name in values:
                Namespace._allowed(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name, value):
            Namespace._allowed(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _allowed(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a template cannot set {name!r} on a namespace")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                               dict=OnlyDicts(), namespace=Namespace)
    return environment


@functools.lru_cache(maxsize=16)
def compile_template(text: str):
    """The template `text`, compiled once per process."""
    import jinja2

    try:
        return _environment().from_string(text)
    except jinja2.TemplateError as e:
        raise ChatError(f"the chat template does not compile: {type(e).__name__}: {e}") from None


@contextmanager
def _recording():
    chunks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _spans.set((chunks, spans))
    try:
        yield chunks, spans
    finally:
        _spans.reset(token)


# ---------------------------------------------------------------------------------------------
# Messages

def as_messages(row) -> list[dict]:
    """A row's messages as a template sees them, checked: a non-empty list of {role, content} with text in both;
    keys whose value is None dropped, the reasoning of a message also under the names templates read."""
    if not isinstance(row, (list, tuple)) or not row:
        raise ChatError(f"expected a non-empty list of {{role, content}} messages, got {_shown(row)}")
    messages = []
    for i, message in enumerate(row):
        if not isinstance(message, dict):
            raise ChatError(f"message {i} is {_shown(message)}, expected a {{role, content}} table")
        message = {k: v for k, v in message.items() if v is not None}
        for name in ("role", "content"):
            if not isinstance(message.get(name), str):
                got = "missing" if name not in message else f"a {type(message[name]).__name__}"
                raise ChatError(f'message {i} has no text "{name}" ({got}); each message is {{role, content}}')
        reasoning = next((message[k] for k in REASONING_NAMES if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------------
# A tokenizer's template

class ChatTemplate:
    """The chat template of an HF tokenizer, bound to it: rendering, tokens and assistant masks."""

    def __init__(self, tokenizer):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ChatError(f"the tokenizer {tokenizer.name} has no chat template (neither a chat_template.jinja "
                            "nor a chat_template in tokenizer_config.json in its folder)")
        self.tokenizer, self.text = tokenizer, tokenizer.chat_template
        self.template = compile_template(self.text)
        self.variables = tokenizer.template_tokens()
        self.marks_generation = bool(_GENERATION_TAG.search(self.text))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """`apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`."""
        return self._render(messages, add_generation_prompt)[0]

    def _render(self, messages: list[dict], add_generation_prompt: bool, spans: bool = False
                ) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        arguments = dict(self.variables, messages=messages, tools=None, documents=None,
                         add_generation_prompt=add_generation_prompt)
        try:
            if not spans:
                return self.template.render(**arguments), []
            with _recording() as (chunks, found):
                for chunk in self.template.generate(**arguments):
                    chunks.append(chunk)
                return "".join(chunks), list(found)
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template refuses it: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template's own Python errors (a bad index, a type): say them
            raise ChatError(f"the chat template fails on it: {type(e).__name__}: {e}") from None

    def _assistant_spans(self, messages: list[dict], turns: str) -> tuple[str, list[tuple[int, int]]]:
        """(the rendering, the character spans of the assistant's text in it: every turn's, or the last's)."""
        if self.marks_generation:
            text, spans = self._render(messages, False, spans=True)
            return text, spans[-1:] if turns == "last" else spans
        text = self.render(messages)
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans = []
        for i in assistant[-1:] if turns == "last" else assistant:
            spans.append(self._added_by(messages, i, text))
        return text, spans

    def _added_by(self, messages: list[dict], i: int, whole: str) -> tuple[int, int]:
        """The characters assistant message i adds after the generation prompt (module docstring)."""
        before = self.render(messages[:i], add_generation_prompt=True)
        through = self.render(messages[:i + 1])
        if not through.startswith(before) or not whole.startswith(through):
            shorter, longer = (before, through) if not through.startswith(before) else (through, whole)
            at = next((k for k, (a, b) in enumerate(zip(shorter, longer, strict=False)) if a != b), min(len(shorter), len(longer)))
            raise ChatError(f"the chat template renders the conversation up to assistant message {i} differently "
                            f"once more follows (at character {at}: {shorter[at:at + 30]!r} becomes "
                            f"{longer[at:at + 30]!r}), so the tokens that message adds cannot be told; a template "
                            "with {% generation %} blocks marks them itself")
        return len(before), len(through)

    def tokens(self, row, turns: str = "all") -> tuple[list[int], list[bool]]:
        """(the conversation's ids, which of them are the assistant's: every turn's, or only the last's)."""
        text, spans = self._assistant_spans(as_messages(row), turns)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        return ids, overlapping(offsets, spans)

    def answer(self, row) -> tuple[list[int], list[bool]]:
        """The conversation up to its last assistant message, whose tokens are the targets: exact match's sample.
        The prompt (the conversation before it, with the generation prompt) tokenizes as the sample's start and
        the targets follow it without a gap, so scoring them teacher-forced is greedy decoding from the prompt;
        they end with the template's end-of-turn token, where generation stops (what a template writes after it,
        ChatML's newline, is not asked for)."""
        messages = as_messages(row)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise ChatError("no assistant message to compare an answer with")
        ids, targets = self.tokens(messages[:last + 1], "last")
        stop = self.end_of_turn_ids()
        end = next((k for k, (t, m) in enumerate(zip(ids, targets, strict=True)) if m and t in stop), None)
        if end is not None:
            targets = targets[:end + 1] + [False] * (len(targets) - end - 1)
        prompt = self.tokenizer.encode(self.render(messages[:last], add_generation_prompt=True))
        first = targets.index(True) if True in targets else len(ids)
        if ids[:len(prompt)] != prompt or first != len(prompt):
            raise ChatError(f"the prompt (the {last} messages before the last assistant message, with the generation "
                            f"prompt) is not the start of the conversation's tokens ({len(prompt)} tokens; the "
                            f"answer starts at token {first}), so greedy decoding from it is not what is scored")
        return ids, targets

    @functools.cached_property
    def _end_of_turn(self) -> list[int]:
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.render(messages)
        except ChatError:
            return []
        at = text.rfind(_PROBE)
        if at < 0:
            return []
        ids, _ = self.tokenizer.encode_with_offsets(text[at + len(_PROBE):])
        return ids[:1] if ids and ids[0] in self.tokenizer.special_tokens() else []

    def end_of_turn_ids(self) -> list[int]:
        """The special token the template ends an assistant message with (Llama 3's <|eot_id|>, ChatML's
        <|im_end|>), as a one-element list; [] when it writes none."""
        return list(self._end_of_turn)


def overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Which tokens (character offsets, in order) overlap one of the spans (in order): transformers' rule for
    `assistant_masks`, under which a token cut by a span's edge is the span's."""
    marked, k = [False] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        marked[i] = end > spans[k][0]
    return marked
