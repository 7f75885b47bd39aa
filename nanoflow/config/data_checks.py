"""Checks of the data a config names: each dataset table (its sources, splits and blend weights), continue_from,
held-out samples and [evaluation]; what can be found without loading a sample."""

from __future__ import annotations

import math
import os

from nanoflow.config.locations import Location, locate, token_folder_problem
from nanoflow.config.schema import Config, DatasetArgs, NanosetDatasetsArgs


def _weight_problems(key: str, weights: list[tuple[str, float]]) -> list[str]:
    problems = [f"{key}: the weight of {name} is {weight}; weights must be finite and >= 0"
                for name, weight in weights if not (math.isfinite(weight) and weight >= 0)]
    if not problems and not any(weight > 0 for _, weight in weights):
        problems.append(f"{key}: every weight is zero; at least one source must have a positive weight")
    return problems


def dataset_problems(dataset: DatasetArgs | NanosetDatasetsArgs) -> list[str]:
    if isinstance(dataset, NanosetDatasetsArgs):
        return _nanoset_problems(dataset)
    problems = []
    name, files = dataset.hf_dataset_or_datasets, dataset.hf_data_files
    if isinstance(name, dict):
        if files is not None:
            problems.append("hf_data_files: a table of datasets names its files in its keys (a path or glob each); "
                            "remove hf_data_files")
        problems += _weight_problems("hf_dataset_or_datasets", list(name.items()))
        ends = dataset.dataset_weights_end
        if ends is not None:
            missing, extra = [n for n in name if n not in ends], [n for n in ends if n not in name]
            problems += [f"dataset_weights_end: no end weight for {n!r}; name every source of "
                         "hf_dataset_or_datasets" for n in missing]
            problems += [f"dataset_weights_end: {n!r} is not a source of hf_dataset_or_datasets" for n in extra]
            if not missing and not extra:
                problems += _weight_problems("dataset_weights_end", list(ends.items()))
    elif dataset.dataset_weights_end is not None:
        problems.append("dataset_weights_end: needs a {name = weight} table in hf_dataset_or_datasets (one dataset "
                        "has nothing to move between)")
    problems += _split_list_problems(dataset)
    for source, _ in dataset.weighted_names():
        location = locate_source(dataset, source)
        problems += location.messages()
        if not location.problems:
            problems += _missing_split_problems(dataset, source, location)
        if dataset.sample_by != "document" and not location.problems and location.builder != "text":
            rows = f"the {location.builder} builder" if location.builder else f"a {location.kind} dataset"
            which = f"{source}'s rows" if isinstance(name, dict) else "the rows"
            problems.append(f'sample_by = "{dataset.sample_by}" splits text files (the "text" builder), but {which} '
                            f"come from {rows}; remove sample_by")
    if (dataset.prompt_column_name is None) != (dataset.completion_column_name is None):
        problems.append("an SFT stage needs both prompt_column_name and completion_column_name")
    return problems + _sft_problems(dataset)


def _sft_problems(dataset: DatasetArgs) -> list[str]:
    """The SFT keys: one kind of rows, and the keys that shape SFT samples only where there are SFT samples."""
    if dataset.messages_column_name is not None and dataset.prompt_column_name is not None:
        return ["messages_column_name and prompt_column_name: a chat stage reads one column of messages; give "
                "either it or the prompt and completion columns"]
    problems = []
    if dataset.assistant_turns != "all" and not dataset.is_chat:
        problems.append(f'assistant_turns = "{dataset.assistant_turns}" chooses among the assistant turns of chat '
                        "rows: it needs messages_column_name")
    for name, default in (("packing", False), ("overlong_samples", "truncate")):
        value = getattr(dataset, name)
        if value != default and not dataset.is_sft:
            shown = "true" if value is True else f'"{value}"'
            problems.append(f"{name} = {shown} shapes SFT samples: it needs messages_column_name, or "
                            "prompt_column_name and completion_column_name (pretraining text is packed already)")
    return problems


