"""One file maps each ``Producer`` to its implementation (``engine/producers.py``), and nothing
else in curvopt branches on the producer: outside the declarations (``extensions/``) no module
names a ``Producer`` member, so a new producer is added in one table row and its engine parts."""

import ast
import pathlib

import pytest

import curvopt
from curvopt import extensions as ext
from curvopt.engine.producers import TABLE, Implementation, coupled_estimate
from curvopt.extensions.quantity import Producer

ROOT = pathlib.Path(curvopt.__file__).parent

#: the declarations name their producer; the table maps it
DECLARING = ("extensions/",)
TABLE_FILE = "engine/producers.py"


def _producer_members(source: str) -> list:
    """The lines of ``source`` that name a ``Producer`` member (``Producer.X``, or ``X``
    imported from ``Producer`` through an alias)."""
    tree = ast.parse(source)
    members = set(Producer.__members__)
    aliases = {"Producer"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            if node.value.id in aliases:
                aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in members
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
    ]


def test_the_check_sees_a_planted_branch():
    planted = (
        "from curvopt.extensions.quantity import Producer\n\n"
        "def run(ext):\n    if ext.quantity.producer is Producer.KFRA:\n        return 1\n"
    )
    assert _producer_members(planted) == [4]
    aliased = "P = Producer\n\ndef f(e):\n    return e in (P.KRONECKER, P.EIGEN_CORRECTED)\n"
    assert _producer_members(aliased) == [4, 4]
    assert _producer_members("def f(made):\n    return made.walks\n") == []


def test_only_the_table_names_a_producer():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == TABLE_FILE or relative.startswith(DECLARING):
            continue
        lines = _producer_members(path.read_text())
        if lines:
            found[relative] = lines
    assert not found, found


def test_every_producer_has_one_row():
    assert list(TABLE) == list(Producer)
    assert all(isinstance(made, Implementation) for made in TABLE.values())
    assert len({id(made) for made in TABLE.values()}) == len(Producer)
    with pytest.raises(TypeError):
        TABLE[Producer.KFRA] = Implementation()  # the table is read-only


def test_every_declared_quantity_is_computed_by_some_part():
    """A row names at least one part that computes (a reduction, columns or a walk)."""
    for producer, made in TABLE.items():
        assert made.reduces or made.bases or made.columns or made.after, producer
        assert made.columns in (None, "diagonal", "factors"), producer
        if made.reduces:
            assert producer.order == 1 and made.columns is None, producer
        if made.columns or made.after:
            assert producer.order == 2, producer
        assert (made.after is not None) == made.walks, producer


@pytest.mark.parametrize(
    "extension, expected",
    [
        (ext.DiagGGNMC(), True),
        (ext.KFAC(), True),
        (ext.EKFAC(), True),
        (ext.DiagGGNExact(), True),  # exact columns of one loss row each
        (ext.KFLR(), True),
        (ext.KFACEmpirical(), False),  # the empirical column: no loss-Hessian root
        (ext.BatchDiagGGNMC(), False),  # per sample: not defined where samples mix
        (ext.KFRA(), False),
        (ext.DiagHessian(), False),
    ],
)
def test_coupled_estimates_follow_the_table(extension, expected):
    assert coupled_estimate(extension) is expected
