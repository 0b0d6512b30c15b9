"""Wide ResNet 28-10 (Zagoruyko and Komodakis, 2016) for 32x32 images, as a karma model file.

    karma-plan examples/wrn.py --hardware v100-16g --gpu-mem 16G --batch-size 1024

Plain PyTorch: pre-activation basic blocks (BatchNorm, ReLU, 3x3 convolution, twice, with
dropout between), four of them in each of three nn.Sequential stages (layer1..layer3) of
widths 160, 320 and 640. Depth and width by KARMA_WRN=DEPTHxWIDTH (default 28x10).
"""

import os

import torch
from torch import nn

DEPTH, WIDEN = (int(v) for v in os.environ.get("KARMA_WRN", "28x10").split("x"))
NUM_CLASSES = 10
BATCH_SIZE = 128
DROPOUT = 0.3


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_ch)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu2 = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(DROPOUT)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.shortcut = (nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)
                         if stride != 1 or in_ch != out_ch else None)

    def forward(self, x):
        out = self.relu1(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.drop(self.relu2(self.bn2(out))))
        return out + identity


class WideResNet(nn.Module):
    def __init__(self):
        super().__init__()
        n = (DEPTH - 4) // 6
        widths = [16, 16 * WIDEN, 32 * WIDEN, 64 * WIDEN]
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        in_ch = widths[0]
        for s in range(3):  # layer1..layer3: each an nn.Sequential, its blocks karma's blocks
            blocks = []
            for k in range(n):
                blocks.append(BasicBlock(in_ch, widths[s + 1], (1 if s == 0 else 2) if k == 0
                                         else 1))
                in_ch = widths[s + 1]
            setattr(self, f"layer{s + 1}", nn.Sequential(*blocks))
        self.bn = nn.BatchNorm2d(in_ch)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, NUM_CLASSES)

    def forward(self, x):
        out = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(self.relu(self.bn(out))), 1))


def build_model() -> nn.Module:
    return WideResNet()


def example_batch(batch_size: int):
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, NUM_CLASSES, (batch_size,))
