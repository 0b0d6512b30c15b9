"""A small language model whose output head is its token embedding (a tied weight, as in
GPT-2), with no other 2-d tensor of the embedding's shape: tests count its gradient's
copies by shape."""

import torch
from torch import nn

VOCAB, WIDTH, DEPTH, SEQ_LEN = 1000, 24, 2, 16
BATCH_SIZE = 2


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(x))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(DEPTH))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx):
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def build_model():
    return TiedLM()


def example_batch(batch_size):
    idx = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return idx[:, :-1], idx[:, 1:]
