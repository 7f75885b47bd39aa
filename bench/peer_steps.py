"""One peer's training step, run by bench/peers.py in that peer's own virtual environment.

    <venv>/bin/python bench/peer_steps.py PEER FOLDER

Imports only the standard library, torch and the peer's own package (nanoflow's side imports nanoflow),
so it runs in a venv that has nothing of this repository installed. FOLDER holds what bench/peers.py
wrote: shape.json (the model and optimizer), weights.json + weights.bin (the shared initial weights, in
HF LlamaForCausalLM's names, float32 little-endian) and batches.bin (int64 token rows, [steps, batch,
sequence + 1]). No pickle anywhere. With "compile" in shape.json every side compiles its whole model
(nanoflow: `[model] compile = true`).

Protocol, one JSON line each way: the worker prints {"ready": …} once built, then for each
"step INDEX LR" line on stdin runs one optimizer step on batch INDEX at that learning rate and prints
{"loss": …, "seconds": …, "cpu": …} (wall and process CPU seconds); "quit" ends it. Only the step
is timed (the batch is already in memory). On loaded cores the CPU seconds are the steadier measure:
the wall time is then mostly waiting for a core.
"""

from __future__ import annotations

import json
import os
import sys
import time
from importlib import metadata

import torch
import torch.nn.functional as F


def read_folder(folder: str):
    with open(os.path.join(folder, "shape.json")) as f:
        shape = json.load(f)
    with open(os.path.join(folder, "weights.json")) as f:
        index = json.load(f)
    with open(os.path.join(folder, "weights.bin"), "rb") as f:
        raw = bytearray(f.read())
    weights = {name: torch.frombuffer(raw, dtype=torch.float32, count=_numel(s), offset=o).view(s).clone()
               for name, (o, s) in index.items()}
    with open(os.path.join(folder, "batches.bin"), "rb") as f:
        tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.int64)
    batches = tokens.view(shape["steps"], shape["batch"], shape["sequence"] + 1)
    return shape, weights, batches


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def adamw(params, shape) -> torch.optim.AdamW:
    """AdamW as nanoflow builds it: decay on matrices only."""
    params = list(params)
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": shape["weight_decay"]},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=shape["lr"], betas=(shape["beta1"], shape["beta2"]), eps=shape["adam_eps"])


