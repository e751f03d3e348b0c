"""What the connector's two sides tell each other each step. Scheduler to workers (pickled with
the SchedulerOutput): the Gets to start before the forward, the Puts to issue after it, and the
requests preempted since the last step. Workers to scheduler (``build_connector_worker_meta``,
aggregated over every worker by vLLM): which of the step's loads landed."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadJob:
    """Load ``keys[i]`` into block ``block_ids[i]`` (a Get: the longest stored prefix); ``lease``
    is the pin the scheduler's lookup took, ended by the Get."""

    req_id: str
    keys: bytes  # packed, key_bytes each
    block_ids: list[int]
    lease: str = ""
    key_bytes: int = 32


@dataclass
class SaveJob:
    """Store block ``block_ids[i]`` under ``keys[i]`` once this step's KV is written (a Put)."""

    req_id: str
    keys: bytes
    block_ids: list[int]
    key_bytes: int = 32


@dataclass
class KVServerConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass
class KVServerWorkerMeta(KVConnectorWorkerMetadata):
    """Per request loading in the step: True if its blocks landed on this worker (and, once
    aggregated, on every worker)."""

    loads: dict[str, bool] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVServerWorkerMeta):
            return self
        merged = dict(self.loads)
        for rid, ok in other.loads.items():
            merged[rid] = merged.get(rid, True) and ok
        return KVServerWorkerMeta(loads=merged)
