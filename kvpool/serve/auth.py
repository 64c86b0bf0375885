"""API keys, tenants and the cluster key: one place that says who may call what.

Every route except the open ones (`/health` and its alias `/ping`, which probes call without a
key and which say only "up or not", and `/metrics` with `--metrics-open`) depends on
`KeyRing.api_key` (`/version` too: vLLM leaves it open, but a version names the bugs to try); a cluster member's `/internal/*` routes depend on `KeyRing.cluster_key`.
Cache-control routes depend on `KeyRing.admin_scope`: a tenant's key acts on its own namespace
only, the admin key (`--admin-api-key`) and the cluster key (the conductor's cluster pins) on
the whole server.
Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every key (no early
exit), so neither the key's bytes nor its length nor which key matched shows in the timing.

Each API key is a tenant. Its requests hash their KV blocks under a salt derived from the key,
so one tenant can never hit (and so never probe, through `cached_tokens` or latency) another
tenant's cached prefix, unless both opt into the shared cache with `"cache_scope": "shared"`.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from kvpool.errors import ConfigError
from kvpool.serve.errors import Unauthenticated

CLUSTER_KEY_ENV = "KVPOOL_CLUSTER_KEY"
ADMIN_KEY_ENV = "KVPOOL_ADMIN_API_KEY"


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who sent a request: `salt` is derived from the key (never the key itself)."""

    salt: str

    def owns(self, salt: str | None) -> bool:
        """Whether a block hashed under `salt` is in this tenant's namespace (its own salt, alone
        or combined with a request's cache_salt; never the shared scope's)."""
        return salt is not None and (salt == self.salt or salt.startswith(self.salt + "/"))


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def _bearer(request: Request) -> bytes | None:
    return bearer_token(request.headers.get("authorization"))


