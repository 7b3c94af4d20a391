"""Plain data shared by the cache policy and every tier: namespaces and block metadata."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from .hashing import CACHE_FORMAT_VERSION, BlockHash, namespace_root

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

DEFAULT_TENANT = "default"


def validate_tenant(tenant: str) -> str:
    """Tenants name folders on disk: keep them to a safe alphabet."""
    if not isinstance(tenant, str) or not _SAFE_NAME.match(tenant):
        raise ValueError(
            "tenant must be 1-128 characters of letters, digits, '.', '_' or '-' "
            f"and start with a letter or digit, got {tenant!r}"
        )
    return tenant


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that decides whether two requests may share cached state."""

    model_fingerprint: str
    block_size: int
    kv_spec: str = "float32"
    tenant: str = DEFAULT_TENANT
    format_version: int = CACHE_FORMAT_VERSION
    root: BlockHash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        validate_tenant(self.tenant)
        object.__setattr__(
            self,
            "root",
            namespace_root(
                model_fingerprint=self.model_fingerprint,
                block_size=self.block_size,
                kv_spec=self.kv_spec,
                tenant=self.tenant,
                format_version=self.format_version,
            ),
        )

    @property
    def key(self) -> str:
        """A short stable id of the namespace (hex), e.g. for folder names."""
        return self.root.hex()[:16]

    def with_tenant(self, tenant: str) -> Namespace:
        return Namespace(
            self.model_fingerprint, self.block_size, self.kv_spec, tenant, self.format_version
        )


@dataclass(frozen=True, slots=True)
class ExtraKeySpan:
    """Extra hash input for tokens ``[start, end)`` (an image digest), in overlapping blocks."""

    start: int
    end: int
    key: bytes

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"extra key span must satisfy 0 <= start < end, got [{self.start}, {self.end})")
        if not isinstance(self.key, bytes) or not self.key:
            raise ValueError("extra key must be non-empty bytes")


def extra_keys_for(spans: Sequence[ExtraKeySpan], start: int, end: int) -> tuple[bytes, ...]:
    """Extra keys of the block covering ``[start, end)``: spans overlapping it, in order."""
    return tuple(s.key for s in spans if s.start < end and s.end > start)


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What every tier knows about a stored block without reading its payload.

    A partial block is always a tail. Not ``truncatable``: restorable only at its end, with a
    ``snapshot``."""

    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    start: int
    extra_keys: tuple[bytes, ...] = ()
    nbytes: int = 0
    truncatable: bool = True
    snapshot: bool = True
    namespace_key: str = ""
    tenant: str = DEFAULT_TENANT

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def restorable_at_end(self) -> bool:
        return self.truncatable or self.snapshot
