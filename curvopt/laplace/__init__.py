"""curvopt as a laplace-torch backend: ``Laplace(model, ..., backend=CurvoptGGN)``.

``CurvoptGGN`` (generalized Gauss-Newton, or its Monte-Carlo Fisher with ``stochastic=True``)
and ``CurvoptEF`` (empirical Fisher) implement laplace-torch 0.3's curvature interfaces:
``full``, ``kron`` and ``diag``, ``jacobians`` and ``gradients``, with laplace's own loss and
``factor``, ``subnetwork_indices``, last-layer use and dict (Hugging Face) batches. Optional:
``import curvopt`` does not import this module, and this module needs laplace-torch.
"""

try:
    import laplace  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "curvopt.laplace needs laplace-torch 0.3: pip install --no-deps laplace-torch==0.3 "
        "asdfghjkl==0.1a4, then pip install backpack-for-pytorch curvlinops-for-pytorch "
        "opt-einsum torchmetrics (laplace imports all its backends; torchvision is not needed)"
    ) from error

from curvopt.laplace.ef import CurvoptEF
from curvopt.laplace.ggn import CurvoptGGN
from curvopt.laplace.interface import CurvoptInterface

__all__ = ["CurvoptGGN", "CurvoptEF", "CurvoptInterface"]
