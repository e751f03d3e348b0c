"""What the connector's two sides tell each other each step. Scheduler to workers (pickled with
the SchedulerOutput): the Gets to start before the forward, the Puts to issue after it, and the
requests preempted since the last step, and (hybrid models) the blocks the step hands out, which
no Put still queued may read after the forward writes them. Workers to scheduler
(``build_connector_worker_meta``, aggregated over every worker by vLLM): which of the step's loads landed."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadJob:
    """Load ``keys[i]`` into block ``block_ids[i]`` of KV cache group ``group`` (a Get: the
    longest stored prefix); ``lease`` is the pin the scheduler's lookup took, ended by the Get.
    ``asynchronous``: the request waits for it (vLLM's WAITING_FOR_REMOTE_KVS) and the workers
    report it in get_finished, not before the step's forward."""

    req_id: str
    keys: bytes  # packed, key_bytes each
    block_ids: list[int]
    lease: str = ""
    key_bytes: int = 32
    group: int = 0
    asynchronous: bool = False


@dataclass
class SaveJob:
    """Store block ``block_ids[i]`` of group ``group`` under ``keys[i]`` once this step's KV is
    written (a Put)."""

    req_id: str
    keys: bytes
    block_ids: list[int]
    key_bytes: int = 32
    group: int = 0


@dataclass
class KVServerConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    reused: set[int] = field(default_factory=set)  # hybrid: blocks given out (or loaded) this step
    # Finished requests whose blocks the scheduler held for a load's report: each worker reports
    # them in finished_sending once this step's Puts of them (if any) ended.
    finished: set[str] = field(default_factory=set)


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
