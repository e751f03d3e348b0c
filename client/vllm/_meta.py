"""What the scheduler-side connector tells the workers each step (pickled with the
SchedulerOutput): the Gets to start before the forward, the Puts to issue after it, and the
requests preempted since the last step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadJob:
    """Load ``keys[i]`` into block ``block_ids[i]`` (a Get: the longest stored prefix); ``lease``
    is the pin the scheduler's lookup took, ended by the Get."""

    req_id: str
    keys: bytes  # packed, key_bytes each
    block_ids: list[int]
    lease: str = ""


@dataclass
class SaveJob:
    """Store block ``block_ids[i]`` under ``keys[i]`` once this step's KV is written (a Put)."""

    req_id: str
    keys: bytes
    block_ids: list[int]


@dataclass
class KVServerConnectorMetadata(KVConnectorMetadata):
    key_bytes: int = 32
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
