"""Build a TieredKVStore from the CLI flags --kv-host-memory, --kv-disk-path, --kv-disk-size,
--kv-remote URL and --kv-write-policy."""

from __future__ import annotations

import re

import numpy as np

from kvpool.errors import ConfigError
from kvpool.store.disk import DiskTier
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.tier import Tier

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from `1073741824`, `512MiB`, `4GB`, `1.5g` (case-insensitive)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}; expected e.g. 512MiB, 4GB or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def make_remote_tier(url: str) -> Tier:
    """RedisTier for redis:// and rediss:// URLs, MooncakeTier for mooncake://."""
    if url.startswith(("redis://", "rediss://")):
        from kvpool.store.remote_redis import RedisTier

        return RedisTier(url)
    if url.startswith("mooncake://"):
        from kvpool.store.remote_mooncake import MooncakeTier

        return MooncakeTier(url)
    raise ConfigError(f"unknown KV pool URL {url!r}; expected redis://host:port or mooncake://host:port")


def make_store(
    host_bytes: int | str,
    disk_path: str | None,
    disk_bytes: int | str,
    remote_url: str | None,
    write_policy: str,
    namespace: str,
    block_shape: tuple[int, ...],
    dtype: np.dtype | str,
    eviction_policy: str = "lru",
) -> TieredKVStore | None:
    """The configured tiers (host, disk, remote; each optional) as one store; None if none is."""
    tiers: list[Tier] = []
    host = parse_size(host_bytes)
    if host > 0:
        tiers.append(HostTier(host, eviction_policy))
    if disk_path:
        disk = parse_size(disk_bytes)
        if disk <= 0:
            raise ConfigError(f"--kv-disk-path {disk_path!r} needs a positive --kv-disk-size, got {disk_bytes!r}")
        tiers.append(DiskTier(disk_path, disk, eviction_policy))
    if remote_url:
        tiers.append(make_remote_tier(remote_url))
    if not tiers:
        return None
    return TieredKVStore(tiers, namespace, block_shape, dtype, write_policy)
