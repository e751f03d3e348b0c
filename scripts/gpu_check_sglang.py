"""The SGLang linker's round trip for scripts/gpu_check.py, on CUDA tensors shaped like SGLang's pools.

SGLang cannot be carried to the GPU machine, so when ``import sglang`` fails this module puts a
stand-in for the four names ``kvclient.sglang.linker`` imports from it into ``sys.modules``
(``PoolName``, ``PoolTransfer``, ``ComponentType``, ``LayerWiseLoadCounter``, ``UnifiedCacheLinker``),
each with SGLang 0.5.23's semantics; ``tests/test_gpu_check_sglang.py`` checks them against the
real classes. What runs is kvserver's real ``KVServerLinker``, as SGLang drives it:

1. engine A (an 8-layer model; the linker refuses pipeline parallelism) fills its pool; its
   "forward" rewrites the pages on its forward stream behind a spinning kernel, and the offload
   is asked for at once, so only the linker's ready events order the daemon's read. It offloads
   ``PAGES`` scattered pages under chained SHA-256 storage hashes, completions popped as SGLang's
   ``check_hicache_events`` does;
2. engine B, another pool, whose forward stream still writes the target slots' old
   contents behind a spinning kernel: ``lookup`` →
   ``load`` into other scattered slots → ``start_layer_wise_loading`` → ``counter.set_consumer``
   → the "attention" reads each layer through the pool's ``get_key_buffer(layer_id)`` hook (which
   calls ``wait_until(local)``) on its compute stream and compares it with A's pages there, on
   the GPU, checked only at the end → ``finish_layer_wise_loading``;
3. a load of keys never stored: ``finish_layer_wise_loading`` is False and B's slots are untouched.

``run(device)`` works on CPU too (the pools then go to shared memory with ``share_cpu_pool``), so
the CPU tests run this exact round before a GPU does.
"""

from __future__ import annotations

import enum
import hashlib
import sys
import time
import types
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field

NUM_LAYERS = 8  # the model's
STAGE = (0, NUM_LAYERS)  # the pool's global layers: the whole model (no PP)
PAGE = 16
TOKENS = 4096  # slots per pool, SGLang's padding page excluded
PAGES = 48
SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep: tens of ms on any current GPU


