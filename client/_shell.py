"""What both client shells show of their core: settings, registration state and counters."""

from __future__ import annotations

from kvclient import _messages as msg
from kvclient.core import ClientCore


class CoreShell:
    _core: ClientCore

    @property
    def target(self) -> str:
        return self._core.target

    @property
    def timeout(self) -> float:
        return self._core.timeout

    @property
    def resilient(self) -> bool:
        return self._core.resilient

    @property
    def registration(self) -> msg.Registration | None:
        return self._core.registration

    @registration.setter
    def registration(self, reg: msg.Registration | None) -> None:
        self._core.registration = reg

    @property
    def connected(self) -> bool:
        return self._core.connected

    @connected.setter
    def connected(self, value: bool) -> None:
        self._core.connected = value

    @property
    def misses(self) -> int:
        return self._core.misses

    @property
    def reconnects(self) -> int:
        return self._core.reconnects

    @property
    def client_id(self) -> str:
        return self._core.client_id
