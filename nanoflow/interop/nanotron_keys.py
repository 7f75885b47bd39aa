"""What nanotron's config keys mean to nanoflow: the keys that cannot carry over (and why), the values
of those that change nothing, and nanotron's defaults for keys a YAML leaves unset.

Read from huggingface/nanotron's source; docs/nanotron.md names the commit.
"""

# Keys that have no nanoflow equivalent, with the reason shown in the report.
# data_stages[i] is written data_stages here.
REASONS = {
    "general.step": "the step comes from the checkpoint",
    "general.consumed_train_samples": "consumed samples come from the checkpoint",
    "general.benchmark_csv_path": "no benchmark CSV",
    "general.ignore_sanity_checks": "nanoflow always validates",
    "general.entity": "no experiment tracker",
    "model.init_method": "weights are drawn with model.initializer_range; for existing weights set model.init_from",
    "model.make_vocab_size_divisible_by": "set model.vocab_size to the padded size",
    "model.ddp_bucket_cap_mb": "FSDP2 does its own bucketing",
    "model.model_config.hidden_act": "nanoflow's MLP is always silu",
    "model.model_config.attention_bias": "nanotron's Qwen2 biases q, k and v; nanoflow's smollm3, the family with "
                                         "layers without RoPE, biases all four projections or none",
    "model.model_config._attn_implementation": "nanoflow uses PyTorch's scaled_dot_product_attention",
    "model.model_config.z_loss_enabled": "no z-loss: the loss is plain cross-entropy",
    "model.model_config.z_loss_coefficient": "no z-loss: the loss is plain cross-entropy",
    "model.model_config.is_qwen2_config": "nanotron's Qwen2Config: nanoflow's llama, qwen2 (attention_bias), smollm3 "
                                          "(no_rope_layer) or mistral (sliding_window_size)",
    "model.model_config.sliding_window_size": "nanoflow reproduces a sliding window as mistral only: no biases, RoPE "
                                              "in every layer",
    "model.model_config.flex_attention_mask": "causal attention over the whole sequence only",
    "model.model_config._fused_rotary_emb": "a kernel choice", "model.model_config._fused_rms_norm": "a kernel choice",
    "model.model_config._use_qkv_packed": "a kernel choice", "model.model_config.log_attn_probs": "a logging switch",
    "model.model_config.ring_attn_heads_k_stride": "no context parallelism",
    "model.init_method.scaling_method": "under NUM_LAYERS, nanotron's default, o_proj and down_proj are drawn with "
                                        "std / sqrt(2 × num_hidden_layers); nanoflow draws every weight with "
                                        "initializer_range",
    "model.model_config.rope_interleaved": "nanoflow uses HF's non-interleaved RoPE",
    "model.model_config.bos_token_id": "special tokens come from the tokenizer",
    "model.model_config.eos_token_id": "special tokens come from the tokenizer",
    "model.model_config.pad_token_id": "special tokens come from the tokenizer",
    "model.model_config.pretraining_tp": "an HF inference setting",
    "model.model_config.use_cache": "an HF inference setting",
    "model.model_config.is_llama_config": "nanotron's LlamaConfig: nanoflow's llama",
    "tokenizer.tokenizer_revision": "tokenizers are local tokenizer.json files",
    "tokenizer.tokenizer_max_length": "sequence lengths come from [tokens] and the stages",
    "parallelism.pp": "nanoflow has no pipeline parallelism: dp and tp only",
    "parallelism.pp_engine": "no pipeline parallelism",
    "parallelism.expert_parallel_size": "no mixture of experts",
    "parallelism.context_parallel_size": "no context parallelism",
    "parallelism.tp_linear_async_communication": "PyTorch's DTensor tensor parallelism has no such switch",
    "parallelism.tp_recompute_allgather": "PyTorch's DTensor tensor parallelism has no such switch",
    "tokens.val_check_interval": "no validation loop",
    "tokens.limit_val_batches": "no validation loop",
    "tokens.limit_test_batches": "no validation loop",
    "optimizer.zero_stage": "FSDP2 shards parameters, gradients and optimizer state over dp",
    "optimizer.accumulate_grad_in_fp32": "master weights and gradients are float32",
    "optimizer.weight_decay_exclude_named_params": "1-D parameters (norms) are never decayed",
    "checkpoints.save_initial_state": "not supported",
    "checkpoints.save_final_state": "the last step is always saved",
    "checkpoints.checkpoints_path_is_shared_file_system": "not needed: every rank writes its own files",
    "logging.log_level": "nanoflow logs progress lines, not levels",
    "logging.log_level_replica": "nanoflow logs progress lines, not levels",
    "data_stages.data.dataset.hf_dataset_or_datasets": "a dataset name, or a {name = weight} table to blend",
    "data_stages.data.dataset.dataset_max_tokens": "not supported",
    "data_stages.data.dataset.return_positions": "not supported",
    "data_stages.data.dataset.pad_samples_to_global_batch_size": "not supported",
    "data_stages.data.dataset.dataset_read_path": "nanoflow reads dataset_folder itself",
    "data_stages.data.dataset.tokenizer_name": "read from each folder's metadata",
    "data_stages.data.dataset.vocab_size": "read from each folder's metadata",
    "data_stages.data.dataset.token_size_in_bytes": "read from each folder's metadata",
    "data_stages.data.dataset.skip_in_stream": "not supported",
    "data_stages.data.dataset.shuffle_files": "nanoflow's sample order is its own (a pure function of the seed)",
    "data_stages.data.dataset.use_old_brrr_dataloader": "not supported",
    "data_stages.data.dataset.debug_max_samples": "not supported",
    "lighteval": "no evaluation hook; run lighteval on an exported model (bin/export)",
    "profiler": "no profiler hook",
    "s3_upload": "set checkpoints.checkpoints_path = \"s3://bucket/prefix\" to write checkpoints to S3 directly",
    "kill_switch_path": "send SIGTERM or SIGUSR1 to stop cleanly",
    "metrics_logging": "metrics go to metrics.jsonl and TensorBoard",
}

