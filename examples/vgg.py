"""VGG-16 (Simonyan and Zisserman, 2014; configuration D) as a karma model file.

    karma-plan examples/vgg.py --hardware v100-16g --gpu-mem 16G --batch-size 256

Plain PyTorch, written as torchvision writes it (ReLU in place after each convolution), with
each convolution and its activation (and the pooling after it) one module of an
nn.Sequential, so that each is a block. Image size by KARMA_VGG_IMAGE (default 224).
"""

import os

import torch
from torch import nn

IMAGE_SIZE = int(os.environ.get("KARMA_VGG_IMAGE", 224))
NUM_CLASSES = 1000
BATCH_SIZE = 32
# output channels of the 13 convolutions; "M": a 2x2 max pooling after the one before
CONFIG_D = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
            512, 512, 512, "M"]


class ConvReLU(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, pool: bool):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x):
        return self.pool(self.relu(self.conv(x)))


class VGG(nn.Module):
    def __init__(self):
        super().__init__()
        layers, in_ch = [], 3
        for k, v in enumerate(CONFIG_D):
            if v == "M":
                continue
            layers.append(ConvReLU(in_ch, v, pool=k + 1 < len(CONFIG_D)
                                   and CONFIG_D[k + 1] == "M"))
            in_ch = v
        self.features = nn.Sequential(*layers)
        side = IMAGE_SIZE // 32
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(512 * side * side, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, NUM_CLASSES))

    def forward(self, x):
        return self.classifier(self.features(x))


def build_model() -> nn.Module:
    return VGG()


def example_batch(batch_size: int):
    return (torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE),
            torch.randint(0, NUM_CLASSES, (batch_size,)))
