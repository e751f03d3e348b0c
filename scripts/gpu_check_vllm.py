"""The vLLM connector's worker side for scripts/gpu_check.py, on CUDA views laid out as vLLM 0.33's.

vLLM cannot be carried to the GPU machine, so when it is not importable this module puts a
stand-in for the two names ``kvclient.vllm._worker`` (and ``_meta``) import from it into
``sys.modules``: ``KVConnectorMetadata`` (vLLM's empty base class), ``KVConnectorWorkerMetadata``
(its abstract ``aggregate``) and ``extract_layer_index``
(vLLM 0.33's semantics); ``tests/test_gpu_check_vllm.py`` checks them against vLLM's own. The
per-layer views are built here with ``torch.as_strided`` from vLLM 0.33's stride formulas
(``compute_layout_strides`` / ``create_kv_cache_views`` over one raw byte buffer; the test checks
them against vLLM's). What runs is kvserver's real ``WorkerSide`` over a ``Space`` of an 8-layer
model, PP 1, called as vLLM's model runner calls the connector:

1. engine A registers its views (``register_kv_caches``); its compute stream rewrites the blocks
   to store behind a spinning kernel (every byte changes), and ``wait_for_save`` with one
   ``SaveJob`` is called at once, on that stream, so only the worker's ready event orders the
   daemon's read; keys are 32-byte chained SHA-256 hashes; ``get_finished`` is polled until it
   reports the request (its Puts done);
2. engine B (another ``WorkerSide`` with its own views, same space), whose compute stream still
   writes the target blocks' old contents behind a spinning kernel: ``start_load_kv`` with one
   ``LoadJob`` into other scattered blocks, then for each layer ``wait_for_layer_load(name)`` and,
   on the compute stream, that layer's blocks compared with A's (on the GPU, checked only at the
   end); ``load_errors()`` is empty, and the blocks not in the load are untouched;
3. a ``LoadJob`` of keys never stored: ``load_errors()`` reports exactly its blocks, untouched;
4. a ``LoadJob`` of a stored prefix then keys never stored: the prefix lands bit for bit and
   ``load_errors()`` reports exactly the blocks past it;
5. an asynchronous ``LoadJob`` (vLLM's WAITING_FOR_REMOTE_KVS, what hybrid models use) into other
   blocks, behind a late write of their old contents on B's stream: ``transfer_results`` is polled
   on that stream until it reports the request; its blocks are then compared on the stream (the
   completion makes the stream wait for every layer's event), and its event slot is free again.

Then a decode step is timed both ways vLLM runs it with this connector (``decode_step``): a
stand-in model of NUM_LAYERS layers (a projection, an attention over the batch's KV blocks read
from the registered views, an output projection) captured whole in one CUDA graph, as vLLM's
FULL_AND_PIECEWISE mode replays decode batches with ``layerwise`` false, against the same layers
captured piece by piece with each attention run eagerly between the pieces, calling the
connector's ``wait_for_layer_load`` first, as PIECEWISE runs every batch with ``layerwise`` true.
No load is in flight (decode batches never load): the difference is what PIECEWISE costs each
decode step. A stand-in, not vLLM's model: the figure is the launch and Python cost per layer.

``run(address, kind, device, layout)`` works on CPU too (the raw buffers are then a
``SharedKVMemory``, and there are no streams or spinning kernels), so the CPU tests run this
exact round before a GPU does.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import time
import types
from abc import ABC, abstractmethod

NUM_LAYERS = 8  # the model's, all in this PP 1 worker
NUM_BLOCKS = 32  # vLLM blocks per engine (block 0, vLLM's null block, is never used)
BLOCKS = 8  # blocks stored by A and loaded by B
MISS_BLOCKS = 4  # blocks of the load of keys never stored
PREFIX_BLOCKS = 4  # stored blocks at the head of the partly stored load (then 2 never stored)
ASYNC_BLOCKS = 4  # stored blocks of the asynchronous load
DECODE_BATCH, DECODE_HIDDEN, DECODE_STEPS = 64, 1024, 200  # the timed decode step (CUDA)
SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep: tens of ms on any current GPU
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))

# vLLM 0.33's KVCacheLayout: the physical order of the logical [L, B, H, N, C] axes.
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),  # "HND"
    "LBNHC": (0, 1, 3, 2, 4),  # "NHD", vLLM's default
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
CASES = (("mha", "LBNHC"), ("mha", "LBHNC"), ("mla", "LBNHC"))  # what gpu_check.py runs


def install_standin() -> bool:
    """Puts the vLLM stand-in into ``sys.modules`` if vLLM is not importable; True if it did."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
        import vllm.model_executor.models.utils  # noqa: F401
        return False
    except ImportError:  # drop what a partial import left, so only the stand-in answers
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]

    class KVConnectorMetadata:
        """vLLM's base of what the scheduler-side connector sends the workers (empty)."""

    class KVConnectorWorkerMetadata(ABC):
        """vLLM's base of what each worker-side connector reports to the scheduler's."""

        @abstractmethod
        def aggregate(self, other):
            """Aggregates metadata with another worker's."""

    def extract_layer_index(layer_name: str, num_attn_module: int = 1) -> int:
        """vLLM 0.33's: the one integer in a module name ("model.layers.3.self_attn.attn" -> 3);
        with ``num_attn_module`` > 1 and "attn" in the name, at most two (i * num + j)."""
        int_vals: list[int] = []
        for subname in layer_name.split("."):
            try:
                int_vals.append(int(subname))
            except ValueError:
                continue
        if num_attn_module == 1 or "attn" not in layer_name:
            assert len(int_vals) == 1, f"layer name {layer_name} should only contain one integer"
            return int_vals[0]
        assert len(int_vals) <= 2, f"layer name {layer_name} should contain most two integers"
        return int_vals[0] * num_attn_module + int_vals[1] if len(int_vals) == 2 else int_vals[0]

    names = {
        "vllm": {}, "vllm.distributed": {}, "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorMetadata": KVConnectorMetadata,
            "KVConnectorWorkerMetadata": KVConnectorWorkerMetadata},
        "vllm.model_executor": {}, "vllm.model_executor.models": {},
        "vllm.model_executor.models.utils": {"extract_layer_index": extract_layer_index},
    }
    for name, attrs in names.items():
        module = types.ModuleType(name, "stand-in for vLLM 0.33.0 (scripts/gpu_check_vllm.py)")
        module.__dict__.update(attrs)
        for value in attrs.values():
            value.__module__ = name
        module.__path__ = []  # a package, so the submodules import
        sys.modules[name] = module
    return True


