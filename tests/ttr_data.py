"""The time-to-result tests' data: MNIST-shaped images whose label is a bright band at row
``2 * label``, learnable in a few steps (no download)."""

import torch

from experiments.data import ImageData, make_splits


def band_splits():
    """Train, validation and evaluation splits of 1,200 + 200 band images (seeded)."""
    gen = torch.Generator().manual_seed(0)

    def draw(n):
        y = torch.randint(0, 10, (n,), generator=gen)
        x = torch.randint(0, 60, (n, 1, 28, 28), generator=gen, dtype=torch.uint8)
        for i, label in enumerate(y.tolist()):
            x[i, 0, 2 * label : 2 * label + 4, 4:24] = 255
        return x, y

    (train_x, train_y), (test_x, test_y) = draw(1200), draw(200)
    data = ImageData("mnist", train_x, train_y, test_x, test_y, 10)
    return make_splits(data, valid_size=100, eval_size=200)