# Values of dropped keys that change nothing in nanoflow (None: any value is harmless).
NEUTRAL = {
    "general.ignore_sanity_checks": None, "general.benchmark_csv_path": None, "general.entity": None,
    "model.ddp_bucket_cap_mb": None, "model.make_vocab_size_divisible_by": 1,
    "model.model_config.bos_token_id": None, "model.model_config.eos_token_id": None,
    "model.model_config.pad_token_id": None, "model.model_config.pretraining_tp": 1,
    "model.model_config.use_cache": None, "model.model_config.is_llama_config": True,
    "parallelism.pp": 1, "parallelism.pp_engine": None, "parallelism.expert_parallel_size": 1,
    "parallelism.context_parallel_size": 1,
    "parallelism.tp_linear_async_communication": None, "parallelism.tp_recompute_allgather": None,
    "tokens.val_check_interval": -1, "tokens.limit_val_batches": 0, "tokens.limit_test_batches": 0,
    "optimizer.zero_stage": 0, "optimizer.accumulate_grad_in_fp32": True,
    "checkpoints.save_initial_state": False, "checkpoints.save_final_state": None,
    "checkpoints.checkpoints_path_is_shared_file_system": None,
    "logging.log_level": None, "logging.log_level_replica": None,
    "tokenizer.tokenizer_revision": None, "tokenizer.tokenizer_max_length": None,
    "model.model_config.attention_bias": False, "model.model_config._attn_implementation": None,
    "model.model_config.z_loss_enabled": False, "model.model_config.z_loss_coefficient": None,
    "model.model_config.is_qwen2_config": True,
    "model.model_config._fused_rotary_emb": None, "model.model_config._fused_rms_norm": None,
    "model.model_config._use_qkv_packed": None, "model.model_config.log_attn_probs": None,
    "model.model_config.ring_attn_heads_k_stride": None, "model.init_method.scaling_method": "NONE",
    "data_stages.data.dataset.tokenizer_name": None, "data_stages.data.dataset.vocab_size": None,
    "data_stages.data.dataset.token_size_in_bytes": None, "data_stages.data.dataset.return_positions": True,
    "data_stages.data.dataset.skip_in_stream": False, "data_stages.data.dataset.shuffle_files": False,
    "data_stages.data.dataset.use_old_brrr_dataloader": False,
    "data_stages.data.dataset.pad_samples_to_global_batch_size": False,
    "optimizer.weight_decay_exclude_named_params": [],
}


