"""A model with an unused parameter, a frozen layer, dropout and a tied embedding and head:
the parameters an optimizer must skip (no gradient) beside the ordinary ones."""
import torch
import torch.nn as nn

BATCH_SIZE = 4

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)
    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 16)
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.emb.weight   # tied
        self.unused = nn.Parameter(torch.randn(8))
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
    def forward(self, x):
        x = self.emb(x)
        x = self.frozen(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

def build_model():
    return Net()

def example_batch(batch_size):
    return torch.randint(0, 16, (batch_size, 5)), torch.randint(0, 16, (batch_size, 5))
