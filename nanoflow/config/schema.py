"""The schema: nanotron's config sections as small frozen attrs classes, each key with its meaning.

Field names follow nanotron so a nanotron YAML translates key for key, with HF LlamaConfig names
in [model]. Every key is declared with `key(...)` (nanoflow.config.keys): its one-line meaning
lives on the field, and docs/config.md is generated from it (nanoflow.config.reference). A key
holding a path says so (`path=`), and the loader resolves every such key against the TOML file's
folder in one walk. The run's sections are here, the curriculum's ([[data_stages]], [evaluation])
in nanoflow.config.stages; how TOML turns into them (exact types, unknown keys refused) is
nanoflow.config.structure.
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import Factory, frozen
from attrs.validators import ge, instance_of, le, lt, optional

from nanoflow.config.families import Architecture, architecture
from nanoflow.config.keys import PATH, TOKENIZER_PATH, key, non_negative, positive, positive_float, unit_interval
from nanoflow.config.locations import BUILDERS  # noqa: F401 - nanoflow.config's name for it comes from here
from nanoflow.config.rope import RopeScalingArgs
from nanoflow.config.stages import (  # noqa: F401 - re-exported: the schema is one namespace
    DataArgs,
    DatasetArgs,
    DatasetStageArgs,
    EvalDatasetArgs,
    EvaluationArgs,
    NanosetDatasetsArgs,
    StageLRSchedulerArgs,
)
from nanoflow.errors import ConfigError  # noqa: F401 - imported from here

REQUIRED = "required (with init_from: config.json's)"
FROM_HF = " (with init_from: config.json's)"


@frozen
class GeneralArgs:
    """[general]: the run's names, its seed and whether it must compute the same bits twice."""

    project: str = key("the project's name, shown with the run's in the plan and its picture", "nanoflow")
    run: str = key("the run's name (not a path: where it writes is checkpoints.checkpoints_path); shown in the "
                   "plan and recorded in the run folder's lock", "run")
    seed: int = key("weight init and, unless a stage sets data.seed, the order of its data", 42)
    deterministic: bool = key("torch's deterministic algorithms (and cuBLAS's and cuDNN's): two runs of the same "
                              "steps give the same bits on a GPU too, at some speed (docs/design.md, \"What runs "
                              "differently on CUDA\"); CPUs compute the same bits either way", False)


