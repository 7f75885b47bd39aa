"""How torch runs (nanoflow/parallel/runtime.py), settled by open_run before any CUDA work: determinism, the
environment CUDA, cuBLAS and NCCL read when they start, `[model] dtype = "auto"`, the attention kernel, and
FSDP2 leaving the loss scale in float32."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers import tiny

import nanoflow.attention
import nanoflow.model
from nanoflow import init_state
from nanoflow.model import Llama
from nanoflow.parallel import runtime
from nanoflow.run import open_run
from nanoflow.step import forward_context, precision

NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
         "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
         "TORCH_NCCL_ASYNC_ERROR_HANDLING")


@pytest.fixture
def torch_switches():
    """Whatever a test opens, the next test starts from torch's own defaults."""
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


@pytest.fixture
def clean_environment(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_deterministic_turns_torchs_deterministic_algorithms_on_and_a_later_run_turns_them_off(tmp_path,
                                                                                                 torch_switches):
    open_run(tiny(tmp_path / "a", "general.deterministic=true"))
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    # nanoflow fills what it reads; torch's fill of every new tensor (a pass over memory each) stays off
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    open_run(tiny(tmp_path / "b"))
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


def test_a_plan_changes_no_setting_of_torchs(tmp_path, torch_switches):
    open_run(tiny(tmp_path / "a", "general.deterministic=true"), join=False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_deterministic_run_trains_on_a_cpu_with_the_same_bits_as_without(tmp_path, torch_switches):
    from nanoflow import stage_data, train_step

    finals = []
    for flag in ("true", "false"):
        state = init_state(tiny(tmp_path / flag, f"general.deterministic={flag}"))
        with stage_data(state) as loader:
            for step in (1, 2):
                state, _ = train_step(state, loader.batch_at(step))
        finals.append({name: p.detach().clone() for name, p in state.model.named_parameters()})
    assert all(torch.equal(finals[0][name], finals[1][name]) for name in finals[0])


def test_on_a_cpu_the_environment_is_left_as_it_is(tmp_path, clean_environment):
    clean_environment.setattr(torch.cuda, "is_available", lambda: False)
    before = dict(os.environ)
    runtime.set_environment(tiny(tmp_path, "general.deterministic=true"), tmp_path, world_size=4)
    assert dict(os.environ) == before


def test_on_cuda_the_allocator_cublas_and_the_flight_recorder_are_set_before_they_start(tmp_path, clean_environment):
    clean_environment.setattr(torch.cuda, "is_available", lambda: True)   # only the variables are set: no CUDA work
    clean_environment.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    clean_environment.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")   # the user's own setting is kept
    runtime.set_environment(tiny(tmp_path, "general.deterministic=true"), tmp_path / "run", world_size=2)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "20000"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] \
        == str(tmp_path / "run" / "flight_recorder" / "rank_")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert not (tmp_path / "run").exists()   # the folder is the training loop's to make, after its checks
    runtime.make_flight_recorder_folder(tmp_path / "run")
    assert (tmp_path / "run" / "flight_recorder").is_dir()


def test_one_process_and_a_fast_run_set_no_cublas_workspace_and_no_flight_recorder(tmp_path, clean_environment):
    clean_environment.setattr(torch.cuda, "is_available", lambda: True)
    runtime.set_environment(tiny(tmp_path), tmp_path / "run", world_size=1)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert not any(name in os.environ for name in NAMES[1:])
    runtime.make_flight_recorder_folder(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_auto_dtype_is_float32_on_a_cpu_and_bfloat16_on_cuda_and_the_run_holds_the_resolved_one(tmp_path):
    config = tiny(tmp_path)
    assert config.model.dtype == "auto"
    assert runtime.resolved(config, torch.device("cpu")).model.dtype == "float32"
    assert runtime.resolved(config, torch.device("cuda", 0)).model.dtype == "bfloat16"
    explicit = tiny(tmp_path, "model.dtype=float32")
    assert runtime.resolved(explicit, torch.device("cuda", 0)) is explicit   # a stated dtype is kept
    run = open_run(config)
    assert run.config.model.dtype == "float32" and run.config.to_dict()["model"]["dtype"] == "float32"


def test_precision_is_autocast_only_for_bfloat16(tmp_path):
    cpu = torch.device("cpu")
    with precision("auto", cpu):
        assert not torch.is_autocast_enabled("cpu")
    with precision("bfloat16", cpu):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with forward_context("bfloat16", cpu):
        assert torch.is_autocast_enabled("cpu")


def test_the_attention_kernel_is_torchs_own_choice_for_the_models_shapes(tmp_path):
    model = tiny(tmp_path, "model.dtype=float32").model   # 32 hidden, 4 heads over 2 kv heads
    assert runtime.attention_kernel(model, torch.device("cpu"), 32) == \
        "flash_attention (float32, head_dim 8, grouped-query 4/2 heads)"
    plain = tiny(tmp_path, "model.dtype=float32", "model.num_key_value_heads=4").model
    assert runtime.attention_kernel(plain, torch.device("cpu"), 32) == "flash_attention (float32, head_dim 8)"


@pytest.mark.parametrize(("grouped", "expanded", "repeat"), [
    ("flash_attention", "flash_attention", False),      # bf16 on sm80-sm90: flash takes the grouped heads
    ("cudnn_attention", "cudnn_attention", False),      # where flash cannot, cuDNN takes them too
    ("math", "efficient_attention", True),              # float32, or deterministic without flash: only the
    ("math", "math", False),                            # memory-efficient kernel is left, and it refuses them
])
def test_grouped_heads_are_repeated_only_where_that_turns_the_math_kernel_into_a_fused_one(grouped, expanded, repeat):
    assert nanoflow.attention.expand_grouped_heads(grouped, expanded) is repeat


def test_where_the_grouped_call_would_take_the_math_kernel_k_and_v_are_repeated_and_the_header_says_so(
        tmp_path, monkeypatch):
    # A dispatcher as torch 2.13's CUDA one answers for float32: math for grouped heads, efficient for whole ones
    # (on this CPU its flash kernel runs either way, so the repeated call's bits can be held to the grouped call's)
    asked = []

    def dispatcher(q, k, v, is_causal=False, enable_gqa=False, **_):
        asked.append((q.shape[1], k.shape[1], enable_gqa))
        return 0 if k.shape[1] != q.shape[1] else 2
    monkeypatch.setattr(torch, "_fused_sdp_choice", dispatcher)
    monkeypatch.setattr(nanoflow.attention, "_EXPANDS", {})
    model = tiny(tmp_path, "model.dtype=float32").model   # 4 heads over 2 kv heads, head_dim 8
    assert runtime.attention_kernel(model, torch.device("cpu"), 32) == "efficient_attention (float32, head_dim 8, " \
        "grouped-query 4/2 heads, k and v repeated to 4 heads: the grouped call would take the math kernel)"
    assert asked == [(4, 2, True), (4, 4, False)]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=generator)
    k, v = torch.randn(2, 2, 16, 8, generator=generator), torch.randn(2, 2, 16, 8, generator=generator)
    called = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: called.append(k.shape[1]) or sdpa(q, k, v, **kw))
    out = nanoflow.attention.causal_attention(q, k, v)
    assert called == [4]   # the kernel got every query head's own k and v
    assert torch.equal(out, sdpa(q, k, v, is_causal=True, enable_gqa=True))
    monkeypatch.setattr(nanoflow.attention, "_EXPANDS", {})   # a CPU asks nothing of its own: grouped as given
    called.clear()
    nanoflow.attention.causal_attention(q, k, v)
    assert called == [2] and len(asked) == 2


