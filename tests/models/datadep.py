"""A model whose forward branches on tensor values: it cannot be traced."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if (y < 0).any():
            y = -y
        return y


def build_model():
    return Net()


def example_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randint(0, 8, (batch_size,))
