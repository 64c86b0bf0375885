"""A real local cluster for the process tests."""

from collections.abc import Iterator

import pytest

from kvpool.cluster.local import ClusterSpec, LocalCluster
from kvpool.store.services import ServiceError


def running_cluster(spec: ClusterSpec) -> Iterator[LocalCluster]:
    """`spec` brought up (the module skips where Redis is not installed), then taken down."""
    c = LocalCluster(spec)
    try:
        c.up(progress=lambda _: None)
    except ServiceError as e:
        pytest.skip(f"{e} (run scripts/install_remote_pools.sh)")
    yield c
    c.down()