@frozen
class ModelArgs:
    """[model]: a decoder of one of transformers' families (Llama, Qwen2, Qwen3, Mistral, SmolLM3, OLMo 2), in HF
    config.json names, plus how to train it.

    With `init_from` naming an HF model folder the architecture is read from its config.json and every
    architecture key here may be left out; a key that is given must agree with config.json. Without one, a
    fresh model needs its five sizes (vocab_size … num_attention_heads); the other keys have the defaults shown,
    whatever the family (docs/hf.md has each family's keys and the switches they make).
    """

    model_type: Literal["llama", "qwen2", "qwen3", "mistral", "smollm3", "olmo2"] | None = key(
        "the family, HF's model_type: what differs from Llama is a few switches (q/k/v biases, q/k RMSNorms, "
        "layers without RoPE, norms after the blocks; docs/hf.md)", None, shown='`"llama"`; with init_from: config.json\'s')
    vocab_size: int | None = key("the embedding's rows: at least the tokenizer's vocabulary (at most 2³², token "
                                 "files hold ids as uint32)", None, validator=optional([*positive, le(1 << 32)]),
                                 shown=REQUIRED)
    hidden_size: int | None = key("the width of the residual stream", None, validator=optional(positive),
                                  shown=REQUIRED)
    intermediate_size: int | None = key("the width of each MLP's hidden layer (SwiGLU)", None,
                                        validator=optional(positive), shown=REQUIRED)
    num_hidden_layers: int | None = key("the number of decoder layers", None, validator=optional(positive),
                                        shown=REQUIRED)
    num_attention_heads: int | None = key("query heads per layer", None, validator=optional(positive),
                                          shown=REQUIRED)
    num_key_value_heads: int | None = key(
        "key/value heads per layer (grouped-query attention); num_attention_heads must divide by it", None,
        validator=optional(positive), shown="num_attention_heads" + FROM_HF)
    head_dim: int | None = key("the width of each attention head (Qwen3 and Mistral state it; q_proj has "
                               "num_attention_heads × head_dim outputs)", None, validator=optional(positive),
                               shown="hidden_size / num_attention_heads" + FROM_HF)
    attention_bias: bool | None = key("llama, qwen3, smollm3, olmo2: biases on the q, k, v and o projections (qwen2 "
                                      "has them on q, k, v always; mistral never)", None, shown="`false`" + FROM_HF)
    sliding_window: int | Literal[False] | None = key(
        "mistral: each position attends to this many positions up to itself; nanoflow attends to every earlier "
        "one, so it must be at least every stage's and eval set's sequence_length (false: no window, "
        "config.json's null)", None, shown="`false`" + FROM_HF)
    no_rope_layers: list[int] | None = key(
        "smollm3: one entry per layer, 1 where the layer applies RoPE, 0 where it attends without positions "
        "(NoPE); given, it wins over no_rope_layer_interval", None,
        shown="from no_rope_layer_interval" + FROM_HF)
    no_rope_layer_interval: int | None = key("smollm3: without no_rope_layers, every layer i with i + 1 a "
                                             "multiple of it takes no RoPE", None, validator=optional(positive),
                                             shown="`4`" + FROM_HF)
    max_position_embeddings: int | None = key("the longest sequence: every stage's and eval set's sequence_length "
                                              "must fit", None, validator=optional(positive), shown="`2048`" + FROM_HF)
    rms_norm_eps: float | None = key("the epsilon of every RMSNorm", None, validator=optional(positive_float),
                                     shown="`1e-05`" + FROM_HF)
    rope_theta: float | None = key("RoPE's base: the frequencies are rope_theta^(-2i/head_dim)", None,
                                   validator=optional(positive_float), shown="`10000.0`" + FROM_HF)
    rope_scaling: RopeScalingArgs | None = key("HF's rope_scaling, computed as transformers does "
                                                     "(docs/hf.md); unset: plain RoPE (with init_from: "
                                                     "config.json's)", None)
    tie_word_embeddings: bool | None = key("lm_head.weight is embed_tokens.weight", None,
                                           shown="`false`" + FROM_HF)
    initializer_range: float | None = key("the std of the normal distribution a fresh start draws every weight "
                                          "matrix from (norms start at 1, biases at 0)", None,
                                          validator=optional(positive_float), shown="`0.02`" + FROM_HF)
    dtype: Literal["auto", "float32", "bfloat16"] = key(
        '"bfloat16": bf16 autocast, the master weights and AdamW moments float32; "auto": bfloat16 on a CUDA device, '
        "float32 on a CPU (a checkpoint records, and a resume compares, what it resolved to)", "auto")
    compile: bool = key("torch.compile the whole forward, loss included, as one graph (each decoder layer alone "
                        "under FSDP2 or tp); the first step of each stage pays for the compilation", False)
    init_from: str | None = key("start a new run from these weights: a checkpoint (run or step folder), or an "
                                "HF model folder (config.json + safetensors) of a family above, whose config.json "
                                "then gives every architecture key left out here; read at step 0 only", None,
                                path=PATH)

    @property
    def architecture(self) -> Architecture:
        """The switches nanoflow.model builds this family's decoder with (set once the keys are complete)."""
        return architecture(self)


