"""The schema: nanotron's config sections as small frozen attrs classes, each key with its meaning.

Field names follow nanotron so a nanotron YAML translates key for key, with HF LlamaConfig names
in [model]. Every key is declared with `key(...)`: its one-line meaning lives on the field, and
docs/config.md is generated from it (nanoflow.config.reference). A key holding a path says so
(`path=`), and the loader resolves every such key against the TOML file's folder in one walk.
How TOML turns into these classes (exact types, unknown keys refused) is nanoflow.config.structure.
"""

from __future__ import annotations

import json
import os
from typing import Literal, Union

import attrs
from attrs import NOTHING, Factory, field, frozen
from attrs.validators import ge, gt, instance_of, le, lt, optional

from nanoflow.config.locations import BUILDERS  # noqa: F401 - nanoflow.config's name for it comes from here
from nanoflow.errors import NanoflowError


class ConfigError(NanoflowError, ValueError):
    """A configuration that cannot run. The message names the file, the stage and the key."""


positive = [instance_of(int), gt(0)]
non_negative = [instance_of(int), ge(0)]
positive_float = [instance_of((int, float)), gt(0)]
unit_interval = [instance_of((int, float)), ge(0), lt(1)]   # Adam's betas: 1 would never forget, > 1 diverge
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


@frozen
class GeneralArgs:
    """[general]: the run's names and its seed."""

    project: str = key("the project's name, shown with the run's in the plan and its picture", "nanoflow")
    run: str = key("the run's name (not a path: where it writes is checkpoints.checkpoints_path); shown in the "
                   "plan and recorded in the run folder's lock", "run")
    seed: int = key("weight init and, unless a stage sets data.seed, the order of its data", 42)


@frozen
class RopeScalingArgs:
    """[model.rope_scaling]: HF's rope_scaling (rope_parameters), for the RoPE types nanoflow implements.

    "linear" divides every frequency by `factor`; "llama3" (Llama 3.1+) divides the low frequencies by
    `factor`, keeps the high ones and blends in between. The types and the keys each needs are
    nanoflow.config.model_checks.ROPE_KEYS.
    """

    rope_type: str = key('"default" (plain RoPE), "linear" (needs factor) or "llama3" (needs all four numbers)',
                         "default")
    factor: Union[float, None] = key("how much longer the context is made: frequencies are divided by it",
                                     None, validator=optional(positive_float))
    low_freq_factor: Union[float, None] = key("llama3: wavelengths beyond original_max_position_embeddings / this "
                                              "are divided by factor", None, validator=optional(positive_float))
    high_freq_factor: Union[float, None] = key("llama3: wavelengths below original_max_position_embeddings / this "
                                               "are kept; in between, blended", None,
                                               validator=optional(positive_float))
    original_max_position_embeddings: Union[int, None] = key("llama3: the context length the model was trained "
                                                             "at before the extension", None,
                                                             validator=optional(positive))


