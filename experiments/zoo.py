"""Moved to :mod:`fixtures.zoo`; this name stays importable for code written against it."""

from fixtures.zoo import *  # noqa: F401,F403
