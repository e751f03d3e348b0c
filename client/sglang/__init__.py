"""kvserver for SGLang 0.5.23, through SGLang's two plug-in seams (docs/integrations.md):

- ``kvclient.sglang.linker.KVServerLinker``, a UnifiedCacheLinker
  (``--unified-cache-external-linker-backend dynamic``): direct L3, layer by layer into the GPU pool;
- ``kvclient.sglang.storage.KVServerStorage``, a HiCacheStorage backend with ``interface_v1``
  (``--hicache-storage-backend dynamic``): the L3 tier behind HiCache's host pool.

Importing this package does not import SGLang; importing either module does (SGLang must be
importable then)."""
