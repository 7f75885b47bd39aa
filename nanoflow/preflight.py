"""The checks that need more than the config file, which nanoflow.run.open_run makes before any work starts
(what `bin/train` and `bin/train --plan` both go through): the model's size against this machine's memory
and `[model] init_from`: a local one must exist, and an HF model folder (local or s3://) has its config.json compared with
`[model]` and its safetensors headers with the weights that model has (the tokenizer is loaded and
measured against model.vocab_size by nanoflow.data.load_run_tokenizer, between the two). The process count
is checked where the processes join: nanoflow.parallel.mesh.init_topology.
"""

from __future__ import annotations

import os

from nanoflow.config import Config, ConfigError, hf_config_mismatches
from nanoflow.flops import matmul_parameters
from nanoflow.io.hf import CONFIG, HFFormatError, HFWeights, is_hf_folder, read_hf_config
from nanoflow.io.store import is_remote

# float32 weights, their gradients and AdamW's two moments: the least a training rank holds per parameter
BYTES_PER_PARAMETER = 16


def check_init_from(config: Config) -> None:
    """When `[model] init_from` is an HF model folder, its config.json must describe the same model as
    `[model]`: a ConfigError names every key that differs and every setting nanoflow's Llama lacks. Then
    its weights, from the safetensors headers only (names, shapes, dtypes), must be the ones that model has:
    a ConfigError names the folder and each tensor missing, unexpected, misshapen or not floating-point.
    A nanoflow checkpoint (run or step folder) is checked when it is read, like a resume."""
    path = config.model.init_from
    if path is not None and not is_remote(path) and not os.path.exists(path):
        raise ConfigError(f"model.init_from: {path} does not exist")
    if path is None or not is_hf_folder(path):
        return
    try:
        hf, where = read_hf_config(path)
    except HFFormatError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    problems = hf_config_mismatches(config.model, hf, where)
    if problems:
        raise ConfigError("\n  ".join(f"model.init_from: {p}" for p in problems))
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
    problems = weight_mismatches(expected, {name: tuple(e["shape"]) for name, e in entries.items()}, tied=tied)
    if not tied and "lm_head.weight" not in entries:
        problems.append(f"{CONFIG} has tie_word_embeddings = false, so the output head lm_head.weight must be stored")
    if any(name.endswith(".bias") for name in set(entries) - set(expected)):
        problems.append("nanoflow's Llama has no biases (a Qwen2-style model \"llamafied\" with its q/k/v biases "
                        "is not a Llama)")
    problems += [f"{name} is stored as {entry['dtype']}, not a floating-point type ({', '.join(FLOAT_DTYPES)})"
                 for name, entry in sorted(entries.items()) if entry["dtype"] not in FLOAT_DTYPES]
    return problems


def parameter_count(model) -> int:
    """Every parameter of the [model] config's Llama: the matmul weights, the input embedding unless tied, the norms."""
    embedding = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    norms = (2 * model.num_hidden_layers + 1) * model.hidden_size
    return matmul_parameters(model) + embedding + norms


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