def install_standin() -> bool:
    """Puts the SGLang stand-in into ``sys.modules`` if SGLang is not importable; True if it did."""
    try:
        import sglang.srt.mem_cache.unified_cache.unified_cache_linker  # noqa: F401
        return False
    except ImportError:  # drop what a partial import left, so only the stand-in answers
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
    import torch

    class PoolName(str, enum.Enum):  # noqa: UP042 (SGLang's own base classes)
        KV = "kv"
        MAMBA = "mamba"
        SWA = "swa"

    @dataclass
    class PoolTransfer:
        name: PoolName
        host_indices: object = None
        device_indices: object = None
        keys: list | None = None
        nodes_to_load: list | None = field(default=None)

    class ComponentType(int, enum.Enum):
        FULL = 0
        SWA = 1
        MAMBA = 2

    class LayerWiseLoadCounter:
        """SGLang's CPU completion counter: one Future per layer per batch; a failure does not
        raise into the forward, ``finish`` reports it."""

        def __init__(self, num_layers: int, on_layer_ready=None) -> None:
            self.num_layers = num_layers
            self.on_layer_ready = on_layer_ready
            self.producer_index = -1
            self.consumer_index = -1
            self.futures: dict[int, list[Future]] = {}

        def update_producer(self) -> int:
            self.producer_index += 1
            self.futures[self.producer_index] = [Future() for _ in range(self.num_layers)]
            return self.producer_index

        def set_consumer(self, index: int) -> None:
            self.consumer_index = index

        def complete(self, index: int, layer: int) -> None:
            self.futures[index][layer].set_result(None)

        def fail(self, index: int, error: BaseException) -> None:
            for future in self.futures.get(index, ()):
                if not future.done():
                    future.set_exception(error)

        def wait_until(self, threshold: int) -> None:
            futures = self.futures.get(self.consumer_index)
            if futures is None:
                return
            futures[threshold].exception()
            if self.on_layer_ready is not None:
                self.on_layer_ready(self.consumer_index, threshold)

        def finish(self, index: int) -> bool:
            futures = self.futures.get(index)
            if futures is None:
                return True
            landed = all(f.exception() is None for f in futures)
            del self.futures[index]
            return landed

        def reset(self) -> None:
            self.producer_index = -1
            self.consumer_index = -1
            self.futures.clear()

    device_module = torch.cuda if torch.cuda.is_available() else torch.cpu

    class UnifiedCacheLinker(ABC):
        layer_done_counter: object
        pools: dict
        forward_stream = None

        def record_offload_ready(self) -> list:
            indices_ready = device_module.Event()
            indices_ready.record()
            events = [indices_ready]
            if self.forward_stream is not None:
                kv_written = device_module.Event()
                kv_written.record(self.forward_stream)
                events.append(kv_written)
            return events

        @abstractmethod
        def lookup(self, rid, transfers): ...

        @abstractmethod
        def load(self, rid, transfers): ...

        @abstractmethod
        def start_layer_wise_loading(self): ...

        @abstractmethod
        def finish_layer_wise_loading(self, counter_index): ...

        @abstractmethod
        def cancel_queued_load(self, rid): ...

        @abstractmethod
        def offload(self, transfers, session_id=None): ...

        @abstractmethod
        def num_completed_offloads(self): ...

        @abstractmethod
        def pop_completed_offload(self): ...

        @abstractmethod
        def reset(self): ...

        @abstractmethod
        def close(self): ...

    names = {
        "sglang": {}, "sglang.srt": {}, "sglang.srt.mem_cache": {},
        "sglang.srt.mem_cache.hicache_storage": {"PoolName": PoolName, "PoolTransfer": PoolTransfer},
        "sglang.srt.mem_cache.unified_cache": {},
        "sglang.srt.mem_cache.unified_cache.components": {"ComponentType": ComponentType},
        "sglang.srt.mem_cache.unified_cache.unified_cache_linker": {
            "LayerWiseLoadCounter": LayerWiseLoadCounter, "UnifiedCacheLinker": UnifiedCacheLinker},
    }
    for name, attrs in names.items():
        module = types.ModuleType(name, "stand-in for SGLang 0.5.23 (scripts/gpu_check_sglang.py)")
        module.__dict__.update(attrs)
        module.__path__ = []  # a package, so the submodules import
        sys.modules[name] = module
    return True


class StagePool:
    """The attributes of SGLang's MHATokenToKVPool / MLATokenToKVPool that the linker and the
    attention read: one tensor per local layer of ``[TOKENS + PAGE, heads, dim]`` (page 0 is
    SGLang's padding page), ``model_layer_ids`` global, and the layer wait hook."""

    def __init__(self, kind: str, device, seed: int, stage: tuple[int, int] = STAGE) -> None:
        import torch

        self.kind = kind
        self.device = device
        self.start_layer = stage[0]
        self.layer_num = stage[1] - stage[0]
        self.model_layer_ids = tuple(range(*stage))
        self.layer_transfer_counter = None
        g = torch.Generator(device=device).manual_seed(seed)
        rows = TOKENS + PAGE

        def buf(heads: int, dim: int, dtype):
            raw = torch.randint(0, 255, (rows, heads, dim * dtype.itemsize), dtype=torch.uint8,
                                generator=g, device=device)
            return raw if dtype == torch.uint8 else raw.view(dtype)

        if kind == "mla":  # DeepSeek's latent, fp8 stored as uint8 as SGLang does
            self.dtype, self.kv_lora_rank, self.qk_rope_head_dim = torch.float8_e4m3fn, 512, 64
            self.kv_buffer = [buf(1, 576, torch.uint8) for _ in range(self.layer_num)]
        else:
            self.dtype, self.head_num, self.head_dim, self.v_head_dim = torch.bfloat16, 8, 128, 128
            self.k_buffer = [buf(8, 128, torch.bfloat16) for _ in range(self.layer_num)]
            self.v_buffer = [buf(8, 128, torch.bfloat16) for _ in range(self.layer_num)]

    def buffers(self, local: int) -> list:
        return [self.kv_buffer[local]] if self.kind == "mla" else [self.k_buffer[local], self.v_buffer[local]]

    def register_layer_transfer_counter(self, counter) -> None:
        self.layer_transfer_counter = counter

    def get_key_buffer(self, layer_id: int):
        """As SGLang's pools: waits for the layer (local id) before handing out the buffer."""
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return self.buffers(layer_id - self.start_layer)


