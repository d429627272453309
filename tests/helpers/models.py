"""Small models, batches and TrainSteps shared by the training tests."""
from __future__ import annotations

import torch

from fastdata.train import TrainStep


def linear_and_batches():
    """A 4 -> 3 linear model and two identical (x, y) batches of 8."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    return model, [(x, y)] * 2


def linear_step() -> TrainStep:
    """A TrainStep of a 4 -> 3 linear model with SGD and cross entropy."""
    model = torch.nn.Linear(4, 3)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy)


def conv_model():
    """A small seeded conv net (BatchNorm inside) for 3-channel images, 4 classes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
