"""What `bin/train --plan` opens of a run's data: every source of the stages the run reaches and of its eval sets,
far enough to find what the run would stop on at start-up — a file that cannot be read, a column it lacks, a name
that is no builder, saved folder or hub set there is, a token folder of another tokenizer — without tokenizing
anything: a token folder is opened as a run opens it (its metadata, its index, its first tokens), local files give
their first row (streamed: nothing else is read, nothing cached), a saved folder its columns, a hub name its
builder. One line per source says what is being opened. What only the whole data tells — a bad row deep in a file,
a source too small for one batch — the run itself still finds, at start-up.
"""

from __future__ import annotations

import logging

from nanoflow.config import Config, NanosetDatasetsArgs
from nanoflow.data.hf_datasets import HFSpec, describe, hf_specs, hub_error, load_rows, missing_column
from nanoflow.data.local_files import first_row
from nanoflow.data.sources import open_token_folder, source_inputs
from nanoflow.data.tokenizer import Tokenizer
from nanoflow.data.tokens import StageDataError
from nanoflow.schedule import Schedule, stage_steps

log = logging.getLogger(__name__)


def probe_data(config: Config, tokenizer: Tokenizer, schedule: Schedule) -> None:
    """Open the sources of every stage the run reaches, and of every eval set, as far as said above; the problems of
    all of them in one StageDataError."""
    stages = {s.name: i for i, s in enumerate(config.data_stages)}
    entries = config.evaluation.datasets if config.evaluation is not None else ()
    # The stages trained, and those an eval set holds out of (evaluated even when not reached)
    opened = sorted({i for i in range(len(stages)) if stage_steps(schedule, i)}
                    | {stages[e.held_out_of] for e in entries if e.held_out_of is not None})
    problems = []
    for index in opened:
        stage = config.data_stages[index]
        problems += _probe(config, stage.data.dataset, stage.name, tokenizer, config.stage_tokens(index).sequence_length)
    for entry in entries:
        if entry.dataset is not None:
            problems += _probe(config, entry.dataset, f"evaluation {entry.name}", tokenizer,
                               config.eval_sequence_length(entry))
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise StageDataError(f"{len(problems)} sources cannot be read as configured:\n  - "
                             + "\n  - ".join(str(e) for e in problems))


def _probe(config: Config, dataset, label: str, tokenizer: Tokenizer, sequence_length: int) -> list[StageDataError]:
    """The problems of one stage's (or eval set's: `label`) sources."""
    found = []
    if isinstance(dataset, NanosetDatasetsArgs):
        for _, _, _, folder in source_inputs(dataset):
            log.info(f'opening stage "{label}": dataset_folder {folder}')
            try:
                open_token_folder(folder, label, tokenizer, sequence_length, config.model.vocab_size,
                                  config.tokenizer.accept_recorded_names or ()).close()
            except StageDataError as e:
                found.append(e)
        return found
    try:
        specs = {spec.key: spec for spec in hf_specs(dataset)}
    except ValueError as e:
        return [StageDataError(f'stage "{label}": {e}')]
    for key, _, _, _ in source_inputs(dataset):
        where = describe(label, specs[key])
        log.info(f"opening {where}")
        try:
            columns = _columns(specs[key], label, where)
        except StageDataError as e:
            found.append(e)
            continue
        missing = None if columns is None else missing_column(columns, dataset.columns, where)
        if missing is not None:
            found.append(missing)
    return found


def _columns(spec: HFSpec, label: str, where: str) -> list[str] | None:
    """The columns of one HF source, as far as can be told without reading its rows (None: not known)."""
    if spec.problems:
        raise StageDataError(f"{where}: " + "; ".join(spec.problems))
    dataset = spec.dataset
    name = {"name": dataset.hf_dataset_config_name} if dataset.hf_dataset_config_name is not None else {}
    if spec.builder is not None:
        # The text builder's rows are lines here: its first line, not its first (maybe whole-file) document
        options = {"sample_by": "line"} if spec.builder == "text" else {}
        row = first_row(spec.builder, spec.files, where, split=spec.split, **name, **options)
        return None if row is None else list(row)
    if spec.kind == "saved":
        return load_rows(spec, label).column_names   # memory-mapped: nothing is read but its schema
    import datasets

    try:   # a hub name: its builder (from the cache when offline), not its rows
        builder = datasets.load_dataset_builder(spec.name, data_files=list(spec.files) or None, **name)
    except Exception as e:  # noqa: BLE001 - the hub's errors are many; name the stage either way
        raise hub_error(spec, where, e) from None
    splits = builder.info.splits
    if splits and spec.split not in splits:
        raise StageDataError(f'{where}: no split "{spec.split}" in {spec.name} (splits: {", ".join(splits)})')
    return list(builder.info.features) if builder.info.features is not None else None
