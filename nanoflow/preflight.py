"""The checks that need more than the config file, which nanoflow.run.open_run makes before any work starts
(what `bin/train` and `bin/train --plan` both go through): `[model] init_from` — a local one must exist, and an
HF model folder's (local or s3://) config.json completes `[model]` — then the model's size against this
machine's memory, and the HF folder's safetensors headers against the weights that model has (the tokenizer is
loaded and measured against model.vocab_size by nanoflow.data.load_run_tokenizer, between the two). The process count
is checked where the processes join: nanoflow.parallel.mesh.init_topology.
"""

from __future__ import annotations

import os

from nanoflow.config import Config, ConfigError, complete_model
from nanoflow.flops import matmul_parameters
from nanoflow.io.hf import CONFIG, HFFormatError, HFWeights, is_hf_folder, read_hf_config
from nanoflow.io.store import is_remote

# float32 weights, their gradients and AdamW's two moments: the least a training rank holds per parameter
BYTES_PER_PARAMETER = 16


def complete_from_init(config: Config) -> Config:
    """`config` with its [model] complete. A fresh start's was completed when the config was loaded; with
    `[model] init_from` naming an HF model folder (local or s3://), its config.json gives every architecture key
    [model] leaves out, read as transformers reads that model_type (nanoflow.config.model_from_hf), and must agree
    with every key [model] gives: a ConfigError names each key that differs and each setting nanoflow does not
    reproduce, with the family. A nanoflow checkpoint as init_from needs a complete [model] (its weights are
    checked against it when they are read, like a resume's)."""
    path = config.model.init_from
    if path is None:
        return config
    if not is_remote(path) and not os.path.exists(path):
        raise ConfigError(f"model.init_from: {path} does not exist")
    if not is_hf_folder(path):
        return complete_model(config)
    try:
        hf, where = read_hf_config(path)
    except HFFormatError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    return complete_model(config, hf, where)


def check_init_from(config: Config) -> None:
    """When `[model] init_from` is an HF model folder, its weights, from the safetensors headers only (names, shapes,
    dtypes), must be the ones the complete [model] (complete_from_init) has: a ConfigError names the folder and
    each tensor missing, unexpected, misshapen or not floating-point."""
    path = config.model.init_from
    if path is None or not is_hf_folder(path):
        return
    try:
        weights = HFWeights(path)
        entries = weights.entries()
    except HFFormatError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    problems = _weight_problems(config, entries)
    if problems:
        raise ConfigError(f"model.init_from: {weights.path}: its safetensors files do not hold the weights its "
                          f"{CONFIG} describes:\n  " + "\n  ".join(problems))


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")   # what a weight may be stored as: copied into float32 parameters


def _weight_problems(config: Config, entries: dict[str, dict]) -> list[str]:
    """How the tensors an HF folder's headers list (`entries`) differ from the weights [model] builds."""
    import torch

    from nanoflow.model import Llama
    from nanoflow.parallel.shards import weight_mismatches

    with torch.device("meta"):   # the names and shapes only: no memory, no init
        expected = {name: tuple(p.shape) for name, p in Llama(config.model).named_parameters()}
    tied = config.model.tie_word_embeddings
    assert tied is not None   # a complete [model]
    problems = weight_mismatches(expected, {name: tuple(e["shape"]) for name, e in entries.items()}, tied=tied)
    if not tied and "lm_head.weight" not in entries:
        problems.append(f"{CONFIG} has tie_word_embeddings = false, so the output head lm_head.weight must be stored")
    family = config.model.model_type
    if any(name.endswith(".bias") for name in set(entries) - set(expected)):
        problems.append(f"its {CONFIG} describes a {family} without these biases (a Qwen2 \"llamafied\" with its "
                        'q/k/v biases is a qwen2: model_type = "qwen2" in its config.json)')
    problems += [f"{name} is stored as {entry['dtype']}, not a floating-point type ({', '.join(FLOAT_DTYPES)})"
                 for name, entry in sorted(entries.items()) if entry["dtype"] not in FLOAT_DTYPES]
    return problems


def parameter_count(model) -> int:
    """Every parameter of the complete [model] config's decoder: the matmul weights, the input embedding unless
    tied, the norms (the q/k norms too) and the biases."""
    arch, layers = model.architecture, model.num_hidden_layers
    embedding = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    q_width, kv_width = model.num_attention_heads * arch.head_dim, model.num_key_value_heads * arch.head_dim
    qk_norms = {"head": 2 * arch.head_dim, "projection": q_width + kv_width, None: 0}[arch.qk_norm]
    norms = (2 * layers + 1) * model.hidden_size + layers * qk_norms   # two a layer, before or after its blocks
    qkv = q_width + 2 * kv_width
    biases = layers * ((qkv if arch.qkv_bias else 0) + (model.hidden_size if arch.o_bias else 0))
    return matmul_parameters(model) + embedding + norms + biases


def check_model_size(config: Config) -> None:
    """Refuse a model whose training state cannot fit in this machine's memory even sharded over every rank
    (a size mistyped by a few digits): said before anything is built, rather than an allocator traceback or
    a build that runs until it is killed. The bound is the memory the state lives in: the GPU's on CUDA (a
    virtual machine's host memory can start far below what it grows to), else the host's."""
    model, parallelism = config.model, config.parallelism
    parameters = parameter_count(model)
    needed = BYTES_PER_PARAMETER * parameters // (parallelism.dp * parallelism.tp)
    available, where = _memory()
    if available is None or needed <= available:
        return
    raise ConfigError(f"model: {parameters:,} parameters (hidden_size = {model.hidden_size}, num_hidden_layers = "
                      f"{model.num_hidden_layers}, intermediate_size = {model.intermediate_size}, vocab_size = "
                      f"{model.vocab_size}) need {needed:,} bytes ({needed / 2**30:,.0f} GiB) per rank for the "
                      f"float32 weights, gradients and AdamW moments; this {where} has {available:,} bytes "
                      f"({available / 2**30:,.0f} GiB) of memory: a size mistyped?")


def _memory() -> tuple[int | None, str]:
    """(bytes of the memory a rank's training state lives in, what holds it)."""
    import torch

    if torch.cuda.is_available():
        from nanoflow.parallel.mesh import device

        return torch.cuda.get_device_properties(device()).total_memory, "GPU"
    return _host_memory(), "machine"


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on every platform: then no check
        return None
