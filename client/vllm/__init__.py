"""kvserver as vLLM 0.33's KV connector (``kvclient.vllm.connector.KVServerConnector``).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvclient.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute"}'

Importing this package does not import vLLM; ``kvclient.vllm.connector`` does.
"""
