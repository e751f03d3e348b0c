"""Reclaiming what dead clients held.

A client is alive while it holds a Session stream open. When the stream ends (the engine exited,
was killed, or lost its connection), the client gets ``grace`` seconds to open a new one; after
that the reaper unregisters it: copies in flight finish, then its host region, shared-memory
mappings and pages are released. A client that never opened a Session survives ``lease`` seconds
after its last call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from kvserver.client_state import ClientState
from kvserver.core import KVCore

logger = logging.getLogger(__name__)


class Reaper:
    def __init__(self, core: KVCore, lease: float, grace: float) -> None:
        self.core = core
        self.lease = lease
        self.grace = grace
        self.tick = max(0.02, min(lease, grace, 1.0) / 10)
        self._task: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def session(self, client: ClientState) -> AsyncIterator[None]:
        client.sessions += 1
        try:
            yield
        finally:
            client.sessions -= 1
            client.session_ended_at = time.monotonic()

    def expired(self, client: ClientState, now: float) -> str | None:
        """Why the client is to be reclaimed now, or None."""
        if client.sessions or client.closing:
            return None
        if client.session_ended_at is not None:
            if now - client.session_ended_at >= self.grace:
                return f"session ended {now - client.session_ended_at:.1f} s ago"
            return None
        if now - client.last_seen >= self.lease:
            return f"no session and no call for {now - client.last_seen:.1f} s"
        return None

    async def reap_once(self) -> None:
        now = time.monotonic()
        for client_id, client in list(self.core.clients.items()):
            why = self.expired(client, now)
            if why is not None:
                logger.warning("reclaiming client %s: %s", client_id, why)
                self.core.reclaimed += 1
                await self.core.unregister(client_id, reason="reclaimed")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            try:
                await self.reap_once()
            except Exception:
                logger.exception("reaper pass failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
