"""The curriculum's sections: [[data_stages]] (each stage's data, sizes and LR schedule) and [evaluation].

Part of the schema (nanoflow.config.schema re-exports every class); each key declared with `key(...)`.
"""

from __future__ import annotations

import json
import os
from typing import Literal

from attrs import frozen
from attrs.validators import ge, instance_of, lt, optional

from nanoflow.config.keys import DATASET_NAME, PATH, key, non_negative, positive, positive_float
from nanoflow.config.rope import RopeScalingArgs


@frozen
class DatasetArgs:
    """HF `datasets` sources (nanotron's PretrainDatasetsArgs): a builder ("text", "json", "parquet", "csv",
    "arrow") over local files, a folder saved with `Dataset.save_to_disk`, or a hub dataset; or a
    `{name = weight}` table of such names to blend (a name may then also be a local path or glob)."""

    hf_dataset_or_datasets: str | dict[str, float] = key(
        'a builder ("text", "json", "csv", "parquet", "arrow") over hf_data_files, a folder saved with '
        "Dataset.save_to_disk, a hub dataset, or a {name = weight} table of them (or of paths and globs) to blend",
        path=DATASET_NAME)
    hf_data_files: str | list[str] | None = key("the builder's files: a path or glob (`**` allowed), or a list "
                                                     "of them", None, path=PATH)
    hf_dataset_config_name: str | None = key("the hub dataset's configuration (load_dataset's name)", None)
    hf_dataset_splits: str | list[str] = key(
        'the split to train on, or nanotron\'s list: the listed splits are loaded (each must exist) and "train" '
        "is trained on", "train")
    text_column_name: str = key("pretraining text, tokenized and packed into windows of sequence_length + 1",
                                "text")
    sample_by: Literal["document", "line", "paragraph"] = key(
        'the "text" builder\'s rows (datasets\' sample_by): each file one document, each line one, or each '
        "paragraph (text between blank lines) one; each ends with end-of-text", "document")
    prompt_column_name: str | None = key("with completion_column_name, an SFT stage: prompt tokens and "
                                               "padding are masked out of the loss", None)
    completion_column_name: str | None = key("the completion of an SFT row, which the loss is taken on",
                                                   None)
    messages_column_name: str | None = key(
        "a chat SFT stage: each row a list of {role, content} messages, rendered with the tokenizer's chat template "
        "(docs/data.md); the loss is taken on the assistant turns", None)
    assistant_turns: Literal["all", "last"] = key(
        "a chat SFT stage: the assistant turns the loss is taken on, every one or only the conversation's last",
        "all")
    packing: bool = key("an SFT stage: several whole samples per window (best-fit decreasing, never one split), "
                        "each attending only to itself from position 0; the rest of a window is padding", False)
    overlong_samples: Literal["truncate", "drop"] = key(
        "an SFT stage: samples longer than sequence_length + 1 tokens are cut to it, keeping their start, or left "
        "out; --plan counts them", "truncate")
    dataset_processing_num_proc_per_process: int = key("processes each rank loads and tokenizes with", 1,
                                                       validator=positive)
    dataset_overwrite_cache: bool = key("download again and tokenize again instead of reading the caches", False)
    dataset_weights_end: dict[str, float] | None = key(
        "with a {name = weight} table: the same names' weights at the stage's end; each share moves linearly "
        "from the stage's first sample to its last", None, path=DATASET_NAME)
    held_out_samples: int | None = key(
        "keep the last N samples (windows, or SFT rows) of each source out of training, for an eval set with "
        "held_out_of this stage; stages sharing a source must reserve the same N", None,
        validator=optional(positive))

    @property
    def is_sft(self) -> bool:
        """Rows of one sample each, their loss on a part of them: prompt/completion or chat messages."""
        return self.prompt_column_name is not None or self.messages_column_name is not None

    @property
    def is_chat(self) -> bool:
        return self.messages_column_name is not None

    @property
    def columns(self) -> tuple[str, ...]:
        if self.messages_column_name is not None:   # chat
            return (self.messages_column_name,)
        prompt, completion = self.prompt_column_name, self.completion_column_name   # SFT: both (data_checks)
        return (prompt, completion) if prompt is not None and completion is not None else (self.text_column_name,)

    @property
    def listed_splits(self) -> tuple[str, ...]:
        splits = self.hf_dataset_splits
        return (splits,) if isinstance(splits, str) else tuple(splits)

    @property
    def train_split(self) -> str:
        """The split training reads: the one named, or "train" of a list (as in nanotron)."""
        return self.hf_dataset_splits if isinstance(self.hf_dataset_splits, str) else "train"

    @property
    def untrained_splits(self) -> tuple[str, ...]:
        """The listed splits training does not read."""
        return tuple(split for split in self.listed_splits if split != self.train_split)

    def weighted_names(self) -> tuple[tuple[str, float], ...]:
        """(name, weight) of each source: a plain name is one source of weight 1."""
        if isinstance(self.hf_dataset_or_datasets, str):
            return ((self.hf_dataset_or_datasets, 1.0),)
        return tuple((name, float(weight)) for name, weight in self.hf_dataset_or_datasets.items())

    def weights_end(self) -> tuple[float, ...] | None:
        """The end weight of each source of `weighted_names` (0 for a name the end table lacks), or None."""
        ends = self.dataset_weights_end
        return None if ends is None else tuple(float(ends.get(name, 0.0)) for name, _ in self.weighted_names())

    def source_key(self, name: str) -> str:
        """What identifies one source across stages (continue_from): the data and how it is read."""
        files = self.hf_data_files if isinstance(self.hf_dataset_or_datasets, str) else None
        read = [name, files, self.hf_dataset_config_name, self.hf_dataset_splits, self.columns]
        if self.sample_by != "document":   # other rows: another source (the default's key stays as it was)
            read.append(self.sample_by)
        if self.is_sft and (self.packing or self.overlong_samples != "truncate"):   # other samples: packed windows,
            read.append(["packed" if self.packing else "rows", self.overlong_samples])   # or fewer rows
        return "hf:" + json.dumps(read)

    def source_keys(self) -> tuple[str, ...]:
        return tuple(self.source_key(name) for name, _ in self.weighted_names())


