"""The one cattrs converter: TOML's plain data structured into the schema's classes.

It rejects unknown keys and lossy coercions ("3" for 3, 2.5 for 2, 1 for true), and reads the keys
that take more than one shape (a name or a list, a name or a {name = weight} table, false or a number).
"""

from __future__ import annotations

import math
from typing import Literal

import cattrs

from nanoflow.config.keys import INT_LIMIT
from nanoflow.config.schema import CLIP_GRAD_EXPECTED, DatasetArgs, NanosetDatasetsArgs, RopeScalingArgs

converter = cattrs.Converter(forbid_extra_keys=True)


def _structure_exact(value, cls):
    """TOML already gives exact types: refuse lossy coercions such as "3" -> 3, 2.5 -> 2 or 1 -> True,
    non-finite floats (inf, nan: no setting means them) and integers beyond int64."""
    if cls is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
    elif cls is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, cls) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"expected {cls.__name__}, got {type(value).__name__} {value!r}")
    if cls is int and not -INT_LIMIT <= value < INT_LIMIT:
        raise ValueError(f"{value} does not fit in a 64-bit integer (at most {INT_LIMIT - 1})")
    return cls(value)


for _type in (int, float, str, bool):
    converter.register_structure_hook(_type, _structure_exact)


def _structure_paths(value, _cls):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise TypeError(f"expected a path or a list of paths, got {value!r}")


converter.register_structure_hook(str | list[str] | None, _structure_paths)


def _structure_name_list(value, _cls):
    if value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise TypeError(f"expected a list of names, got {value!r}" + (f' (write ["{value}"])' if isinstance(value, str)
                                                                    else ""))


converter.register_structure_hook(list[str] | None, _structure_name_list)


def _structure_names(value, _cls):
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        return value
    raise TypeError(f"expected a name or a non-empty list of names, got {value!r}")


def _structure_weight(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number as the weight of {where}, got {value!r}")
    return float(value)


def _weights_by_name(table: dict) -> dict[str, float]:
    return {str(name): _structure_weight(weight, repr(name)) for name, weight in table.items()}


def _structure_datasets(value, _cls):
    """hf_dataset_or_datasets: a name, or a table {name = weight}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value:
        return _weights_by_name(value)
    raise TypeError(f"expected a dataset name or a table {{name = weight}}, got {value!r}")


def _structure_weight_table(value, _cls):
    """dataset_weights_end of HF datasets: a table {name = weight}, the names of hf_dataset_or_datasets."""
    if value is None:
        return None
    if isinstance(value, dict) and value:
        return _weights_by_name(value)
    raise TypeError(f"expected a table {{name = weight}} of the names in hf_dataset_or_datasets, got {value!r}")


def _structure_weights(value, _cls):
    if value is None:
        return None
    if isinstance(value, list):
        return [_structure_weight(w, f"entry {i}") for i, w in enumerate(value)]
    raise TypeError(f"expected a list of weights, got {value!r}")


def _structure_dataset(value, _cls):
    """[data_stages.data.dataset]: token folders when it names dataset_folder, else HF datasets."""
    if isinstance(value, dict) and "dataset_folder" in value:
        return converter.structure(value, NanosetDatasetsArgs)
    return converter.structure(value, DatasetArgs)


def _structure_rope_scaling(value, _cls):
    """[model.rope_scaling]; HF's legacy key `type` is read as rope_type, as transformers reads it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"expected a table of rope_type, factor, ..., got {value!r}")
    value = dict(value)
    if "type" in value:
        legacy = value.pop("type")
        if value.setdefault("rope_type", legacy) != legacy:
            raise ValueError(f"type = {legacy!r} and rope_type = {value['rope_type']!r} disagree; "
                             "write rope_type only (type is its legacy name)")
    return converter.structure(value, RopeScalingArgs)


def _structure_clip_grad(value, _cls):
    if value is True:
        raise TypeError("true is not a max norm: give the max gradient norm (e.g. 1.0), or false for no clipping")
    if value is False:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r} (false means no clipping)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(CLIP_GRAD_EXPECTED + f", got {value!r}")
    return float(value)


def _structure_window(value, _cls):
    """sliding_window: a number of positions, or false (config.json's null: no window)."""
    if value is None or value is False:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a number of positions (1 or more), or false for no window, got {value!r}")
    return value


def _structure_int_list(value, _cls):
    if value is None or (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                         for v in value)):
        return value
    raise TypeError(f"expected a list of integers, got {value!r}")


converter.register_structure_hook(str | list[str], _structure_names)
converter.register_structure_hook(int | Literal[False] | None, _structure_window)
converter.register_structure_hook(list[int] | None, _structure_int_list)
converter.register_structure_hook(RopeScalingArgs | None, _structure_rope_scaling)
converter.register_structure_hook(float | Literal[False], _structure_clip_grad)
converter.register_structure_hook(str | dict[str, float], _structure_datasets)
converter.register_structure_hook(list[float] | None, _structure_weights)
converter.register_structure_hook(dict[str, float] | None, _structure_weight_table)
converter.register_structure_hook(DatasetArgs | NanosetDatasetsArgs, _structure_dataset)
converter.register_structure_hook(DatasetArgs | NanosetDatasetsArgs | None,
                                  lambda value, cls: None if value is None else _structure_dataset(value, cls))