@frozen
class ModelArgs:
    """[model]: a Llama decoder, in HF LlamaConfig names, plus how to train it."""

    vocab_size: int = key("the embedding's rows: at least the tokenizer's vocabulary (at most 2³², token files "
                          "hold ids as uint32)", validator=[*positive, le(1 << 32)])
    hidden_size: int = key("the width of the residual stream", validator=positive)
    intermediate_size: int = key("the width of each MLP's hidden layer (SwiGLU)", validator=positive)
    num_hidden_layers: int = key("the number of decoder layers", validator=positive)
    num_attention_heads: int = key("query heads per layer; hidden_size must divide by it", validator=positive)
    num_key_value_heads: int = key(
        "key/value heads per layer (grouped-query attention); num_attention_heads must divide by it",
        Factory(lambda self: self.num_attention_heads, takes_self=True), validator=positive,
        shown="num_attention_heads")
    max_position_embeddings: int = key("the longest sequence: every stage's and eval set's sequence_length must "
                                       "fit", 2048, validator=positive)
    rms_norm_eps: float = key("the epsilon of every RMSNorm", 1e-5, validator=positive_float)
    rope_theta: float = key("RoPE's base: the frequencies are rope_theta^(-2i/head_dim)", 10000.0,
                            validator=positive_float)
    rope_scaling: Union[RopeScalingArgs, None] = key("HF's rope_scaling, computed as transformers does "
                                                     "(docs/hf.md); unset: plain RoPE", None)
    tie_word_embeddings: bool = key("lm_head.weight is embed_tokens.weight", False)
    initializer_range: float = key("the std of the normal distribution a fresh start draws every weight matrix "
                                   "from (norms start at 1)", 0.02, validator=positive_float)
    dtype: Literal["float32", "bfloat16"] = key('"bfloat16": bf16 autocast; the master weights and AdamW moments '
                                                "stay float32", "float32")
    compile: bool = key("torch.compile each decoder layer (worth it on GPUs; on CPUs the first steps pay for the "
                        "compilation)", False)
    init_from: Union[str, None] = key("start a new run from these weights: a checkpoint (run or step folder) or an "
                                      "HF Llama folder (config.json + safetensors); read at step 0 only", None,
                                      path=PATH)


@frozen
class TokenizerArgs:
    """[tokenizer]: how text becomes token ids (the `tokenizers` extra reads a tokenizer.json)."""

    tokenizer_name_or_path: str = key('"bytes" (the built-in byte tokenizer: 256 bytes + end-of-text), a '
                                      "tokenizer.json, or an HF model or tokenizer folder holding one", "bytes",
                                      path=TOKENIZER_PATH)
    eos_token: Union[str, None] = key("the end-of-text token every document ends with; unset: the folder's "
                                      "tokenizer_config.json, else a special token such as `<|endoftext|>`, `</s>`, "
                                      "`<eos>`", None)
    bos_token: Union[str, None] = key("the BOS an export declares (nanoflow adds none); unset: as eos_token, from "
                                      "`<|begin_of_text|>`, `<s>`, ...", None)
    accept_recorded_names: Union[list[str], None] = key(
        "tokenizer names recorded in token folders that cannot be resolved here (a hub name, a path on another "
        "machine), to be taken as this tokenizer; each acceptance is logged", None)


@frozen
class ParallelismArgs:
    """[parallelism]: the process layout; torchrun must start dp × tp processes (docs/parallelism.md)."""

    dp: int = key("data-parallel size: FSDP2 shards parameters, gradients and AdamW moments over it", 1,
                  validator=positive)
    tp: int = key("tensor-parallel size: each layer's heads and MLP split over it", 1, validator=positive)
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = key(
        'nanotron\'s names; "REDUCE_SCATTER" is sequence parallelism: norms and the residual stream split by '
        "position over tp (every sequence_length must divide by tp)", "ALL_REDUCE")
    recompute_layer: bool = key("nanotron's name: each decoder layer's activations are recomputed in backward "
                                "instead of kept (any layout, one process too)", False)


@frozen
class TokensArgs:
    """[tokens]: the run's sizes; a stage may override each but train_steps."""

    sequence_length: int = key("tokens per sample: a window of sequence_length + 1 tokens gives as many "
                               "predictions", validator=positive)
    train_steps: int = key("the run's last step (stages starting after it are legal, warned of and not reached)",
                           validator=positive)
    micro_batch_size: int = key("samples per forward pass on each data-parallel replica", validator=positive)
    batch_accumulation_per_replica: Union[int, None] = key(
        "micro-batches accumulated per step; global batch = micro_batch_size × this × dp", None,
        validator=optional(positive), shown="global_batch_size / (micro_batch_size × dp), else 1")
    global_batch_size: Union[int, None] = key(
        "samples per step; stated alone, the accumulation follows from it (so the run keeps its batch on any dp); "
        "stated with the accumulation, the two must agree", None, validator=optional(positive))


