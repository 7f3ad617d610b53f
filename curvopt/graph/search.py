"""Reading the autograd graph: the one graph search and the one read of a node's edges.

:func:`search` is the one walk over autograd nodes: every reader of the graph (the pass's
``walk.Walk``, the checkpoint stages and releases, the flow check's region, DiagHessian's and
KFRA's traversals, a returned loss's graph read at the forward) is a call of it with its own
``expand``. :func:`edges_of` is the one read of a node's edges (its ``next_functions``).
What holds for a graph's structure across passes is ``curvopt.core.plans``'s.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, Iterable, Tuple


def edges_of(node) -> tuple:
    """The edges of ``node``: ``(node it passes gradient to or None, output nr)`` pairs."""
    return node.next_functions


def search(starts: Iterable, expand: Callable[[object], Iterable], seen=None) -> dict:
    """Depth-first from ``starts``, each node once (``None`` skipped): ``expand(node)`` gives the
    nodes to go on to (empty: stop there). Returns ``{node: expand(node)}`` in visiting order
    (``seen``: such a dict of nodes not to visit again, updated in place)."""
    seen = {} if seen is None else seen
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = nexts = expand(node)
        stack.extend(nexts)
    return seen


def upstream(node) -> list:
    """The nodes ``node`` passes gradient to (``None`` for constants)."""
    return [fn for fn, _ in edges_of(node)]


def reaches(start, node, done: dict) -> bool:
    """Whether ``node`` lies upstream of ``start``, walking on from ``done`` (the nodes whose
    whole upstream was walked already, updated here)."""
    if node in done:
        return True
    search([start], upstream, done)
    return node in done


def read_down(root, expand) -> Tuple[Dict[object, tuple], Dict[object, int]]:
    """A loss's own graph, read from its output node ``root`` before any backward
    (``recognize``): ``expand(node, state, inputs)`` (``inputs``: the nodes ``node`` passes
    gradient to, None for a constant) gives the state to walk ``inputs`` with, or None to stop
    at ``node`` (``root`` is walked with state None). Returns the inputs of every node expanded
    and how many expanded nodes feed each node."""
    inputs: Dict[object, tuple] = {}
    consumers: Dict[object, int] = defaultdict(int)
    states = {root: None}  # the state a node is walked with: that of its latest push

    def down(node):
        nexts = tuple(upstream(node))
        below = expand(node, states[node], nexts)
        if below is None:
            return ()
        inputs[node] = nexts
        for fn in nexts:
            if fn is not None:
                consumers[fn] += 1
                states[fn] = below
        return nexts

    search([root], down)
    return inputs, dict(consumers)
