"""Tiny random decoders of many Hugging Face families, built from configs (no downloads).

Used by the family test matrix and by ``specontext explain --model tiny:<family>``. Every
model has 2 layers, hidden size 64 and a vocabulary of 128; the configs exercise what each
family is known for: sliding windows (Mistral 24 tokens; Gemma 2/3 alternating
sliding/global layers), logit soft-capping (Gemma 2), query/key norms (Qwen3), multi-query
attention (Falcon), partial rotary (GPT-NeoX, 25%), Conv1D and learned positions (GPT-2),
mixture-of-experts (Mixtral) and multi-head latent attention (DeepSeek-V2/V3) and ALiBi position biases (BLOOM, MPT).
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 128


def _common(**extra):
    base = {"vocab_size": VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
    base.update(extra)
    return base


def _llama_like(cls, **extra):
    return cls(**_common(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, **extra))


def _config(family: str):
    if family == "llama":
        return tf.LlamaConfig(**_common(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                        num_key_value_heads=2))
    if family == "mistral":  # sliding window smaller than prompt + decode
        return _llama_like(tf.MistralConfig, sliding_window=24)
    if family == "mixtral":
        return _llama_like(tf.MixtralConfig, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if family == "qwen2":
        return _llama_like(tf.Qwen2Config)
    if family == "qwen3":
        return _llama_like(tf.Qwen3Config, head_dim=16)
    if family == "gemma2":
        return _llama_like(tf.Gemma2Config, head_dim=16, sliding_window=24, query_pre_attn_scalar=16,
                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "gemma3":
        return _llama_like(tf.Gemma3TextConfig, head_dim=16, sliding_window=24, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "full_attention"])
    if family == "phi3":
        return tf.Phi3Config(**_common(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, pad_token_id=0))
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(**_common(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                          rotary_pct=0.25))
    if family == "falcon":
        return tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                               bias=False, alibi=False)
    if family == "opt":
        return tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=96,
                            num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
                            pad_token_id=1)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**_common(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16))
    if family == "bloom":  # ALiBi, BLOOM's 3-D baddbmm/bmm attention
        return tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    if family == "mpt":  # ALiBi as a 3-D position bias added to the scores
        return tf.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=256, expansion_ratio=2)
    if family == "deepseek_v2":  # MLA without a query LoRA, complex-number rotary embedding
        return tf.DeepseekV2Config(**_common(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16))
    raise ValueError(f"unknown family {family!r}")


_MODELS = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM", "falcon": "FalconForCausalLM", "opt": "OPTForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
    "bloom": "BloomForCausalLM", "mpt": "MptForCausalLM",
}
FAMILIES = tuple(_MODELS)
__all__ = ["FAMILIES", "tiny_family"]


def tiny_family(family: str, attn: str, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer ``family`` causal LM with ``attn_implementation=attn``, in eval mode.

    Raises:
        ValueError: ``family`` is not one of :data:`FAMILIES` (the message lists them).
    """
    if family not in _MODELS:
        raise ValueError(f"unknown family {family!r}: use tiny:<family> with one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    config = _config(family)
    config._attn_implementation = attn
    model = getattr(tf, _MODELS[family])(config)
    return model.eval()
