"""A small residual MLP with a warmup-plus-cosine learning-rate schedule (LambdaLR).

The factor is 0 at step 0 (the first step moves nothing), rises linearly for WARMUP steps,
then falls along a cosine to 10% by TOTAL steps. KARMA_SCHEDULE=onecycle uses SGD with
momentum under OneCycleLR instead (it schedules the momentum too).
"""

import math
import os

import torch
import torch.nn as nn

BATCH_SIZE = 4
WIDTH, DEPTH, IN_FEATURES, CLASSES = 32, 3, 16, 10
WARMUP, TOTAL = 2, 6
KIND = os.environ.get("KARMA_SCHEDULE", "warmup_cosine")


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.norm(self.fc(x)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model():
    return MLP()


def example_batch(batch_size):
    return torch.randn(batch_size, IN_FEATURES), torch.randint(0, CLASSES, (batch_size,))


def make_optimizer(params):
    if KIND == "onecycle":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def warmup_cosine(step):
    if step < WARMUP:
        return step / WARMUP
    progress = min(1.0, (step - WARMUP) / (TOTAL - WARMUP))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer):
    if KIND == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=TOTAL)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
