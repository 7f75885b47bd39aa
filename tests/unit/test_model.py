import math
from types import SimpleNamespace

import pytest
import torch

from nanoflow.model import Llama


def tiny_cfg(**overrides):
    cfg = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def make_model(seed=0, **overrides):
    model = Llama(tiny_cfg(**overrides))
    model.reset_parameters(torch.Generator().manual_seed(seed))
    return model


def expected_shapes(n_layers, vocab, hidden, inter, n_heads, n_kv):
    hd = hidden // n_heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (n_heads * hd, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (n_kv * hd, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (n_kv * hd, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, n_heads * hd)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_and_shapes_match_hf_layout(tied):
    model = make_model(tie_word_embeddings=tied)
    want = expected_shapes(2, 64, 32, 64, 4, 2)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == want  # no extra keys either: rotary tables must not be in the state_dict
    params = dict(model.named_parameters(remove_duplicate=False))
    assert {k: tuple(v.shape) for k, v in params.items()} == want
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    n_unique = len({id(p) for p in model.parameters()})
    assert n_unique == len(want) - (1 if tied else 0)


# ---- independent reference: explicit loops, explicit mask, explicit per-pair RoPE ----


def ref_rmsnorm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def ref_rope(x, theta):
    """x: [T, n_heads, hd]. Rotates pair (i, i + hd/2) at position t by angle t * theta^(-2i/hd)."""
    T, H, hd = x.shape
    half = hd // 2
    out = x.clone()
    for t in range(T):
        for i in range(half):
            ang = t * theta ** (-2.0 * i / hd)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[t, :, i], x[t, :, i + half]
            out[t, :, i] = a * c - b * s
            out[t, :, i + half] = b * c + a * s
    return out


def ref_forward(model, cfg, ids):
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // H
    logits = []
    for seq in ids:
        T = len(seq)
        x = sd["model.embed_tokens.weight"][seq]  # [T, hidden]
        for li in range(cfg.num_hidden_layers):
            p = f"model.layers.{li}."
            h = ref_rmsnorm(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(T, H, hd)
            k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(T, KV, hd)
            v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(T, KV, hd)
            q, k = ref_rope(q, cfg.rope_theta), ref_rope(k, cfg.rope_theta)
            k = torch.stack([k[:, hh * KV // H] for hh in range(H)], dim=1)  # explicit repeat of kv heads
            v = torch.stack([v[:, hh * KV // H] for hh in range(H)], dim=1)
            mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
            heads = []
            for hh in range(H):
                scores = q[:, hh] @ k[:, hh].T / math.sqrt(hd) + mask
                heads.append(torch.softmax(scores, dim=-1) @ v[:, hh])
            x = x + torch.cat(heads, dim=-1) @ sd[p + "self_attn.o_proj.weight"].T
            h = ref_rmsnorm(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            g = h @ sd[p + "mlp.gate_proj.weight"].T
            u = h @ sd[p + "mlp.up_proj.weight"].T
            x = x + (g * torch.sigmoid(g) * u) @ sd[p + "mlp.down_proj.weight"].T
        x = ref_rmsnorm(x, sd["model.norm.weight"], cfg.rms_norm_eps)
        logits.append(x @ sd["lm_head.weight"].T)
    return torch.stack(logits)


@pytest.mark.parametrize("tied", [False, True])
def test_forward_matches_hand_written_reference(tied):
    cfg = tiny_cfg(num_hidden_layers=1, tie_word_embeddings=tied, initializer_range=0.2)
    model = Llama(cfg)
    model.reset_parameters(torch.Generator().manual_seed(1))
    with torch.no_grad():  # non-unit norm weights so a dropped norm scale would be caught
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(ids)
    want = ref_forward(model, cfg, ids)
    assert got.shape == (2, 11, cfg.vocab_size) and got.dtype == torch.float32
    assert want.abs().max() > 0.1  # the comparison is not vacuous
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_causal_masking():
    model = make_model(seed=3)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base = model(ids)
        for t in range(ids.shape[1]):
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 1) % 64
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
            assert not torch.allclose(out[:, t], base[:, t])  # the change itself is visible


def test_deterministic_init():
    a, b, c = make_model(seed=7), make_model(seed=7), make_model(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
        if "norm" in k:
            assert torch.equal(sa[k], torch.ones_like(sa[k])), k
        else:
            assert not torch.equal(sa[k], sc[k]), k


def test_init_ignores_global_rng_and_has_hf_statistics():
    torch.manual_seed(0)
    a = make_model(seed=5, vocab_size=512, initializer_range=0.05)
    torch.manual_seed(123)
    b = make_model(seed=5, vocab_size=512, initializer_range=0.05)
    for (k, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), k
    w = a.model.embed_tokens.weight
    assert abs(w.mean().item()) < 0.005 and abs(w.std().item() - 0.05) < 0.005


def test_sequence_longer_than_max_positions_raises():
    model = make_model()
    model(torch.zeros(1, 16, dtype=torch.long))  # exactly max_position_embeddings is fine
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))
