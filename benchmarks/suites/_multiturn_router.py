"""A cache-aware router for the two-node rows: it follows each node's KV events (the daemon's
Events call, what an engine's connector publishes to its router) and places a request on the node
whose cache holds the longest prefix of the request's pages; on a tie (a new client, or both
nodes holding as much), the trace's random pick. What llm-d's precise prefix scorer or Dynamo's KV
router do with the events an engine publishes, reduced to the one score that matters here.
"""

from __future__ import annotations

from kvclient import CacheView


class EventRouter:
    def __init__(self, addresses: list[str], geom, model: str = "multiturn-dp") -> None:
        self.views = [CacheView(a, model=model, layout=geom.layout, dtype=geom.dtype, page_size=geom.page,
                                num_layers=geom.layers, timeout=10) for a in addresses]
        self._where = [("", 0) for _ in addresses]
        self.held: list[set[bytes]] = [set() for _ in addresses]
        self.events = 0  # events applied
        self.poll()  # the first reads start the nodes' logs

    def poll(self) -> None:
        for i, view in enumerate(self.views):
            while True:
                r = view.events(*self._where[i])
                self._where[i] = (r.log_id, r.next_seq)
                for ev in r.events:
                    (self.held[i].difference_update if ev.removed else self.held[i].update)(ev.keys)
                    self.events += 1
                if not r.events:
                    break

    def place(self, keys: list[bytes], default: int) -> int:
        """The node to send a request whose pages are ``keys`` to."""
        self.poll()
        matches = []
        for held in self.held:
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            matches.append(n)
        best = max(matches)
        if best == 0 or matches.count(best) > 1:
            return default
        return matches.index(best)

    def close(self) -> None:
        for view in self.views:
            view.close()
