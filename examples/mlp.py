"""A deep multilayer perceptron, the smallest karma model file.

    karma-plan examples/mlp.py --print-ir

Width, depth and input size by environment variables KARMA_MLP_WIDTH (default 1024),
KARMA_MLP_DEPTH (default 8) and KARMA_MLP_IN (default 256). Ten classes.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

WIDTH = int(os.environ.get("KARMA_MLP_WIDTH", 1024))
DEPTH = int(os.environ.get("KARMA_MLP_DEPTH", 8))
IN_FEATURES = int(os.environ.get("KARMA_MLP_IN", 256))
CLASSES = 10
BATCH_SIZE = 64


class Layer(nn.Module):
    """Linear, LayerNorm, GELU, with a residual connection."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.norm(self.fc(x)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, WIDTH)
        self.layers = nn.ModuleList(Layer(WIDTH) for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model() -> nn.Module:
    return MLP()


def example_batch(batch_size: int):
    return torch.randn(batch_size, IN_FEATURES), torch.randint(0, CLASSES, (batch_size,))
