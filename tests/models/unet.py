"""A tiny U-Net-like stack: decoder layers read encoder outputs (long skips)."""
import torch
import torch.nn as nn

WIDTH = 16
DEPTH = 3


class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x, skip):
        return torch.tanh(self.fc(torch.cat([x, skip], dim=-1)))


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.down = nn.ModuleList(Down() for _ in range(DEPTH))
        self.up = nn.ModuleList(Up() for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x):
        x = self.inp(x)
        skips = []
        for d in self.down:
            skips.append(x)
            x = d(x)
        for u in self.up:
            x = u(x, skips.pop())
        return self.out(x)


def build_model():
    return UNet()


def example_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,))
