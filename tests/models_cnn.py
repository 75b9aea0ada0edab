"Models for the report's tests, importable by `dtnb report --model models_cnn:<factory>` with tests/ on the path"
import torch
from torch import nn


def cnn(classes:int=10) -> nn.Module:
    "A small CNN of Conv-BatchNorm-ReLU blocks in a chain, then a classifier: for 3x32x32 inputs"
    block = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2))
    return nn.Sequential(block(3, 8), block(8, 16), nn.Flatten(), nn.Linear(16 * 8 * 8, classes))


def make_batch():
    "One (images, labels) batch of 32 samples for `--batch models_cnn:make_batch`"
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 3, 32, 32, generator=g), torch.randint(10, (32,), generator=g)


def make_dataset(n:int=256):
    "A map-style dataset of (image, label) samples for `--dataset models_cnn:make_dataset`"
    x, y = make_batch()
    return torch.utils.data.TensorDataset(x.repeat(n // 32, 1, 1, 1), y.repeat(n // 32))


def tiny_cnn(classes:int=10, seed:int=0) -> nn.Module:
    "Two Conv-BatchNorm-ReLU layers and a classifier for 3x8x8 inputs: the BatchNorm CNN of the fast tests"
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes))


def tiny_images(n:int=64, classes:int=10, seed:int=0):
    "A TensorDataset of `n` random 3x8x8 images and labels"
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(classes, (n,),
                                                                                              generator=g))
