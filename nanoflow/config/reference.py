"""The config reference, docs/config.md, rendered from the schema: every key with its TOML path, type, default
and the meaning its field carries. `python -m nanoflow.config.reference > docs/config.md` writes it; a test
fails when the page and the schema disagree. Pure: it only reads the classes.
"""

from __future__ import annotations

import inspect
import re
import typing
from typing import Literal

import attrs

from nanoflow.config.keys import DATASET_NAME, PATH, TOKENIZER_PATH, is_union
from nanoflow.config.schema import Config

TITLE = "# Config reference"

INTRO = """\
Generated from the fields of the schema, `nanoflow/config/schema.py` and `stages.py` (`python -m
nanoflow.config.reference > docs/config.md`; a test fails when the two differ): edit a key's
meaning there, not here.

A config is one TOML file. A key's path names the tables it sits in: `tokens.train_steps` is
`train_steps` under `[tokens]`; `data_stages[].data.dataset.hf_data_files` is `hf_data_files` under
`[data_stages.data.dataset]` of one `[[data_stages]]` entry. `--set` takes the same paths, a stage by
its name or index: `--set data_stages.sft.sequence_length=64`.

Paths are relative to the TOML file; `s3://bucket/prefix` works wherever a checkpoint path is asked
for. Unknown keys are errors. Types are exact (`train_steps = "10"` is an error, not 10); floats must
be finite (`inf`, `nan` are errors), integers fit in 64 bits. A stage may start after `train_steps`:
a short trial of a long schedule is legal, warned about at start-up and marked "not reached" in the
plan.

A fragment, over `schedules/tiny.toml`: a cooldown stage with its own data and LR schedule.

```toml
[[data_stages]]
name = "pretrain"
start_training_step = 1
[data_stages.data.dataset]
hf_dataset_or_datasets = "text"
hf_data_files = "data/words/pretrain.txt"      # relative to the TOML file

[[data_stages]]
name = "cooldown"
start_training_step = 9
[data_stages.data]
continue_from = "pretrain"
[data_stages.data.dataset]
hf_dataset_or_datasets = "text"
hf_data_files = "data/words/pretrain.txt"
[data_stages.learning_rate_scheduler]
min_decay_lr = 0.0
```
"""

# The TOML table each section is written as, by its path ("" is the file's top level).
_TYPE_WORDS = {int: "integer", float: "number", str: "string", bool: "boolean"}
_PATH_WORDS = {PATH: "path", TOKENIZER_PATH: "path", DATASET_NAME: "name or path"}


def render() -> str:
    """docs/config.md."""
    sections: list[str] = []
    _sections(Config, "", sections, seen=set())
    return "\n\n".join([TITLE, INTRO.rstrip("\n"), *sections]) + "\n"


def fields() -> list[tuple[str, attrs.Attribute]]:
    """(key path, field) of every key in the schema, in the reference's order: what the tests walk."""
    found: list[tuple[str, attrs.Attribute]] = []
    _walk(Config, "", found, seen=set())
    return found


def _tables(type_) -> list[type]:
    """The attrs classes a field's type holds as tables (tuple[X, ...] counts: an array of tables)."""
    if attrs.has(type_):
        return [type_]
    origin = typing.get_origin(type_)
    if is_union(type_) or origin is tuple:
        return [t for arg in typing.get_args(type_) for t in _tables(arg)]
    return []


def _child_path(path: str, name: str, type_) -> str:
    dotted = f"{path}.{name}" if path else name
    return dotted + "[]" if typing.get_origin(type_) is tuple else dotted


def _walk(cls: type, path: str, found: list, seen: set) -> None:
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    for f in attrs.fields(cls):
        found.append((f"{path}.{f.name}" if path else f.name, f))
    for f in attrs.fields(cls):
        for table in _tables(hints[f.name]):
            if table not in seen:
                _walk(table, _child_path(path, f.name, hints[f.name]), found, seen)


def _sections(cls: type, path: str, out: list[str], seen: set) -> None:
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in attrs.fields(cls):
        key = f"{path}.{f.name}" if path else f.name
        cells = (f"`{key}`", _type_text(hints[f.name], f.metadata.get("path")), _default_text(f), f.metadata["doc"])
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    out.append(f"## {_heading(cls, path)}\n\n{_intro(cls)}\n\n" + "\n".join(rows))
    for f in attrs.fields(cls):
        for table in _tables(hints[f.name]):
            if table not in seen:
                _sections(table, _child_path(path, f.name, hints[f.name]), out, seen)


def _heading(cls: type, path: str) -> str:
    if not path:
        return "The top level"
    table = path.replace("[]", "")
    header = f"`[[{table}]]`" if path.endswith("[]") else f"`[{table}]`"
    kind = {"DatasetArgs": "HF datasets", "NanosetDatasetsArgs": "token folders"}.get(cls.__name__)
    return f"{header}: {kind}" if kind else header


def _intro(cls: type) -> str:
    """The class's docstring, less the table name that the heading already gives, as one paragraph each."""
    text = re.sub(r"^\[\[?[\w.]+\]\]?: ", "", inspect.cleandoc(cls.__doc__ or ""))
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    return "\n\n".join(p[:1].upper() + p[1:] for p in paragraphs)


def _type_text(type_, path_kind: str | None) -> str:
    """A field's type in TOML's words: "integer", "string or list of strings", "table", ..."""
    if type_ is type(None):
        return ""
    if attrs.has(type_):
        return "table"
    origin, args = typing.get_origin(type_), typing.get_args(type_)
    if is_union(type_):
        return _one_of(_type_text(a, path_kind) for a in args if a is not type(None))
    if origin is Literal:
        return _one_of(f"`{_toml(a)}`" for a in args)
    if origin is tuple:
        return "array of tables"
    if origin is list:
        return f"list of {_type_text(args[0], path_kind)}s"
    if origin is dict:
        return "table {name = weight}"
    if type_ is str and path_kind is not None:
        return _PATH_WORDS[path_kind]
    return _TYPE_WORDS.get(type_, getattr(type_, "__name__", str(type_)))


def _one_of(words) -> str:
    """"a", "a or b", "a, b or c"."""
    words = list(dict.fromkeys(words))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _default_text(f: attrs.Attribute) -> str:
    if "default" in f.metadata:
        return f.metadata["default"]
    default = f.default
    if default is attrs.NOTHING:
        return "required"
    # attrs' stubs declare Factory as a function returning the default's type; at run time it is the class of the marker
    if isinstance(default, attrs.Factory):   # type: ignore[arg-type]
        return "its keys' defaults"
    if default is None:
        return "unset"
    return f"`{_toml(default)}`"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    print(render(), end="")
