"""Session-scoped real servers for the remote tier tests, on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from store_helpers import serve

from kvpool.store.services import LocalService, mooncake_master_service, redis_service


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    yield from serve(redis_service(log_path=Path(tmp_path_factory.mktemp("redis")) / "redis.log"))


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalService]:
    log = Path(tmp_path_factory.mktemp("mooncake")) / "master.log"
    yield from serve(mooncake_master_service(log_path=log))