def bearer_token(header: str | None) -> bytes | None:
    """The token of `Authorization: Bearer <token>` as raw bytes (any bytes are fine: no 500)."""
    if header is None:
        return None
    raw = header.encode("latin-1")  # starlette decodes header bytes as latin-1: this is lossless
    scheme, _, token = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return token.strip()


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The API keys (as digests, each with its tenant), the cluster key and the admin key (digests)."""

    api_keys: tuple[tuple[bytes, Tenant], ...] = ()
    cluster: bytes | None = None
    metrics_open: bool = False
    admin: bytes | None = None

    @classmethod
    def build(cls, api_keys: Sequence[str] = (), cluster_key: str | None = None,
              metrics_open: bool = False, admin_key: str | None = None) -> KeyRing:
        keys = []
        for key in api_keys:
            if not key:
                raise ConfigError("an API key may not be empty")
            raw = key.encode()
            salt = "tenant-" + hmac.new(b"kvpool tenant salt", raw, hashlib.sha256).hexdigest()[:24]
            keys.append((_digest(raw), Tenant(salt)))
        if cluster_key == "":
            raise ConfigError("the cluster key may not be empty")
        if admin_key == "":
            raise ConfigError("the admin API key may not be empty")
        if admin_key is not None and admin_key in api_keys:
            raise ConfigError("the admin API key must differ from every --api-key (a tenant's key acts on "
                              "its own namespace only)")
        return cls(tuple(keys), _digest(cluster_key.encode()) if cluster_key else None, metrics_open,
                   _digest(admin_key.encode()) if admin_key else None)

    @property
    def open(self) -> bool:
        """No API key configured: every route is open (for a server on loopback only)."""
        return not self.api_keys

    def tenant(self, token: bytes | None) -> Tenant | None:
        if token is None:
            return None
        given = _digest(token)
        found = None
        for digest, tenant in self.api_keys:  # all of them, so timing does not tell which matched
            if hmac.compare_digest(given, digest):
                found = tenant
        return found

    # -- FastAPI dependencies --------------------------------------------------------------
    def api_key(self, request: Request) -> None:
        """Sets `request.state.tenant` (None when the server has no keys)."""
        request.state.tenant = None
        if self.open:
            return
        tenant = self.tenant(_bearer(request))
        if tenant is None:
            raise Unauthenticated("missing or invalid API key (send Authorization: Bearer <key>)")
        request.state.tenant = tenant

    def cluster_key(self, request: Request) -> None:
        """The cluster key when one is set; otherwise the same rule as the API routes."""
        if self.cluster is None:
            self.api_key(request)
            return
        token = _bearer(request)
        if token is None or not hmac.compare_digest(_digest(token), self.cluster):
            raise Unauthenticated("missing or invalid cluster key (the conductor's --cluster-key)")

    def recognises(self, token: bytes | None) -> bool:
        """Whether the token is any key of this server (API, cluster or admin): what `KeyGate` asks
        before routing; each route then checks the key it needs."""
        if token is None:
            return False
        given = _digest(token)
        known = [d for d, _ in self.api_keys] + [d for d in (self.cluster, self.admin) if d is not None]
        return sum(hmac.compare_digest(given, d) for d in known) > 0  # every one compared, no early exit

    def is_admin(self, token: bytes | None) -> bool:
        return self.admin is not None and token is not None and hmac.compare_digest(_digest(token), self.admin)

    def admin_scope(self, request: Request) -> Tenant | None:
        """Who a whole-server operation acts for: None for the whole server (the admin key, the
        cluster key: the conductor, which already scopes `cache_salt` to its tenants as on
        /internal/generate, or a server with no key at all), else the calling tenant, whose
        namespace alone it may touch."""
        token = _bearer(request)
        admin = self.is_admin(token)
        conductor = self.cluster is not None and token is not None and hmac.compare_digest(_digest(token), self.cluster)
        if admin or conductor:
            return None
        if self.open and self.admin is None:
            return None
        tenant = self.tenant(token)
        if tenant is None:
            raise Unauthenticated("missing or invalid API key (send Authorization: Bearer <key>; "
                                  "whole-server operations need the --admin-api-key)")
        return tenant

    def metrics(self, request: Request) -> None:
        """Whole-server counters: open with --metrics-open, else any API key or the admin key."""
        if not self.metrics_open and not self.is_admin(_bearer(request)):
            self.api_key(request)


def effective_salt(tenant: Tenant | None, cache_salt: str | None, scope: str) -> str | None:
    """The prefix-cache salt a request's blocks are hashed with."""
    if tenant is None or scope == "shared":
        return cache_salt
    return tenant.salt if cache_salt is None else f"{tenant.salt}/{cache_salt}"


def request_salt(request: Request, cache_salt: str | None, scope: str) -> str | None:
    return effective_salt(getattr(request.state, "tenant", None), cache_salt, scope)


# -- flags, shared by `kvpool serve` and `kvpool conductor` ----------------------------------
def add_auth_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require `Authorization: Bearer KEY` on every route but /health (repeat for "
                            "several tenants; each key gets its own prefix-cache namespace)")
    group.add_argument("--api-keys-file", default=None, metavar="PATH",
                       help="more API keys, one per line (# starts a comment)")
    group.add_argument("--cluster-key", default=os.environ.get(CLUSTER_KEY_ENV), metavar="KEY",
                       help=f"the key the conductor and its instances share for /internal routes "
                            f"(default: ${CLUSTER_KEY_ENV}; without it /internal needs an API key)")
    group.add_argument("--metrics-open", action="store_true",
                       help="serve /metrics without the API key (default: behind it when keys are set)")


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """--api-key values and the lines of --api-keys-file."""
    keys = list(args.api_key)
    if args.api_keys_file:
        path = Path(args.api_keys_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"--api-keys-file {path}: {e.strerror or e}") from e
        keys += [s for line in lines if (s := line.split("#", 1)[0].strip())]
        if not keys:
            raise ConfigError(f"--api-keys-file {path} holds no key")
    return keys


def keyring_from_args(args: argparse.Namespace) -> KeyRing:
    """`kvpool serve`'s keys (the conductor adds its own `--admin-api-key`, for its cluster pins)."""
    return KeyRing.build(api_keys_from_args(args), args.cluster_key, args.metrics_open,
                         getattr(args, "admin_api_key", None))
