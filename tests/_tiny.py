"""Tiny random decoders built in the tests (no downloads)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(layers: int = 3, heads: int = 6, kv_heads: int = 2, attn: str = "sdpa", seed: int = 0):
    """A random Llama with GQA (6 query heads over 2 KV heads = groups of 3)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()
