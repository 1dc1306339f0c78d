"""API keys of the gateway: which tenant a key speaks for.

Keys are stored as their SHA-256 digest, never in clear: in the config
(``[[gateway.keys]]``) or in a keys file (``[gateway] keys_file``, lines of
``sha256:<64 hex> <tenant>``, ``#`` comments). A key made by
:func:`new_key` is 32 random bytes (256 bits), so a fast hash is the right
one: a slow password hash (bcrypt, scrypt, argon2) protects low-entropy
secrets that can be guessed, which these are not, and would cost its
milliseconds on every request; no salt is needed either, as no table of
precomputed digests covers 2**256 keys. A fast digest also lets a key be
looked up in one dictionary probe, so no comparison against the stored
digests runs in time that depends on how much of a guess matched.

A key never reaches a log line, an event, a metric or an error message:
only the tenant it maps to does.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

from ..config import GatewayConfig
from ..errors import ConfigError

__all__ = ["KeyStore", "digest", "new_key"]

#: The prefix of keys made here, so a leaked one is recognisable in a scan.
KEY_PREFIX: Final = "rq-"
_LINE = re.compile(r"^sha256:([0-9a-f]{64})\s+([A-Za-z0-9_-]{1,64})$")
#: Longer keys are refused unhashed (no digest of megabytes per request).
MAX_KEY_LENGTH: Final = 512


def digest(key: str) -> str:
    """The stored form of ``key``: its SHA-256, as 64 hex digits."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key() -> str:
    """A new API key: ``rq-`` and 256 random bits, URL-safe base64."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyStore:
    """Digest -> tenant, built once when the gateway starts."""

    def __init__(self, tenants_by_digest: Mapping[str, str]) -> None:
        self._tenants = dict(tenants_by_digest)

    def __len__(self) -> int:
        return len(self._tenants)

    def tenant_of(self, key: str) -> str | None:
        """The tenant ``key`` speaks for; ``None`` for an unknown key."""
        found = self.lookup(key)
        return None if found is None else found[1]

    def lookup(self, key: str) -> tuple[str, str] | None:
        """``key``'s digest and the tenant it speaks for; ``None`` for an unknown key."""
        if not key or len(key) > MAX_KEY_LENGTH:
            return None
        sha = digest(key)
        tenant = self._tenants.get(sha)
        return None if tenant is None else (sha, tenant)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self._tenants.values())

    @classmethod
    def from_config(cls, config: GatewayConfig) -> KeyStore:
        """The keys of ``config`` and of its keys file. Raises :class:`ConfigError`
        naming the file and line of a bad entry, or a digest given twice for
        different tenants."""
        pairs: list[tuple[str, str, str]] = [
            (key.sha256, key.tenant, f"$.gateway.keys[{index}]")
            for index, key in enumerate(config.keys)
        ]
        if config.keys_file is not None:
            pairs.extend(_read_keys_file(config.keys_file))
        return cls(_merge(pairs))


def _read_keys_file(path: str) -> Iterable[tuple[str, str, str]]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the keys file: {exc.strerror}", path="$.gateway.keys_file"
        ) from exc
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            # The line is not shown: it might be a key pasted in clear.
            raise ConfigError(
                f"{path}, line {number}: expected 'sha256:<64 hex digits> <tenant>'"
                " (store the key's digest, never the key: `renqueue gateway keygen TENANT`)",
                path="$.gateway.keys_file",
            )
        yield match.group(1), match.group(2), f"{path}:{number}"


def _merge(pairs: Iterable[tuple[str, str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for sha, tenant, where in pairs:
        if out.get(sha, tenant) != tenant:
            raise ConfigError(
                f"the same key digest is given for tenants {out[sha]!r} and {tenant!r} ({where})",
                path="$.gateway.keys",
            )
        out[sha] = tenant
    return out
