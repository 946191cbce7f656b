"""Emulated hosts for tests: network namespaces joined by shaped links (``tools/netlab.py``).

A plugin of the suite (``pytest_plugins`` in ``conftest.py``): any test may ask for its fixtures.
``make_lab(n)`` gives a :class:`netlab.Lab` of a leader and ``n`` workers for one test; ``module_labs(n)`` one
that the module's tests share. Each lab is closed in the fixture's finalizer, whether the test passed or failed:
its processes killed, its namespaces deleted. Where namespaces cannot be made (not root, no iproute2 or iptables)
the test is skipped, saying why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import netlab
import pytest


@functools.cache
def why_not() -> str | None:
    return netlab.unavailable()


def _make(labs: list[netlab.Lab], n: int) -> netlab.Lab:
    why = why_not()
    if why:
        pytest.skip(f"emulated hosts need network namespaces: {why}")
    lab = netlab.Lab(n)
    labs.append(lab)
    return lab


def _close(labs: list[netlab.Lab]) -> None:
    for lab in labs:
        lab.close()


@pytest.fixture
def make_lab() -> Iterator[Callable[[int], netlab.Lab]]:
    labs: list[netlab.Lab] = []
    try:
        yield functools.partial(_make, labs)
    finally:
        _close(labs)


@pytest.fixture(scope="module")
def module_labs() -> Iterator[Callable[[int], netlab.Lab]]:
    """Labs the module's tests share: ``module_labs(n)`` makes one the first time (later calls return it)."""
    labs: dict[int, netlab.Lab] = {}
    made: list[netlab.Lab] = []

    def get(n: int) -> netlab.Lab:
        if n not in labs:
            labs[n] = _make(made, n)
        return labs[n]

    try:
        yield get
    finally:
        _close(made)