@frozen
class LRSchedulerArgs:
    """[optimizer.learning_rate_scheduler]: the run's LR as a function of the step (nanoflow.lr)."""

    learning_rate: float = key("the peak LR", validator=positive_float)
    lr_warmup_steps: int = key("steps of warmup; step 1 of a linear warmup trains at lr / W, never at 0", 0,
                               validator=non_negative)
    lr_warmup_style: Literal["linear", "constant"] = key("the warmup's shape", "linear")
    lr_decay_style: Literal["linear", "cosine", "1-sqrt", "constant"] = key("the decay's shape", "cosine")
    lr_decay_starting_step: Union[int, None] = key("the last step at the peak (set it for warmup-stable-decay)",
                                                   None, validator=optional(positive),
                                                   shown="the end of the warmup")
    lr_decay_steps: Union[int, None] = key("the decay's length in steps", None, validator=optional(positive),
                                           shown="to the last step")
    min_decay_lr: float = key("the LR the decay ends at (and stays at)", 0.0,
                              validator=[instance_of((int, float)), ge(0)])


@frozen
class OptimizerFactoryArgs:
    """[optimizer.optimizer_factory]: AdamW's settings."""

    name: Literal["adamW"] = key("the optimizer (AdamW is the one nanoflow has)", "adamW")
    adam_beta1: float = key("the first moment's decay, in [0, 1)", 0.9, validator=unit_interval)
    adam_beta2: float = key("the second moment's decay, in [0, 1)", 0.95, validator=unit_interval)
    adam_eps: float = key("added to the second moment's root, > 0", 1e-8, validator=positive_float)
    torch_adam_is_fused: bool = key("torch's fused AdamW kernel (false: torch's default choice)", False)


def _clip_grad_valid(_instance, _attribute, value) -> None:
    if value is not False and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(CLIP_GRAD_EXPECTED + f", got {value!r}")


CLIP_GRAD_EXPECTED = "expected the max gradient norm (a number > 0) or false for no clipping"


@frozen
class OptimizerArgs:
    """[optimizer]: AdamW, its LR schedule, weight decay and clipping."""

    learning_rate_scheduler: LRSchedulerArgs = key("the run's LR schedule")
    optimizer_factory: OptimizerFactoryArgs = key("AdamW's settings", Factory(OptimizerFactoryArgs))
    weight_decay: float = key("decoupled (AdamW), on weight matrices only: norms are not decayed", 0.0,
                              validator=[instance_of((int, float)), ge(0)])
    clip_grad: Union[float, Literal[False]] = key(
        "the max global gradient norm; false: no clipping (nanotron's `clip_grad: null`; TOML has no null)", 1.0,
        validator=_clip_grad_valid)

    @property
    def max_grad_norm(self) -> Union[float, None]:
        """The norm gradients are clipped to, or None when they are not clipped."""
        return None if self.clip_grad is False else self.clip_grad


@frozen
class CheckpointsArgs:
    """[checkpoints]: the run folder, saving and resuming (docs/resume.md)."""

    checkpoints_path: str = key("the run folder, a local folder or s3://bucket/prefix: checkpoints, and "
                                "metrics.jsonl when it is local", "checkpoints", path=PATH)
    checkpoint_interval: int = key("save every N steps (and at the end, and on a stop signal)", 1000,
                                   validator=positive)
    resume_checkpoint_path: Union[str, None] = key(
        "a run or step folder to start from, once (only read); once checkpoints_path holds checkpoints that began "
        "there, a rerun continues the newest of them", None, path=PATH)
    load_optimizer: bool = key("false: fresh AdamW moments where the run starts from resume_checkpoint_path",
                               True)
    load_lr_scheduler: bool = key("false: the LR schedule restarts where the run starts from "
                                  "resume_checkpoint_path", True)
    keep: Union[int, None] = key("keep only the N most recently committed checkpoints", None,
                                 validator=optional(positive), shown="all")
    ignore_fingerprint_mismatch: bool = key(
        "resume although a begun stage's data, tokenizer or seeds changed (OLMo-core's name); warns, naming each "
        "change", False)
    ignore_lr_schedule_change: bool = key(
        "resume although the config gives a begun stage's next step another LR (a stage's length or LR keys "
        "edited, a stage inserted after the resume step); warns, naming the change and both LRs", False)
    async_save: bool = key("write checkpoints from a background thread off a host copy of the state while "
                           "training goes on; one save in flight, a stop and the end wait for it", False)


