"""Tenants: whose cached pages a caller may see, decided by its credentials, never by a field.

A caller is in the tenant of the tenant token it sends (``x-kvserver-tenant`` metadata, tokens
listed in ``--tenant-tokens``), else in ``uid:<uid>`` of the process its peer ticket came from
(the fd socket reads it with SO_PEERCRED), else in ``anonymous`` (TCP with no tenant token).
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass, field

from kvserver.config import parse_size
from kvserver.errors import Unauthenticated
from kvserver.peers.tickets import PeerCred

TENANT_KEY = "x-kvserver-tenant"
ANONYMOUS = "anonymous"
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True, slots=True)
class TenantBook:
    """The tenant tokens (token -> tenant name) and each named tenant's own quota in bytes."""

    tokens: dict[bytes, str] = field(default_factory=dict)
    quotas: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, capacity: int, origin: str = "tenant tokens") -> TenantBook:
        """Lines ``name token [quota]`` (a quota is a size or a share of the budget, as
        --host-memory takes it); blank lines and lines starting with # are skipped."""
        tokens: dict[bytes, str] = {}
        quotas: dict[str, int] = {}
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            where = f"{origin} line {number}"
            if len(words) not in (2, 3):
                raise ValueError(f"{where}: expected 'name token [quota]', got {len(words)} fields")
            name, token = words[0], words[1]
            if not _NAME.fullmatch(name) or name.startswith("uid:") or name == ANONYMOUS:
                raise ValueError(f"{where}: tenant name {name!r} must be 1-64 of [A-Za-z0-9_.:-], "
                                 f"and not 'uid:...' or '{ANONYMOUS}' (those name callers without a token)")
            if len(token) < 16:
                raise ValueError(f"{where}: the token of {name} is {len(token)} characters; at least 16")
            if token.encode() in tokens:
                raise ValueError(f"{where}: this token is given to two tenants")
            tokens[token.encode()] = name
            if len(words) == 3:
                quota = words[2]
                try:
                    quotas[name] = parse_quota(quota, capacity)
                except ValueError as exc:
                    raise ValueError(f"{where}: quota {quota!r}: {exc}") from None
        return cls(tokens, quotas)

    @classmethod
    def load(cls, path: str, capacity: int) -> TenantBook:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read tenant tokens file {path}: {exc.strerror}") from None
        return cls.parse(text, capacity, path)

    def named(self, metadata) -> str | None:
        """The tenant of the call's tenant token; None without one. A token nobody was given is
        refused: a caller that meant a tenant must not silently land in another."""
        got = None
        for key, value in metadata or ():
            if key == TENANT_KEY:
                got = value.encode() if isinstance(value, str) else value
        if got is None:
            return None
        for token, name in self.tokens.items():  # constant time per token
            if hmac.compare_digest(got, token):
                return name
        raise Unauthenticated(f"unknown tenant token in {TENANT_KEY} metadata")


def parse_quota(text: str, capacity: int) -> int:
    """A quota: a size, or a share of the host memory budget ('25%'); at most the budget."""
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise ValueError(f"{text!r} is not a share like '25%'") from None
        if not 0 < share <= 100:
            raise ValueError(f"a share of the budget is above 0% and at most 100%, not {text!r}")
        return int(capacity * share / 100)
    return min(parse_size(text), capacity)


def tenant_of(named: str | None, peer: PeerCred | None) -> str:
    """A caller's tenant: its token's, else its uid's, else the anonymous one."""
    if named is not None:
        return named
    if peer is not None:
        return f"uid:{peer.uid}"
    return ANONYMOUS
