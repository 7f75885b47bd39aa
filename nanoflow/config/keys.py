"""How the schema declares a key: `key(doc, default, ...)`, an attrs field that carries the key's one-line meaning
and, for a path, how the loader resolves it; and the validators the sections share."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable

from attrs import NOTHING, field
from attrs.validators import ge, gt, instance_of, lt

Validators = list[Callable[[typing.Any, typing.Any, typing.Any], typing.Any]]   # attrs validators, as optional() takes

positive: Validators = [instance_of(int), gt(0)]
non_negative: Validators = [instance_of(int), ge(0)]
positive_float: Validators = [instance_of((int, float)), gt(0)]
unit_interval: Validators = [instance_of((int, float)), ge(0), lt(1)]   # Adam's betas: 1 would never forget, > 1 diverge
INT_LIMIT = 1 << 63   # every integer must fit torch's and numpy's int64

# How a path key is resolved against the TOML file's folder (nanoflow.config.load). A URL
# (s3://...) and an absolute path are always left as written.
PATH = "path"                   # always a path
TOKENIZER_PATH = "tokenizer"    # a path, except the built-in tokenizer's name "bytes"
DATASET_NAME = "dataset name"   # a path when it looks like one (or exists), else a builder or hub name;
                                # in a {name = weight} table, each name


def key(doc: str, default=NOTHING, *, validator=None, path: str | None = None, shown: str | None = None,
        **kwargs):
    """A config key: an attrs field carrying its one-line meaning `doc`; `path` is how a path in it is resolved
    (PATH, TOKENIZER_PATH, DATASET_NAME); `shown` is the default as the reference writes it, where the value
    alone does not say it (a default computed from another key)."""
    metadata = {"doc": doc}
    if path is not None:
        metadata["path"] = path
    if shown is not None:
        metadata["default"] = shown
    return field(default=default, validator=validator, metadata=metadata, **kwargs)


def is_union(type_) -> bool:
    """`X | Y` and `Union[X, Y]` alike: the schema writes the first, and typing tells them apart."""
    return typing.get_origin(type_) in (typing.Union, types.UnionType)
