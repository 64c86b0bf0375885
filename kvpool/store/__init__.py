"""Tiered KV store (Mooncake Store / LMCache role): host, disk and remote tiers of KV blocks."""

from kvpool.store.disk import DiskTier
from kvpool.store.factory import make_remote_tier, make_store
from kvpool.store.format import (
    CorruptBlock,
    block_namespace,
    block_shape,
    decode_block,
    encode_block,
)
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.tier import StoreKey, Tier, TierStats

__all__ = [
    "CorruptBlock", "DiskTier", "HostTier", "StoreKey", "Tier", "TierStats", "TieredKVStore",
    "block_namespace", "block_shape", "decode_block", "encode_block", "make_remote_tier",
    "make_store",
]
