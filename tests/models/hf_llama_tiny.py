"""A tiny Hugging Face Llama (2 layers, hidden 64, grouped-query attention) from its config.

Rotary cos/sin tables are computed once, in the head, and read by every layer: a test of
saved storages shared between blocks. `LlamaLogits` returns the logits tensor (the IR
measures the loss on a tensor output).
"""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
SEQ_LEN = 32
BATCH_SIZE = 2


class LlamaLogits(nn.Module):
    """forward(input_ids) -> logits [B, T, vocab] of the wrapped causal LM `lm`."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False, return_dict=True).logits


def build_model() -> nn.Module:
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_cache=False, attn_implementation="sdpa",
    )
    return LlamaLogits(LlamaForCausalLM(config))


def example_batch(batch_size: int):
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN)), torch.randint(0, VOCAB, (batch_size, SEQ_LEN))


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
