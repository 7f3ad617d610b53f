"""Everyday training patterns (issue: never silently wrong): right numbers or a specific error.

Each case either compares with an independent ``torch.func`` reference in float64 or asserts the
documented exception and that nothing was written.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DT,
    assert_close,
    assert_no_attributes,
    ggn_reference,
    per_sample_grads_loop,
)
from reference import per_sample_grads
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import AccumulationError, UnsupportedModuleError
from curvopt.optim import KFAC

N = 6


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _data(n=N):
    return torch.randn(n, 4, dtype=DT), torch.randint(0, 3, (n,))


def _extended(plain):
    model = curvopt.extend(_copy(plain))
    return model, curvopt.extend(nn.CrossEntropyLoss())


def _copy(plain):
    import copy

    return copy.deepcopy(plain)


# ------------------------------------------------------------------ silent wrong numbers before
class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(7, 4), nn.Linear(4, 4)

    def forward(self, idx):
        return torch.tanh(self.lin(self.emb(idx))) @ self.emb.weight.T


@pytest.mark.parametrize(
    "extension", [ext.DiagGGNExact, ext.BatchDiagGGNExact, ext.DiagGGNMC, ext.KFLR, ext.BatchGrad]
)
def test_tied_output_layer_raises(extension):
    model = curvopt.extend(_TiedHead().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    idx, target = torch.randint(0, 7, (5,)), torch.randint(0, 7, (5,))
    with pytest.raises(UnsupportedModuleError, match="emb.weight.*outside the module"):
        with curvopt.collect(extension()):
            lossfunc(model(idx), target).backward()
    assert_no_attributes(model)


def test_penalty_on_activations_raises():
    model, lossfunc = _extended(_mlp())
    x, y = _data()
    out = model(x)
    with pytest.raises(UnsupportedModuleError, match="extended loss\\(es\\) alone"):
        with curvopt.collect(ext.DiagGGNExact(), ext.DiagHessian()):
            (lossfunc(out, y) + 0.1 * (out**2).sum()).backward()
    assert_no_attributes(model)


def test_penalty_on_parameters_raises():
    model, lossfunc = _extended(_mlp())
    x, y = _data()
    penalty = 0.1 * sum((p**2).sum() for p in model.parameters())
    with pytest.raises(UnsupportedModuleError, match="outside the module"):
        with curvopt.collect(ext.DiagHessian()):
            (lossfunc(model(x), y) + penalty).backward()
    assert_no_attributes(model)


def test_unextended_loss_term_raises():
    model, lossfunc = _extended(_mlp())
    x, y = _data()
    out = model(x)
    with pytest.raises(UnsupportedModuleError, match="extended loss\\(es\\) alone"):
        with curvopt.collect(ext.DiagGGNExact()):
            (lossfunc(out, y) + F.cross_entropy(out, y)).backward()


@pytest.mark.parametrize("split", [3, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_accumulate_like_one_batch(reduction, split):
    """Two backward passes in one collect equal one pass over the concatenated batch (the
    micro-batch losses scaled so that they sum to the full-batch loss); unequal micro-batches
    (4 + 2) weight the input-side Kronecker factors by their sizes."""
    plain = _mlp()
    x, y = _data()
    attrs = [
        "grad_batch",
        "batch_l2",
        "sum_grad_squared",
        "variance",
        "diag_ggn_exact",
        "diag_ggn_exact_batch",
        "diag_h",
        "kflr",
    ]
    exts = [
        ext.BatchGrad(),
        ext.BatchL2Grad(),
        ext.SumGradSquared(),
        ext.Variance(),
        ext.DiagGGNExact(),
        ext.BatchDiagGGNExact(),
        ext.DiagHessian(),
        ext.KFLR(),
    ]
    whole, lossfunc = _extended(plain)
    lossfunc.reduction = reduction
    with curvopt.collect(*exts):
        lossfunc(whole(x), y).backward()
    parts, lossfunc = _extended(plain)
    lossfunc.reduction = reduction
    weight = 0.5 if reduction == "mean" else 1.0
    with curvopt.collect(*exts):
        (weight * lossfunc(parts(x[:2]), y[:2])).backward()
        (weight * lossfunc(parts(x[2:4]), y[2:4])).backward()
    with curvopt.collect(*exts):  # a new collect starts afresh
        (weight * lossfunc(parts(x[2:4]), y[2:4])).backward()
    assert parts[0].weight.grad_batch.shape[0] == 2
    parts, lossfunc = _extended(plain)
    lossfunc.reduction = reduction
    first, second = (split / N, 1 - split / N) if reduction == "mean" else (1.0, 1.0)
    with curvopt.collect(*exts):
        (first * lossfunc(parts(x[:split]), y[:split])).backward()
        (second * lossfunc(parts(x[split:]), y[split:])).backward()
    for (name, p), q in zip(whole.named_parameters(), parts.parameters()):
        assert_close(q.grad, p.grad, f"{name}.grad")
        for attr in attrs:
            a, b = getattr(q, attr), getattr(p, attr)
            if isinstance(a, list):
                for i, (fa, fb) in enumerate(zip(a, b)):
                    assert_close(fa, fb, f"{name}.{attr}[{i}]")
            else:
                assert_close(a, b, f"{name}.{attr}")


def test_kfra_does_not_accumulate():
    model, lossfunc = _extended(_mlp())
    x, y = _data()
    with pytest.raises(AccumulationError, match="KFRA"):
        with curvopt.collect(ext.KFRA()):
            lossfunc(model(x[:3]), y[:3]).backward()
            lossfunc(model(x[3:]), y[3:]).backward()


@pytest.mark.parametrize("length", [5, 3])  # T != N, and T == N (only the probes can tell)
@pytest.mark.parametrize("extension", [ext.DiagGGNExact, ext.BatchGrad])
def test_sequence_first_transformer_is_per_sample_of_dim_1(length, extension):
    """batch_first=False: the Linear/LayerNorm calls see [T, N, D]; with the loss extended the
    batch is found on their dim 1 (MultiheadAttention's batch), first and second order."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0), nn.Linear(4, 3)).to(DT)
    x = torch.randn(length, 3, 4, dtype=DT)
    y = torch.randint(0, 3, (length * 3,))
    model, lossfunc = _extended(plain)

    def loss_on(out, target):
        return nn.CrossEntropyLoss()(out.reshape(-1, 3), target)

    with curvopt.collect(extension()):
        lossfunc(model(x).reshape(-1, 3), y).backward()
    if extension is ext.BatchGrad:
        want = per_sample_grads(plain, loss_on, x, y, 1)
        for name, p in model.named_parameters():
            assert_close(p.grad_batch, want[name], name)
    else:
        blocks, _ = ggn_reference(plain, loss_on, x, y, out_dim=1)
        for name, p in model.named_parameters():
            assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)