def geometry(kind: str) -> dict:
    """The per-layer cache of one pool kind: heads H, block tokens N, content bytes C of one
    (head, token) cell, vLLM's tensor dtype, kvserver's wire dtype and KVLayout."""
    import torch

    from kvserver.protocol.layout import KVLayout

    if kind == "mla":  # DeepSeek's latent (512 + 64 rope), fp8 kept by vLLM as uint8; FlashMLA's block
        return {"heads": 1, "block": 64, "content": 576, "dtype": torch.uint8,
                "wire": torch.float8_e4m3fn, "layout": KVLayout.mla(512, 64)}
    return {"heads": 8, "block": 16, "content": 2 * 128 * 2, "dtype": torch.bfloat16,  # K then V, bf16
            "wire": torch.bfloat16, "layout": KVLayout.mha(8, 128)}


def layout_strides(kind: str, layout: str, num_blocks: int, num_layers: int) -> tuple[int, ...]:
    """Byte strides of the logical [L, B, H, N, C] axes, as vLLM's compute_layout_strides (no
    padding, no kernel block split): the physical order's innermost axis first, each stride the
    product of the sizes inside it."""
    g = geometry(kind)
    shape = (num_layers, num_blocks, g["heads"], g["block"], g["content"])
    strides, current = [0] * 5, 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = current
        current *= shape[dim]
    return tuple(strides)


def raw_bytes(kind: str, num_blocks: int, num_layers: int) -> int:
    g = geometry(kind)
    return num_layers * num_blocks * g["heads"] * g["block"] * g["content"]


def views(raw, kind: str, layout: str, num_blocks: int, num_layers: int) -> list:
    """The per-layer [B, H, N, C] views vLLM 0.33's create_kv_cache_views carves from the flat
    byte buffer ``raw`` (uint8 or int8, at least ``raw_bytes``), layer l at l * layer stride, in
    vLLM's tensor dtype (C elements: K then V of one head for MHA, the latent for MLA)."""
    import torch

    g = geometry(kind)
    strides = layout_strides(kind, layout, num_blocks, num_layers)
    size = (num_blocks, g["heads"], g["block"], g["content"])
    return [torch.as_strided(raw, size=size, stride=strides[1:],
                             storage_offset=raw.storage_offset() + layer * strides[0]).view(g["dtype"])
            for layer in range(num_layers)]


