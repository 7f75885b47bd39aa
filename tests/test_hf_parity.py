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
