"""The DeepOBS test problems: architectures, parameter counts, initialisation, param groups."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from experiments.problems import PROBLEMS, get_problem, maxpool_same, tf_same_padding

# Parameter counts worked out from the architectures (they match the DeepOBS papers):
# logreg 784*10+10; 2c2d 32*25+32 + 64*32*25+64 + 3136*1024+1024 + 1024*10+10;
# 3c3d 64*3*25+64 + 96*64*9+96 + 128*96*9+128 + 1152*512+512 + 512*256+256 + 256*10+10;
# All-CNN-C 96*27+96 + 2*(96*96*9+96) + 192*96*9+192 + 3*(192*192*9+192) + 192*192+192
#   + 100*192+100.
EXPECTED = {
    "mnist_logreg": ((1, 28, 28), 10, 7_850),
    "fmnist_2c2d": ((1, 28, 28), 10, 3_274_634),
    "cifar10_3c3d": ((3, 32, 32), 10, 895_210),
    "cifar100_allcnnc": ((3, 32, 32), 100, 1_387_108),
}
PLAIN = (
    nn.Conv2d,
    nn.Linear,
    nn.ReLU,
    nn.MaxPool2d,
    nn.ZeroPad2d,
    nn.Flatten,
    nn.Dropout,
    nn.AvgPool2d,
)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_shapes_and_parameter_counts(name):
    shape, classes, count = EXPECTED[name]
    problem = get_problem(name)
    model = problem.model(seed=0)
    assert problem.input_shape == shape
    assert sum(p.numel() for p in model.parameters()) == count
    assert model.eval()(torch.rand(2, *shape)).shape == (2, classes)
    assert type(model) is nn.Sequential
    assert all(isinstance(m, PLAIN) for m in model.children())


def test_paper_settings():
    settings = {n: (p.dataset, p.batch_size, p.epochs, p.weight_decay) for n, p in PROBLEMS.items()}
    assert settings == {
        "mnist_logreg": ("mnist", 128, 50, 0.0),
        "fmnist_2c2d": ("fmnist", 128, 100, 0.0),
        "fmnist_vit": ("fmnist", 128, 100, 0.0),
        "cifar10_3c3d": ("cifar10", 128, 100, 0.002),
        "cifar100_allcnnc": ("cifar100", 256, 350, 5e-4),
    }
    assert isinstance(get_problem("mnist_logreg").loss(), nn.CrossEntropyLoss)
    with pytest.raises(ValueError, match="unknown problem"):
        get_problem("mnist_vae")


def test_seeded_models_ignore_global_rng():
    problem = get_problem("cifar10_3c3d")
    torch.manual_seed(123)
    a = problem.model(seed=5)
    state = torch.get_rng_state()
    b = problem.model(seed=5)
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = problem.model(seed=6)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def _layers(model, kind):
    return [m for m in model.modules() if isinstance(m, kind)]


def test_initialisation_as_deepobs():
    logreg = get_problem("mnist_logreg").model(0)
    assert all(torch.all(p == 0) for p in logreg.parameters())
    twoc = get_problem("fmnist_2c2d").model(0)
    for layer in _layers(twoc, (nn.Conv2d, nn.Linear)):
        assert torch.all(layer.bias == 0.05) and layer.weight.abs().max() <= 0.1
    big = _layers(twoc, nn.Linear)[0].weight
    assert big.std().item() == pytest.approx(0.05 * 0.8796, rel=0.01)  # std of N(0,1) cut at ±2
    threec = get_problem("cifar10_3c3d").model(0)
    conv = _layers(threec, nn.Conv2d)[0].weight
    assert conv.std().item() == pytest.approx((2 / (3 * 25 + 64 * 25)) ** 0.5, rel=0.05)
    assert all(torch.all(layer.bias == 0) for layer in _layers(threec, (nn.Conv2d, nn.Linear)))
    allcnn = get_problem("cifar100_allcnnc").model(0)
    assert all(torch.all(layer.bias == 0.1) for layer in _layers(allcnn, nn.Conv2d))


def test_param_groups_decay_weights_only():
    problem = get_problem("cifar10_3c3d")
    model = problem.model(0)
    weights, biases = problem.param_groups(model)
    assert weights["weight_decay"] == 0.002 and biases["weight_decay"] == 0.0
    assert all(p.dim() > 1 for p in weights["params"]) and all(
        p.dim() == 1 for p in biases["params"]
    )
    assert len(weights["params"]) + len(biases["params"]) == len(list(model.parameters()))


def test_tensorflow_same_padding():
    assert tf_same_padding(28, 3, 2) == (0, 1)  # asymmetric: the extra row goes after
    assert tf_same_padding(28, 2, 2) == (0, 0)
    assert tf_same_padding(32, 5, 1) == (2, 2)
    x = torch.rand(2, 4, 28, 28)  # non-negative, as after a ReLU
    pool = nn.Sequential(*maxpool_same(3, 2, 28))
    reference = F.max_pool2d(F.pad(x, (0, 1, 0, 1), value=float("-inf")), 3, 2)
    assert torch.equal(pool(x), reference) and reference.shape[-1] == 14
