"""Reclaiming what dead clients held.

A client is alive while it holds a Session stream open. When the stream ends (the engine exited,
was killed, or lost its connection), the client gets ``grace`` seconds to open a new one; after
that the reaper unregisters it: copies in flight finish, then its host region, shared-memory
mappings and pages are released. A client that never opened a Session survives ``lease`` seconds
after its last call. A client whose GPU work outlived the daemon's wait limit is reclaimed at once.

Each reclaim runs as its own task: a release that cannot finish (a GPU that never lets go) holds
up nobody else's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from kvserver.core.client_state import ClientState, public_id
from kvserver.core.kvcore import KVCore
from kvserver.errors import UnknownClient
from kvserver.peers.tickets import process_exited

logger = logging.getLogger(__name__)


class Reaper:
    def __init__(self, core: KVCore, lease: float, grace: float) -> None:
        self.core = core
        self.lease = lease
        self.grace = grace
        self.tick = max(0.02, min(lease, grace, 1.0) / 10)
        self._task: asyncio.Task | None = None
        self._reclaims: dict[str, asyncio.Task] = {}  # client id -> its reclaim, while it runs
        self._failed: set[str] = set()  # clients whose check failed (logged once)

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
        if client.closing:
            return None
        failed = client.device.failed or client.device.plane_failed()
        if failed:
            return failed
        if client.sessions:
            return None
        if client.session_ended_at is None and client.pidfd >= 0 and process_exited(client.pidfd):
            client.session_ended_at = now  # its process is gone: no Session will come
        if client.session_ended_at is not None:
            if now - client.session_ended_at >= self.grace:
                return f"session ended {now - client.session_ended_at:.1f} s ago"
            return None
        if now - client.last_seen >= self.lease and client.gate is not None:
            self.core.harvest(client)  # its data-plane calls renew its lease too
        if now - client.last_seen >= self.lease:
            return f"no session and no call for {now - client.last_seen:.1f} s"
        return None

    def reap_once(self) -> list[asyncio.Task]:
        """Starts the reclaim of every expired client, each in its own task; returns them."""
        now = time.monotonic()
        started = []
        if self._failed:
            self._failed &= self.core.clients.keys()
        for client_id, client in list(self.core.clients.items()):
            if client_id in self._reclaims:
                continue
            try:
                why = self.expired(client, now)
            except Exception:  # this client's own: the others are looked at all the same
                if client_id not in self._failed:  # (once: the check runs again every tick)
                    self._failed.add(client_id)
                    logger.exception("deciding whether client %s is alive failed", public_id(client_id))
                continue
            if why is not None:
                logger.warning("reclaiming client %s: %s", public_id(client_id), why)
                self.core.reclaimed += 1
                task = asyncio.get_running_loop().create_task(self._reclaim(client_id))
                self._reclaims[client_id] = task
                started.append(task)
        return started

    async def _reclaim(self, client_id: str) -> None:
        try:
            await self.core.unregister(client_id, reason="reclaimed")
        except UnknownClient:  # unregistered by its engine meanwhile
            pass
        except Exception:
            logger.exception("reclaiming client %s failed", public_id(client_id))
        finally:
            del self._reclaims[client_id]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            try:
                self.reap_once()
            except Exception:
                logger.exception("reaper pass failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stops looking for expired clients. Reclaims under way go on (an unregister, once
        begun, runs to its end); shutdown waits for them through the clients they release."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
