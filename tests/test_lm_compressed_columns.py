"""The prototype of ``benchmarks/lm_compressed_columns.py``: the exact KFLR output factor of a
decoder's ``qkv`` from ``T·min(d, V)`` columns per sample equals the one from ``T·V`` columns,
torch.func's full-Jacobian GGN block and curvopt's ``kflr``, in float64."""

import pytest
import torch
from torch import nn

import curvopt
from benchmarks.lm_compressed_columns import qkv_output_factor, reference_qkv_output_factor
from curvopt import extensions as ext
from fixtures.zoo import GPT


@pytest.mark.parametrize("vocab", [20, 5], ids=["d<V (compressed)", "V<d (kept)"])
def test_compressed_columns_give_the_exact_qkv_factor(vocab):
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=8, heads=2, t_max=4).double().eval()
    idx, y = torch.randint(vocab, (3, 4)), torch.randint(vocab, (3, 4))
    reference = reference_qkv_output_factor(model, idx)
    assert reference.abs().max() > 1e-3
    full = qkv_output_factor(model, idx, compress=False)
    compressed = qkv_output_factor(model, idx)
    torch.testing.assert_close(full, reference, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(compressed, reference, rtol=1e-10, atol=1e-14)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    loss = lossfunc(curvopt.extend(model)(idx).reshape(-1, vocab), y.reshape(-1))
    with curvopt.collect(ext.KFLR()):
        loss.backward()
    torch.testing.assert_close(
        model.block.attn.qkv.weight.kflr[0], reference, rtol=1e-10, atol=1e-14
    )
