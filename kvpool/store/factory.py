"""Build a TieredKVStore from the CLI flags --kv-host-memory, --kv-disk-path, --kv-disk-size,
--kv-remote URL, --kv-write-policy and the per-tier codecs --kv-disk-codec, --kv-remote-codec."""

from __future__ import annotations

import numpy as np

from kvpool.errors import ConfigError
from kvpool.sizes import parse_bytes
from kvpool.store.codec import get_codec
from kvpool.store.disk import DiskTier
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.tier import Tier


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
    disk_codec: str = "none",
    remote_codec: str = "none",
) -> TieredKVStore | None:
    """The configured tiers (host, disk, remote; each optional) as one store; None if none is.
    The host tier stores raw bytes (compressing DRAM copies costs more than it saves)."""
    get_codec(disk_codec, "--kv-disk-codec")  # refused before any tier is built
    get_codec(remote_codec, "--kv-remote-codec")
    tiers: list[Tier] = []
    codecs: dict[str, str] = {}
    host = parse_bytes(host_bytes, "--kv-host-memory")
    if host > 0:
        tiers.append(HostTier(host, eviction_policy))
    if disk_path:
        disk = parse_bytes(disk_bytes, "--kv-disk-size")
        if disk <= 0:
            raise ConfigError(f"--kv-disk-path {disk_path!r} needs a positive --kv-disk-size, got {disk_bytes!r}")
        tiers.append(DiskTier(disk_path, disk, eviction_policy))
        codecs[tiers[-1].name] = disk_codec
    if remote_url:
        tiers.append(make_remote_tier(remote_url))
        codecs[tiers[-1].name] = remote_codec
    if not tiers:
        return None
    return TieredKVStore(tiers, namespace, block_shape, dtype, write_policy, codecs=codecs)