@frozen
class NanosetDatasetsArgs:
    """Folders of pre-tokenized files (nanotron's NanosetDatasetsArgs; the `*.ds` layout HF datatrove writes and
    `bin/prepare` writes). Several folders are blended by `dataset_weights`; without weights, in proportion to
    their sizes (each folder read once per epoch of the whole, as nanotron does)."""

    dataset_folder: str | list[str] = key("a token folder (written by bin/prepare or datatrove), or a list "
                                                "of them to blend", path=PATH)
    dataset_weights: list[float] | None = key("the folders' blend weights", None,
                                                    shown="by size")
    dataset_weights_end: list[float] | None = key(
        "the folders' weights at the stage's end (needs dataset_weights); shares move linearly in between", None)
    held_out_samples: int | None = key(
        "keep the last N windows of each folder out of training, for an eval set with held_out_of this stage",
        None, validator=optional(positive))

    is_sft = False

    @property
    def folders(self) -> tuple[str, ...]:
        return (self.dataset_folder,) if isinstance(self.dataset_folder, str) else tuple(self.dataset_folder)

    def weights_end(self) -> tuple[float, ...] | None:
        return None if self.dataset_weights_end is None else tuple(self.dataset_weights_end)

    def source_key(self, folder: str) -> str:
        return "tokens:" + os.path.abspath(folder)

    def source_keys(self) -> tuple[str, ...]:
        return tuple(self.source_key(folder) for folder in self.folders)


@frozen
class DataArgs:
    """[data_stages.data]: what a stage reads, and in which order."""

    dataset: DatasetArgs | NanosetDatasetsArgs = key(
        "the stage's data: token folders when the table names dataset_folder, else HF datasets")
    seed: int | None = key("the stage's data order", None, shown="general.seed")
    num_loading_workers: int = key("background threads building the next batches", 0, validator=non_negative)
    continue_from: str | None = key("the name of an earlier stage: the sources this stage shares with it "
                                          "continue where that stage stopped", None)


@frozen
class StageLRSchedulerArgs:
    """[data_stages.learning_rate_scheduler]: the stage's own LR schedule, replacing the run's for its steps
    (nanoflow.lr.resolve_stage_lr). Every key is optional: learning_rate defaults to the run's LR at the
    stage's first step, the decay (linear) to the stage's last step, min_decay_lr to the run's.
    lr_decay_starting_step is a global step, as in nanotron."""

    learning_rate: float | None = key("the LR of the stage's first step: \"decay from here\"", None,
                                            validator=optional(positive_float),
                                            shown="the run's LR at the stage's first step")
    lr_warmup_steps: int = key("a warmup over the stage's first steps", 0, validator=non_negative)
    lr_warmup_style: Literal["linear", "constant"] = key("the warmup's shape", "linear")
    lr_decay_style: Literal["linear", "cosine", "1-sqrt", "constant"] = key(
        "nanotron's default; not the run's style, which for a WSD run is the \"constant\" a cooldown ends",
        "linear")
    lr_decay_starting_step: int | None = key("the last step before the decay: a global step within the "
                                                   "stage", None, validator=optional(positive),
                                                   shown="the stage's first step (after its warmup)")
    lr_decay_steps: int | None = key("the decay's length; it must end within the stage", None,
                                           validator=optional(positive), shown="to the stage's last step")
    min_decay_lr: float | None = key("the LR reached at the stage's last step", None,
                                           validator=optional([instance_of((int, float)), ge(0)]),
                                           shown="the run's")