# The one deliberate difference, stated atop every converted file (docs/nanotron.md says more).
LR_SHIFT = ("# LR: nanoflow's step s trains at the LR nanotron's scheduler gives for index s. nanotron trains\n"
            "# its step s at index s - 1 (step 1 at index 0: LR 0 under a linear warmup), so this run is one\n"
            "# scheduler index ahead of the nanotron run at every step.\n")


# nanotron's meaning of a key the YAML leaves unset (or null). The converter writes these out.

# LlamaConfig / Qwen2Config defaults (config/models_config.py), for the keys nanoflow's [model] has.
MODEL_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
NANOTRON_DATA_SEED = 42   # DataArgs.seed unset: DEFAULT_SEED, not general.seed
NANOTRON_DTYPE = "bfloat16"   # ModelArgs.dtype unset


# nanotron's model configs, by the flag each sets ("We use this help differentiate models in yaml/python
# conversion"): LlamaConfig, Qwen2Config, Starcoder2Config (src/nanotron/config/models_config.py),
# MambaModelConfig (examples/mamba/config.py), LlaMoEConfig (examples/moe/config_llamoe.py). nanotron picks the
# class from the flag (its dacite is strict, so a flag only one class has decides) and builds the model of that
# class (trainer.py CONFIG_TO_MODEL_CLASS). None: the converter carries it over as a Llama; else why not.
MODEL_CONFIG_FLAGS = {
    "is_llama_config": ("LlamaConfig", None),
    "is_qwen2_config": ("Qwen2Config", None),
    "is_starcoder2_config": ("Starcoder2Config", "a GPT-BigCode decoder (GELU MLP, LayerNorm, biases, multi-query "
                                                 "attention), not a Llama"),
    "is_mamba_config": ("MambaModelConfig", "a state-space model (Mamba), not a transformer"),
    "is_llamoe_config": ("LlaMoEConfig", "a mixture-of-experts Llama (its MLPs are routed experts)"),
}

# The fields Qwen2Config has and LlamaConfig has not: without the Llama flag, a model_config holding one of them is
# a Qwen2Config (nanotron's union tries LlamaConfig first, strictly).
QWEN2_FIELDS = ("is_qwen2_config", "rope_seq_len_interpolation_factor", "flex_attention_mask", "sliding_window_size",
                "no_rope_layer", "_fused_rotary_emb", "_fused_rms_norm", "_use_qkv_packed", "_use_doc_masking",
                "log_attn_probs", "ring_attn_heads_k_stride", "moe_config")

# The fields only that class has (none of LlamaConfig's or Qwen2Config's): a model_config without a flag that
# holds one of them is that class's, as nanotron's union of config classes would read it.
MODEL_CONFIG_FIELDS = {
    "is_starcoder2_config": ("activation_function", "attention_softmax_in_fp32", "attn_pdrop", "embd_pdrop",
                             "global_attn_layers", "grouped_query", "layer_norm_epsilon", "multi_query",
                             "num_kv_heads", "resid_pdrop", "scale_attention_softmax_in_fp32", "scale_attn_weights",
                             "use_position_embeddings", "use_rotary_embeddings"),
    "is_mamba_config": ("d_model", "ssm_cfg", "rms_norm", "fused_add_norm", "residual_in_fp32",
                        "pad_vocab_size_multiple"),
    "is_llamoe_config": ("moe_num_experts", "num_experts_per_tok", "moe_capacity_factor"),
}
