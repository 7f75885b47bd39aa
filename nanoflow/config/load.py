"""Reading a config: TOML, `--set` overrides, paths relative to the file, readable structure errors."""

from __future__ import annotations

import difflib
import glob
import json
import os
import re
import sys
import typing
from pathlib import Path

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from nanoflow.config.checks import complete_model, validate
from nanoflow.config.keys import DATASET_NAME, PATH, TOKENIZER_PATH, is_union
from nanoflow.config.schema import BUILDERS, Config, ConfigError
from nanoflow.config.structure import converter

# ---------------------------------------------------------------------------------------------
# Loading

def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Read, override, structure and validate a TOML config. Raises ConfigError."""
    path = Path(path)
    raw = _read_toml(path)
    for override in overrides:
        apply_override(raw, override, path)
    return _structure(raw, str(path), base=path.parent)


def _read_toml(path: Path) -> dict:
    """The TOML table in `path`, or a ConfigError saying in one line why the file is not a config file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a config file (give the .toml file inside it)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read: {e.strerror or e}") from None
    if b"\0" in data:
        raise ConfigError(f"{path}: not a text file (it holds NUL bytes): give the run's TOML config") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 (byte {data[e.start]:#04x} on line {line}): TOML files are "
                          "UTF-8; save it as UTF-8") from None
    try:
        return _parse_toml(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except ValueError as e:   # what _parse_toml says a config cannot hold
        raise ConfigError(f"{path}: not a config: {e}") from None


def _parse_toml(text: str) -> dict:
    """tomllib.loads, with the two inputs it answers with a Python error turned into a ValueError that says why:
    nesting too deep for its recursion, and an integer longer than Python converts from text (a config's
    numbers have a few digits)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise
    except RecursionError:  # tomllib recurses once per level of arrays and inline tables
        raise ValueError("arrays or inline tables nested too deeply for the TOML parser") from None
    except ValueError:   # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        number = re.search(rf"(?<![\w.])[+-]?\d[\d_]{{{sys.get_int_max_str_digits()},}}", text)
        line = text[:number.start()].count("\n") + 1 if number else None
        digits = sum(c.isdigit() for c in number.group()) if number else None
        raise ValueError((f"line {line}: an integer of {digits:,} digits" if number else "an integer too long")
                         + f"; Python reads at most {sys.get_int_max_str_digits():,}, and no key takes one that "
                           "long") from None


def config_from_dict(raw: dict, where: str, overrides: list[str] = ()) -> Config:
    """A config recorded as plain data (a checkpoint's metadata "config", its paths already absolute), with
    `--set` overrides, structured and validated as a file is; errors are prefixed with `where`."""
    raw = json.loads(json.dumps(raw))   # a private copy: overrides never change the caller's dict
    for override in overrides:
        apply_override(raw, override, Path(where))
    return _structure(raw, where)


def _structure(raw: dict, where: str, base: Path | None = None) -> Config:
    """The config `raw` describes, its paths resolved against `base` (a recorded config's are already absolute),
    validated."""
    shape = shape_problems(raw, Config)
    if shape:   # a value where a table belongs: structuring it would only say that 'str' has no 'keys'
        raise ConfigError(f"{where}:\n  " + "\n  ".join(shape))
    try:
        config = converter.structure(raw, Config)
    except Exception as e:  # cattrs gathers every problem into one exception group
        raise ConfigError(f"{where}:\n  " + "\n  ".join(_describe_structure_errors(e, raw))) from None
    if base is not None:
        config = resolve_paths(config, base)
    if config.model.init_from is None:   # a fresh start: [model] completed here (else by nanoflow.preflight)
        try:
            return complete_model(config)
        except ConfigError as e:
            raise ConfigError(f"{where}:\n  {e}") from None
    problems = validate(config)
    if problems:
        raise ConfigError(f"{where}:\n  " + "\n  ".join(problems))
    return config


def apply_override(raw: dict, override: str, path: Path) -> None:
    """Apply `section.key=value` (value in TOML syntax; a bare word is a string) to the raw config.

    Stages are addressed by name or index: `data_stages.sft.sequence_length=64`.
    """
    dotted, sep, text = override.partition("=")
    if not sep or not dotted:
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    try:
        value = _parse_toml(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    except ValueError as e:
        shown = override if len(override) <= 60 else f"{override[:40]}…"
        raise ConfigError(f"--set {shown!r}: {str(e).removeprefix('line 1: ')}") from None
    keys = dotted.strip().split(".")
    node = raw
    for i, key in enumerate(keys[:-1]):
        if isinstance(node, list):
            node = _entry_by_name_or_index(node, key, keys[i - 1] if i else "", override, path)
        else:
            node = node.setdefault(key, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"--set {override!r}: {'.'.join(keys[:i + 1])} in {path} is not a table")
    if isinstance(node, list):
        example = (f"evaluation.datasets.{keys[-1]}.max_samples" if keys[-2:-1] == ["datasets"]
                   else f"data_stages.{keys[-1]}.sequence_length")
        kind = _ENTRY_KINDS.get(keys[-2] if len(keys) > 1 else "", ("entry",))[0]
        raise ConfigError(f"--set {override!r}: name a key inside the {kind}, e.g. {example}")
    node[keys[-1]] = value


_ENTRY_KINDS = {"data_stages": ("stage", "stages"), "datasets": ("eval set", "eval sets")}   # lists addressed by name


def _entry_by_name_or_index(entries: list, key: str, list_key: str, override: str, path: Path) -> dict:
    if not all(isinstance(entry, dict) for entry in entries):   # an earlier --set made it ["a"]: no names to find
        shown = json.dumps(entries)
        raise ConfigError(f"--set {override!r}: {list_key or 'the top level'} in {path} is "
                          f"{shown if len(shown) <= 40 else shown[:37] + '...'}, not an array of tables to address "
                          f"an entry of by name or index")
    for i, entry in enumerate(entries):
        if entry.get("name") == key or str(i) == key:
            return entry
    one, many = _ENTRY_KINDS.get(list_key, ("entry", "entries"))
    names = ", ".join(str(s.get("name")) for s in entries)
    raise ConfigError(f"--set {override!r}: {path} has no {one} {key!r} ({many}: {names})")


def _resolve(base: Path, value: str) -> str:
    if not value.strip():  # an unset shell variable in --set: refused by key (checks.py), never the TOML's folder
        return value
    # A URL, even a malformed one ("s3:/bucket"), is left as written for the store to accept or refuse.
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", value) or os.path.isabs(value):
        return value
    return os.path.abspath(base / value)


LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt", ".md")


def looks_local(name: str, base: Path) -> bool:
    """Whether a dataset name is meant as a local path, present or not: a hub id is "name" or
    "namespace/name", so a name with a glob, a file extension, more than one "/", a leading "/", "."
    or "~", or a first component that is a folder here, is a path (and a missing one is an error
    at once, not minutes of hub retries)."""
    if name.startswith(("/", "./", "../", "~")) or any(c in name for c in "*?[") or name.count("/") > 1:
        return True
    if os.path.splitext(name)[1].lower() in LOCAL_SUFFIXES:
        return True
    return "/" in name and os.path.isdir(base / name.partition("/")[0])   # os.path: False for a name too long


def resolve_paths(config: Config, base: Path) -> Config:
    """`config` with every path key (a field marked `path=` in the schema) made relative to `base`, the TOML file's
    folder, not the working directory: one walk over the sections, the stages and the eval sets."""
    changes = {}
    for f in attrs.fields(type(config)):
        value = getattr(config, f.name)
        kind = f.metadata.get("path")
        if kind is not None and value is not None:
            resolved = _RESOLVERS[kind](base, value)
        elif attrs.has(type(value)):
            resolved = resolve_paths(value, base)
        elif isinstance(value, tuple) and value and attrs.has(type(value[0])):   # [[data_stages]], eval sets
            resolved = tuple(resolve_paths(entry, base) for entry in value)
        else:
            continue
        if resolved != value:
            changes[f.name] = resolved
    return attrs.evolve(config, **changes) if changes else config


def _resolve_path(base: Path, value: str | list[str]) -> str | list[str]:
    return _resolve(base, value) if isinstance(value, str) else [_resolve(base, v) for v in value]


def _resolve_tokenizer(base: Path, value: str) -> str:
    return value if value == "bytes" else _resolve(base, value)


def _resolve_dataset_name(base: Path, value: str | dict[str, float]) -> str | dict[str, float]:
    """A dataset name that is a local path or glob is relative to the TOML file; a {name = weight} table's names
    alike. A builder's name and a hub id are left as written."""
    if isinstance(value, dict):
        return {_resolve_dataset_name(base, name): weight for name, weight in value.items()}
    if value not in BUILDERS and (os.path.exists(base / value) or glob.glob(str(base / value), recursive=True)
                                  or looks_local(value, base)):
        return _resolve(base, os.path.expanduser(value))
    return value


_RESOLVERS = {PATH: _resolve_path, TOKENIZER_PATH: _resolve_tokenizer, DATASET_NAME: _resolve_dataset_name}


# ---------------------------------------------------------------------------------------------
# Error messages

def _describe_structure_errors(exc: BaseException, raw: dict) -> list[str]:
    def describe(error: BaseException, _type) -> str:
        if isinstance(error, ForbiddenExtraKeysError):
            valid = [f.name for f in attrs.fields(error.cl)]
            parts = []
            for key in sorted(error.extra_fields):
                near = difflib.get_close_matches(key, valid, n=1)
                parts.append(f"unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else
                                                      f" (valid keys: {', '.join(valid)})"))
            return "; ".join(parts)
        if isinstance(error, KeyError):
            missing.append(_type)
            return "required key missing"
        allowed = _literal_values(_type)
        if allowed and isinstance(error, cattrs.errors.CattrsError):
            return _not_one_of(str(error).partition(" not in literal ")[0], allowed)
        if isinstance(error, (ValueError, TypeError)):
            return str(error)
        return cattrs.v.format_exception(error, _type)

    missing: list = []   # the type of each missing key, in the order its line comes
    lines = []
    for line in cattrs.transform_error(exc, path="$", format_exception=describe):
        message, _, where = line.rpartition(" @ ")
        if message == "required key missing" and missing:
            message += f": {_how_to_add(where, missing.pop(0))}"
        lines.append(f"{_readable_path(where, raw)}: {message}")
    return lines


_KINDS = {str: "a string", bool: "true or false", int: "a number", float: "a number", list: "an array", dict: "a table"}


def _kind(value) -> str:
    return next((name for kind, name in _KINDS.items() if isinstance(value, kind)), "a date or time")


def _table_types(type_) -> tuple[tuple[type, ...], type | None]:
    """(the section classes, the entry class of an array of sections) that a schema type asks for: one of them
    or neither (a value, or a value that may also be a table)."""
    members = [m for m in (typing.get_args(type_) if is_union(type_) else (type_,))
               if m is not type(None)]
    if members and all(attrs.has(m) for m in members):
        return tuple(members), None
    if len(members) == 1 and typing.get_origin(members[0]) is tuple:
        entry = typing.get_args(members[0])[0]
        return ((), entry) if attrs.has(entry) else ((), None)
    return (), None


def shape_problems(raw: dict, cls: type, prefix: str = "") -> list[str]:
    """Each key of `raw` that holds a value where `cls` has a section ([name]) or an array of sections
    ([[name]]), or a section where it has an array: the one line that says what to write instead."""
    problems, hints = [], typing.get_type_hints(cls)
    for key, value in raw.items():
        if key not in hints:   # an unknown key: structuring names it, with the keys it might have meant
            continue
        sections, entry = _table_types(hints[key])
        dotted = f"{prefix}{key}"
        if len(sections) == 1 and isinstance(value, dict):
            problems += shape_problems(value, sections[0], f"{dotted}.")
        elif sections and not isinstance(value, dict):
            table = re.sub(r"\[\d+\]", "", dotted)   # data_stages[0].data is written [data_stages.data]
            problems.append(f"{dotted}: {_kind(value)}, but it is a table: write [{table}] and its keys below it")
        elif entry is not None and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    problems += shape_problems(item, entry, f"{dotted}[{i}].")
                else:
                    problems.append(f"{dotted}[{i}]: {_kind(item)}, but each entry is a table: write [[{dotted}]] "
                                    "and its keys below it, once per entry")
        elif entry is not None:
            problems.append(f"{dotted}: {_kind(value)}, but it is an array of tables: write [[{dotted}]] "
                            f"(two brackets) once per entry, and its keys below it"
                            + (f" ([{dotted}.…] sections belong to an entry)" if isinstance(value, dict) else ""))
    return problems


_EXAMPLE_VALUES = {"hf_dataset_or_datasets": '"text"', "name": '"sft"', "dataset_folder": '"tokens/"'}
_EXAMPLE_OF_TYPE = {int: "1", float: "1.0", str: '"..."', bool: "true"}


def _how_to_add(where: str, type_) -> str:
    """What to write for a missing key at `where` ('$.data_stages[1].data'), with an example value."""
    dotted = re.sub(r"\[\d+\]", "", where.removeprefix("$").lstrip("."))
    table, _, key = dotted.rpartition(".")
    type_ = _first_of(type_)   # a table of one of several kinds: the first is the example
    _, entry = _table_types(type_)
    if entry is not None:
        return f"add a [[{dotted}]] table for each entry, with {_required_keys(entry, dotted)}"
    if not attrs.has(type_):
        example = _EXAMPLE_VALUES.get(key, _EXAMPLE_OF_TYPE.get(type_, '"..."'))
        return f"add {key} = {example}" + (f" under [{table}]" if table else "")
    while True:   # down to the table whose own keys are values: that is what a config spells out
        hints = typing.get_type_hints(type_)
        nested = [f for f in attrs.fields(type_) if f.default is attrs.NOTHING and attrs.has(_first_of(hints[f.name]))]
        if not nested:
            break
        dotted, type_ = f"{dotted}.{nested[0].name}", _first_of(hints[nested[0].name])
    keys = _required_keys(type_, dotted)
    return f"add the table [{dotted}]" + (f" with {keys}" if keys else "")


def _required_keys(cls: type, dotted: str) -> str:
    """The keys a [dotted] section of `cls` must have, each with an example value, its required sections named."""
    hints = typing.get_type_hints(cls)
    parts = []
    for f in attrs.fields(cls):
        if f.default is not attrs.NOTHING:
            continue
        type_ = _first_of(hints[f.name])
        parts.append(f"a [{dotted}.{f.name}] table" if attrs.has(type_) else
                     f"{f.name} = {_EXAMPLE_VALUES.get(f.name, _EXAMPLE_OF_TYPE.get(type_, '...'))}")
    return " and ".join(parts)


def _first_of(type_):
    while is_union(type_):
        type_ = typing.get_args(type_)[0]
    return type_


def _literal_values(type_) -> tuple:
    """The values a Literal[...] field allows (also inside a Union such as Literal[...] | None); () otherwise."""
    if typing.get_origin(type_) is typing.Literal:
        return typing.get_args(type_)
    if is_union(type_):
        return tuple(value for member in typing.get_args(type_) for value in _literal_values(member))
    return ()


def _not_one_of(value: str, allowed: tuple) -> str:
    """"'cosin' is not allowed: expected one of 'linear', 'cosine' (did you mean 'cosine'?)"."""
    names = [str(a) for a in allowed]
    folded = {name.lower().replace("_", "").replace("-", ""): name for name in names}
    near = folded.get(value.lower().replace("_", "").replace("-", "")) or next(
        iter(difflib.get_close_matches(value, names, n=1, cutoff=0.5)), None)
    return (f"{value!r} is not allowed: expected one of {', '.join(map(repr, allowed))}"
            + (f" (did you mean {near!r}?)" if near else ""))


def _readable_path(where: str, raw: dict) -> str:
    """'$.data_stages[1].data.dataset' -> 'data_stages[1] (stage "sft").data.dataset'."""
    where = where.removeprefix("$").lstrip(".")
    if where.startswith("data_stages["):
        index_text, _, rest = where[len("data_stages["):].partition("]")
        stages = raw.get("data_stages", [])
        try:
            name = stages[int(index_text)].get("name")
        except (ValueError, IndexError, KeyError, AttributeError):   # KeyError: a [data_stages] table, not an array
            name = None
        label = f'data_stages[{index_text}]' + (f' (stage "{name}")' if name else "")
        return label + rest
    return where or "(top level)"


