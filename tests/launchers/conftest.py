"""Fixtures of the launcher suite; the backends themselves are in :mod:`tests.launchers.harness`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.lineage.store import LineageStore, open_store
from tests.launchers.harness import BACKENDS, Harness, make_harness


@pytest.fixture
def store(openlab_home: Any) -> Iterator[LineageStore]:
    with open_store() as s:
        yield s


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest) -> Harness:
    return make_harness(request.param, request)


@pytest.fixture
def docker_harness(request: pytest.FixtureRequest) -> Harness:
    return make_harness("docker", request)


@pytest.fixture
def slurm_harness(request: pytest.FixtureRequest) -> Harness:
    return make_harness("slurm", request)


@pytest.fixture
def k8s_harness(request: pytest.FixtureRequest) -> Harness:
    return make_harness("kubernetes", request)
