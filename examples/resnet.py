"""ResNet-50 / ResNet-152 / ResNet-200 (and a tiny variant for CPU tests) as a karma model file.

Plain PyTorch, no torchvision: the standard architecture (He et al., 2015) with Bottleneck
blocks and BatchNorm. The depth and image size come from environment variables:

    karma-plan examples/resnet.py --print-ir                      # ResNet-50, 224x224
    KARMA_RESNET=152 karma-plan examples/resnet.py --print-ir     # ResNet-152
    KARMA_RESNET_IMAGE=128 karma-plan examples/resnet.py ...      # smaller images
    KARMA_RESNET=tiny karma-plan examples/resnet.py ...           # 8 blocks, width 8, 32x32

Karma finds blocks as the children of nn.Sequential containers: layer1..layer4 are each an
nn.Sequential of Bottleneck modules; the stem (conv1, bn1, relu, maxpool) and the head
(avgpool, fc) are direct attributes of the model.
"""

import os

import torch
from torch import nn

_VARIANTS = {
    # name: (blocks per stage, base width, default image size, classes, batch size)
    "50": ([3, 4, 6, 3], 64, 224, 1000, 32),
    "152": ([3, 8, 36, 3], 64, 224, 1000, 32),
    "200": ([3, 24, 36, 3], 64, 224, 1000, 32),
    "tiny": ([2, 2, 2, 2], 8, 32, 10, 8),
}

VARIANT = os.environ.get("KARMA_RESNET", "50")
if VARIANT not in _VARIANTS:
    raise ValueError(f"KARMA_RESNET={VARIANT!r} is not a known variant; "
                     "use one of 50, 152, 200, tiny")
LAYERS, WIDTH, _DEFAULT_IMAGE, NUM_CLASSES, BATCH_SIZE = _VARIANTS[VARIANT]
IMAGE_SIZE = int(os.environ.get("KARMA_RESNET_IMAGE", _DEFAULT_IMAGE))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as in torchvision's ResNet v1.5), 1x1 expand, plus shortcut."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers: list[int], width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = width
        stages = []
        for i, n in enumerate(layers):
            stage_width = width * 2**i
            stride = 1 if i == 0 else 2
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(in_ch, stage_width, stride if j == 0 else 1))
                in_ch = stage_width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model() -> nn.Module:
    return ResNet(LAYERS, WIDTH, NUM_CLASSES)


def example_batch(batch_size: int):
    """Random images [B, 3, H, W] float32 and labels [B] int64 (no device: follows the default)."""
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,))
    return images, labels
