"""Real services shared by every test package, started once per session on free loopback ports."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.store.services import LocalService, ServiceError, mooncake_master_service, redis_service


def _serve(service: LocalService) -> Iterator[LocalService]:
    try:
        service.start()
    except ServiceError as e:
        if os.environ.get("CI"):
            raise  # CI installs every service: a missing one is a failure, not a skip
        pytest.skip(f"{e} (run scripts/install_remote_pools.sh)")
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    yield from _serve(redis_service(log_path=Path(tmp_path_factory.mktemp("redis")) / "redis.log"))


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    yield from _serve(mooncake_master_service(log_path=Path(tmp_path_factory.mktemp("mooncake")) / "master.log"))
