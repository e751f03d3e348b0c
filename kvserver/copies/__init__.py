"""How bytes move between host rows and device pools, whatever the medium: copy jobs, their
plans and rows, the copy workers' queues (prefetch before offload), the order among one client's
copies, per-layer progress, buffer geometry, and the C copy kernel (``csrc/kvcopy.c``, built as
``kvserver.copies._kvcopy``; torch's indexing when it is not built).

Owns: ``job`` (Job), ``transfer`` (CopyPlan, BufferTable, rows, RowCopier), ``workers``
(CopyQueue, Work), ``order`` (JobOrder), ``progress`` (LayerSignal) and ``geometry``.
May import: ``protocol`` and ``errors`` only: the media build on it, and it knows no client.
"""
