from types import SimpleNamespace

import pytest
import torch
import transformers

from nanoflow.model import Llama

FIELDS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
    "max_position_embeddings rms_norm_eps initializer_range tie_word_embeddings"
).split()


def make_pair(tied, attn_implementation):
    hf_cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA: 4 query heads per kv head
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        initializer_range=0.1,  # larger than default so the logits are far from trivial
        tie_word_embeddings=tied,
        attention_bias=False,
        mlp_bias=False,
    )
    hf_cfg._attn_implementation = attn_implementation
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # randomise norm weights too; HF initialises them to 1
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ours_cfg = SimpleNamespace(**{f: getattr(hf_cfg, f) for f in FIELDS}, rope_theta=hf_cfg.rope_parameters["rope_theta"])
    return hf, Llama(ours_cfg)


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_ours_logits_match(tied, attn_implementation):
    hf, ours = make_pair(tied, attn_implementation)
    sd = hf.state_dict()
    assert ("lm_head.weight" in sd) and (sd["lm_head.weight"] is not None)
    ours.load_state_dict(sd, strict=True)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 96, (3, 32), generator=torch.Generator().manual_seed(0))
    a, b = logits(hf, ids), logits(ours, ids)
    assert a.shape == b.shape == (3, 32, 96)
    assert a.abs().max() > 1.0
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tied", [False, True])
def test_ours_to_hf_state_dict_loads_strict(tied):
    hf, ours = make_pair(tied, "eager")
    ours.reset_parameters(torch.Generator().manual_seed(3))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(4))
    hf.load_state_dict(ours.state_dict(), strict=True)
    for k, v in ours.state_dict().items():
        assert torch.equal(hf.state_dict()[k], v), k
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    assert (logits(hf, ids) - logits(ours, ids)).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------------------
# RoPE scaling: HF's rope_scaling "linear" and "llama3", at lengths where it changes the numbers

ORIGINAL = 64                   # llama3's original_max_position_embeddings: the test runs past it
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}
LINEAR = {"rope_type": "linear", "factor": 4.0}


def make_scaled_pair(rope_scaling: dict, attn_implementation="eager"):
    """A random HF Llama with `rope_scaling` (head_dim 16, theta 10000: wavelengths 6 to 20000 positions,
    so llama3's three bands — kept, blended, divided — each hold some of the 8 frequencies)."""
    from nanoflow.config import RopeScalingArgs

    hf_cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=dict(rope_scaling), initializer_range=0.1, tie_word_embeddings=False)
    hf_cfg._attn_implementation = attn_implementation
    assert hf_cfg.rope_parameters["rope_type"] == rope_scaling["rope_type"]
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ours_cfg = SimpleNamespace(**{f: getattr(hf_cfg, f) for f in FIELDS}, rope_theta=10000.0,
                               rope_scaling=RopeScalingArgs(**rope_scaling))
    ours = Llama(ours_cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def test_llama3_test_frequencies_cover_the_three_bands():
    import math

    wavelengths = [2 * math.pi * 10000.0 ** (i / 16) for i in range(0, 16, 2)]
    kept = [w for w in wavelengths if w < ORIGINAL / LLAMA3["high_freq_factor"]]
    divided = [w for w in wavelengths if w > ORIGINAL / LLAMA3["low_freq_factor"]]
    assert kept and divided and len(kept) + len(divided) < len(wavelengths)   # some blended in between


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("rope_scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_rope_scaling_logits_match_hf(rope_scaling, attn_implementation):
    from nanoflow.model import rope_inv_freq

    hf, ours = make_scaled_pair(rope_scaling, attn_implementation)
    assert torch.equal(rope_inv_freq(16, 10000.0, ours.model.rope_scaling), hf.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 96, (2, 3 * ORIGINAL), generator=torch.Generator().manual_seed(0))   # past ORIGINAL
    a, b = logits(hf, ids), logits(ours, ids)
    assert a.abs().max() > 1.0
    assert (a - b).abs().max().item() <= 1e-5
    # The scaling matters at this length: plain RoPE on the same weights gives other logits.
    ours.model.rope_scaling = None
    assert (logits(ours, ids) - a).abs().max().item() > 1e-3


def test_rope_default_type_is_plain_rope():
    from nanoflow.config import RopeScalingArgs
    from nanoflow.model import rope_inv_freq

    plain = rope_inv_freq(16, 10000.0, None)
    assert torch.equal(rope_inv_freq(16, 10000.0, RopeScalingArgs("default")), plain)
    hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling={"rope_type": "default"})
    inv_freq = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg).inv_freq
    assert torch.equal(inv_freq, plain)
