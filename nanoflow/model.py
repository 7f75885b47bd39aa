"""A Llama decoder with the parameter names, shapes and RoPE convention of HF's LlamaForCausalLM, and the few
switches that make it HF's Qwen2, Qwen3, Mistral, SmolLM3 or OLMo 2 instead.

`cfg` is any object with: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, max_position_embeddings, rms_norm_eps,
rope_theta, tie_word_embeddings, initializer_range, and optionally rope_scaling (None, or an object with
rope_type "default" | "linear" | "llama3" | "yarn" and that type's keys: nanoflow.config.RopeScalingArgs, yarn's
factor and original_max_position_embeddings resolved as nanoflow.config.Rope resolves them) and `architecture`,
the family's switches
(nanoflow.config.Architecture: head_dim, qkv_bias, o_bias, qk_norm, norm_after, nope_layers); without it, a
plain Llama's.

With `position_ids` (packed documents: they restart at 0 at each document), RoPE is taken at those
positions and attention stays within each document (nanoflow.attention).
"""

import math
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from nanoflow.attention import Documents, causal_attention
from nanoflow.loss import describe, lm_loss, token_scores


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before scaling, exactly as HF does, so bf16 matches HF bit for bit.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2], float32 on the CPU, after `scaling` (HF's rope_scaling; None: plain RoPE).

    On the CPU whatever the model's device, as transformers computes them: an accelerator's pow may round
    differently, and a last-bit difference in a frequency grows with the position it multiplies.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = "default" if scaling is None else scaling.rope_type
    if kind == "default":
        return inv_freq
    if kind == "linear":   # positions / factor, i.e. every frequency / factor
        return inv_freq / scaling.factor
    if kind == "llama3":
        # Llama 3.1's rule, by each frequency's wavelength against the pretraining context length L:
        # longer than L / low_freq_factor: / factor; shorter than L / high_freq_factor: unchanged;
        # in between: blended linearly in L / wavelength. (The order of operations is HF's, for its roundings.)
        context = scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        scaled = torch.where(wavelength > context / low, inv_freq / scaling.factor, inv_freq)
        middle = (wavelength >= context / high) & (wavelength <= context / low)
        return torch.where(middle, blended, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"rope_scaling.rope_type = {kind!r}: nanoflow implements default, linear, llama3 and yarn")


def _yarn_inv_freq(head_dim: int, theta: float, scaling) -> torch.Tensor:
    """YaRN's frequencies, as transformers 5 computes them (its operations in its order, for its roundings).

    Dimension pair i makes L / wavelength_i rotations over the pretraining context L
    (original_max_position_embeddings): pairs making more than beta_fast rotations are kept, pairs making
    fewer than beta_slow are divided by factor, and a linear ramp over the dimension index blends in between.
    """
    beta_fast, beta_slow = scaling.beta_fast or 32, scaling.beta_slow or 1
    context = scaling.original_max_position_embeddings

    def dimension(rotations: float) -> float:   # the pair index making `rotations` rotations over the context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001   # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return 1.0 / (scaling.factor * powers) * (1 - kept) + 1.0 / powers * kept


def rope_attention_scaling(scaling) -> float:
    """What transformers multiplies cos and sin by: YaRN's attention factor (given, or from factor, mscale and
    mscale_all_dim as YaRN's paper gives it); 1 for the other types."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(m: float = 1.0) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.mscale) / mscale(scaling.mscale_all_dim))
    return mscale()


def rope_cos_sin(positions: int | torch.Tensor, head_dim: int, theta: float, device: torch.device,
                 scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin at `positions`, in float32, times YaRN's attention factor: an int T means positions 0..T-1
    ([T, head_dim]); a tensor of positions (position_ids [rows, T]) gives [rows, T, head_dim], each token's own angles.

    Recomputed every forward instead of cached in buffers: it is tiny next to the matmuls, and it stays
    correct after `model.to(bfloat16)` (which would round cached tables) and after meta-device init
    (which would leave cached tables empty). Only the inverse frequencies are kept, on the device (_inv_freq_on).
    """
    inv_freq = _inv_freq_on(head_dim, theta, scaling, device)
    if isinstance(positions, int):
        positions = torch.arange(positions, dtype=torch.float32, device=device)
    else:
        positions = positions.to(device=device, dtype=torch.float32)
    freqs = positions[..., None] * inv_freq  # one product a token, as transformers' matmul over a length-1 axis
    emb = torch.cat((freqs, freqs), dim=-1)  # HF's layout: pairs are (i, i + head_dim/2), not (2i, 2i+1)
    attention = rope_attention_scaling(scaling)
    return emb.cos() * attention, emb.sin() * attention


_INV_FREQ: dict[tuple, torch.Tensor] = {}   # rope_inv_freq's tables, by RoPE and device


def _inv_freq_on(head_dim: int, theta: float, scaling, device: torch.device) -> torch.Tensor:
    """rope_inv_freq's table on `device`, copied there once per RoPE and device: a copy from the host at every
    forward would make each forward wait for it on a GPU."""
    key = (head_dim, theta, repr(scaling), str(device))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = rope_inv_freq(head_dim, theta, scaling).to(device)
    return _INV_FREQ[key]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def _per_head(table: torch.Tensor) -> torch.Tensor:
    """cos or sin as `LlamaModel.positions` gives them ([T, head_dim], or [rows, 1, T, head_dim]) laid out to
    broadcast over [B, T, heads, head_dim]: [T, 1, head_dim], or [rows, T, 1, head_dim]."""
    return table.unsqueeze(-2) if table.dim() == 2 else table.transpose(1, 2)


def architecture(cfg):
    """The family's switches (nanoflow.config.Architecture); a config without them (a bare namespace) is a Llama's."""
    arch = getattr(cfg, "architecture", None)
    return arch if arch is not None else SimpleNamespace(
        head_dim=cfg.hidden_size // cfg.num_attention_heads, qkv_bias=False, o_bias=False, qk_norm=None,
        norm_after=False, nope_layers=())


class Attention(nn.Module):
    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        arch = architecture(cfg)
        self.head_dim = arch.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=arch.o_bias)
        # Queries and keys RMS-normed before RoPE: each head over head_dim (Qwen3), or the whole projection (OLMo 2)
        self.qk_norm = arch.qk_norm
        if self.qk_norm is not None:
            whole = self.qk_norm == "projection"
            self.q_norm = RMSNorm(self.q_proj.out_features if whole else self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.k_proj.out_features if whole else self.head_dim, cfg.rms_norm_eps)
        self.use_rope = layer not in arch.nope_layers   # SmolLM3's NoPE layers attend without positions

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the projection outputs, not the config, so column-sharded
        # (tensor-parallel) projections that hold only a slice of the heads still work.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            # Rotated in the projections' own [B, T, heads, head_dim] layout, before the transpose: the gradients
            # of q and k then come back in that layout too, and reach the projections without a copy.
            cos, sin = _per_head(cos), _per_head(sin)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = causal_attention(q, k, v, documents)  # within each document when the batch packs several
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        self.norm_after = architecture(cfg).norm_after
        if not self.norm_after:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if self.norm_after:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        if self.norm_after:   # OLMo 2: each block's output is normed before it joins the residual stream
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, documents))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, documents)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack without the output head; lives at `Llama.model`, as in HF."""

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, layer) for layer in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head_dim = architecture(cfg).head_dim
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = getattr(cfg, "rope_scaling", None)
        self.max_position_embeddings = cfg.max_position_embeddings

    def set_rope(self, theta: float, scaling) -> None:
        """Encode positions with this RoPE from the next forward on (a stage's: nanoflow.config.stage_rope). cos and
        sin are computed in forward, outside the layers, so a compiled layer is not recompiled for it."""
        self.rope_theta, self.rope_scaling = theta, scaling

    def positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, Documents | None]:
        """cos, sin and the documents of a forward over `input_ids` (None: each row one document), worked out
        eagerly, outside any compiled region: a new RoPE (a stage's) or a new packing reaches the compiled code
        as new tensor values, never as a constant it was traced with."""
        T = input_ids.shape[1]
        if T > self.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings={self.max_position_embeddings}")
        device = self.embed_tokens.weight.device
        if position_ids is None:
            documents = None
            cos, sin = rope_cos_sin(T, self.head_dim, self.rope_theta, device, self.rope_scaling)
        else:
            if position_ids.shape != input_ids.shape:
                raise ValueError(f"position_ids of shape {list(position_ids.shape)} for input_ids of shape "
                                 f"{list(input_ids.shape)}")
            documents = Documents.from_position_ids(position_ids)
            cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta, device, self.rope_scaling)
            cos, sin = cos[:, None], sin[:, None]   # [rows, 1, T, head_dim]: the same angles for every head
        return cos, sin, documents

    def decode(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               documents: Documents | None = None) -> torch.Tensor:
        """The final hidden states, given `positions`' tables (float32)."""
        x = self.embed_tokens(input_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # HF rounds the tables to the activation dtype too
        for layer in self.layers:
            x = layer(x, cos, sin, documents)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode(input_ids, *self.positions(input_ids, position_ids))


class Llama(nn.Module):
    """Causal LM: input_ids [B, T] -> logits [B, T, vocab_size] (or, with labels, their summed loss). No training logic."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    loss_method = "fused"  # or "plain" (nanoflow.loss.lm_loss): the reference path, through the whole logits

    def set_rope(self, theta: float, scaling) -> None:
        """LlamaModel.set_rope: the RoPE of the next forwards."""
        self.model.set_rope(theta, scaling)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                ignore_index: int = -100, grad_scale: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, scores: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, vocab_size]; or, given labels [B, T], the cross-entropy summed over the positions
        whose label is not `ignore_index` (nanoflow.loss: the fused path never holds the whole logits;
        `grad_scale`, the gradient the caller's backward will bring, makes its rounding the plain order's);
        or, given labels and `scores`, evaluation's per-position (−log-likelihood, argmax is the label) pair,
        [B, T] each, without gradients (nanoflow.loss.token_scores: a chunk of logits at a time).
        `position_ids` [B, T]: packed documents, restarting at 0 at each one (None: 0..T-1, one per row)."""
        cos, sin, documents = self.model.positions(input_ids, position_ids)
        if documents is not None and documents.whole_rows:
            documents = None   # attention is then plain causal attention: the compiled body takes it
        if scores and labels is not None:   # evaluation: eager, it runs a few times a run
            hidden = self.model.decode(input_ids, cos, sin, documents)
            return token_scores(hidden, self.lm_head.weight, labels, ignore_index)
        body = self._body if self._compiled_body is None or documents is not None else self._compiled_body
        return body(input_ids, cos, sin, documents, labels, ignore_index, grad_scale)

    _compiled_body: Callable[..., torch.Tensor] | None = None   # compile_whole's: _body compiled

    def _body(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None,
              labels: torch.Tensor | None, ignore_index: int, grad_scale: torch.Tensor | None) -> torch.Tensor:
        hidden = self.model.decode(input_ids, cos, sin, documents)
        if labels is None:
            return self.lm_head(hidden)
        return lm_loss(hidden, self.lm_head.weight, labels, ignore_index, grad_scale, self.loss_method)

    def compile_whole(self) -> None:
        """torch.compile the forward after `positions` as one graph (fullgraph: a break is an error, not a silent
        eager piece): the embedding, every layer, the norm and the head or the fused loss. RoPE's tables and
        the documents are worked out eagerly and passed in, so a stage's new RoPE is new input values, not a
        recompile; a new shape (a stage's sequence length or micro-batch) compiles once more. Static shapes: the
        graph of a shape is the same whatever ran before it, so a resumed run computes what the run it resumes
        computed. Rows of several packed documents run the body eagerly (their attention follows each batch's
        documents). Parameter names are unchanged: the module is not wrapped."""
        self._compiled_body = torch.compile(self._body, fullgraph=True, dynamic=False)

    def describe_loss(self) -> str:
        """The loss `forward(ids, labels)` computes, in words (the start-up header's)."""
        return describe(self.cfg.vocab_size, self.loss_method)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """HF's _init_weights: Linear/Embedding ~ N(0, initializer_range), biases = 0, norms = 1.

        Draws only from `generator` (never the global RNG), in module order, so equal seeds give bitwise-equal models.
        """
        seen = set()  # a tied weight is drawn once, not overwritten by a second draw
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in seen:
                seen.add(id(module.weight))
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.initializer_range, generator=generator)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    nn.init.zeros_(bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