class MHATokenToKVPool(StagePool):
    """Stand-in named as SGLang's MHA pool (the linker stores SGLang's own pool classes only)."""


class MLATokenToKVPool(StagePool):
    """Stand-in named as SGLang's MLA pool."""


def stage_pool(kind: str, device, seed: int, stage: tuple[int, int] = STAGE) -> StagePool:
    return (MLATokenToKVPool if kind == "mla" else MHATokenToKVPool)(kind, device, seed, stage)


def storage_hashes(tokens: list[int]) -> list[str]:
    """Chained SHA-256 page hashes as 64-hex strings, the form of SGLang's storage hashes."""
    out, prior = [], b""
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        prior = hashlib.sha256(prior + repr(tokens[i:i + PAGE]).encode()).digest()
        out.append(prior.hex())
    return out


def make_linker(address: str, pool: StagePool, forward_stream=None):
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from kvclient.sglang.linker import KVServerLinker, share_cpu_pool

    if pool.device.type == "cpu":
        share_cpu_pool(pool)
    allocator = types.SimpleNamespace(get_kvcache=lambda: pool)
    params = types.SimpleNamespace(token_to_kv_pool_allocator=allocator, page_size=PAGE, pp_rank=0,
                                   pp_size=1, attn_tp_cache_group=None, tp_cache_group=None)
    server_args = types.SimpleNamespace(model_path="check-sglang-linker", served_model_name=None,
                                        tp_size=1, pp_size=1)
    linker = KVServerLinker(server_args, params, components={ComponentType.FULL},
                            extra_config={"address": address, "num_layers": NUM_LAYERS,
                                          "model": f"check-sglang-{pool.kind}", "timeout_s": 30.0,
                                          "load_timeout_s": 60.0},
                            forward_stream=forward_stream)
    pool.register_layer_transfer_counter(linker.layer_done_counter)
    return linker


