"""Tiny random HF models (float32, eager attention) for the fidelity tests.

Weights are redrawn so activations are of order one everywhere (HF's 0.02 init makes them vanish) and
norm weights are random too, so a forward pass that skips or misplaces a norm weight is caught.
The LM-head rows of the control tokens are zeroed so greedy decoding never stops on an end token.
"""

from __future__ import annotations

import torch
from transformers import (
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Ministral3Config,
    Ministral3ForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from .gguf_writer import tiny_vocab

__all__ = ["MINISTRAL3_ROPE", "randomize", "tiny_granite", "tiny_llama", "tiny_ministral3", "tiny_olmo2",
           "tiny_qwen2", "tiny_qwen3", "tiny_qwen3moe", "tiny_smollm3"]

# what every tiny model shares: 64 wide, 4 query heads over 2 KV heads (GQA) of 16 dims, the tiny vocabulary
_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               attn_implementation="eager")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that with head_dim 16 the factors hit all three branches (1, smooth, factor)
    "original_max_position_embeddings": 64,
}


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every parameter: linear/embedding N(0, 1/in) (stacked experts [E, out, in] alike, the
    router's logits then of order one), biases N(0, 1), norm weights U(0.5, 1.5)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif param.ndim == 1:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
        special = tiny_vocab().special_ids
        model.get_output_embeddings().weight[special] = 0.0
    return model


def _finish(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    model = model.to(torch.float32)
    randomize(model, seed)
    model.eval()
    return model


def tiny_llama(*, rope_parameters: dict | None = None, tie_word_embeddings: bool = False,
               seed: int = 0) -> LlamaForCausalLM:
    """3 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head_dim 16."""
    config = LlamaConfig(
        vocab_size=len(tiny_vocab().tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attn_implementation="eager",
    )
    return _finish(LlamaForCausalLM(config), seed)


def tiny_qwen3(*, tie_word_embeddings: bool = True, seed: int = 0) -> Qwen3ForCausalLM:
    """3 layers, hidden 64, 4 query heads over 2 KV heads, head_dim 32 (not 64/4), QK-norm, tied head."""
    config = Qwen3Config(
        vocab_size=len(tiny_vocab().tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attn_implementation="eager",
    )
    return _finish(Qwen3ForCausalLM(config), seed)


def tiny_qwen3moe(*, tie_word_embeddings: bool = False, experts: int = 8, top_k: int = 2,
                  seed: int = 0) -> Qwen3MoeForCausalLM:
    """tiny_qwen3's attention; every layer a mixture of `experts` SwiGLU experts of width 64, `top_k`
    taken per token, their probabilities renormalised (norm_topk_prob, as the released models)."""
    config = Qwen3MoeConfig(
        vocab_size=len(tiny_vocab().tokens),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attn_implementation="eager",
        experts_implementation="eager",  # the per-expert loop, not torch's grouped_mm
    )
    return _finish(Qwen3MoeForCausalLM(config), seed)


def tiny_qwen2(*, tie_word_embeddings: bool = True, seed: int = 0) -> Qwen2ForCausalLM:
    """3 layers, GQA, q/k/v biases (drawn N(0, 1): as large as the products they are added to), NEOX rope."""
    config = Qwen2Config(vocab_size=len(tiny_vocab().tokens), num_hidden_layers=3, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=tie_word_embeddings, use_sliding_window=False, **_COMMON)
    model = _finish(Qwen2ForCausalLM(config), seed)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model


def tiny_olmo2(*, tie_word_embeddings: bool = False, seed: int = 0) -> Olmo2ForCausalLM:
    """3 layers, GQA, post-norms only, QK-norm over all heads (random weights, so per head ≠ over all
    heads), NEOX rope, separate LM head (llama.cpp requires one)."""
    config = Olmo2Config(vocab_size=len(tiny_vocab().tokens), num_hidden_layers=3, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         tie_word_embeddings=tie_word_embeddings, **_COMMON)
    return _finish(Olmo2ForCausalLM(config), seed)


def tiny_granite(*, seed: int = 0, **overrides) -> GraniteForCausalLM:
    """3 layers, GQA, tied head, and all four multipliers away from 1 (and the attention scale away
    from 1/√16): embedding 3, residual 0.5, attention 0.125, logits divided by 4. All are exact in float32,
    as the GGUF stores them."""
    values = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.125,
                  logits_scaling=4.0) | overrides
    config = GraniteConfig(vocab_size=len(tiny_vocab().tokens), num_hidden_layers=3, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           tie_word_embeddings=True, **values, **_COMMON)
    return _finish(GraniteForCausalLM(config), seed)


def tiny_smollm3(*, seed: int = 0) -> SmolLM3ForCausalLM:
    """5 layers, GQA, tied head; transformers' default `no_rope_layers` (interval 4): layer 3 has no
    rope, as llama.cpp's fixed step of 4 says, and layer 4 has it again."""
    config = SmolLM3Config(vocab_size=len(tiny_vocab().tokens), num_hidden_layers=5, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 5000000.0},
                           tie_word_embeddings=True, use_sliding_window=False, **_COMMON)
    assert config.no_rope_layers == [1, 1, 1, 0, 1]
    return _finish(SmolLM3ForCausalLM(config), seed)


# YaRN with a ramp inside the 8 pairs of a 16-dim head (pairs 0…5: base 100, betas 1 and 0.1 over an
# original context of 8), the cos/sin factor get_mscale(4, 1) / get_mscale(4, 0.5) ≈ 1.065, and the
# attention temperature stepping every 8 positions (β 0.5: 1.69 at position 24; Ministral 3 has 0.1)
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 100.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 1.0,
    "beta_slow": 0.1,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
    "llama_4_scaling_beta": 0.5,
}


def tiny_ministral3(*, seed: int = 0, **rope_overrides) -> Ministral3ForCausalLM:
    """3 layers, GQA, head_dim 16, separate LM head, `MINISTRAL3_ROPE` (entries replaced by
    `rope_overrides`); a context of 64 (transformers warns that released configs have factor × the
    original context, 32: YaRN reads only `factor`)."""
    rope = MINISTRAL3_ROPE | rope_overrides
    common = _COMMON | {"max_position_embeddings": 64}
    config = Ministral3Config(vocab_size=len(tiny_vocab().tokens), num_hidden_layers=3, head_dim=16,
                              rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=False, **common)
    return _finish(Ministral3ForCausalLM(config), seed)


tiny_mistral3 = tiny_ministral3  # by its GGUF architecture, as the family lists of the tests name it
