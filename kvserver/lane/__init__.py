"""The data-plane fast lane, the daemon's half: a sealed shared-memory ring per registration,
watched on the event loop, whose requests run the same checks and copies as their RPCs
(docs/lane.md). The ring's layout both ends agree on is ``kvserver.protocol.ring``.

Owns: ``server`` (Lane: doorbells, slots, progress words) and ``book`` (OpenLane's checks).
May import: ``core`` and everything below it.
"""
