"""A model called with keyword arguments that computes its own loss and returns a dict.

The shape of a Hugging Face model without transformers: `model(**inputs)` with a `labels`
entry, `{"loss", "logits", "hidden"}` out (the hidden state requires grad but the loss does
not use it), dropout (so evaluation mode matters), and held-out `eval_batches`. With
DICT_IO_TARGETS=1 it takes no labels and returns logits only, and the targets are separate.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 4
FEATURES, WIDTH, CLASSES = 16, 32, 8
OWN_LOSS = os.environ.get("DICT_IO_TARGETS", "0") != "1"


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, h, scale):
        return h + self.drop(torch.tanh(self.fc(self.norm(h)))) * scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, features, scale, labels=None):
        h = self.inp(features)
        for layer in self.layers:
            h = layer(h, scale=scale)
        logits = self.head(h)
        if labels is None:
            return {"logits": logits, "hidden": h}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits, "hidden": h}


def build_model():
    return Net()


def example_batch(batch_size):
    inputs = {"features": torch.randn(batch_size, FEATURES), "scale": torch.rand(batch_size, 1)}
    labels = torch.randint(0, CLASSES, (batch_size,))
    if OWN_LOSS:
        return {**inputs, "labels": labels}, None
    return inputs, labels


def eval_batches(batch_size):
    generator = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(2):
        features = torch.randn(batch_size, FEATURES, generator=generator)
        scale = torch.rand(batch_size, 1, generator=generator)
        labels = torch.randint(0, CLASSES, (batch_size,), generator=generator)
        inputs = {"features": features, "scale": scale}
        out.append(({**inputs, "labels": labels}, None) if OWN_LOSS else (inputs, labels))
    return out
