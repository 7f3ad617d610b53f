"""The overhead benchmark's curvlinops column: curvlinops and curvopt agree where their
definitions coincide (skipped when curvlinops is not importable), and the GPT cases compare on
the parameters both support."""

import numpy as np
import pytest
import torch

import curvopt
from curvopt import extensions as ext
from curvopt import linalg
from experiments.overhead.backends import BACKENDS, Instance, freeze_all_but_linear, probe_vector
from experiments.overhead.cases import QUANTITIES
from experiments.overhead.problems import PROBLEMS, TokenLogits
from experiments.overhead.timing import build_steps
from fixtures import zoo

curvlinops = pytest.importorskip("curvlinops")


def test_ggn_matvec_equals_curvlinops_in_float64():
    """Exact GGN @ v on a small MLP, both reductions: the same matrix, to rounding."""
    for reduction in ("mean", "sum"):
        problem = zoo.mlp(reduction)
        model, lossfunc = curvopt.extend(problem.model), curvopt.extend(problem.lossfunc)
        X, y = problem.make_batch(5)
        v = probe_vector(model)
        assert v.dtype == torch.float64
        mine = linalg.GGN(model, lossfunc, [(X, y)]) @ v.numpy()
        G = curvlinops.GGNLinearOperator(
            model, lossfunc, list(model.parameters()), [(X, y)], check_deterministic=False
        )
        theirs = (G @ v).numpy()
        np.testing.assert_allclose(mine, theirs, rtol=1e-10, atol=1e-12)
        assert np.abs(theirs).max() > 1e-3  # not trivially zero


def test_kflr_factors_equal_curvlinops_type2_in_float64():
    """KFLR against curvlinops' type-2 KFAC on an MLP: ``kron(B, A)`` per weight and ``B`` per
    bias are the same matrices (the factors' split of scale between B and A may differ)."""
    problem = zoo.mlp("mean")
    model, lossfunc = curvopt.extend(problem.model), curvopt.extend(problem.lossfunc)
    X, y = problem.make_batch(7)
    with curvopt.collect(ext.KFLR()):
        lossfunc(model(X), y).backward()
    op = curvlinops.KFACLinearOperator(
        model,
        lossfunc,
        list(model.parameters()),
        [(X, y)],
        check_deterministic=False,
        fisher_type="type-2",
    )
    op.compute_kronecker_factors()
    for name, module in model.named_children():
        if not isinstance(module, torch.nn.Linear):
            continue
        A, B = op._input_covariances[name], op._gradient_covariances[name]
        torch.testing.assert_close(torch.kron(*module.weight.kflr), torch.kron(B, A))
        torch.testing.assert_close(module.bias.kflr[0], B)


def test_backends_ggn_matvecs_agree_on_the_gpt():
    """The benchmark's two GGN_matvec steps compute the same product on the GPT decoder
    (curvlinops' under the unfused attention kernel), float32."""
    problem = PROBLEMS["gpt"].resized(2)
    quantity = QUANTITIES["GGN_matvec"]
    mine = BACKENDS["curvopt"].make_step(Instance.of(problem), quantity)()
    theirs = BACKENDS["curvlinops"].make_step(Instance.of(problem), quantity)()
    np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-3, atol=1e-5 * np.abs(mine).max())


def test_gpt_kfac_compares_on_the_linear_parameters():
    """curvlinops cannot do KFAC of embeddings and LayerNorm (n/a), so ``KFAC_linear`` freezes
    them and the output layer tied to the token embedding; both backends then run."""
    problem = PROBLEMS["gpt"].resized(2)
    model = problem.build()[0]
    freeze_all_but_linear(model)
    gpt = model.model
    assert not gpt.tok.weight.requires_grad and not gpt.ln_f.weight.requires_grad
    assert gpt.block.fc.weight.requires_grad and gpt.block.out.bias.requires_grad
    steps, failed = build_steps(problem, ["KFAC", "KFAC_linear"], ["curvopt", "curvlinops"])
    assert {("curvopt", "KFAC"), ("curvopt", "KFAC_linear"), ("curvlinops", "KFAC_linear")} <= set(
        steps
    )
    assert [(r.quantity, r.backend) for r in failed] == [("KFAC", "curvlinops")]
    assert failed[0].error.startswith("n/a: KFACLinearOperator")


def test_gpt_kflr_is_not_curvlinops_type2_below_the_attention():
    """Why the GPT's KFLR cell is marked ``≠`` (``cases.DIFFERENT_DEFINITIONS``): curvlinops'
    type-2 KFAC backpropagates the c-th loss-Hessian column of all rows together, so where
    attention mixes positions (qkv) it pairs the columns of different rows. On the layers
    above the attention the two are the same matrices; on qkv they differ, and curvlinops'
    own Monte-Carlo KFAC (whose cross-row terms vanish in expectation) approaches curvopt's
    KFLR, not its type-2 (float64)."""
    torch.manual_seed(0)
    model = curvopt.extend(TokenLogits(zoo.GPT(vocab=32, d=16, heads=2, t_max=6)).double())
    freeze_all_but_linear(model)
    lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
    X, y = torch.randint(32, (3, 6)), torch.randint(32, (18,))
    with curvopt.collect(ext.KFLR()):
        lossfunc(model(X), y).backward()
    params = [p for p in model.parameters() if p.requires_grad]

    def theirs(**options):
        op = curvlinops.KFACLinearOperator(
            model, lossfunc, params, [(X, y)], check_deterministic=False, **options
        )
        op.compute_kronecker_factors()
        return {
            n: torch.kron(op._gradient_covariances[n], op._input_covariances[n])
            for n in op._input_covariances
        }

    type2 = theirs(fisher_type="type-2")
    sampled = theirs(fisher_type="mc", mc_samples=1000, seed=1)
    block = model.model.block
    layers = {
        "attn.qkv": block.attn.qkv,
        "attn.proj": block.attn.proj,
        "fc": block.fc,
        "out": block.out,
    }
    relative = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    for name, layer in layers.items():
        mine = torch.kron(*layer.weight.kflr)
        differs = relative(type2[f"model.block.{name}"], mine)
        if name == "attn.qkv":
            assert differs > 0.3
            assert relative(sampled[f"model.block.{name}"], mine) < 0.1
            assert relative(sampled[f"model.block.{name}"], type2[f"model.block.{name}"]) > 0.3
        else:
            assert differs < 1e-12, name
