"""A TOML writer for the values a config holds: tables, arrays of tables, scalars and arrays of scalars."""

from __future__ import annotations

import math
import re

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")   # fullmatch: `$` would also match before a final newline
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters (DEL too) escaped, the rest literal."""
    return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in text) + '"'


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_scalar(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _is_table_array(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, dict) for v in value)


def _is_table(key: str, value) -> bool:
    return isinstance(value, dict) and not _inline(key, value)


def _inline(key: str, value) -> bool:
    """A {name = weight} blend is written inline: it is a value, not a section."""
    return key == "hf_dataset_or_datasets"


def to_toml(data: dict) -> str:
    """`data` as TOML text: a table's scalars first, then its [tables] and [[arrays of tables]], in the order given."""
    lines: list[str] = []
    _emit(data, [], lines)
    return "\n".join(lines).strip("\n") + "\n"


def _emit(table: dict, path: list[str], lines: list[str], header: str | None = None) -> None:
    if header is not None:
        lines += ["", header]
    for key, value in table.items():
        if value is not None and not _is_table(key, value) and not _is_table_array(value):
            lines.append(f"{_key(key)} = {_scalar(value)}")
    for key, value in table.items():
        dotted = path + [_key(key)]
        if _is_table(key, value):
            has_values = any(v is not None and not _is_table(k, v) and not _is_table_array(v) for k, v in value.items())
            # A table holding only sub-tables needs no header of its own (theirs define it).
            _emit(value, dotted, lines, f"[{'.'.join(dotted)}]" if has_values or not value else None)
        elif _is_table_array(value):
            for item in value:
                _emit(item, dotted, lines, f"[[{'.'.join(dotted)}]]")