@frozen
class TokenizerArgs:
    """[tokenizer]: how text becomes token ids (the `tokenizers` extra reads a tokenizer.json)."""

    tokenizer_name_or_path: str = key('"bytes" (the built-in byte tokenizer: 256 bytes + end-of-text), a '
                                      "tokenizer.json, or an HF model or tokenizer folder holding one", "bytes",
                                      path=TOKENIZER_PATH)
    eos_token: str | None = key("the end-of-text token every document ends with; unset: the folder's "
                                      "tokenizer_config.json, else a special token such as `<|endoftext|>`, `</s>`, "
                                      "`<eos>`", None)
    bos_token: str | None = key("the BOS an export declares (nanoflow adds none); unset: as eos_token, from "
                                      "`<|begin_of_text|>`, `<s>`, ...", None)
    accept_recorded_names: list[str] | None = key(
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
    batch_accumulation_per_replica: int | None = key(
        "micro-batches accumulated per step; global batch = micro_batch_size × this × dp", None,
        validator=optional(positive), shown="global_batch_size / (micro_batch_size × dp), else 1")
    global_batch_size: int | None = key(
        "samples per step; stated alone, the accumulation follows from it (so the run keeps its batch on any dp); "
        "stated with the accumulation, the two must agree", None, validator=optional(positive))
    document_masking: bool = key(
        "packed windows: each document attends only to itself, its positions start at 0, and an end-of-text "
        "token's prediction of the next document is no target (nanotron's _use_doc_masking)", False)


@frozen
class LRSchedulerArgs:
    """[optimizer.learning_rate_scheduler]: the run's LR as a function of the step (nanoflow.lr)."""

    learning_rate: float = key("the peak LR", validator=positive_float)
    lr_warmup_steps: int = key("steps of warmup; step 1 of a linear warmup trains at lr / W, never at 0", 0,
                               validator=non_negative)
    lr_warmup_style: Literal["linear", "constant"] = key("the warmup's shape", "linear")
    lr_decay_style: Literal["linear", "cosine", "1-sqrt", "constant"] = key("the decay's shape", "cosine")
    lr_decay_starting_step: int | None = key("the last step at the peak (set it for warmup-stable-decay)",
                                                   None, validator=optional(positive),
                                                   shown="the end of the warmup")
    lr_decay_steps: int | None = key("the decay's length in steps", None, validator=optional(positive),
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
    torch_adam_is_fused: bool | None = key(
        "nanotron's key: torch's fused AdamW kernel, one kernel for all the update's arithmetic (CPU and CUDA); false: "
        "torch's default choice (a for-loop on a CPU, foreach on CUDA); unset: fused, and a resume keeps what its "
        "checkpoint trained with (one written before fused was the default: not fused)", None,
        shown="fused; a resume: as its checkpoint")


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
    clip_grad: float | Literal[False] = key(
        "the max global gradient norm; false: no clipping (nanotron's `clip_grad: null`; TOML has no null)", 1.0,
        validator=_clip_grad_valid)
    ema_decay: float | None = key(
        "keep an exponential moving average of the weights in float32, updated after every optimizer step as "
        "ema = decay × ema + (1 − decay) × weights; saved with each checkpoint (its ema/ group), evaluated beside the "
        "weights, exported by `bin/export --ema`; a stage may set its own (docs/monitoring.md, \"Weight EMA\")", None,
        validator=optional([instance_of((int, float)), ge(0), lt(1)]), shown="none")

    @property
    def max_grad_norm(self) -> float | None:
        """The norm gradients are clipped to, or None when they are not clipped."""
        return None if self.clip_grad is False else self.clip_grad


@frozen
class CheckpointsArgs:
    """[checkpoints]: the run folder, saving and resuming (docs/resume.md)."""

    checkpoints_path: str = key("the run folder, a local folder or s3://bucket/prefix: checkpoints, and "
                                "metrics.jsonl when it is local", "checkpoints", path=PATH)
    checkpoint_interval: int = key("save every N steps (and at the end, and on a stop signal)", 1000,
                                   validator=positive)
    resume_checkpoint_path: str | None = key(
        "a run or step folder to start from, once (only read); once checkpoints_path holds checkpoints that began "
        "there, a rerun continues the newest of them", None, path=PATH)
    load_optimizer: bool = key("false: fresh AdamW moments where the run starts from resume_checkpoint_path",
                               True)
    load_lr_scheduler: bool = key("false: the LR schedule restarts where the run starts from "
                                  "resume_checkpoint_path", True)
    keep: int | None = key("keep only the N most recently committed checkpoints", None,
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
class WandbArgs:
    """[logging.wandb]: Weights & Biases logging from rank 0, in wandb.init's own names (docs/monitoring.md)."""

    project: str = key("the W&B project")
    entity: str | None = key("the W&B team or user", None, shown="W&B's default entity")
    name: str | None = key("the W&B run's display name", None, shown="general.run")
    mode: Literal["online", "offline", "disabled"] | None = key(
        '"offline": written to `dir` only, for `wandb sync` later; "disabled": nothing', None,
        shown='WANDB_MODE, else "online"')
    dir: str | None = key("where W&B writes its files (a wandb/ folder in it)", None, path=PATH,
                          shown="the run folder")


@frozen
class LoggingArgs:
    """[logging]: the progress lines, and Weights & Biases."""

    iteration_step_info_interval: int = key("a plain log line every N steps when not on a terminal", 1,
                                            validator=positive)
    wandb: WandbArgs | None = key("log to Weights & Biases (the `wandb` extra); unset: not", None)


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
    evaluation: EvaluationArgs | None = key("eval sets; unset: no evaluation (and nothing recorded for it)",
                                                  None)

    @property
    def keeps_ema(self) -> bool:
        """Whether the run keeps a weight EMA: [optimizer] ema_decay or a stage's is set."""
        return self.optimizer.ema_decay is not None or any(s.ema_decay is not None for s in self.data_stages)

    def stage_ema_decay(self, index: int) -> float:
        """The EMA decay of stage `index`'s steps: its own, else the run's, else 0 (the EMA follows the weights)."""
        own = self.data_stages[index].ema_decay
        return own if own is not None else (self.optimizer.ema_decay or 0.0)

    def stage_tokens(self, index: int) -> TokensArgs:
        """[tokens] with stage `index`'s overrides applied and the accumulation resolved."""
        stage = self.data_stages[index]
        overrides = {key: getattr(stage, key) for key in
                     ("sequence_length", "micro_batch_size", "batch_accumulation_per_replica", "global_batch_size",
                      "document_masking")
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

    def eval_document_masking(self, entry: EvalDatasetArgs) -> bool:
        """An eval set's document masking: its own; else, held out of a stage, that stage's; else tokens'."""
        if entry.document_masking is not None:
            return entry.document_masking
        names = [stage.name for stage in self.data_stages]
        if entry.held_out_of in names:
            return self.stage_tokens(names.index(entry.held_out_of)).document_masking
        return self.tokens.document_masking

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