@frozen
class LoggingArgs:
    """[logging]: the progress lines."""

    iteration_step_info_interval: int = key("a plain log line every N steps when not on a terminal", 1,
                                            validator=positive)


@frozen
class DatasetArgs:
    """HF `datasets` sources (nanotron's PretrainDatasetsArgs): a builder ("text", "json", "parquet", "csv",
    "arrow") over local files, a folder saved with `Dataset.save_to_disk`, or a hub dataset; or a
    `{name = weight}` table of such names to blend (a name may then also be a local path or glob)."""

    hf_dataset_or_datasets: Union[str, dict[str, float]] = key(
        'a builder ("text", "json", "csv", "parquet", "arrow") over hf_data_files, a folder saved with '
        "Dataset.save_to_disk, a hub dataset, or a {name = weight} table of them (or of paths and globs) to blend",
        path=DATASET_NAME)
    hf_data_files: Union[str, list[str], None] = key("the builder's files: a path or glob (`**` allowed), or a list "
                                                     "of them", None, path=PATH)
    hf_dataset_config_name: Union[str, None] = key("the hub dataset's configuration (load_dataset's name)", None)
    hf_dataset_splits: Union[str, list[str]] = key(
        'the split to train on, or nanotron\'s list: the listed splits are loaded (each must exist) and "train" '
        "is trained on", "train")
    text_column_name: str = key("pretraining text, tokenized and packed into windows of sequence_length + 1",
                                "text")
    prompt_column_name: Union[str, None] = key("with completion_column_name, an SFT stage: prompt tokens and "
                                               "padding are masked out of the loss", None)
    completion_column_name: Union[str, None] = key("the completion of an SFT row, which the loss is taken on",
                                                   None)
    dataset_processing_num_proc_per_process: int = key("processes each rank loads and tokenizes with", 1,
                                                       validator=positive)
    dataset_overwrite_cache: bool = key("download again and tokenize again instead of reading the caches", False)
    dataset_weights_end: Union[dict[str, float], None] = key(
        "with a {name = weight} table: the same names' weights at the stage's end; each share moves linearly "
        "from the stage's first sample to its last", None, path=DATASET_NAME)
    held_out_samples: Union[int, None] = key(
        "keep the last N samples (windows, or SFT rows) of each source out of training, for an eval set with "
        "held_out_of this stage; stages sharing a source must reserve the same N", None,
        validator=optional(positive))

    @property
    def is_sft(self) -> bool:
        return self.prompt_column_name is not None

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.prompt_column_name, self.completion_column_name) if self.is_sft else (self.text_column_name,)

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
        return "hf:" + json.dumps([name, files, self.hf_dataset_config_name, self.hf_dataset_splits, self.columns])

    def source_keys(self) -> tuple[str, ...]:
        return tuple(self.source_key(name) for name, _ in self.weighted_names())


