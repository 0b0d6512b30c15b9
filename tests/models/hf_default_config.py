"""A Hugging Face Llama with its config's defaults (use_cache=True), passed unchanged."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH_SIZE = 2


def build_model():
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))


def example_batch(batch_size):
    ids = torch.randint(0, 128, (batch_size, 16))
    return {"input_ids": ids, "labels": ids.clone()}, None


def loss_fn(output, targets):
    return output.loss + 0.0 * output.logits.sum()  # what a user writes: the ModelOutput's fields
