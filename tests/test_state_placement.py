"""A checkpoint resumes in another precision or on another device with every part of its state
alike: ``load_state_dict`` moves a curvature average kept as its Gram root (``GramFactor``) and a
cached Woodbury inverse (``LowRankInverse``) as ``torch.optim`` moves the plain tensors beside
them (to the parameter's device, and dtype where it is floating point).

Before this, a float64 checkpoint loaded into a float32 model kept float64 roots and bases beside
float32 factors, and the next step failed on the mixed dtypes (on another device, on the mixed
devices).
"""

import io

import torch
from torch import nn

import curvopt
from curvopt.core.reductions import GramFactor
from curvopt.optim import KFAC
from curvopt.inversion.factor_inverse import LowRankInverse
from curvopt.optim.state_placement import placed

#: input width 120 above the batch of 8: Woodbury inverses and root-only averages for ``A``; the
#: exact curvature (KFLR), so that the float32 and float64 runs draw no Monte-Carlo labels
OPTIONS = dict(
    lr=0.1,
    damping=0.1,
    curvature="kflr",
    curvature_ema=0.9,
    curvature_interval=2,
    inverse_interval=2,
)


def _model(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(120, 30), nn.ReLU(), nn.Linear(30, 3)).to(dtype)
    return curvopt.extend(net)


def _train(net, opt, steps, seed):
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(seed)
    dtype = next(net.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(8, 120, generator=generator, dtype=torch.float64).to(dtype)
        y = torch.randint(0, 3, (8,), generator=generator)
        opt.zero_grad()
        loss = lossfunc(net(x), y)
        with opt.collect():
            loss.backward()
        opt.step()


def _tensor_likes(value):
    if isinstance(value, (GramFactor, LowRankInverse)):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [found for entry in value for found in _tensor_likes(entry)]
    return []


def _saved_float64_run():
    net = _model(torch.float64)
    opt = KFAC(net.parameters(), **OPTIONS)
    _train(net, opt, 3, seed=0)
    kinds = {type(v) for state in opt.state.values() for v in _tensor_likes(state)}
    assert kinds == {GramFactor, LowRankInverse}  # the state this test is about is there
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return net, opt, torch.load(buffer, weights_only=True)


def test_a_float64_checkpoint_resumes_in_float32_with_every_factor_cast():
    """The float32 run resumed from the float64 checkpoint takes the float64 run's next three
    steps to float32's precision (relative 1e-5 of the parameters' change; ~1e-6 measured);
    every root and basis in its state is float32."""
    net64, opt64, saved = _saved_float64_run()
    net32 = _model(torch.float32)
    net32.load_state_dict(net64.state_dict())
    opt32 = KFAC(net32.parameters(), **OPTIONS)
    opt32.load_state_dict(saved)
    loaded = [v for state in opt32.state.values() for v in _tensor_likes(state)]
    assert loaded and all(v.dtype == torch.float32 for v in loaded if isinstance(v, GramFactor))
    assert all(
        v.basis.dtype == v.shift.dtype == torch.float32
        for v in loaded
        if isinstance(v, LowRankInverse)
    )
    start = [p.detach().clone() for p in net64.parameters()]
    _train(net64, opt64, 3, seed=1)
    _train(net32, opt32, 3, seed=1)
    for p32, p64, p0 in zip(net32.parameters(), net64.parameters(), start):
        change64, change32 = p64.detach() - p0, p32.detach().double() - p0
        assert (change32 - change64).norm() <= 1e-5 * change64.norm()


def test_placed_moves_the_tensor_likes_to_the_parameter_and_leaves_the_rest():
    """Device (``meta`` stands for another device here) and floating dtype follow the
    parameter; an integer parameter keeps the values' dtype; other entries are untouched."""
    root = torch.randn(2, 5, dtype=torch.float64)
    inverse = LowRankInverse.of(root, 0.5)
    marker, tensor = object(), torch.ones(3)
    state = {
        "curvature": [tensor, GramFactor(root)],
        "inverse": {"value": (inverse,)},
        "other": marker,
        "step": 4,
    }
    moved = placed(state, torch.empty(2, dtype=torch.float32, device="meta"))
    gram_factor, low_rank = moved["curvature"][1], moved["inverse"]["value"][0]
    assert gram_factor.root.device.type == "meta" and gram_factor.dtype == torch.float32
    assert low_rank.basis.device.type == low_rank.shift.device.type == "meta"
    assert low_rank.basis.dtype == torch.float32
    assert isinstance(moved["inverse"]["value"], tuple)
    assert moved["curvature"][0] is tensor and moved["other"] is marker and moved["step"] == 4
    kept = placed(state, torch.zeros(2, dtype=torch.int64))
    assert kept["curvature"][1] is state["curvature"][1]  # nothing to change: the same object
    assert kept["inverse"]["value"][0].basis.dtype == torch.float64