@frozen
class DatasetStageArgs:
    """[[data_stages]]: one stage of the curriculum, from its start step to the next stage's (docs/stages.md)."""

    name: str = key("the stage's name, unique: in the plan, the logs, --set and continue_from")
    start_training_step: int = key("the stage's first step; stages sort by it, the first starts at step 1")
    data: DataArgs = key("what the stage reads")
    sequence_length: int | None = key("the stage's own tokens.sequence_length", None,
                                            validator=optional(positive), shown="tokens'")
    micro_batch_size: int | None = key("the stage's own tokens.micro_batch_size", None,
                                             validator=optional(positive), shown="tokens'")
    batch_accumulation_per_replica: int | None = key("the stage's own tokens.batch_accumulation_per_replica",
                                                           None, validator=optional(positive), shown="tokens'")
    global_batch_size: int | None = key("the stage's own tokens.global_batch_size", None,
                                              validator=optional(positive), shown="tokens'")
    document_masking: bool | None = key("the stage's own tokens.document_masking", None, shown="tokens'")
    learning_rate_scheduler: StageLRSchedulerArgs | None = key(
        "the stage's own LR schedule (a cooldown, an annealing phase); unset: the run's", None)
    ema_decay: float | None = key(
        "the stage's own weight-EMA decay (optimizer.ema_decay's meaning); a run where only some stages set one "
        "keeps the EMA equal to the weights in the others (decay 0), so an anneal's EMA starts from its first "
        "step's weights", None, validator=optional([instance_of((int, float)), ge(0), lt(1)]),
        shown="optimizer.ema_decay, else 0")
    rope_theta: float | None = key("the stage's own RoPE base (a long-context stage's); it holds for the stages "
                                   "after too, until one sets another", None, validator=optional(positive_float),
                                   shown="the previous stage's (the first: model.rope_theta)")
    rope_scaling: RopeScalingArgs | None = key(
        "the stage's own rope_scaling, the keys of [model.rope_scaling] (rope_type = \"default\": none); it holds "
        "for the stages after too, until one sets another", None,
        shown="the previous stage's (the first: model.rope_scaling)")


@frozen
class EvalDatasetArgs:
    """[[evaluation.datasets]]: one fixed held-out set, evaluated during training and by bin/eval."""

    name: str = key("unique: the name in eval.jsonl, TensorBoard and the report")
    dataset: DatasetArgs | NanosetDatasetsArgs | None = key(
        "the set's own data (the keys of data_stages[].data.dataset); or instead held_out_of", None)
    held_out_of: str | None = key("a stage's name: the samples its sources keep out of training "
                                        "(their held_out_samples)", None)
    max_samples: int = key("a fixed subset: this many samples evenly spaced over the set", 128, validator=positive)
    metric: Literal["loss", "exact_match", "multiple_choice"] = key(
        '"exact_match" (prompt/completion sets): greedy answers compared token for token, as accuracy; '
        '"multiple_choice" (context, choices, answer rows): each choice scored by its log-likelihood, as '
        "lm-evaluation-harness scores acc and acc_norm", "loss")
    sequence_length: int | None = key("the length its samples are cut at", None,
                                            validator=optional(positive),
                                            shown="the stage's for held_out_of, else tokens.sequence_length")
    micro_batch_size: int | None = key("samples per forward pass", None, validator=optional(positive),
                                             shown="tokens.micro_batch_size")
    document_masking: bool | None = key("attention within each document of a packed window, as in training "
                                        "(tokens.document_masking)", None,
                                        shown="the stage's for held_out_of, else tokens.document_masking")
    context_column_name: str | None = key('multiple_choice: the column of the text each choice continues', None,
                                          shown='"context"')
    choices_column_name: str | None = key("multiple_choice: the column of the list of choices", None,
                                          shown='"choices"')
    answer_column_name: str | None = key("multiple_choice: the column of the right choice, its index (or its text)",
                                         None, shown='"answer"')
    target_delimiter: str | None = key("multiple_choice: what joins the context and a choice (lm-evaluation-harness's "
                                       "target_delimiter)", None, shown='" "')

    CHOICE_KEYS = ("context_column_name", "choices_column_name", "answer_column_name", "target_delimiter")

    @property
    def choice_format(self) -> tuple[str, str, str, str]:
        """A multiple_choice set's (context column, choices column, answer column, target delimiter)."""
        def given(value: str | None, default: str) -> str:
            return default if value is None else value
        return (given(self.context_column_name, "context"), given(self.choices_column_name, "choices"),
                given(self.answer_column_name, "answer"), given(self.target_delimiter, " "))


@frozen
class EvaluationArgs:
    """[evaluation]: fixed held-out sets, evaluated during training (docs/evaluation.md)."""

    interval: int | None = key("evaluate every N steps; always also at each stage's last step (the run's "
                                     "end among them)", None, validator=optional(positive), shown="stage ends only")
    datasets: tuple[EvalDatasetArgs, ...] = key("the eval sets", ())