def run(address: str, kind: str, device: str = "cuda") -> dict:
    """The round trip of the module's notes for one pool kind; the result's ``ok`` says it all."""
    import random

    import torch

    install_standin()
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    cuda = dev.type == "cuda"
    rng = random.Random(11)
    pages = TOKENS // PAGE  # slot pages 1..pages (page 0 is padding)
    tokens = [rng.randrange(128_000) for _ in range(PAGES * PAGE)]
    keys = storage_hashes(tokens)
    put_pages = rng.sample(range(1, pages + 1), PAGES)
    get_pages = rng.sample(range(1, pages + 1), PAGES)

    slot_cache: dict[tuple, torch.Tensor] = {}

    def slots(page_ids: list[int]):
        """The pages' slots on the device, made once: a host-to-device copy inside the stream work
        below would make the CPU wait for the spinning kernels and order everything by itself."""
        key = tuple(page_ids)
        if key not in slot_cache:
            t = torch.tensor(page_ids, dtype=torch.int64)
            slot_cache[key] = (t[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).to(dev)
        return slot_cache[key]

    def rows(pool: StagePool, local: int, page_ids: list[int]) -> list:
        return [b[slots(page_ids)].view(torch.uint8) for b in pool.buffers(local)]

    result: dict = {"kind": f"sglang-linker-{kind}", "device": dev.type}
    stream_a = torch.cuda.Stream() if cuda else None
    a, b = stage_pool(kind, dev, 1), stage_pool(kind, dev, 2)
    linker_a = make_linker(address, a, stream_a)
    compute = torch.cuda.Stream() if cuda else None
    linker_b = make_linker(address, b, compute)
    extra = [p for p in range(1, pages + 1) if p not in get_pages][:4]
    for page_ids in (put_pages, get_pages, extra):
        slots(page_ids)
    try:
        # 1. A's "forward" writes the pages on its forward stream; the offload is asked for at
        # once, so only the linker's ready events keep the daemon from reading them too early.
        with (torch.cuda.stream(stream_a) if cuda else _null()):
            if cuda:  # the write lands tens of ms late: a Put not ordered after it reads old bytes
                torch.cuda._sleep(SLEEP_CYCLES)
            for local in range(a.layer_num):
                for buf in a.buffers(local):
                    buf[slots(put_pages)] = buf[slots(put_pages)].flip(0)
            want = [[r.clone() for r in rows(a, local, put_pages)] for local in range(a.layer_num)]
        ok_offload = linker_a.offload([PoolTransfer(name=PoolName.KV, keys=keys,
                                                    device_indices=slots(put_pages))])
        deadline = time.monotonic() + 60
        while linker_a.num_completed_offloads() < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        result["offloaded"] = bool(ok_offload and linker_a.pop_completed_offload())
        if cuda:
            torch.cuda.synchronize()  # ``want`` is read on other streams below

        # 2. B: lookup, load, layer-wise loading read through the pool's wait hook.
        untouched = [[r.clone() for r in rows(b, local, extra)] for local in range(b.layer_num)]
        found = linker_b.lookup("r1", [PoolTransfer(name=PoolName.KV, keys=keys)])
        result["lookup"] = len(found)
        result["queued"] = linker_b.load("r1", [PoolTransfer(name=PoolName.KV, keys=keys,
                                                             device_indices=slots(get_pages))])
        if cuda:
            torch.cuda.synchronize()
        marks = []  # (CPU seconds, GPU event) as each layer becomes usable on the compute stream
        if cuda:  # B's forward still writes the slots' old contents, late: the load must land after
            with torch.cuda.stream(compute):
                torch.cuda._sleep(SLEEP_CYCLES)
                for local in range(b.layer_num):
                    for buf in b.buffers(local):
                        buf[slots(get_pages)] = 0
        t0 = time.perf_counter()
        start = _event(cuda, compute)
        index = linker_b.start_layer_wise_loading()
        linker_b.layer_done_counter.set_consumer(index)
        same = []
        with (torch.cuda.stream(compute) if cuda else _null()):
            for local, layer in enumerate(b.model_layer_ids):
                bufs = b.get_key_buffer(layer)  # wait_until(local): on CUDA the stream waits
                marks.append((time.perf_counter() - t0, _event(cuda, compute)))
                got = [buf[slots(get_pages)].view(torch.uint8) for buf in bufs]
                # Compared on the stream, checked at the end: a CPU sync here would let every
                # later layer land before its own stream wait is put to the test.
                same += [(g == w).all() for g, w in zip(got, want[local], strict=True)]
        if cuda:
            compute.synchronize()
            result["gpu_ms_until_layer0_usable"] = round(start.elapsed_time(marks[0][1]), 3)
            result["gpu_ms_until_last_layer_usable"] = round(start.elapsed_time(marks[-1][1]), 3)
        result["cpu_ms_until_layer0_released"] = round(marks[0][0] * 1e3, 3)
        result["finished"] = linker_b.finish_layer_wise_loading(index)
        result["ms_whole_load"] = round((time.perf_counter() - t0) * 1e3, 3)
        result["exact"] = bool(torch.stack(same).all()) and len(same) == b.layer_num * len(b.buffers(0))
        result["past_slots_untouched"] = all(
            torch.equal(r, u) for local in range(b.layer_num)
            for r, u in zip(rows(b, local, extra), untouched[local], strict=True))

        # 3. A miss: keys never stored; the load fails and touches nothing.
        other = storage_hashes([t + 1 for t in tokens[: 4 * PAGE]])
        before = [[r.clone() for r in rows(b, local, extra)] for local in range(b.layer_num)]
        linker_b.load("r2", [PoolTransfer(name=PoolName.KV, keys=other, device_indices=slots(extra))])
        index = linker_b.start_layer_wise_loading()
        linker_b.layer_done_counter.set_consumer(index)
        with (torch.cuda.stream(compute) if cuda else _null()):
            for layer in b.model_layer_ids:
                b.get_key_buffer(layer)
        result["miss_reported"] = linker_b.finish_layer_wise_loading(index) is False
        result["miss_untouched"] = all(torch.equal(r, u) for local in range(b.layer_num)
                                       for r, u in zip(rows(b, local, extra), before[local], strict=True))
    finally:
        linker_a.close()
        linker_b.close()
    result["ok"] = bool(result.get("offloaded") and result.get("lookup") == PAGES and result.get("queued")
                        and result.get("finished") and result.get("exact")
                        and result.get("past_slots_untouched") and result.get("miss_reported")
                        and result.get("miss_untouched"))
    return result


def _event(cuda: bool, stream):
    """A timing event recorded on ``stream`` now (CUDA), else None."""
    if not cuda:
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
