"""Layers called with keyword arguments; a bias computed once (in the head) is read by every layer
and comes first in the call's keywords, as T5's position_bias would if passed by keyword."""

import torch
import torch.nn as nn

BATCH_SIZE = 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, bias, h):
        return h + torch.tanh(self.fc(h)) + bias


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.bias = nn.Linear(16, 16)
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(16, 8)
    def forward(self, x):
        h = self.inp(x)
        bias = self.bias(x)
        for layer in self.layers:
            h = layer(bias=bias, h=h)
        return self.head(h)


def build_model():
    return Net()


def example_batch(b):
    return torch.randn(b, 16), torch.randint(0, 8, (b,))
