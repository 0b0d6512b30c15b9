"""Residual layers of which one changes a matmul's output in place (`relu_` on a Linear's
result): selective recompute, which keeps what matmuls return, cannot run that layer."""

import torch
from torch import nn

WIDTH, DEPTH = 8, 3
BATCH_SIZE = 4


class Layer(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.in_place = in_place

    def forward(self, x):
        y = self.fc(x)
        return x + (torch.relu_(y) if self.in_place else torch.relu(y))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer(in_place=i == 1) for i in range(DEPTH))
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model() -> nn.Module:
    return Net()


def example_batch(batch_size: int):
    return torch.randn(batch_size, WIDTH), torch.randint(0, 2, (batch_size,))