def locate_source(dataset: DatasetArgs, name: str) -> Location:
    """Where one source of an HF dataset lies, by the definition the loader uses too."""
    in_table = isinstance(dataset.hf_dataset_or_datasets, dict)
    return locate(name, None if in_table else dataset.hf_data_files, in_table)


def _split_list_problems(dataset: DatasetArgs) -> list[str]:
    splits = dataset.hf_dataset_splits
    if isinstance(splits, str):
        return []
    if not splits:
        return ['hf_dataset_splits: an empty list; name the split to train on (e.g. "train")']
    if len(set(splits)) != len(splits):
        return [f"hf_dataset_splits: {splits!r} names a split twice"]
    if "train" not in splits:
        return [f'hf_dataset_splits: a list of splits trains on "train", as in nanotron, and {splits!r} does not '
                f'list it; to train on another split, name it alone (hf_dataset_splits = "{splits[0]}")']
    return []


def _missing_split_problems(dataset: DatasetArgs, name: str, location: Location) -> list[str]:
    """Every listed split must exist where the disk tells which splits a source has (local files: one, "train"; a
    DatasetDict saved to disk: its dataset_dict.json); a hub dataset's splits are checked when it is loaded."""
    listed = dataset.listed_splits
    if location.kind == "saved" and location.splits is None:   # a Dataset saved alone: one table, no split names
        if len(listed) > 1:
            return [f"hf_dataset_splits: {name} is one dataset saved without splits (a Dataset, not a DatasetDict), "
                    f"so it has no split {', '.join(map(repr, dataset.untrained_splits))} to load; "
                    f'name one split (hf_dataset_splits = "{dataset.train_split}")']
        return []
    if location.splits is None:
        return []
    missing = [split for split in listed if split not in location.splits]
    if not missing:
        return []
    if location.kind == "files":
        subject = f"{location.builder} files {', '.join(location.files[:3])}"
        what = 'local files make one split, "train"'
    else:
        subject, what = name, f"its splits are {', '.join(location.splits)}"
    return [f"hf_dataset_splits: no split {', '.join(map(repr, missing))} in {subject}: {what}"]


def _nanoset_problems(dataset: NanosetDatasetsArgs) -> list[str]:
    problems = [f"dataset_folder: {problem}" for folder in dataset.folders
                if (problem := token_folder_problem(folder)) is not None]
    if len(set(map(os.path.abspath, dataset.folders))) != len(dataset.folders):
        problems.append("dataset_folder: a folder is named twice")
    weights = dataset.dataset_weights
    if weights is not None:
        if len(weights) != len(dataset.folders):
            problems.append(f"dataset_weights: {len(weights)} weights for {len(dataset.folders)} folders")
        else:
            problems += _weight_problems("dataset_weights", list(zip(dataset.folders, weights, strict=True)))
    ends = dataset.dataset_weights_end
    if ends is not None:
        if weights is None:
            problems.append("dataset_weights_end: needs dataset_weights, the weights at the stage's start")
        elif len(ends) != len(dataset.folders):
            problems.append(f"dataset_weights_end: {len(ends)} weights for {len(dataset.folders)} folders")
        else:
            problems += _weight_problems("dataset_weights_end", list(zip(dataset.folders, ends, strict=True)))
    return problems


def continue_from_problems(config: Config, index: int) -> list[str]:
    """continue_from names an earlier stage with the same sequence length that reads one of this stage's sources."""
    stage = config.data_stages[index]
    name = stage.data.continue_from
    if name is None:
        return []
    earlier = {s.name: i for i, s in enumerate(config.data_stages[:index])
               if s.start_training_step < stage.start_training_step}
    if name not in earlier:
        names = ", ".join(f'"{n}"' for n in earlier) or "none"
        return [f'"{name}" is not a stage that starts before stage "{stage.name}" (earlier stages: {names})']
    other = earlier[name]
    ours, theirs = config.stage_tokens(index).sequence_length, config.stage_tokens(other).sequence_length
    if ours != theirs:
        return [f'continuing stage "{name}" needs its sequence_length ({theirs}), but this stage has {ours}: '
                "a sample is a window of sequence_length + 1 tokens, so positions do not carry over"]
    carried: set[str] = set()
    chain: int | None = other
    while chain is not None:   # the sources whose position the earlier stage carries: its own and its chain's
        carried |= set(config.data_stages[chain].data.dataset.source_keys())
        before = config.data_stages[chain].data.continue_from
        chain = next((i for i, s in enumerate(config.data_stages[:chain]) if s.name == before), None)
    if not set(stage.data.dataset.source_keys()) & carried:
        return [f'stage "{stage.name}" reads none of the sources of stage "{name}", so there is nothing to continue']
    return []


