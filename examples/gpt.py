"""GPT-2 in plain PyTorch (after nanoGPT), as a karma model file.

    karma-plan examples/gpt.py --print-ir
    KARMA_GPT=xl karma-plan examples/gpt.py --print-ir --batch-size 8

Size by environment variable KARMA_GPT = tiny | small | medium | large | xl (default small);
sequence length by KARMA_SEQ (default 1024; 32 for tiny). `tiny` is for fast tests on a CPU.
The token embedding and the output head share their weight, as in GPT-2.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

# name: (n_layer, n_head, n_embd, vocab_size, default sequence length)
SIZES = {
    "tiny": (2, 2, 32, 128, 32),
    "small": (12, 12, 768, 50257, 1024),
    "medium": (24, 16, 1024, 50257, 1024),
    "large": (36, 20, 1280, 50257, 1024),
    "xl": (48, 25, 1600, 50257, 1024),
}
SIZE = os.environ.get("KARMA_GPT", "small")
if SIZE not in SIZES:
    raise ValueError(f"KARMA_GPT={SIZE!r} is not a GPT size; use one of {', '.join(SIZES)}")
N_LAYER, N_HEAD, N_EMBD, VOCAB, _SEQ = SIZES[SIZE]
SEQ = int(os.environ.get("KARMA_SEQ", _SEQ))
DROPOUT = 0.1
BATCH_SIZE = 4 if SIZE == "tiny" else 8


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.resid_dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(SEQ, N_EMBD)
        self.drop = nn.Dropout(DROPOUT)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT()


def example_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]
