"""A model as a user's own script has it: functions under their own names, no model file
protocol. tests/test_model_object.py hands them to karma.model."""

import torch
import torch.nn as nn

WIDTH, VOCAB, SEQ = 64, 128, 16


class Net(nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                          nn.Linear(4 * WIDTH, WIDTH)) for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def make_net() -> nn.Module:
    return Net()


def make_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ))
    return tokens, torch.randint(0, VOCAB, (batch_size, SEQ))


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