def test_fsdp2s_root_hands_the_loss_its_float32_grad_scale_under_bfloat16(tmp_path, monkeypatch):
    # FSDP2's MixedPrecisionPolicy casts a module's floating-point forward inputs to param_dtype by default: the
    # root's would be the grad_scale, 1 / target tokens, rounded to bf16's 8 bits before the loss scales by it.
    from torch.distributed.device_mesh import init_device_mesh

    from nanoflow.parallel.plan import shard_data_parallel

    config = tiny(tmp_path)
    model = Llama(config.model)
    model.reset_parameters(torch.Generator().manual_seed(0))
    seen = []
    real = nanoflow.model.lm_loss

    def spy(hidden, weight, labels, ignore_index, grad_scale=None, method="fused"):
        seen.append(grad_scale.dtype)
        return real(hidden, weight, labels, ignore_index, grad_scale, method)

    monkeypatch.setattr(nanoflow.model, "lm_loss", spy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shard_data_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), "bfloat16")
        ids = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        with precision("bfloat16", torch.device("cpu")):
            loss = model(ids, ids, grad_scale=torch.ones(()) / 3)
        loss.backward()
    finally:
        dist.destroy_process_group()
    assert seen == [torch.float32]
    assert model.model.embed_tokens.weight.grad is not None