# ---------------------------------------------------------------------------------------------
# [evaluation] and held_out_samples

def held_out_problems(config: Config) -> list[str]:
    """Stages that read one source must reserve the same held_out_samples of it: a stage that reserved none would
    train on the windows another keeps for evaluation (and continue_from would read on in another order)."""
    problems: list[str] = []
    reserved: dict[str, tuple[str, int | None]] = {}
    for i, stage in enumerate(config.data_stages):
        dataset = stage.data.dataset
        for key in dataset.source_keys():
            first = reserved.setdefault(key, (stage.name, dataset.held_out_samples))
            if first[1] != dataset.held_out_samples:
                problems.append(
                    f'data_stages[{i}] (stage "{stage.name}").data.dataset.held_out_samples = '
                    f'{dataset.held_out_samples or "unset"}, but stage "{first[0]}" reads the same source with '
                    f'held_out_samples = {first[1] or "unset"}; stages that share a source must reserve the same '
                    "samples of it, or one trains on what another holds out")
    return problems


def evaluation_problems(config: Config) -> list[str]:
    """Every problem of [evaluation] that can be found without opening data."""
    evaluation = config.evaluation
    if evaluation is None:
        return []
    if not evaluation.datasets:
        return ["evaluation: no [[evaluation.datasets]] to evaluate; add one, or remove [evaluation]"]
    problems, seen = [], set()
    for i, entry in enumerate(evaluation.datasets):
        label = f'evaluation.datasets[{i}] ("{entry.name}")'
        if not entry.name.strip():
            problems.append(f"evaluation.datasets[{i}].name: empty; give each eval set a name")
        elif entry.name in seen:
            problems.append(f"{label}.name: another eval set is named \"{entry.name}\"; names must be unique")
        seen.add(entry.name)
        dataset, source_problems = _eval_source(config, entry, label)
        problems.extend(source_problems)
        if dataset is None:
            continue
        if entry.metric == "multiple_choice":
            problems.extend(_choice_problems(entry, label))
        else:
            problems.extend(f'{label}.{name}: a multiple_choice key; this set\'s metric is "{entry.metric}"'
                            for name in entry.CHOICE_KEYS if getattr(entry, name) is not None)
        if entry.metric == "exact_match" and not dataset.is_sft:
            problems.append(f'{label}.metric = "exact_match" needs prompt/completion data (prompt_column_name and '
                            "completion_column_name) or chat messages (messages_column_name): it compares the "
                            "greedy answer to the completion, or to the last assistant turn")
        if entry.dataset is not None and getattr(dataset, "packing", False):
            problems.append(f"{label}.dataset.packing: an eval set scores whole samples one a row; packing is for "
                            "training (remove it)")
        length = config.eval_sequence_length(entry)   # against the model's bounds: checks.model_problems
        if config.parallelism.tp_mode == "REDUCE_SCATTER" and length % config.parallelism.tp:
            problems.append(f"{label}: sequence_length = {length} is not divisible by parallelism.tp = "
                            f'{config.parallelism.tp}, which parallelism.tp_mode = "REDUCE_SCATTER" needs')
    return problems