def mean_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class Plain:
    """A hand-written loop over a peer's nn.Module: forward, mean cross entropy, backward, clip, AdamW."""

    def __init__(self, model, shape):
        self.model, self.shape = model, shape
        self.optimizer = adamw(model.parameters(), shape)

    def logits(self, ids):
        return self.model(ids)

    def step(self, ids, labels, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = mean_loss(self.logits(ids), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.shape["clip"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


# ---------------------------------------------------------------------------------------------
# The peers

class HF(Plain):
    """transformers' LlamaForCausalLM (sdpa attention) in a plain PyTorch loop."""

    def __init__(self, shape, weights):
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["positions"],
            rms_norm_eps=shape["norm_eps"], tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
        if hasattr(config, "rope_parameters"):   # transformers ≥ 5 keeps RoPE's settings there
            config.rope_parameters = {"rope_type": "default", "rope_theta": shape["rope_theta"]}
        else:
            config.rope_theta = shape["rope_theta"]
        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(weights, strict=True)
        model.train()
        if shape.get("compile"):
            model.compile()   # the whole model, in place
        super().__init__(model, shape)
        self.version = f"transformers {transformers.__version__}"

    def logits(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


class LitGPT(Plain):
    """litgpt's GPT (its Llama layout) under Lightning Fabric, litgpt's own weight conversion and loss."""

    def __init__(self, shape, weights):
        import lightning
        from litgpt.model import GPT, Config
        from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama
        from litgpt.utils import chunked_cross_entropy

        config = Config(
            name="nanoflow-peer", block_size=shape["positions"], vocab_size=shape["vocab"],
            padded_vocab_size=shape["vocab"], n_layer=shape["layers"], n_head=shape["heads"],
            n_embd=shape["hidden"], n_query_groups=shape["kv_heads"], rotary_percentage=1.0,
            parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=shape["norm_eps"],
            mlp_class_name="LLaMAMLP", intermediate_size=shape["intermediate"], rope_base=int(shape["rope_theta"]))
        model = GPT(config)
        converted = {}
        copy_weights_hf_llama(config, {}, converted, dict(weights))
        model.load_state_dict(converted, strict=False)   # strict=False: the RoPE cache buffers are not weights
        missing = {k for k in model.state_dict() if k not in converted and "rope" not in k and "mask" not in k}
        if missing:
            raise SystemExit(f"litgpt: no converted weight for {sorted(missing)[:4]}")
        if shape.get("compile"):
            model.compile()   # the whole model, in place, before Fabric wraps it
        self.fabric = lightning.Fabric(accelerator="cpu", devices=1, precision="32-true")
        optimizer = adamw(model.parameters(), shape)
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        self.shape, self.loss = shape, chunked_cross_entropy
        self.model.train()
        self.version = f"litgpt {metadata.version('litgpt')}, lightning {lightning.__version__}"

    def step(self, ids, labels, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.loss(self.model(ids), labels)
        self.fabric.backward(loss)
        self.fabric.clip_gradients(self.model, self.optimizer, max_norm=self.shape["clip"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


# HF LlamaForCausalLM's names → OLMo-core's (olmo_core.nn.hf.convert's table for a pre-norm Llama block; that
# module imports transformers, which the OLMo-core venv does not have)
OLMO_NAMES = {
    "model.embed_tokens.weight": "embeddings.weight", "model.norm.weight": "lm_head.norm.weight",
    "lm_head.weight": "lm_head.w_out.weight",
    "self_attn.q_proj.weight": "attention.w_q.weight", "self_attn.k_proj.weight": "attention.w_k.weight",
    "self_attn.v_proj.weight": "attention.w_v.weight", "self_attn.o_proj.weight": "attention.w_out.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight", "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "feed_forward_norm.weight",
}


class OLMoCore:
    """OLMo-core's Transformer (TransformerConfig.llama_like) trained by its TransformerTrainModule: train_batch
    (its own loss: summed cross entropy ÷ target tokens), optim_step (its clipping), zero_grads."""

    class Trainer:   # what the train module asks of olmo_core's Trainer in a step: somewhere to put metrics
        def __init__(self):
            self.ce_loss = None

        def record_metric(self, *args, **kwargs):
            pass

        def record_ce_loss(self, value, reduce_type=None):
            self.ce_loss = value

    def __init__(self, shape, weights):
        from olmo_core.nn.feed_forward import FeedForwardConfig
        from olmo_core.nn.transformer import TransformerConfig
        from olmo_core.optim import AdamWConfig, OptimGroupOverride
        from olmo_core.train.train_module import TransformerTrainModule

        config = TransformerConfig.llama_like(
            d_model=shape["hidden"], vocab_size=shape["vocab"], n_layers=shape["layers"], n_heads=shape["heads"],
            n_kv_heads=shape["kv_heads"], layer_norm_eps=shape["norm_eps"], rope_theta=int(shape["rope_theta"]),
            feed_forward=FeedForwardConfig(hidden_size=shape["intermediate"], bias=False))
        model = config.build(init_device="cpu")
        optim = AdamWConfig(lr=shape["lr"], betas=(shape["beta1"], shape["beta2"]), eps=shape["adam_eps"],
                            weight_decay=shape["weight_decay"],
                            group_overrides=[OptimGroupOverride(params=["*norm.weight"], opts={"weight_decay": 0.0})])
        tokens = shape["batch"] * shape["sequence"]
        self.module = TransformerTrainModule(model=model, optim=optim, rank_microbatch_size=tokens,
                                             max_sequence_length=shape["sequence"], max_grad_norm=shape["clip"],
                                             compile_model=bool(shape.get("compile")), device=torch.device("cpu"))
        self.trainer = self.Trainer()
        self.module._attach_trainer(self.trainer)
        converted = {}
        for name, tensor in weights.items():
            if name.startswith("model.layers."):
                _, _, layer, rest = name.split(".", 3)
                converted[f"blocks.{layer}.{OLMO_NAMES[rest]}"] = tensor
            else:
                converted[OLMO_NAMES[name]] = tensor
        self.module.model.load_state_dict(converted, strict=True)   # after the module's own init_weights
        self.version = f"ai2-olmo-core {metadata.version('ai2-olmo-core')}"

    def step(self, ids, labels, lr: float) -> float:
        for group in self.module.optim.param_groups:
            group["lr"] = lr
        self.module.train_batch({"input_ids": ids, "labels": labels})
        self.module.optim_step()
        self.module.zero_grads()
        return float(self.trainer.ce_loss)


class Nanoflow:
    """nanoflow.train_step on the same shape (its config from the curriculum with the shape's overrides)."""

    def __init__(self, shape, weights):
        import nanoflow

        self.config = nanoflow.load_config(shape["nanoflow_config"], overrides=shape["nanoflow_overrides"])
        self.state = nanoflow.init_state(self.config)
        self.state.model.load_state_dict(weights, strict=True)
        self.train_step = nanoflow.train_step
        self.version = f"nanoflow {nanoflow.__version__}" if hasattr(nanoflow, "__version__") else "nanoflow"

    def step(self, ids, labels, lr: float) -> float:
        self.state, metrics = self.train_step(self.state, {"input_ids": ids, "labels": labels})
        if abs(metrics["lr"] - lr) > 1e-12 * max(1.0, lr):
            raise SystemExit(f"nanoflow's step ran at lr {metrics['lr']}, the peers at {lr}")
        return metrics["loss"]


PEERS = {"nanoflow": Nanoflow, "hf": HF, "olmo-core": OLMoCore, "litgpt": LitGPT}


def main() -> int:
    peer, folder = sys.argv[1], sys.argv[2]
    torch.set_num_threads(int(os.environ.get("PEERS_THREADS", "1")))
    shape, weights, batches = read_folder(folder)
    torch.manual_seed(0)
    side = PEERS[peer](shape, weights)
    print(json.dumps({"ready": peer, "version": side.version, "torch": torch.__version__,
                      "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        index, lr = int(words[1]), float(words[2])
        ids, labels = batches[index, :, :-1].contiguous(), batches[index, :, 1:].contiguous()
        start, cpu = time.perf_counter(), time.process_time()
        loss = side.step(ids, labels, lr)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(json.dumps({"loss": loss, "seconds": seconds, "cpu": cpu}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
