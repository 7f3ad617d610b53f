"""The damped Newton step as a chain of small stages (see :mod:`curvopt.optim.stages.base`).

:data:`NEWTON` is the chain every Newton optimizer runs by default; a stage is one module here
with a :class:`Stage` subclass (its ``order`` places it) and its instance in :data:`NEWTON`, or,
for one optimizer, ``stages=NEWTON.with_stage(MyStage())``.
"""

from curvopt.optim.stages.base import Chain, GroupStep, ParamStep, Preconditioner, Stage
from curvopt.optim.stages.curvature_ema import AverageCurvature
from curvopt.optim.stages.decoupled_weight_decay import DecoupledWeightDecay
from curvopt.optim.stages.eigenbasis import RefreshEigenbasis
from curvopt.optim.stages.eigenbasis_adam import EigenbasisAdam
from curvopt.optim.stages.learning_rate import ScaleByLearningRate
from curvopt.optim.stages.momentum import TraceMomentum
from curvopt.optim.stages.orthogonalize import Orthogonalize
from curvopt.optim.stages.precondition import Precondition
from curvopt.optim.stages.schedule_free import ScheduleFree
from curvopt.optim.stages.trust_region import ScaleByTrustRegion
from curvopt.optim.stages.weight_decay import AddWeightDecay

#: the damped Newton step of ``DiagGGNNewton``, ``KFAC`` and ``EKFAC``
NEWTON = Chain(
    (
        AddWeightDecay(),
        AverageCurvature(),
        Precondition(),
        ScaleByTrustRegion(),
        TraceMomentum(),
        Orthogonalize(),
        ScaleByLearningRate(),
        ScheduleFree(),
    )
)

#: ``EigenAdam``'s step: Adam in the eigenbasis of the averaged Kronecker factors
EIGEN_ADAM = Chain(
    (
        AverageCurvature(),
        RefreshEigenbasis(),
        EigenbasisAdam(),
        DecoupledWeightDecay(),
        ScaleByLearningRate(),
        ScheduleFree(),
    )
)

__all__ = [
    "EIGEN_ADAM",
    "NEWTON",
    "Orthogonalize",
    "AddWeightDecay",
    "AverageCurvature",
    "Chain",
    "DecoupledWeightDecay",
    "EigenbasisAdam",
    "GroupStep",
    "ParamStep",
    "Precondition",
    "Preconditioner",
    "RefreshEigenbasis",
    "ScaleByLearningRate",
    "ScaleByTrustRegion",
    "ScheduleFree",
    "Stage",
    "TraceMomentum",
]
