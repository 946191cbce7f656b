"""Test configuration: hypothesis profiles, a shared CPU backend, the graph helper, the install kept as found."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from helpers import assert_same_bits, compute
from hypothesis import HealthCheck, settings

import ggml_hybrid as gh

pytest_plugins = ["netns"]  # emulated hosts: the make_lab and module_labs fixtures

# ci: reproducible (derandomized) and small enough for 2 cores; dev: more examples, random seeds
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (builds, installs)")


def pytest_collection_modifyitems(config, items):
    # slow tests (wheel and sdist builds into fresh environments) stay out of CI's default run
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


NATIVE = Path(gh.__file__).resolve().parent / "_native"


def native_libraries() -> dict[str, str]:
    """The package's compiled files (the cffi module, GGML's libraries, optional backends, the stub) by sha256."""
    files = [p for p in NATIVE.rglob("*") if p.is_file() and (".so" in p.suffixes or p.suffix == ".pyi")]
    return {p.relative_to(NATIVE).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(files)}


@pytest.fixture(scope="session", autouse=True)
def install_kept_as_found():
    """The suite never changes the user's install: a test that exercises the build builds in a copy or a
    temporary folder. Fails the run (an error at the last test's teardown) if any compiled file of the package
    was added, removed or changed, whatever backends the checkout was built with."""
    before = native_libraries()
    yield
    after = native_libraries()
    changed = sorted(n for n in before.keys() & after.keys() if before[n] != after[n])
    removed, added = sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys())
    if changed or removed or added:
        pytest.fail(f"the suite changed the package's compiled files in {NATIVE}: removed {removed}, added {added}, "
                    f"changed {changed}; a test that builds must build in a copy", pytrace=False)


@pytest.fixture(scope="session")
def cpu_backend():
    backend = gh.cpu(2)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def twin_backend():
    """The backend of the library named by GGML_HYBRID_OPS_TWIN (tests/test_pin_backend.py names the unpatched pin's
    CPU backend), or None."""
    path = os.environ.get("GGML_HYBRID_OPS_TWIN")
    if not path:
        yield None
        return
    backend = gh.ggml.backend.backend_from_library(path, n_threads=2)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def run(cpu_backend, twin_backend):
    """``run(build, consts=..., inputs=...)``: compute a graph on the CPU backend, return numpy outputs. With
    GGML_HYBRID_OPS_TWIN set, the graph is also computed on that library's backend and must give the same bits."""

    def _run(build, consts=None, inputs=None, graph_size: int = 256):
        out = compute(cpu_backend, build, consts, inputs, graph_size)
        if twin_backend is not None:
            assert_same_bits(out, compute(twin_backend, build, consts, inputs, graph_size))
        return out

    return _run
