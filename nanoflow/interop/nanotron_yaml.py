"""Reading a nanotron YAML config: PyYAML's safe loader, behind bounds that no config comes near.

PyYAML builds an alias as a reference to its anchored node, so a few hundred bytes of aliases of aliases
(a "billion laughs") load at once into a structure that no walk ever finishes, and an alias inside its own
anchor loads as a cycle. nanotron reads its configs with yaml's SafeLoader, which takes anchors and aliases,
so they are taken here too, as long as the document they expand to stays small: one pass over the parser's
events (PyYAML's parser keeps its own stack, so it does not recurse) measures it before anything is built.
Every refusal is one line naming the line of the file.
"""

from __future__ import annotations

import re
import sys

from nanoflow.errors import MissingExtraError, NanotronConfigError

MAX_VALUES = 100_000   # values (scalars, lists, mappings) the document expands to; a nanotron config has hundreds
MAX_DEPTH = 64         # levels of nesting; a nanotron config has about six (data_stages[].data.dataset...)

_DECIMAL = re.compile(r"[-+]?[0-9][0-9_]*")   # the plain scalars YAML 1.1 reads as a decimal integer


def read_nanotron_yaml(path: str):
    """The YAML document in `path`, parsed with yaml.SafeLoader; a NanotronConfigError (one line) for a file that
    cannot be read, is not UTF-8 text, or is no config (an alias bomb or cycle, too deep, a number Python cannot
    read, not YAML)."""
    try:
        import yaml
    except ImportError:
        raise MissingExtraError("reading YAML", "pyyaml") from None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except IsADirectoryError:
        raise NanotronConfigError("is a folder, not a config file (give the nanotron YAML file)") from None
    except OSError as e:
        raise NanotronConfigError(f"cannot be read: {e.strerror or e}") from None
    if b"\0" in data:
        raise NanotronConfigError("not a text file (it holds NUL bytes): give the nanotron YAML config")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise NanotronConfigError(f"not UTF-8 (byte {data[e.start]:#04x} on line {line}): save it as UTF-8") from None
    try:
        _check_size(yaml.parse(text, Loader=yaml.SafeLoader), yaml)
        return yaml.load(text, Loader=yaml.SafeLoader)
    except NanotronConfigError:
        raise
    except yaml.YAMLError as e:
        raise NanotronConfigError(f"not valid YAML: {' '.join(str(e).split())}") from None
    except ValueError as e:   # a value the constructor cannot make (a date such as 2024-02-30)
        raise NanotronConfigError(f"not a config: {e}") from None


def _check_size(events, yaml) -> None:
    """Refuse, before it is built, a document whose aliases expand past MAX_VALUES values, an alias inside the
    node it names, nesting deeper than MAX_DEPTH, or an integer longer than Python converts from text."""
    sizes: dict[str, int] = {}   # each anchor's node: the values it expands to
    open_nodes: list[list] = []  # the lists and mappings being read: [anchor, values so far]
    total = 0
    for event in events:
        line = event.start_mark.line + 1
        if isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append([event.anchor, 1])
            if len(open_nodes) > MAX_DEPTH:
                raise NanotronConfigError(f"line {line}: nested more than {MAX_DEPTH} levels deep; a nanotron "
                                          "config nests about six")
            continue
        if isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for anchor, _ in open_nodes):
                raise NanotronConfigError(f"line {line}: alias *{event.anchor} inside the node it names (a "
                                          "structure that holds itself); a config cannot be one")
            anchor, size = None, sizes.get(event.anchor, 1)   # an undefined alias: the loader names it
        elif isinstance(event, yaml.ScalarEvent):
            _check_integer(event, line)
            anchor, size = event.anchor, 1
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_nodes.pop()
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        if open_nodes:
            open_nodes[-1][1] += size
        else:
            total += size
        if total + sum(values for _, values in open_nodes) > MAX_VALUES:
            raise NanotronConfigError(f"line {line}: its aliases expand to more than {MAX_VALUES:,} values (a YAML "
                                      "alias bomb?); a nanotron config has a few hundred")


def _check_integer(event, line: int) -> None:
    """A plain scalar that YAML reads as a decimal integer longer than Python's int() takes from text."""
    limit = sys.get_int_max_str_digits()
    if event.style is None and event.implicit[0] and len(event.value) > limit and _DECIMAL.fullmatch(event.value):
        digits = sum(c.isdigit() for c in event.value)
        if digits > limit:
            raise NanotronConfigError(f"line {line}: an integer of {digits:,} digits; Python reads at most "
                                      f"{limit:,}, and no config key takes one that long")
