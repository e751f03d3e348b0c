"""``KVServerConnector``: kvserver's node-wide cache as vLLM 0.33's KV connector, loaded by module
path, no patch:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvclient.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "unix:///run/kvserver/kvserver.sock"}}'

``kv_connector_extra_config`` (all optional): ``address`` (default: KVSERVER_ADDRESS or the
daemon's default socket), ``token``, ``tenant_token``, ``model`` (the KV space's name; default
the served model name), ``num_layers`` (default the model's), ``layerwise`` (default false: the
forward waits for a step's whole load, on the GPU, and vLLM keeps its full CUDA graphs for decode;
true: each layer's attention waits only for that layer, which needs PIECEWISE CUDA graphs for
every batch), ``lookup`` ("sync", or
"async": the lookup runs off the scheduler's thread and the request is scheduled a step later),
``lookup_pin_ms`` (default 10000), ``timeout_s`` (each daemon call, default 5),
``load_timeout_s`` (default 30), ``event_slots`` (CUDA: loads in one step, default 16),
``retry_register_s`` (default 5), ``tp_rank`` / ``pp_rank`` (only without vLLM's process groups),
``load`` ("auto", the default: "sync" for a hit in the daemon's host memory, "async" for one its
disk tier or the cluster holds in part; "sync": the step's forward waits for its loads; "async":
the request waits in WAITING_FOR_REMOTE_KVS until its load ended, and vLLM caches its blocks only
then; hybrid models always load asynchronously).
``kv_role``: "kv_both" loads and stores, "kv_consumer" only loads, "kv_producer" only stores.

Hybrid models (full-attention and sliding-window layers under vLLM's hybrid KV cache manager:
Gemma 2/3, gpt-oss, Mistral's sliding window) are stored one KV cache group to a space; a hit is
the longest prefix every group can serve (a sliding window needs only its last blocks). Mamba and
linear-attention state is refused.

Keys are vLLM's own block hashes (sha256 by default: the same in every process, so DP replicas and
a restarted engine share). A failed load is reported through ``get_block_ids_with_load_errors``
and vLLM recomputes those blocks with ``kv_load_failure_policy`` "recompute" (vLLM's default,
"fail", fails those requests instead, and the connector warns at startup); every
other daemon failure is a miss or a block not stored.

A cache reset (``reset_cache``: vLLM's ``reset_prefix_cache(reset_connector=True)``, which
``pause_generation(clear_cache=True)`` runs around an in-place weight update) turns the connector
off for the rest of the process; sleep mode is refused at startup (``supports_sleep_mode``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvclient.vllm._meta import KVServerConnectorMetadata
from kvclient.vllm._scheduler import SchedulerSide
from kvclient.vllm._space import extra_config, keys_shareable, read_groups
from kvclient.vllm._worker import WorkerSide

__all__ = ["KVServerConnector", "KVServerConnectorMetadata"]

logger = logging.getLogger("kvclient.vllm")


class KVServerConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("KVServerConnector needs vLLM's KVCacheConfig, which vLLM 0.33 gives both roles")
        cfg = extra_config(vllm_config)
        groups = read_groups(vllm_config, kv_cache_config)
        enabled = keys_shareable(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
            if enabled and policy != "recompute":
                logger.warning("kvserver: kv_load_failure_policy is %r: a load that fails (the daemon gone "
                               "mid-step) fails its requests; set \"kv_load_failure_policy\": \"recompute\" "
                               "in --kv-transfer-config to have vLLM recompute those blocks", policy)
            ktc = vllm_config.kv_transfer_config
            kve = getattr(vllm_config, "kv_events_config", None)
            self._scheduler = SchedulerSide(groups, cfg, enabled, self._request_block_ids,
                                            loads=bool(ktc.is_kv_consumer), saves=bool(ktc.is_kv_producer),
                                            events=bool(kve is not None and kve.enable_kv_cache_events))
        else:
            self._worker = WorkerSide(groups, cfg, enabled)

    def _request_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self._kv_cache_manager.get_block_ids(req_id))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """False: vLLM then refuses ``--enable-sleep-mode`` at startup. Sleep mode frees the KV
        cache memory the workers registered with the daemon (their pools are its IPC handles, or
        shared memory) and maps new memory at wake-up; the registrations would name memory that
        is gone or reused."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load runs between attention layers: not inside a full CUDA graph.
        return bool((extra_config or {}).get("layerwise", False))

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, tuple(block_ids))

    def reset_cache(self) -> bool | None:
        """vLLM's cache reset (``Scheduler.reset_connector_cache``, on the scheduler's connector
        only): the connector stops loading and storing for the rest of the process (logged at
        WARNING) and answers True, as vLLM's pause needs. See ``SchedulerSide.reset``."""
        if self._scheduler is not None:
            self._scheduler.reset()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    # ---- worker side -----------------------------------------------------------------------

    def _meta(self) -> KVServerConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVServerConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(self._meta())

    def build_connector_worker_meta(self):
        return self._worker.worker_meta() if self._worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        if isinstance(kv_connector_metadata, KVServerConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        # A Put stores a block's every layer of this stage, so the blocks are stored once, after
        # the last layer (wait_for_save): one daemon call per request a step, not one per layer.
        return

    def wait_for_save(self):
        self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Asynchronous loads end through get_transfer_results only (with their failures): vLLM
        # 0.33's model runners ask that, never this.
        sending, _ = self._worker.get_finished(finished_req_ids)
        return sending, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def shutdown(self):
        side = self._scheduler or self._worker
        if side is not None:
            side.shutdown()
