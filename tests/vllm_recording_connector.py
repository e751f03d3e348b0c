"""A KV connector that only records which of its methods vLLM calls, in order, for
tests/test_vllm_env.py: vLLM's KVConnectorFactory loads it by module path
(kv_connector_module_path = "vllm_recording_connector"). It subclasses vLLM 0.33's real
KVConnectorBase_V1 and SupportsHMA, so importing it needs tests/vllm_env.setup() first (the factory
imports it only after a test has called setup()). It is not kvserver's connector (issue 11).

extra config: {"matched_tokens": N} makes get_num_new_matched_tokens report N external tokens
(loaded synchronously); 0 by default.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

CALLS: list[tuple[str, str, Any]] = []  # (role, method, detail), across all instances


class RecordingMetadata(KVConnectorMetadata):
    def __init__(self, new_req_ids: list[str]):
        self.new_req_ids = new_req_ids


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.matched_tokens = int(extra.get("matched_tokens", 0))

    def _rec(self, method: str, detail: Any = None) -> None:
        CALLS.append((self.role.name, method, detail))

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._rec("get_num_new_matched_tokens", (request.request_id, num_computed_tokens))
        n = max(0, self.matched_tokens - num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._rec("update_state_after_alloc",
                  (request.request_id, blocks.get_block_ids(), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        self._rec("build_connector_meta", ids)
        return RecordingMetadata(ids)

    def update_connector_output(self, connector_output):
        self._rec("update_connector_output", None)

    def request_finished(self, request, block_ids):
        self._rec("request_finished", (request.request_id, list(block_ids)))
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        self._rec("request_finished_all_groups",
                  (request.request_id, tuple(list(b) for b in block_ids)))
        return False, None

    # worker side (not driven by the scheduler tests)
    def start_load_kv(self, forward_context, **kwargs):
        self._rec("start_load_kv")

    def wait_for_layer_load(self, layer_name):
        self._rec("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self._rec("save_kv_layer", layer_name)

    def wait_for_save(self):
        self._rec("wait_for_save")
