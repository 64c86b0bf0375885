"""Chained block hashes: one identity for a full KV block in every tier and in the simulator.

hash(block i) = H(hash(block i-1) || tokens of block i || extra keys). The first block's
parent is a seed derived from the namespace (model identity), so two models never share;
a request's `cache_salt` enters the first block, and by chaining every later one. H is
BLAKE2b-128 over a fixed little-endian encoding: stable across processes and restarts
(Python's `hash()` is salted per process) and collision-safe between tenants. A LoRA adapter's
identity joins the salt (`adapter_salt`), so its blocks never meet the base model's or another
adapter's in any cache, tier, index or event.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvpool.errors import InvalidRequest

BlockHash = bytes | int
_DIGEST = 16
# A fresh H state: copying an empty one skips the constructor's keyword parsing, a fifth of
# the cost of hashing one block (the simulator hashes millions).
new_hash = hashlib.blake2b(digest_size=_DIGEST).copy


def root_hash(namespace: str = "") -> BlockHash:
    """The parent of every sequence's first block in `namespace`."""
    return hashlib.blake2b(b"kvpool-block-v1\x00" + namespace.encode(), digest_size=_DIGEST).digest()


def key_bytes(key: BlockHash) -> bytes:
    """A key as bytes, to chain or tag: a digest as it is, an interned int (below 2**64) as 16
    little-endian bytes, which a digest equals only by a 2**-64 chance."""
    return key if isinstance(key, bytes) else key.to_bytes(_DIGEST, "little")


# Whether the host's "q" arrays need a byte swap for the little-endian encoding (checked once,
# not per block: the simulator hashes every decode block it fills).
_SWAP = array("q").itemsize != 8 or array("q", [1]).tobytes()[0] != 1


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("q", tokens)
    if _SWAP:  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def chain_hashes(parent: BlockHash, data: bytes, block_size: int, extra: bytes = b"") -> list[BlockHash]:
    """The chained-hash loop, the one every caller runs: hashes of each full block of `data`
    (tokens as little-endian int64, `block_size` per block) from `parent` on; `extra` key
    bytes enter the first block. A trailing partial block is not hashed."""
    step = 8 * block_size
    out: list[BlockHash] = []
    for i in range(0, len(data) - step + 1, step):
        h = new_hash()
        h.update(parent + data[i : i + step])
        if extra:
            h.update(b"\x00extra\x00" + extra)
            extra = b""
        parent = h.digest()
        out.append(parent)
    return out


def hash_blocks(
    tokens: Sequence[int],
    block_size: int,
    namespace: str = "",
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
    limit: int | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of `tokens` (at most `limit` blocks in all), from block
    `start_block` on.

    `parent` is the key of block `start_block - 1` (None means the root of `namespace`),
    which lets a caller extend a sequence's hashes without rehashing its prefix. The salt
    enters block 0 only.
    """
    parent = root_hash(namespace) if parent is None else key_bytes(parent)
    end = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    if end <= start_block:
        return []
    salt = cache_salt.encode() if cache_salt and start_block == 0 else b""
    return chain_hashes(parent, _token_bytes(tokens[start_block * block_size : end * block_size]), block_size, salt)


# What separates a request's own salt from an adapter's identity: a NUL, which `check_salt`
# refuses in every request's salt, so no salt a client sends can equal an adapter's.
_ADAPTER_TAG = "\x00lora:"


def check_salt(cache_salt: str | None) -> None:
    """Refuse a salt that could pose as an adapter's (`adapter_salt`)."""
    if cache_salt is not None and "\x00" in cache_salt:
        raise InvalidRequest("cache_salt may not contain NUL characters", param="cache_salt")


def adapter_salt(cache_salt: str | None, adapter_key: str) -> str:
    """The salt a request served through the LoRA adapter `adapter_key` (a stable digest of its
    name and files) hashes its blocks under. The request's own salt stays the prefix, joined by
    "/" as a tenant's is, so a tenant still owns its adapter blocks (`Tenant.owns`)."""
    check_salt(cache_salt)
    return (f"{cache_salt}/" if cache_salt else "") + _ADAPTER_TAG + adapter_key