def block_keys(tokens: list[int], block: int) -> list[bytes]:
    """Chained SHA-256 block hashes (32 bytes each), the form of vLLM's sha256 block hashes."""
    out, prior = [], b""
    for i in range(0, len(tokens) - len(tokens) % block, block):
        prior = hashlib.sha256(prior + repr(tokens[i:i + block]).encode()).digest()
        out.append(prior)
    return out


def run(address: str, kind: str, device: str = "cuda", layout: str = "LBNHC") -> dict:
    """The round of the module's notes for one pool kind and layout; the result's ``ok`` says it all."""
    import torch

    install_standin()
    from kvclient.vllm._meta import KVServerConnectorMetadata, LoadJob, SaveJob
    from kvclient.vllm._space import Space
    from kvclient.vllm._worker import WorkerSide

    started = time.perf_counter()
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    cuda = dev.type == "cuda"
    g = geometry(kind)
    block = g["block"]
    space = Space(model=f"check-vllm-{kind}-{layout.lower()}", layout=g["layout"], dtype=g["wire"],
                  page_size=block, num_layers=NUM_LAYERS, tp_size=1, pp_size=1, hash_stride=1)
    # Per-layer waits (layerwise true): what this check proves is layer i usable before layer i+1.
    cfg = {"address": address, "timeout_s": 30.0, "load_timeout_s": 60.0, "layerwise": True}
    rng = random.Random(13)
    tokens = [rng.randrange(128_000) for _ in range(BLOCKS * block)]
    keys = block_keys(tokens, block)
    never = block_keys([t + 1 for t in tokens[: MISS_BLOCKS * block]], block)  # never stored
    put_blocks = rng.sample(range(1, NUM_BLOCKS), BLOCKS)
    get_blocks = rng.sample(range(1, NUM_BLOCKS), BLOCKS)
    free = [b for b in range(1, NUM_BLOCKS) if b not in get_blocks]
    extra = free[:MISS_BLOCKS]  # B's blocks past the load: the miss goes there
    partial = free[MISS_BLOCKS:MISS_BLOCKS + PREFIX_BLOCKS + 2]  # the partly stored load's
    at = MISS_BLOCKS + PREFIX_BLOCKS + 2
    later = free[at:at + ASYNC_BLOCKS]  # the asynchronous load's

    # Block indices on the device, made before any stream work: a copy of a host list to the GPU
    # synchronises the current stream, which would let a spinning kernel end before the writes
    # behind it were even queued.
    indices: dict[tuple[int, ...], object] = {}

    def index(blocks: list[int]):
        key = tuple(blocks)
        if key not in indices:
            indices[key] = torch.tensor(blocks, dtype=torch.int64).to(dev)
        return indices[key]

    def rows(view, blocks: list[int]):
        """The bytes of ``blocks`` of one layer's view, gathered: [blocks, H, N, C bytes]."""
        return view.view(torch.uint8)[index(blocks)]

    for blocks in (put_blocks, get_blocks, extra, partial, partial[:PREFIX_BLOCKS], later):
        index(blocks)

    def meta(**jobs) -> KVServerConnectorMetadata:
        return KVServerConnectorMetadata(**jobs)

    mems: list = []

    def engine(seed: int) -> tuple[WorkerSide, list]:
        size = raw_bytes(kind, NUM_BLOCKS, NUM_LAYERS)
        gen = torch.Generator(device=dev).manual_seed(seed)
        fill = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen, device=dev)
        if cuda:
            raw = fill
        else:  # the daemon maps a CPU engine's KV cache: it lies in shared memory
            from kvclient.views_pool import SharedKVMemory

            mems.append(SharedKVMemory(size))
            raw = mems[-1].tensor
            raw.copy_(fill)
        layer_views = views(raw, kind, layout, NUM_BLOCKS, NUM_LAYERS)
        worker = WorkerSide(space, cfg, True)
        worker.register_kv_caches(dict(zip(LAYER_NAMES, layer_views, strict=True)))
        return worker, layer_views

    result: dict = {"kind": f"vllm-worker-{kind}-{layout}", "device": dev.type, "layout": layout,
                    "block_tokens": block}
    workers: list[WorkerSide] = []
    try:
        wa, va = engine(1)
        workers.append(wa)
        wb, vb = engine(2)
        workers.append(wb)
        compute_a = torch.cuda.Stream() if cuda else None
        compute_b = torch.cuda.Stream() if cuda else None
        zeros = torch.zeros_like(rows(vb[0], get_blocks))  # B's "old contents", already on the device
        if cuda:
            torch.cuda.synchronize()  # the views' contents exist before either stream uses them

        # 1. A's forward rewrites the blocks on its compute stream; the save is asked for at once,
        # on that stream, so only the worker's ready event keeps the daemon from reading too early.
        syncs: list[str] = []  # CPU syncs torch reports inside the stream-ordered sections (CUDA)
        t0 = time.perf_counter()
        with _stream(compute_a), _sync_watch(cuda, syncs):
            if cuda:  # the write lands tens of ms late: a Put not ordered after it reads old bytes
                torch.cuda._sleep(SLEEP_CYCLES)
            for layer, view in enumerate(va):
                u, i = view.view(torch.uint8), index(put_blocks)
                u[i] = u[i] ^ (0x11 * (layer % 15 + 1))  # every byte changes
            want = [rows(view, put_blocks).clone() for view in va]
            wa.wait_for_save(meta(saves=[SaveJob("a1", b"".join(keys), list(put_blocks))]))
        deadline = time.monotonic() + 60
        saved = False
        while not saved and time.monotonic() < deadline:
            done, _ = wa.get_finished({"a1"})
            saved = bool(done and "a1" in done)
            if not saved:
                time.sleep(0.005)
        result["saved"] = saved
        result["ms_save"] = round((time.perf_counter() - t0) * 1e3, 3)
        result["lookup"] = wb.client.lookup(b"".join(keys), key_bytes=32).pages
        if cuda:
            torch.cuda.synchronize()  # ``want`` is read on B's stream below

        # 2. B loads them into other blocks while its forward still writes their old contents.
        untouched = [rows(view, extra).clone() for view in vb]
        marks, waits, same = [], [], []  # per layer: (CPU s, GPU event), no load failed, equal
        t0 = time.perf_counter()
        with _stream(compute_b), _sync_watch(cuda, syncs):
            if cuda:  # the load must land after this late write, not before
                torch.cuda._sleep(SLEEP_CYCLES)
                for view in vb:
                    view.view(torch.uint8)[index(get_blocks)] = zeros
            start = _event(cuda)
            wb.start_load_kv(meta(loads=[LoadJob("b1", b"".join(keys), list(get_blocks))]))
            for layer, name in enumerate(LAYER_NAMES):
                wb.wait_for_layer_load(name)  # CUDA: the stream waits for the layer's event
                marks.append((time.perf_counter() - t0, _event(cuda)))
                waits.append(bool(wb._loads) and not any(load.batch.failed for load in wb._loads))
                # Compared on the stream, checked at the end: a CPU sync here would let every
                # later layer land before its own stream wait is put to the test.
                same.append((rows(vb[layer], get_blocks) == want[layer]).all())
        if cuda:
            compute_b.synchronize()
            result["gpu_ms_until_layer0_usable"] = round(start.elapsed_time(marks[0][1]), 3)
            result["gpu_ms_until_last_layer_usable"] = round(start.elapsed_time(marks[-1][1]), 3)
        result["cpu_ms_until_layer0_released"] = round(marks[0][0] * 1e3, 3)
        errors = wb.load_errors()
        result["ms_whole_load"] = round((time.perf_counter() - t0) * 1e3, 3)
        result["layer_waits"] = len(waits) == NUM_LAYERS and all(waits)
        result["exact"] = len(same) == NUM_LAYERS and bool(torch.stack(same).all())
        result["load_errors_empty"] = errors == set()
        result["past_blocks_untouched"] = all(torch.equal(rows(view, extra), u)
                                              for view, u in zip(vb, untouched, strict=True))
        result["bytes"] = sum(w.numel() for w in want)
        result["stream_syncs"] = syncs[:5]  # none expected: each would shorten a spinning kernel's test

        # 3. A miss: keys never stored; every block of the job is reported, none is written.
        before = [rows(view, extra).clone() for view in vb]
        with _stream(compute_b):
            wb.start_load_kv(meta(loads=[LoadJob("b2", b"".join(never), list(extra))]))
            for name in LAYER_NAMES:
                wb.wait_for_layer_load(name)
        if cuda:
            compute_b.synchronize()
        errors = wb.load_errors()
        result["miss_errors"] = sorted(errors)
        result["miss_reported"] = errors == set(extra)
        result["miss_untouched"] = all(torch.equal(rows(view, extra), u)
                                       for view, u in zip(vb, before, strict=True))

        # 4. A stored prefix, then keys never stored: the prefix lands, the rest is reported.
        with _stream(compute_b):
            wb.start_load_kv(meta(loads=[LoadJob("b3", b"".join(keys[:PREFIX_BLOCKS] + never[:2]),
                                                 list(partial))]))
            for name in LAYER_NAMES:
                wb.wait_for_layer_load(name)
        if cuda:
            compute_b.synchronize()
        errors = wb.load_errors()
        result["prefix_exact"] = all(torch.equal(rows(view, partial[:PREFIX_BLOCKS]), w[:PREFIX_BLOCKS])
                                     for view, w in zip(vb, want, strict=True))
        result["prefix_errors_exact"] = errors == set(partial[PREFIX_BLOCKS:])

        # 5. An asynchronous load: reported by transfer_results once it ended, then readable on
        # the stream that polled it.
        old = torch.zeros_like(rows(vb[0], later))
        if cuda:
            torch.cuda.synchronize()
        reported: tuple = (set(), set())
        same = []
        t0 = time.perf_counter()
        with _stream(compute_b), _sync_watch(cuda, syncs):
            if cuda:
                torch.cuda._sleep(SLEEP_CYCLES)
                for view in vb:
                    view.view(torch.uint8)[index(later)] = old
            wb.start_load_kv(meta(loads=[LoadJob("b4", b"".join(keys[:ASYNC_BLOCKS]), list(later),
                                                 asynchronous=True)]))
            deadline = time.monotonic() + 60
            while "b4" not in reported[0] and time.monotonic() < deadline:
                _, recving, failed = wb.transfer_results(set())
                reported = (reported[0] | recving, reported[1] | failed)
                if "b4" not in reported[0]:
                    time.sleep(0.002)
            same = [(rows(view, later) == w[:ASYNC_BLOCKS]).all() for view, w in zip(vb, want, strict=True)]
        if cuda:
            compute_b.synchronize()
        result["ms_async_load"] = round((time.perf_counter() - t0) * 1e3, 3)
        result["async_reported"] = "b4" in reported[0] and "b4" not in reported[1]
        result["async_exact"] = bool(same) and bool(torch.stack(same).all())
        result["async_slots_free"] = all(len(free_slots) == wb.event_slots for free_slots in wb._slots)
    finally:
        for worker in workers:
            worker.shutdown()
        for mem in mems:
            mem.close()
    if (kind, layout) == CASES[0]:  # one case times it: the three run at once on one GPU
        result["decode_step"] = decode_step(space, cfg, kind, layout, dev)
    result["seconds"] = round(time.perf_counter() - started, 3)
    result["ok"] = bool(result.get("saved") and result.get("lookup") == BLOCKS and result.get("layer_waits")
                        and result.get("exact") and result.get("load_errors_empty")
                        and result.get("past_blocks_untouched") and result.get("miss_reported")
                        and result.get("miss_untouched") and result.get("prefix_exact")
                        and result.get("prefix_errors_exact") and result.get("async_reported")
                        and result.get("async_exact") and result.get("async_slots_free"))
    return result