@frozen
class NanosetDatasetsArgs:
    """Folders of pre-tokenized files (nanotron's NanosetDatasetsArgs; the `*.ds` layout HF datatrove writes and
    `bin/prepare` writes). Several folders are blended by `dataset_weights`; without weights, in proportion to
    their sizes (each folder read once per epoch of the whole, as nanotron does)."""

    dataset_folder: Union[str, list[str]] = key("a token folder (written by bin/prepare or datatrove), or a list "
                                                "of them to blend", path=PATH)
    dataset_weights: Union[list[float], None] = key("the folders' blend weights", None,
                                                    shown="by size")
    dataset_weights_end: Union[list[float], None] = key(
        "the folders' weights at the stage's end (needs dataset_weights); shares move linearly in between", None)
    held_out_samples: Union[int, None] = key(
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

    dataset: Union[DatasetArgs, NanosetDatasetsArgs] = key(
        "the stage's data: token folders when the table names dataset_folder, else HF datasets")
    seed: Union[int, None] = key("the stage's data order", None, shown="general.seed")
    num_loading_workers: int = key("background threads building the next batches", 0, validator=non_negative)
    continue_from: Union[str, None] = key("the name of an earlier stage: the sources this stage shares with it "
                                          "continue where that stage stopped", None)


@frozen
class StageLRSchedulerArgs:
    """[data_stages.learning_rate_scheduler]: the stage's own LR schedule, replacing the run's for its steps
    (nanoflow.lr.resolve_stage_lr). Every key is optional: learning_rate defaults to the run's LR at the
    stage's first step, the decay (linear) to the stage's last step, min_decay_lr to the run's.
    lr_decay_starting_step is a global step, as in nanotron."""

    learning_rate: Union[float, None] = key("the LR of the stage's first step: \"decay from here\"", None,
                                            validator=optional(positive_float),
                                            shown="the run's LR at the stage's first step")
    lr_warmup_steps: int = key("a warmup over the stage's first steps", 0, validator=non_negative)
    lr_warmup_style: Literal["linear", "constant"] = key("the warmup's shape", "linear")
    lr_decay_style: Literal["linear", "cosine", "1-sqrt", "constant"] = key(
        "nanotron's default; not the run's style, which for a WSD run is the \"constant\" a cooldown ends",
        "linear")
    lr_decay_starting_step: Union[int, None] = key("the last step before the decay: a global step within the "
                                                   "stage", None, validator=optional(positive),
                                                   shown="the stage's first step (after its warmup)")
    lr_decay_steps: Union[int, None] = key("the decay's length; it must end within the stage", None,
                                           validator=optional(positive), shown="to the stage's last step")
    min_decay_lr: Union[float, None] = key("the LR reached at the stage's last step", None,
                                           validator=optional([instance_of((int, float)), ge(0)]),
                                           shown="the run's")


@frozen
class DatasetStageArgs:
    """[[data_stages]]: one stage of the curriculum, from its start step to the next stage's (docs/stages.md)."""

    name: str = key("the stage's name, unique: in the plan, the logs, --set and continue_from")
    start_training_step: int = key("the stage's first step; stages sort by it, the first starts at step 1")
    data: DataArgs = key("what the stage reads")
    sequence_length: Union[int, None] = key("the stage's own tokens.sequence_length", None,
                                            validator=optional(positive), shown="tokens'")
    micro_batch_size: Union[int, None] = key("the stage's own tokens.micro_batch_size", None,
                                             validator=optional(positive), shown="tokens'")
    batch_accumulation_per_replica: Union[int, None] = key("the stage's own tokens.batch_accumulation_per_replica",
                                                           None, validator=optional(positive), shown="tokens'")
    global_batch_size: Union[int, None] = key("the stage's own tokens.global_batch_size", None,
                                              validator=optional(positive), shown="tokens'")
    learning_rate_scheduler: Union[StageLRSchedulerArgs, None] = key(
        "the stage's own LR schedule (a cooldown, an annealing phase); unset: the run's", None)


@frozen
class EvalDatasetArgs:
    """[[evaluation.datasets]]: one fixed held-out set, evaluated during training and by bin/eval."""

    name: str = key("unique: the name in eval.jsonl, TensorBoard and the report")
    dataset: Union[DatasetArgs, NanosetDatasetsArgs, None] = key(
        "the set's own data (the keys of data_stages[].data.dataset); or instead held_out_of", None)
    held_out_of: Union[str, None] = key("a stage's name: the samples its sources keep out of training "
                                        "(their held_out_samples)", None)
    max_samples: int = key("a fixed subset: this many samples evenly spaced over the set", 128, validator=positive)
    metric: Literal["loss", "exact_match"] = key(
        '"exact_match" (prompt/completion sets): greedy answers compared token for token, as accuracy', "loss")
    sequence_length: Union[int, None] = key("the length its samples are cut at", None,
                                            validator=optional(positive),
                                            shown="the stage's for held_out_of, else tokens.sequence_length")
    micro_batch_size: Union[int, None] = key("samples per forward pass", None, validator=optional(positive),
                                             shown="tokens.micro_batch_size")


@frozen
class EvaluationArgs:
    """[evaluation]: fixed held-out sets, evaluated during training (docs/evaluation.md)."""

    interval: Union[int, None] = key("evaluate every N steps; always also at each stage's last step (the run's "
                                     "end among them)", None, validator=optional(positive), shown="stage ends only")
    datasets: tuple[EvalDatasetArgs, ...] = key("the eval sets", ())


def _by_start_step(stages) -> tuple[DatasetStageArgs, ...]:
    return tuple(sorted(stages, key=lambda s: s.start_training_step))


@frozen
class Config:
    """A whole run: the sections of one TOML file."""

    model: ModelArgs = key("the model")
    tokens: TokensArgs = key("the run's sizes")
    optimizer: OptimizerArgs = key("AdamW and the LR schedule")
    # Sorted by start step, so a stage's index here is its index in the Schedule.
    data_stages: tuple[DatasetStageArgs, ...] = key("the curriculum: one table per stage", converter=_by_start_step)
    general: GeneralArgs = key("names and the seed", Factory(GeneralArgs))
    tokenizer: TokenizerArgs = key("the tokenizer", Factory(TokenizerArgs))
    parallelism: ParallelismArgs = key("the process layout", Factory(ParallelismArgs))
    checkpoints: CheckpointsArgs = key("saving and resuming", Factory(CheckpointsArgs))
    logging: LoggingArgs = key("the progress lines", Factory(LoggingArgs))
    evaluation: Union[EvaluationArgs, None] = key("eval sets; unset: no evaluation (and nothing recorded for it)",
                                                  None)

    def stage_tokens(self, index: int) -> TokensArgs:
        """[tokens] with stage `index`'s overrides applied and the accumulation resolved."""
        stage = self.data_stages[index]
        overrides = {key: getattr(stage, key) for key in
                     ("sequence_length", "micro_batch_size", "batch_accumulation_per_replica", "global_batch_size")
                     if getattr(stage, key) is not None}
        tokens = attrs.evolve(self.tokens, **overrides)
        if tokens.batch_accumulation_per_replica is None:
            per_step = tokens.micro_batch_size * self.parallelism.dp
            stated = tokens.global_batch_size
            accumulation = stated // per_step if stated is not None and stated % per_step == 0 else 1
            tokens = attrs.evolve(tokens, batch_accumulation_per_replica=accumulation)
        return tokens

    def eval_sequence_length(self, entry: EvalDatasetArgs) -> int:
        """An eval set's sequence length: its own; else, held out of a stage, that stage's (the reserved windows
        are cut at it); else tokens.sequence_length, the run's base length, which adding a stage never changes."""
        if entry.sequence_length is not None:
            return entry.sequence_length
        names = [stage.name for stage in self.data_stages]
        if entry.held_out_of in names:
            return self.stage_tokens(names.index(entry.held_out_of)).sequence_length
        return self.tokens.sequence_length

    def data_seed(self, index: int) -> int:
        seed = self.data_stages[index].data.seed
        return self.general.seed if seed is None else seed

    def to_dict(self) -> dict:
        """The resolved config as plain data (None values dropped, so it round-trips through TOML)."""
        return _drop_none(attrs.asdict(self))


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value]
    return value
