"""ResNet with bottleneck blocks (v1.5: the stride sits in the 3x3 conv), for ImageNet-style input.

``resnet50()`` is the standard 224x224, 1000-class ResNet50 with 25,557,032 parameters.
``resnet_tiny()`` is a [1,1,1,1] bottleneck ResNet of width 16 for fast tests.
Init: Kaiming-normal (fan_out, ReLU) convs, BatchNorm weight 1 / bias 0, torch default for the
final Linear; ``zero_init_residual`` zeroes the last BatchNorm weight of every residual branch.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand (x4), plus identity/projection."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers: Sequence[int], num_classes: int = 1000, width: int = 64,
                 zero_init_residual: bool = False):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages = []
        cin = width
        for i, blocks in enumerate(layers):
            planes = width * 2**i
            stride = 1 if i == 0 else 2
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(cin, planes, stride if b == 0 else 1))
                cin = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000, zero_init_residual: bool = False) -> ResNet:
    return ResNet([3, 4, 6, 3], num_classes, width=64, zero_init_residual=zero_init_residual)


def resnet_tiny(num_classes: int = 10, zero_init_residual: bool = False) -> ResNet:
    return ResNet([1, 1, 1, 1], num_classes, width=16, zero_init_residual=zero_init_residual)