def decode_step(space, cfg: dict, kind: str, layout: str, dev) -> dict:
    """Median ms of a stand-in decode step, one CUDA graph (``full_ms``) against graph pieces with
    eager attention and the connector's per-layer wait between them (``piecewise_ms``), measured
    in the same run; on CPU the same step runs eagerly, a few times (no figure)."""
    import torch

    from kvclient.vllm._worker import WorkerSide

    cuda = dev.type == "cuda"
    batch, hidden, steps = (DECODE_BATCH, DECODE_HIDDEN, DECODE_STEPS) if cuda else (4, 64, 3)
    raw = torch.zeros(raw_bytes(kind, NUM_BLOCKS, NUM_LAYERS), dtype=torch.uint8, device=dev)
    mem = None
    if not cuda:
        from kvclient.views_pool import SharedKVMemory

        mem = SharedKVMemory(raw.numel())
        raw = mem.tensor
    layer_views = views(raw, kind, layout, NUM_BLOCKS, NUM_LAYERS)
    worker = WorkerSide(space, dict(cfg, layerwise=True), True)
    try:
        worker.register_kv_caches(dict(zip(LAYER_NAMES, layer_views, strict=True)))
        gen = torch.Generator(device=dev).manual_seed(5)
        dtype = torch.bfloat16 if cuda else torch.float32
        w_in = [torch.randn(hidden, hidden, generator=gen, device=dev).to(dtype) / 32 for _ in LAYER_NAMES]
        w_out = [torch.randn(hidden, hidden, generator=gen, device=dev).to(dtype) / 32 for _ in LAYER_NAMES]
        blocks = torch.arange(1, 1 + BLOCKS, device=dev)
        x0 = torch.randn(batch, hidden, generator=gen, device=dev).to(dtype)

        def attention(i: int, q):  # the batch reads this layer's KV blocks
            kv = layer_views[i].view(torch.uint8)[blocks].reshape(-1).to(dtype)
            width = min(kv.numel(), hidden)
            scores = torch.softmax(q[:, :width] * kv[:width], dim=-1)
            return q + torch.nn.functional.pad(scores, (0, hidden - width))

        def full(x):
            for i in range(NUM_LAYERS):
                x = attention(i, x @ w_in[i]) @ w_out[i]
            return x

        def piece_in(i, x):
            return x @ w_in[i]

        def piece_out(i, x):
            return x @ w_out[i]

        if not cuda:
            for _ in range(steps):
                x = x0
                for i, name in enumerate(LAYER_NAMES):
                    worker.wait_for_layer_load(name)
                    x = piece_out(i, attention(i, piece_in(i, x)))
            return {"graphs": False, "steps": steps}
        stream = torch.cuda.Stream()
        static = x0.clone()
        with torch.cuda.stream(stream):
            for _ in range(3):
                full(static)  # warm-up before capture
        torch.cuda.synchronize()
        g_full = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_full):
            out_full = full(static)
        def capture(piece, i: int):
            """(its static input, its graph, its static output) of one layer's piece."""
            x = torch.empty_like(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = piece(i, x)
            return x, graph, y

        pieces = [(capture(piece_in, i), capture(piece_out, i)) for i in range(NUM_LAYERS)]

        def piecewise():
            x = static
            for i, ((a, g_a, b), (c, g_c, d)) in enumerate(pieces):
                a.copy_(x)
                g_a.replay()
                worker.wait_for_layer_load(LAYER_NAMES[i])  # what layerwise adds between pieces
                c.copy_(attention(i, b))
                g_c.replay()
                x = d
            return x

        def timed(step) -> float:
            times = []
            for _ in range(steps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                step()
                end.record()
                end.synchronize()
                times.append(max(start.elapsed_time(end), (time.perf_counter() - t0) * 1e3))
            return sorted(times)[len(times) // 2]

        g_full.replay()
        same = bool(torch.allclose(piecewise().float(), out_full.float(), rtol=0.05, atol=0.05))
        full_ms = timed(g_full.replay)
        piece_ms = timed(piecewise)
        full_ms = min(full_ms, timed(g_full.replay))  # the baseline again: the GPU warms up
        return {"graphs": True, "layers": NUM_LAYERS, "batch": batch, "hidden": hidden, "steps": steps,
                "same_output": same, "full_ms": round(full_ms, 4), "piecewise_ms": round(piece_ms, 4),
                "piecewise_over_full": round(piece_ms / full_ms, 3) if full_ms else None}
    finally:
        worker.shutdown()
        if mem is not None:
            mem.close()


def _event(cuda: bool):
    """A timing event recorded on the current stream now (CUDA), else None."""
    if not cuda:
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@contextlib.contextmanager
def _sync_watch(cuda: bool, found: list):
    """CUDA: collects the synchronizing CUDA operations torch warns of while the block runs
    (``torch.cuda.set_sync_debug_mode("warn")``, any thread): a CPU sync on a stream behind a
    spinning kernel waits it out, and the ordering it is there to test is no longer tested."""
    if not cuda:
        yield
        return
    import warnings

    import torch

    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
    found += [str(w.message)[:300] for w in caught if "synchroniz" in str(w.message).lower()]


def _stream(stream):
    """``torch.cuda.stream(stream)``, or nothing to enter on CPU (``stream`` None)."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)