def _eval_source(config: Config, entry, label: str) -> tuple[DatasetArgs | NanosetDatasetsArgs | None, list[str]]:
    """The dataset eval set `entry` reads (its own table, or the stage's it is held out of) and what is wrong with
    it; no dataset when there is none to check further."""
    if (entry.dataset is None) == (entry.held_out_of is None):
        return None, [f"{label}: give exactly one of a [evaluation.datasets.dataset] table and held_out_of "
                      "(a stage whose source reserves held_out_samples)"]
    problems = []
    if entry.held_out_of is not None:
        stages = {stage.name: stage for stage in config.data_stages}
        stage = stages.get(entry.held_out_of)
        if stage is None:
            return None, [f'{label}.held_out_of: no stage is named "{entry.held_out_of}" (stages: '
                          + ", ".join(stages) + ")"]
        dataset = stage.data.dataset
        if dataset.held_out_samples is None:
            problems.append(f'{label}.held_out_of: stage "{stage.name}" reserves nothing; set its '
                            "data.dataset.held_out_samples = N to keep its last N samples out of training")
        own = config.stage_tokens(list(stages).index(stage.name)).sequence_length
        if entry.sequence_length not in (None, own):
            problems.append(f'{label}.sequence_length = {entry.sequence_length}, but stage "{stage.name}" cuts '
                            f"its windows (and so the held-out ones) at {own}; leave it unset")
        return dataset, problems
    dataset = entry.dataset
    problems.extend(f"{label}.dataset: {p}" for p in dataset_problems(dataset))
    if dataset.held_out_samples is not None:
        problems.append(f"{label}.dataset.held_out_samples: an eval set reads all of its dataset; to evaluate "
                        "a stage's reserved samples, use held_out_of = the stage's name")
    if isinstance(getattr(dataset, "hf_dataset_splits", None), list):
        problems.append(f"{label}.dataset.hf_dataset_splits: an eval set reads one split; name it "
                        '(e.g. hf_dataset_splits = "validation")')
    return dataset, problems


def _choice_problems(entry, label: str) -> list[str]:
    """A multiple_choice set reads rows of its own (context, choices, answer), not windows or SFT pairs."""
    if entry.held_out_of is not None or isinstance(entry.dataset, NanosetDatasetsArgs):
        return [f'{label}.metric = "multiple_choice" reads rows of text (context, choices, answer) from a dataset '
                "table of its own (an HF builder over files, a saved or hub dataset), not a token folder or a "
                "stage's held-out windows"]
    problems = []
    if entry.dataset.is_sft:
        problems.append(f'{label}.dataset: prompt/completion columns are for SFT sets; a multiple_choice set names '
                        "its columns with context_column_name, choices_column_name and answer_column_name")
    if isinstance(entry.dataset.hf_dataset_or_datasets, dict):
        problems.append(f'{label}.dataset.hf_dataset_or_datasets: a multiple_choice set reads one dataset, not a blend')
    return problems


def untrained_splits(config: Config) -> list[str]:
    """One line for each stage whose hf_dataset_splits lists splits it does not train on (a list trains on
    "train", as in nanotron), naming the eval sets that read them, if any."""
    lines = []
    for stage in config.data_stages:
        dataset = stage.data.dataset
        if isinstance(dataset, NanosetDatasetsArgs) or not dataset.untrained_splits:
            continue
        parts = []
        for split in dataset.untrained_splits:
            readers = [entry.name for entry in (config.evaluation.datasets if config.evaluation else ())
                       if isinstance(entry.dataset, DatasetArgs) and _same_data(entry.dataset, dataset)
                       and entry.dataset.hf_dataset_splits == split]
            parts.append(f'"{split}"' + (f" (eval set {', '.join(readers)})" if readers else " (not evaluated either)"))
        lines.append(f'stage "{stage.name}": hf_dataset_splits = {list(dataset.listed_splits)!r} trains on '
                     f'"{dataset.train_split}" only, as nanotron does; not trained on: {", ".join(parts)}')
    return lines


def _same_data(a: DatasetArgs, b: DatasetArgs) -> bool:
    return (a.hf_dataset_or_datasets, a.hf_data_files, a.hf_dataset_config_name) == \
        (b.hf_dataset_or_datasets, b.hf_data_files, b.hf_dataset_config_name)
