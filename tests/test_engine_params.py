"""The modules of a parameter come from the parameter (``params``): ``owners`` and ``tied``
ask the modules ``extend`` found holding it, not every extended model in the process, and a
freed parameter leaves no entry behind. There is no list of every extended model to scan: what
``extend`` installed is kept per object (``curvopt.core.extended``)."""

import gc
import weakref

import torch
from torch import nn

import curvopt
from curvopt.core import extended, params


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight  # tied before extend
        self.mid = nn.Linear(4, 4)


def test_owners_and_tied_read_the_parameters_not_the_extended_models():
    model = curvopt.extend(_Tied())
    other = curvopt.extend(nn.Linear(4, 4))  # another model in the process
    found = params.owners(list(model.parameters()))
    assert found[id(model.mid.weight)] == (model.mid, "weight")
    assert found[id(model.mid.bias)] == (model.mid, "bias")
    assert found[id(model.emb.weight)] == (model.emb, "weight")  # the first holder
    assert id(other.weight) not in found
    assert params.tied(model.emb.weight)
    assert not params.tied(model.mid.weight) and not params.tied(other.weight)


def test_a_parameter_that_a_module_no_longer_owns_is_not_its():
    model = curvopt.extend(_Tied())
    old = model.mid.weight
    model.mid.weight = nn.Parameter(torch.zeros(4, 4))
    assert id(old) not in params.owners([old])


def test_a_freed_parameter_leaves_no_entry():
    """The table drops a parameter's entry when the parameter is freed (keyed by ``id``: the
    entries of other tests' parameters, freed meanwhile, may go too, so only these are read)."""
    layer = curvopt.extend(nn.Linear(3, 2))
    keys = {id(p) for p in layer.parameters()}
    assert keys <= set(extended._PARAMETERS._data)
    assert [ref() for ref in extended.entry_of(layer.weight).holders] == [layer]
    freed = [weakref.ref(p) for p in layer.parameters()]
    del layer
    gc.collect()
    assert all(ref() is None for ref in freed)
    assert not keys & set(extended._PARAMETERS._data)


def test_unextend_takes_the_modules_off_their_parameters():
    model = curvopt.extend(_Tied())
    curvopt.unextend(model.head)  # the tied weight stays the embedding's
    assert params.owners([model.emb.weight])[id(model.emb.weight)] == (model.emb, "weight")
    assert not params.tied(model.emb.weight)
    curvopt.unextend(model)
    assert params.owners(list(model.parameters())) == {}
    assert all(extended.entry_of(p) is None for p in model.parameters())