def test_sequence_first_with_a_plain_loss_raises_when_layers_disagree():
    """Without the extended loss nothing can find the batch: T != N raises (T == N is what
    curvopt.verify is for, README)."""
    plain = nn.Sequential(nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0), nn.Linear(4, 3)).to(DT)
    model = curvopt.extend(_copy(plain))
    x, y = torch.randn(5, 3, 4, dtype=DT), torch.randint(0, 3, (15,))
    with pytest.raises(UnsupportedModuleError, match="samples"):
        with curvopt.collect(ext.BatchGrad()):
            nn.CrossEntropyLoss()(model(x).reshape(-1, 3), y).backward()
    assert_no_attributes(model)


class _Mixing(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.a, self.b, self.kind = nn.Linear(4, 5), nn.Linear(5, 3), kind

    def forward(self, x):
        h = self.a(x)
        if self.kind == "mean":
            h = h - h.mean(0)
        else:
            h = F.batch_norm(h, None, None, training=True)
        return self.b(h)


@pytest.mark.parametrize("kind", ["mean", "batch_norm"])
@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.DiagGGNExact, ext.BatchDiagGGNMC])
def test_batch_mixing_functional_ops_raise(kind, extension):
    model = curvopt.extend(_Mixing(kind).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data()
    with pytest.raises(UnsupportedModuleError, match="mixes samples"):
        with curvopt.collect(extension()):
            lossfunc(model(x), y).backward()
    assert_no_attributes(model)


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return F.linear(torch.tanh(self.a(x)), self.b.weight, self.b.bias)


@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.SumGradSquared, ext.DiagGGNExact])
def test_parameter_used_without_its_module_raises(extension):
    model = curvopt.extend(_Functional().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data()
    with pytest.raises(UnsupportedModuleError, match="never called"):
        with curvopt.collect(extension()):
            lossfunc(model(x), y).backward()
    assert_no_attributes(model)


# ------------------------------------------------------------------ false errors before
def test_sum_check_at_a_stationary_point_in_float32():
    torch.manual_seed(0)
    x = torch.randn(1024, 5)
    y = x @ torch.randn(5, 1) + 0.3 * torch.randn(1024, 1)
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(1024, 1)], 1), y).solution
    layer = nn.Linear(5, 1)
    with torch.no_grad():
        layer.weight.copy_(solution[:5].T)
        layer.bias.copy_(solution[5])
    model = curvopt.extend(layer)
    with curvopt.collect(ext.BatchGrad(), ext.Variance()):
        curvopt.extend(nn.MSELoss())(model(x), y).backward()
    g = model.weight.grad_batch
    assert bool(((g.sum(0) - model.weight.grad).abs() <= 1e-5 * g.abs().sum(0)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models_pass_the_sum_check(dtype):
    model = curvopt.extend(_mlp().to(dtype))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data()
    with curvopt.collect(ext.BatchGrad(), ext.Variance(), ext.KFRA()):
        lossfunc(model(x.to(dtype)), y).backward()
    assert model[0].weight.grad_batch.dtype == dtype
    assert model[0].weight.kfra[0].dtype == dtype


def test_autocast_bfloat16_passes_the_sum_check():
    model = curvopt.extend(_mlp().float())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with curvopt.collect(ext.BatchGrad(), ext.SumGradSquared()):
            lossfunc(model(x.float()), y).backward()
    assert model[0].weight.grad_batch.shape == (N, 5, 4)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.o = nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 3)

    def forward(self, x):
        return self.o(self.a(x, x, x)[0].mean(1))  # need_weights=True (the default)


@pytest.mark.parametrize("extension", [ext.DiagGGNExact, ext.BatchDiagGGNExact])
def test_attention_with_weights_second_order(extension):
    torch.manual_seed(0)
    plain = _Attention().to(DT).eval()
    x, y = torch.randn(3, 5, 4, dtype=DT), torch.randint(0, 3, (3,))
    model, lossfunc = _extended(plain)
    with curvopt.collect(extension()):
        lossfunc(model(x), y).backward()
    blocks, per_sample = ggn_reference(plain, nn.CrossEntropyLoss(), x, y)
    for name, p in model.named_parameters():
        if extension is ext.DiagGGNExact:
            want = torch.diagonal(blocks[name]).reshape(p.shape)
            assert_close(p.diag_ggn_exact, want, name)
        else:
            assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


def test_torch_compile_second_order_raises_clearly(capfd):
    model, lossfunc = _extended(_mlp())
    compiled = torch.compile(model)
    x, y = _data()
    try:
        out = compiled(x)
    except Exception as error:  # no compiler toolchain: nothing to check
        pytest.skip(f"torch.compile unavailable here: {error}")
    with pytest.raises(UnsupportedModuleError, match="torch.compile"):
        with curvopt.collect(ext.DiagGGNExact()):
            lossfunc(out, y).backward()
    import gc

    gc.collect()
    assert "Exception ignored" not in capfd.readouterr().err


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(h + torch.tanh(self.b(h)))


def test_kfra_on_a_residual_network_raises():
    model = curvopt.extend(_Residual().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data(1)
    with pytest.raises(UnsupportedModuleError, match="residual"):
        with curvopt.collect(ext.KFRA()):
            lossfunc(model(x), y).backward()
    assert_no_attributes(model)


class _TiedChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_kfra_with_a_weight_tied_across_modules_raises():
    model = curvopt.extend(_TiedChain().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data()
    with pytest.raises(UnsupportedModuleError, match="tied"):
        with curvopt.collect(ext.KFRA()):
            lossfunc(model(x), y).backward()
    assert_no_attributes(model)


# ------------------------------------------------------------------ layouts of the loss
@pytest.mark.parametrize("layout", ["kdim", "batch-first", "sequence-first"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_flattened_rows_equal_the_reference(layout, reduction):
    """Summed quantities are those of the loss as computed, per-sample ones per sample of the
    model (here: the sequence axis of a position-wise MLP is dim 1)."""
    plain = _mlp()
    n, t = 3, 4
    x = torch.randn(n, t, 4, dtype=DT)
    y = torch.randint(0, 3, (n, t))
    y[0, 1] = -100
    lf = nn.CrossEntropyLoss(reduction=reduction)
    if layout == "kdim":

        def loss_on(out, target):
            return lf(out.permute(0, 2, 1), target)

        inputs, target = x, y
    elif layout == "batch-first":

        def loss_on(out, target):
            return lf(out.reshape(-1, 3), target.reshape(-1))

        inputs, target = x, y
    else:  # the model runs on [T, N, D]; its batch is dim 0 = T for a position-wise MLP

        def loss_on(out, target):
            return lf(out.reshape(-1, 3), target.reshape(-1))

        inputs, target = x.transpose(0, 1).contiguous(), y.T.contiguous()
    model = curvopt.extend(_copy(plain))
    lf = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))  # the loss_on closures use it
    with curvopt.collect(ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.BatchGrad()):
        loss_on(model(inputs), target).backward()
    blocks, per_sample = ggn_reference(plain, loss_on, inputs, target)
    grads = per_sample_grads(plain, loss_on, inputs, target)
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)
        assert_close(p.grad_batch, grads[name], name)


# ------------------------------------------------------------------ curvopt.verify
def test_verify_passes_a_supported_model_with_flattened_rows():
    model, _ = _extended(_mlp())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(3, 2, 4, dtype=DT), torch.randint(0, 3, (3, 2))
    exts = [
        ext.BatchGrad(),
        ext.Variance(),
        ext.BatchL2Grad(),
        ext.SumGradSquared(),
        ext.DiagGGNExact(),
        ext.BatchDiagGGNExact(),
        ext.DiagHessian(),
        ext.BatchDiagHessian(),
    ]
    errors = curvopt.verify(
        model, lambda out, t: lossfunc(out.reshape(-1, 3), t.reshape(-1)), x, y, exts
    )
    assert set(errors["0.weight"]) == {e.attr for e in exts}
    assert max(max(e.values()) for e in errors.values()) < 1e-10
    assert model[0].weight.grad is None  # .grad left as it was


def test_verify_reports_a_model_that_mixes_samples():
    """With a plain (not extended) loss nothing in the pass can see the mixing; verify can."""
    model = curvopt.extend(_Mixing("mean").to(DT))
    x, y = _data(4)
    with pytest.raises(curvopt.VerificationError, match="a.weight.grad_batch"):
        curvopt.verify(model, nn.CrossEntropyLoss(), x, y, [ext.BatchGrad()])


class _SignedSquare(torch.autograd.Function):
    """A custom op (``x |x|``) whose backward branches on values, which ``vmap`` cannot run."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x.abs()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if not g.any():  # data-dependent control flow
            return torch.zeros_like(g)
        return g * 2 * x.abs()


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(_SignedSquare.apply(self.a(x)))


def test_custom_autograd_function_first_and_second_order():
    torch.manual_seed(0)
    plain = _Custom().to(DT)
    model, lossfunc = _extended(plain)
    x, y = _data()
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):
        lossfunc(model(x), y).backward()
    # references by plain autograd (torch.func cannot run this Function)
    names = [n for n, _ in plain.named_parameters()]
    values = tuple(p.detach() for p in plain.parameters())

    def out_of(*params):
        return torch.func.functional_call(plain, dict(zip(names, params)), (x,))

    out = out_of(*values).detach()
    jac = torch.autograd.functional.jacobian(out_of, values)
    hess = torch.func.hessian(lambda o: nn.CrossEntropyLoss()(o, y))(out).reshape(18, 18)
    grads = per_sample_grads_loop(plain, nn.CrossEntropyLoss(), x, y)
    for (name, p), j in zip(model.named_parameters(), jac):
        j = j.reshape(18, -1)
        want = torch.einsum("op,oq,qp->p", j, hess, j).reshape(p.shape)
        assert_close(p.diag_ggn_exact, want, name)
        assert_close(p.grad_batch, grads[name], name)


@pytest.mark.parametrize("case", ["mask", "prefix"])
def test_loss_on_rows_selected_by_data_or_a_prefix(case):
    """``logits[mask]`` (a fresh mask every step: the row map is probed on every pass, never
    cached) and ``out[:k]`` (a loss on the first k samples only) give the reference numbers."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(7, 4), nn.Tanh(), nn.Linear(4, 7)).to(DT)
    model, lossfunc = _extended(plain)
    for _ in range(3):  # a fresh selection every step
        idx = torch.randint(0, 7, (4, 6) if case == "mask" else (4,))
        if case == "mask":
            select = torch.zeros(4, 6, dtype=torch.bool)
            for n in range(4):
                select[n, torch.randperm(6)[:3]] = True  # 3 rows of every sample
        else:
            select = slice(0, 3)

        def loss_on(out, target, select=select):
            return nn.CrossEntropyLoss()(out[select].reshape(-1, 7), target[select].reshape(-1))

        with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):
            lossfunc(model(idx)[select].reshape(-1, 7), idx[select].reshape(-1)).backward()
        blocks, _ = ggn_reference(plain, loss_on, idx, idx)
        grads = per_sample_grads(plain, loss_on, idx, idx)
        for name, p in model.named_parameters():
            assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
            assert_close(p.grad_batch, grads[name], name)


# ------------------------------------------------------------------ every probe, every key counts
class _HalfFeedsHalf(nn.Module):
    """One half of the batch also feeds the other: sample ``n`` and ``n ± N/2`` differ only in
    the top bit of the sample index, and the leak goes one way, so only the top bit's probe on
    one of its two sides sees it."""

    def __init__(self, upper_into_lower):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.upper_into_lower = upper_into_lower

    def forward(self, x):
        h = torch.tanh(self.a(x))
        half = h.shape[0] // 2
        low, high = h[:half], h[half:]
        if self.upper_into_lower:
            low = low + 0.5 * high
        else:
            high = high + 0.5 * low
        return self.b(torch.cat([low, high]))


@pytest.mark.parametrize("upper_into_lower", [True, False])
@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.DiagGGNExact, ext.BatchDiagGGNExact])
def test_mixing_seen_only_by_the_top_bit_on_one_side_raises(upper_into_lower, extension):
    torch.manual_seed(0)
    model = curvopt.extend(_HalfFeedsHalf(upper_into_lower).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data(8)
    with pytest.raises(UnsupportedModuleError, match="which of the 8 samples"):
        with curvopt.collect(extension()):
            lossfunc(model(x), y).backward()
    assert_no_attributes(model)


def test_row_layout_follows_the_loss_input_shape():
    """One graph structure, the loss input reshaped two ways (``[N T, C]`` rows and
    ``[N, T C]``) on alternate passes: the verified row layout is keyed by that shape too."""
    torch.manual_seed(0)
    plain = _mlp()
    model = curvopt.extend(_copy(plain))
    lossfunc = curvopt.extend(nn.MSELoss())
    x, target = torch.randn(N, 3, 4, dtype=DT), torch.randn(N, 3, 3, dtype=DT)
    for shape in [(-1, 3), (N, -1), (-1, 3), (N, -1)]:

        def loss_on(out, t, shape=shape):
            return nn.MSELoss()(out.reshape(shape), t.reshape(shape))

        for p in model.parameters():
            p.__dict__.pop("diag_ggn_exact_batch", None)
            p.__dict__.pop("grad_batch", None)
        with curvopt.collect(ext.BatchDiagGGNExact(), ext.BatchGrad()):
            lossfunc(model(x).reshape(shape), target.reshape(shape)).backward()
        _, per_sample = ggn_reference(plain, loss_on, x, target)
        grads = per_sample_grads(plain, loss_on, x, target)
        for name, p in model.named_parameters():
            assert_close(p.diag_ggn_exact_batch, per_sample[name], f"{shape} {name}")
            assert_close(p.grad_batch, grads[name], f"{shape} {name}")


class _SharedToken(nn.Module):
    """A call without the batch (one shared index, output ``[1, D]``) added to every position
    of every sample: broadcast along the batch and along the sequence."""

    def __init__(self):
        super().__init__()
        self.tok, self.shared, self.head = nn.Embedding(7, 4), nn.Embedding(2, 4), nn.Linear(4, 7)

    def forward(self, idx):
        h = self.tok(idx) + self.shared(torch.zeros(1, dtype=torch.long, device=idx.device))
        return self.head(torch.tanh(h))


def test_broadcast_along_batch_and_sequence_sums_over_the_sequence():
    torch.manual_seed(0)
    plain = _SharedToken().to(DT)
    model, lossfunc = _extended(plain)
    idx, y = torch.randint(0, 7, (N, 3)), torch.randint(0, 7, (N, 3))

    def loss_on(out, target):
        return nn.CrossEntropyLoss()(out.reshape(-1, 7), target.reshape(-1))

    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
        lossfunc(model(idx).reshape(-1, 7), y.reshape(-1)).backward()
    grads = per_sample_grads(plain, loss_on, idx, y)
    blocks, per_sample = ggn_reference(plain, loss_on, idx, y)
    for name, p in model.named_parameters():
        assert_close(p.grad_batch, grads[name], name)
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


def test_a_forward_while_an_optimizer_rests_is_named():
    """A forward pass run outside ``collect`` while the armed optimizer of its model rests
    between refreshes (its model carries no hook then) raises naming that cause when its
    backward runs inside a block; the forward of a model that no optimizer covers keeps its
    hooks and gives the block its quantities, as does the rested model's forward inside the
    block (both against a loop over samples)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    rested = curvopt.extend(copy.deepcopy(plain))
    opt = KFAC(rested.parameters(), lr=0.0)  # (steps of length 0: ``rested`` stays ``plain``)
    mse = curvopt.extend(nn.MSELoss())
    opt.zero_grad()
    mse(rested(torch.randn(5, 4, dtype=torch.float64)), torch.randn(5, 2).double()).backward()
    opt.step()  # a refresh; the next steps rest
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    rested.zero_grad()
    loss = mse(rested(x), y)
    with pytest.raises(UnsupportedModuleError, match="rested between refreshes"):
        with curvopt.collect(ext.BatchGrad()):
            loss.backward()
    reference = per_sample_grads_loop(plain, nn.MSELoss(), x, y)
    uncovered = curvopt.extend(copy.deepcopy(plain))
    loss = mse(uncovered(x), y)  # outside the block, while ``opt`` rests
    with curvopt.collect(ext.BatchGrad()):
        loss.backward()
    rested.zero_grad()
    with curvopt.collect(ext.BatchGrad()):
        mse(rested(x), y).backward()
    for model in (uncovered, rested):
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad_batch, reference[name], rtol=1e-10, atol=1e-12)
    del opt
