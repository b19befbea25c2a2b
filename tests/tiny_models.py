"""Tiny random-weight transformers models built from configs (no download),
shared by the backend, pass and transformers-integration tests."""

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 48}),
}


def causal_lm(family: str, attn_implementation: str, seed: int, *, num_layers: int = 2, head_dim: int = 32, **config):
    """A GQA decoder (4 query heads, 2 KV heads) of `family`; `config` overrides fields."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = config_class(
        vocab_size=97, hidden_size=128, intermediate_size=160, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
        initializer_range=0.05, attn_implementation=attn_implementation, **{**extra, **config},
    )
    return model_class(cfg).eval()


def gpt2(attn_implementation: str, seed: int, initializer_range: float = 0.05) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=97, n_embd=64, n_layer=2, n_head=2, n_positions=256, initializer_range=initializer_range,
        bos_token_id=0, eos_token_id=0, attn_implementation=attn_implementation,
    )
    return GPT2LMHeadModel(config).eval()
