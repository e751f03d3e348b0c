"""kvserver for SGLang 0.5.23: ``kvclient.sglang.linker.KVServerLinker``, a UnifiedCacheLinker
(``--unified-cache-external-linker-backend dynamic``). Importing this package does not import
SGLang; importing ``kvclient.sglang.linker`` does (SGLang must be importable then)."""
