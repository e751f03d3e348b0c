"""One-shot GPU check of the CUDA IPC path: correctness, per-layer events, bandwidth.

Run on a machine with one CUDA GPU, from the repository root (100-117 s on an H200, 2026-12-04):

    python scripts/gpu_check.py [--quick]

It starts the daemon as a subprocess, spawns engine processes (spawn, never fork) whose KV pools
are torch CUDA tensors, and checks:
1. write -> wipe -> load is bit-exact for MHA (bf16) and MLA (fp8) pools, with two engines that
   hold layers [0, 16) and [16, 32) of one model;
2. per-layer events: after ``stream_wait_layer(0)`` the engine reads layer 0 on its own stream,
   correctly, while the last layer's event has not completed yet;
3. host <-> device bandwidth through the daemon for scattered pages of 1, 16 and 64 tokens,
   against a contiguous pinned cudaMemcpy of the same bytes measured in the same run;
4. after unregister, the pool's memory goes back to torch when the engine frees it;
5. a pool whose buffers reach past the real allocation (declared allocation_size 2^63) is refused
   with INVALID_ARGUMENT;
6. a write waiting on an engine ready event that does not fire (recorded behind a spinning
   kernel) fails with DEADLINE_EXCEEDED past the daemon's --cuda-wait-seconds and fails only its
   own client: another client on the same GPU loads bit-exactly all along, the stalled one is
   reclaimed, and its quarantined host region is released once the spinning kernel ends;
7. the node-wide cache on real CUDA tensors: one engine Puts scattered pages of its pool under
   their content keys (``page_keys``) and unregisters; a second registration, in another process
   with its own pool, looks the keys up, Gets them (plus keys never stored) into other scattered
   pages of its pool, and reads each layer on its compute stream right after
   ``stream_wait_layer``: bit for bit the first engine's pages, the pages past the stored prefix
   untouched; and a Put whose ready event fires after its deadline (behind another engine's
   spinning kernel) is answered DEADLINE_EXCEEDED and stores nothing (``late_put``);
8. the SGLang linker (``kvclient.sglang.linker.KVServerLinker``, scripts/gpu_check_sglang.py) on
   CUDA tensors shaped like SGLang's MHA (bf16) and MLA (fp8 stored as uint8) pools of one PP
   stage (global layers [4, 8)): one linker offloads scattered pages after its forward stream's
   write, another looks them up, loads them into other slots, and its "attention" reads every
   layer through the pool's ``get_key_buffer`` hook on its compute stream, where the linker's
   counter makes the stream wait for that layer's event: bit for bit, slots past the load
   untouched, and a load of keys never stored reported failed with its slots untouched;
9. the vLLM connector's worker side (``kvclient.vllm._worker.WorkerSide``,
   scripts/gpu_check_vllm.py) on CUDA per-layer views laid out as vLLM 0.33 lays them out (MHA
   bf16 8 x 128 in LBNHC and LBHNC, MLA fp8 stored as uint8 1 x 576 in LBNHC) of an 8-layer
   model: engine A's compute stream rewrites scattered blocks behind a spinning kernel and
   ``wait_for_save`` is called at once (only the worker's ready event orders the daemon's read),
   ``get_finished`` reports the request once its Puts are done; engine B, whose compute stream
   still writes the target blocks' old contents behind a spinning kernel, calls
   ``start_load_kv``, then ``wait_for_layer_load`` per layer and compares that layer with A's
   blocks on the stream: bit for bit, ``load_errors()`` empty, blocks past the load untouched;
   a load of keys never stored has exactly its blocks reported by ``load_errors()``, untouched,
   and a partly stored load has its prefix exact and exactly the rest reported.
It prints one JSON document and exits non-zero if a check failed. ``--preflight`` runs only
what needs no GPU (imports from this tree, daemon start and health) and is tested on CPU.
Needs torch with CUDA, CuPy (cupy-cuda12x or cupy-cuda13x) with NVRTC, grpcio, protobuf, uvloop,
grpcio-reflection and grpcio-health-checking; kvserver and kvclient come from this source tree,
installed or not.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_WAIT_SECONDS = 5  # the daemon's --cuda-wait-seconds in this check
LANE_TRIPS = 200  # one-page write + load round trips timed per engine (the fast lane)
STALL_SECONDS = 12  # how long the stalled client's ready event is held back (> CUDA_WAIT_SECONDS)
# Writes the stalled client sends behind its ready event besides the one timed: more than the
# daemon's 64 waiter threads, which one stalled pool held all of before its waits went one at a
# time (B's loads then waited for A's deadline); and more driver calls (11 each) than a stream's
# queue is reported to take (about 1000), which would hold a copy worker in a driver call were
# the daemon not to keep each stream within plan.MAX_QUEUED (512) calls.
STALL_EXTRA_WRITES = 100
# The cache round trip: an 8-layer MHA (8 x 128, bf16) model, pools of 4096 tokens, 64 pages of 16
# tokens stored (32 MiB) and 4 more asked for that were never stored.
CACHE_LAYERS, CACHE_TOKENS, CACHE_PAGE, CACHE_PAGES, CACHE_EXTRA = 8, 4096, 16, 64, 4
CACHE_SEEDS = {"put": 11, "get": 12}  # each engine's pool contents
# The late Put (``late_put``): its deadline (timeout_ms) and how long its ready event is held back
# behind another engine's spinning kernel (past that deadline, well within CUDA_WAIT_SECONDS).
LATE_TIMEOUT_MS, LATE_SPIN_SECONDS = 300, 0.8
# The vLLM worker-side round (scripts/gpu_check_vllm.py): (pool kind, vLLM 0.33 layout), its CASES.
VLLM_CASES = (("mha", "LBNHC"), ("mha", "LBHNC"), ("mla", "LBNHC"))


def _use_source_tree() -> None:
    """kvserver and kvclient from this tree, installed or not: kvclient's sources live in client/,
    so a bare tree (as on a lent GPU machine) reaches them through a symlink named kvclient. Spawned
    engines inherit sys.path, and with it the link."""
    sys.path.insert(0, ROOT)
    client = os.path.realpath(os.path.join(ROOT, "client"))
    spec = importlib.util.find_spec("kvclient")
    if spec is not None and spec.origin and os.path.dirname(os.path.realpath(spec.origin)) == client:
        return
    link_dir = tempfile.mkdtemp(prefix="kvclient-src-")
    os.symlink(client, os.path.join(link_dir, "kvclient"))
    sys.path.insert(0, link_dir)
    atexit.register(shutil.rmtree, link_dir, True)


_use_source_tree()


def engine(address: str, kind: str, start: int, end: int, num_layers: int, page_size: int,
           num_tokens: int, transfer_tokens: int, bench_rounds: int, out, bench_lock, barrier=None) -> None:
    """One engine process: a CUDA pool for layers [start, end), checks, and timings. It reports
    each stage as it starts, so a hang is reported with where it happened."""
    result = {"kind": kind, "range": [start, end], "page_size": page_size}

    def stage(name: str) -> None:
        out.put({"range": [start, end], "stage": name})

    try:
        stage("import torch and allocate the pool")
        import torch

        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        from kvclient import CudaKVPool, KVClient, KVLayout

        dev = torch.device("cuda", 0)
        if kind == "mha":
            layout, dtype = KVLayout.mha(8, 128), torch.bfloat16
        else:
            layout, dtype = KVLayout.mla(512, 64), torch.float8_e4m3fn
        heads, dim = layout.token_shape
        g = torch.Generator(device=dev).manual_seed(start)
        buffers = [[torch.randint(0, 255, (num_tokens, heads, dim * dtype.itemsize), dtype=torch.uint8,
                                  device=dev, generator=g).view(dtype) for _ in range(layout.num_parts)]
                   for _ in range(end - start)]
        stage("register (IPC open, pinning)")
        pool = CudaKVPool(layout, dtype, buffers)
        client = KVClient(address, timeout=60, resilient=False)
        client.register(model=f"check-{kind}", pool=pool, start_layer=start, end_layer=end,
                        num_layers=num_layers, host_tokens=transfer_tokens, page_size=page_size,
                        pp_rank=start // (end - start), pp_size=num_layers // (end - start))
        pages = transfer_tokens // page_size
        perm = torch.randperm(num_tokens // page_size, generator=torch.Generator().manual_seed(1))[:pages]
        dev_idx = (perm[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        host = client.alloc(transfer_tokens)
        host = host.view(-1, page_size).flip(0).reshape(-1)  # scattered on the host side too
        nbytes = transfer_tokens * layout.token_bytes(dtype) * layout.num_parts * (end - start)

        # 1. bit-exact round trip, with the engine's ready event ordering the write.
        stage("write, wipe, load")
        want = [[b.view(torch.uint8)[dev_idx.to(dev)].clone() for b in layer] for layer in buffers]
        ready = torch.cuda.Event(interprocess=True)
        ready.record()
        assert client.write(host_indices=host, device_indices=dev_idx, ready_event=ready) == nbytes
        for layer in buffers:
            for b in layer:
                b.view(torch.uint8)[dev_idx.to(dev)] = 0
        del layer, b  # no name may keep a pool buffer alive past step 4
        torch.cuda.synchronize()

        # 2. layer 0 on the engine's stream right after its event, while later layers still land.
        stream = torch.cuda.Stream()
        dev_idx_gpu = dev_idx.to(dev)

        def layer0(event_slot: int, first: list) -> tuple[dict, list]:
            """Loads, reads layer 0 on ``stream`` right after its event; when each step came."""
            t0 = time.perf_counter()
            handle = client.load(host_indices=host, device_indices=dev_idx, event_slot=event_slot)
            assert handle.wait_recorded()
            t1 = time.perf_counter()
            last = handle.events[end - 1]
            assert handle.stream_wait_layer(start, stream)
            with torch.cuda.stream(stream):
                got0 = [b.view(torch.uint8)[dev_idx_gpu].clone() for b in first]
                done0 = torch.cuda.Event()
                done0.record(stream)
            done0.synchronize()
            t2 = time.perf_counter()
            before_last = not last.query()
            handle.wait()
            t3 = time.perf_counter()
            del last, handle
            return {"before_last_layer": before_last, "ms_until_recorded": round((t1 - t0) * 1e3, 2),
                    "ms_until_layer0_read": round((t2 - t0) * 1e3, 2),
                    "ms_until_load_done": round((t3 - t0) * 1e3, 2)}, got0

        # (with the other engine of the model loading at the same time, as in a PP step)
        if barrier is not None:
            stage("wait for the other engine, then load")
            barrier.wait(120)
        timing, got0 = layer0(0, buffers[0])
        result["layer0_ready_before_last_layer"] = timing["before_last_layer"]
        result["layer0_timing"] = timing
        result["layer0_exact"] = all(torch.equal(a, b) for a, b in zip(got0, want[0], strict=True))
        torch.cuda.synchronize()
        result["exact"] = all(torch.equal(b.view(torch.uint8)[dev_idx.to(dev)], w)
                              for layer, wl in zip(buffers, want, strict=True)
                              for b, w in zip(layer, wl, strict=True))

        # 3. bandwidth: daemon write and load vs a contiguous pinned copy of the same bytes, one
        # engine at a time, once both are done with the steps above.
        if barrier is not None:
            stage("wait for the other engine to be past its first load")
            barrier.wait(120)
        stage("bandwidth")
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def timed(fn) -> float:
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(bench_rounds):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / bench_rounds

        with bench_lock:  # one engine at a time: the two would share the link and skew the ratios
            t = {
                "memcpy_h2d": timed(lambda: gpu.copy_(pinned, non_blocking=True)),
                "memcpy_d2h": timed(lambda: pinned.copy_(gpu, non_blocking=True)),
                "daemon_write_d2h": timed(lambda: client.write(host_indices=host, device_indices=dev_idx)),
                "daemon_load_h2d": timed(lambda: client.load(host_indices=host, device_indices=dev_idx,
                                                             event_slot=1).wait()),
            }
            # The same layer-0 read with this engine alone on the GPU.
            result["layer0_alone"] = layer0(1, buffers[0])[0]
            # One page on the lane the client took (the fast lane on a Unix socket: docs/lane.md):
            # write + load round trips against a pinned cudaMemcpy of the same page both ways.
            one_host, one_dev = host[:page_size], dev_idx[:page_size]
            page_bytes = nbytes // pages
            one_pinned = torch.empty(page_bytes, dtype=torch.uint8, pin_memory=True)
            one_gpu = torch.empty(page_bytes, dtype=torch.uint8, device=dev)
            trips, copies, engine_cpu = [], [], 0.0
            for _ in range(LANE_TRIPS):
                t0, c0 = time.perf_counter(), time.process_time()
                client.write(host_indices=one_host, device_indices=one_dev)
                client.load(host_indices=one_host, device_indices=one_dev, event_slot=1).wait()
                trips.append(time.perf_counter() - t0)
                engine_cpu += time.process_time() - c0
                t0 = time.perf_counter()
                one_gpu.copy_(one_pinned, non_blocking=True)
                one_pinned.copy_(one_gpu, non_blocking=True)
                torch.cuda.synchronize()
                copies.append(time.perf_counter() - t0)
            trips.sort()
            copies.sort()
            result["page_round_trip_us"] = {
                "lane": "ring" if client.lane is not None else "grpc",
                "p50": round(trips[len(trips) // 2] * 1e6, 1),
                "p99": round(trips[int(len(trips) * 0.99)] * 1e6, 1),
                "pinned_memcpy_p50": round(copies[len(copies) // 2] * 1e6, 1),
                # the engine's CPU per round trip, and the lane's request format (1: binary; a
                # CUDA pool's requests are served by the daemon's loop unless it runs with
                # --plane-cuda: then by its compiled data plane, report["plane_cuda"])
                "engine_cpu_us": round(engine_cpu / LANE_TRIPS * 1e6, 1),
                "request_format": client.lane.request_format if client.lane is not None else 0,
            }
        result["bytes"] = nbytes
        result["lane"] = "ring" if client.lane is not None else "grpc"
        result["GBps"] = {k: round(nbytes / v / 1e9, 2) for k, v in t.items()}
        result["load_vs_memcpy"] = round(t["memcpy_h2d"] / t["daemon_load_h2d"], 3)
        result["write_vs_memcpy"] = round(t["memcpy_d2h"] / t["daemon_write_d2h"], 3)

        # 4. after unregister, the pool's memory goes back to torch when the engine frees it
        # (the exports' IPC reference counts are released; otherwise torch holds it back).
        stage("unregister and free")
        pool_bytes = sum(b.untyped_storage().nbytes() for layer in buffers for b in layer)
        del want, got0  # freed first, so that they cannot make up for the pool
        gc.collect()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(dev)
        client.unregister()
        del pool, buffers
        gc.collect()
        torch.cuda.empty_cache()
        result["pool_memory_returned"] = reserved - torch.cuda.memory_reserved(dev) >= pool_bytes
        client.close()
    except BaseException:
        result["error"] = traceback.format_exc()
        if barrier is not None:
            barrier.abort()  # the other engine stops waiting for this one at once
    result["final"] = True
    out.put(result)


def _spin_cycles_per_ms(torch) -> float:
    """``torch.cuda._sleep``'s cycles a millisecond, measured once the clocks have risen (a spin
    calibrated at idle clocks ends early)."""
    cycles_per_ms = 0.0
    for _ in range(3):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        torch.cuda._sleep(200_000_000)
        t1.record()
        t1.synchronize()
        cycles_per_ms = max(cycles_per_ms, 200_000_000 / max(t0.elapsed_time(t1), 1e-3))
    return cycles_per_ms


def queue_depth_probe(out, spin_seconds: float = 2.0, max_calls: int = 8192) -> None:
    """How many driver calls a stream takes behind work that does not end before a call waits for
    room: the bound the data plane must stay under (plan.PLANE_MAX_QUEUED), since its one thread
    must never wait in the driver. For each kind of call the plane makes, on a stream of its own
    held by a kernel spinning for ``spin_seconds``: 512-byte cuMemcpyAsync calls from pinned host
    memory, kernel launches (a one-cycle ``torch.cuda._sleep``: the runtime's launch, the driver's
    queue), and cuEventRecord calls. A call taking over 20 ms is taken to have waited; per kind,
    the calls taken before it (None: none of ``calls_made`` waited, in at most half the spin)."""
    result: dict = {"kind": "queue_depth", "spin_seconds": spin_seconds}
    try:
        import ctypes

        import torch

        cycles_per_ms = _spin_cycles_per_ms(torch)
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        src = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory()
        dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        event = torch.cuda.Event()
        event.record()  # created: torch makes a CUDA event only at its first record
        torch.cuda.synchronize()
        d, h, ev = dst.data_ptr(), src.data_ptr(), ctypes.c_void_p(event.cuda_event)

        def memcpy(s, k: int) -> int:
            return lib.cuMemcpyAsync(d + (k % 2048) * 512, h + (k % 2048) * 512, 512, s)

        def launch(s, k: int) -> int:
            torch.cuda._sleep(1)  # on the current stream: the probe's
            return 0

        def record(s, k: int) -> int:
            return lib.cuEventRecord(ev, s)

        for name, call in (("memcpy", memcpy), ("launch", launch), ("event_record", record)):
            stream = torch.cuda.Stream()
            s = ctypes.c_void_p(stream.cuda_stream)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(cycles_per_ms * spin_seconds * 1000))
                start, slowest, made, waited_at = time.perf_counter(), 0.0, 0, None
                while made < max_calls and time.perf_counter() - start < spin_seconds / 2:  # the spin holds
                    t0 = time.perf_counter()
                    rc = call(s, made)
                    took = time.perf_counter() - t0
                    if rc:
                        raise RuntimeError(f"{name}: CUresult {rc} after {made} calls")
                    slowest = max(slowest, took)
                    if took > 0.02:
                        waited_at = made  # the calls the stream took before this one
                        break
                    made += 1
            stream.synchronize()
            result[name] = {"calls_before_a_wait": waited_at, "calls_made": made + (waited_at is not None),
                            "slowest_call_ms": round(slowest * 1e3, 3)}
        result["ok"] = True
    except Exception:
        result.update(ok=False, error=traceback.format_exc())
    out.put(result)


def stall_spinner(seconds: float, conn) -> None:
    """Another engine process's forward work: sends an interprocess event's handle, then, on
    "go", records it behind a kernel that spins for ``seconds`` (calibrated once the clocks have
    risen: a spin calibrated at idle clocks ends early), says "spinning", and "done" once it fired."""
    import torch

    cycles_per_ms = _spin_cycles_per_ms(torch)
    ready = torch.cuda.Event(interprocess=True)
    side = torch.cuda.Stream()
    ready.record(side)
    torch.cuda.synchronize()
    conn.send(bytes(ready.ipc_handle()))
    conn.recv()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(cycles_per_ms * seconds * 1000))
        ready.record(side)
    conn.send("spinning")
    ready.synchronize()
    conn.send("done")


def safety_engine(address: str, wait_seconds: float, stall_seconds: float, out) -> None:
    """One engine process checking the daemon against hostile or stuck engines on a real GPU:
    an oversized declared span, and a ready event that does not fire for ``stall_seconds``."""
    result: dict = {"kind": "safety", "range": [0, 1]}

    def stage(name: str) -> None:
        out.put({"range": [0, 1], "stage": name})

    try:
        stage("import torch and allocate the pools")
        import threading

        import torch

        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        from kvclient import CudaKVPool, KVClient, KVClientError, KVLayout

        dev = torch.device("cuda", 0)
        layout, dtype, tokens = KVLayout.mha(8, 128), torch.bfloat16, 4096

        def new_pool(seed: int) -> CudaKVPool:
            g = torch.Generator(device=dev).manual_seed(seed)
            heads, dim = layout.token_shape
            return CudaKVPool(layout, dtype, [[
                torch.randint(0, 255, (tokens, heads, dim * 2), dtype=torch.uint8, device=dev,
                              generator=g).view(dtype) for _ in range(2)] for _ in range(2)])

        def register(client, pool) -> None:
            client.register(model="check-safety", pool=pool, start_layer=0, end_layer=2, num_layers=2,
                            host_tokens=1024, page_size=16)

        # 5. buffers reaching far past the real allocation, declared inside 2^63 bytes.
        stage("oversized declared span")
        pool = new_pool(1)

        class Oversized:
            def __init__(self, inner) -> None:
                self.layout, self.dtype, self.buffers = inner.layout, inner.dtype, inner.buffers
                self.inner = inner

            def descriptor(self):
                desc = self.inner.descriptor()
                for layer in desc.layers:
                    for part in layer.parts:
                        part.cuda.allocation_size = 1 << 63
                desc.num_tokens = tokens * 4096  # 4096 times what the tensors hold
                return desc

        probe = KVClient(address, timeout=60, resilient=False)
        try:
            register(probe, Oversized(pool))
            result["oversized_span_refused"] = False
        except KVClientError as exc:
            result["oversized_span_refused"] = (exc.code.name == "INVALID_ARGUMENT"
                                                and "the allocation the handle opens is" in exc.message)
            result["oversized_span_message"] = exc.message[:300]
        probe.close()

        # 6. client A's ready event does not fire for stall_seconds; client B loads meanwhile.
        stage("stalled ready event")
        b, a = KVClient(address, timeout=60, resilient=False), KVClient(address, timeout=60, resilient=False)
        register(b, pool)
        reserved_b = b.stats(all_clients=True).reserved_bytes
        pool_a = new_pool(2)
        register(a, pool_a)
        dev_idx = torch.arange(256)
        host_b, host_a = b.alloc(256), a.alloc(256)
        want = [[t.view(torch.uint8)[:256].clone() for t in layer] for layer in pool.buffers]
        torch.cuda.synchronize()
        b.write(host_indices=host_b, device_indices=dev_idx)
        # The ready event is another engine process's, recorded behind its spinning kernel: a
        # spin in this process could hold up B's own wipes here (streams of one process can
        # share a hardware queue), which would say nothing about the daemon.
        spin_end, spin_far = mp.get_context("spawn").Pipe()
        spinner = mp.get_context("spawn").Process(target=stall_spinner, args=(stall_seconds, spin_far),
                                                  daemon=True)
        spinner.start()
        spin_far.close()  # the spinner's end only: if it dies, a read here ends at once
        if not spin_end.poll(120):
            raise RuntimeError("the spinning engine did not start within 120 s")
        ready = spin_end.recv()  # the event's handle
        # A first write naming the event, recorded and passed, before the spin: the loop opens the
        # event, and A's stalled write is then the data plane's where it puts CUDA copies on the
        # GPU (--plane-cuda), which must give it up as the loop does.
        a.write(host_indices=host_a, device_indices=dev_idx, ready_event=ready)
        spin_end.send("go")
        if not spin_end.poll(60) or spin_end.recv() != "spinning":
            raise RuntimeError("the spinning engine did not spin")
        stall: dict = {"a_public_id": a.registration.client_id[:8] + "..."}  # as the daemon logs it
        result["stall"] = stall

        def stalled_write() -> None:
            start = time.monotonic()
            try:
                a.write(host_indices=host_a, device_indices=dev_idx, ready_event=ready)
                stall["a_code"] = "OK"
            except KVClientError as exc:
                stall["a_code"], stall["a_message"] = exc.code.name, exc.message[:300]
            stall["a_seconds"] = round(time.monotonic() - start, 2)

        # 16 scattered tokens each: the copy kernel's 11 driver calls (the wait, 4 uploads of 2
        # calls, the launch, the record), 1100 in all: the last ones wait in the daemon's copy
        # queue, not in a full driver queue on a copy worker every engine's copies need.
        def extra_write() -> None:
            try:
                a.write(host_indices=host_a[:16], device_indices=dev_idx[:32:2], ready_event=ready)
                code = "OK"
            except KVClientError as exc:
                code = exc.code.name
            with extra_lock:
                extra_codes[code] = extra_codes.get(code, 0) + 1

        extra_codes: dict[str, int] = {}
        extra_lock = threading.Lock()
        spin_started = time.monotonic()
        writer = threading.Thread(target=stalled_write)
        writer.start()
        extras = [threading.Thread(target=extra_write, daemon=True) for _ in range(STALL_EXTRA_WRITES)]
        for t in extras:
            t.start()
        loads, exact, wipe_s, load_s = 0, True, [], []
        work = torch.cuda.Stream()  # B's own stream: nothing it waits for is behind the spin
        while writer.is_alive():
            w0 = time.monotonic()
            with torch.cuda.stream(work):
                for layer in pool.buffers:
                    for t in layer:
                        t.view(torch.uint8)[:256] = 0
            work.synchronize()  # this stream only: the device-wide one would wait for the spin
            w1 = time.monotonic()
            b.load(host_indices=host_b, device_indices=dev_idx).wait()
            w2 = time.monotonic()
            with torch.cuda.stream(work):
                exact &= all(torch.equal(t.view(torch.uint8)[:256], w)
                             for layer, wl in zip(pool.buffers, want, strict=True)
                             for t, w in zip(layer, wl, strict=True))
            wipe_s.append(w1 - w0)
            load_s.append(w2 - w1)
            loads += 1
        writer.join()
        for t in extras:
            t.join(wait_seconds + 30)
        stall["a_extra_writes"] = dict(extra_codes)
        stall["b_loads_during_stall"], stall["b_exact"] = loads, exact
        # where B's time went: a load held up by A's stall shows here, apart from the check's own
        stall["b_wipe_seconds_max"] = round(max(wipe_s, default=0.0), 4)
        stall["b_load_seconds_max"] = round(max(load_s, default=0.0), 4)
        stall["b_load_seconds_median"] = round(sorted(load_s)[len(load_s) // 2], 4) if load_s else None
        stalled_at = time.monotonic()

        def a_gone() -> bool:
            try:
                a.stats()
            except KVClientError as exc:
                return exc.code.name == "NOT_FOUND"
            return False

        while time.monotonic() - stalled_at < 5 and not a_gone():
            time.sleep(0.1)
        stall["a_reclaimed"] = a_gone()
        stall["held_while_stalled"] = b.stats(all_clients=True).reserved_bytes > reserved_b
        # the hold is looked at while the spin still runs, or the look proves nothing
        # it says "done" once the event fired (a dead spinner is not spinning either)
        stall["spin_running_at_check"] = spinner.is_alive() and not spin_end.poll()
        stall["seconds_since_spin_start"] = round(time.monotonic() - spin_started, 2)
        # C: a third client's whole life while A's stream is still held up. Its scattered rows
        # take CuPy blocks for their offset tables on its stream, which its release frees; a
        # cudaFree waits for every stream of the device, A's stalled one too: if the release
        # waits for the spin, other engines' Unregisters do (and CuPy's pool lock with them).
        c = KVClient(address, timeout=60, resilient=False)
        register(c, new_pool(3))
        host_c, dev_c = c.alloc(256), torch.randperm(tokens)[:256]
        c0 = time.monotonic()
        c.write(host_indices=host_c, device_indices=dev_c)  # (its blocks' cudaMalloc: as cudaFree?)
        c1 = time.monotonic()
        c.load(host_indices=host_c, device_indices=dev_c).wait()
        stall["c_write_seconds"], stall["c_load_seconds"] = round(c1 - c0, 3), round(time.monotonic() - c1, 3)
        stall["c_spin_running"] = spinner.is_alive() and not spin_end.poll()
        u0 = time.monotonic()
        c.unregister()
        stall["c_unregister_seconds"] = round(time.monotonic() - u0, 3)
        c.close()
        a.close()
        while time.monotonic() - stalled_at < stall_seconds + 10:
            if b.stats(all_clients=True).reserved_bytes == reserved_b:
                break
            time.sleep(0.2)
        stall["quarantine_released"] = b.stats(all_clients=True).reserved_bytes == reserved_b
        stall["quarantine_seconds"] = round(time.monotonic() - stalled_at, 1)
        b.unregister()
        b.close()
        spinner.join(stall_seconds + 30)
        result["ok"] = bool(result["oversized_span_refused"] and stall["a_code"] == "DEADLINE_EXCEEDED"
                            and stall["a_seconds"] < wait_seconds + 3 and loads >= 1 and exact
                            and stall["b_load_seconds_max"] < wait_seconds / 2  # never behind A's waits
                            and stall["a_reclaimed"] and stall["held_while_stalled"]
                            and stall["spin_running_at_check"]
                            and stall["c_write_seconds"] < 2 and stall["c_load_seconds"] < 2
                            and (not stall["c_spin_running"] or stall["c_unregister_seconds"] < 2)
                            and stall["quarantine_released"])
    except BaseException:
        result["error"] = traceback.format_exc()
        result["ok"] = False
    result["final"] = True
    out.put(result)


def cache_plan(num_tokens: int = CACHE_TOKENS, page_size: int = CACHE_PAGE, pages: int = CACHE_PAGES,
               extra: int = CACHE_EXTRA, seed: int = 7) -> dict:
    """What the cache round trip moves, decided without a GPU: the token ids of ``pages + extra``
    whole pages (the first ``pages`` get stored), the storing engine's device pages (``pages``,
    scattered) and the loading engine's (``pages + extra``, scattered, another order)."""
    import random

    pool_pages = num_tokens // page_size
    if pages + extra > pool_pages:
        raise ValueError(f"{pages + extra} pages do not fit a pool of {pool_pages}")
    rng = random.Random(seed)
    return {
        "page_size": page_size,
        "pages": pages,
        "tokens": [rng.randrange(128_000) for _ in range((pages + extra) * page_size)],
        "put_pages": rng.sample(range(pool_pages), pages),
        "get_pages": rng.sample(range(pool_pages), pages + extra),
    }


def late_put(address: str, pool, packed: bytes, pages: list[int], page: int) -> dict:
    """A Put already on the GPU whose copy ends after its deadline: its ready event is another
    engine's, recorded behind a kernel spinning for LATE_SPIN_SECONDS, past the Put's deadline
    (LATE_TIMEOUT_MS). Its engine may have reused the device pages by the time the copy reads them,
    so the daemon answers DEADLINE_EXCEEDED, the copy ended after its timeout_ms, and stores
    nothing; a Put of the first key behind that event fired already stores it. ``packed``: keys
    of 16 bytes never stored otherwise; ``pages`` their device pages. The Puts are raw gRPC calls,
    each with its own timeout_ms, of a registration of ``pool``."""
    import grpc

    from kvclient import KVClient
    from kvserver.v1 import kvserver_pb2 as pb
    from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

    result: dict = {"spin_seconds": LATE_SPIN_SECONDS, "timeout_ms": LATE_TIMEOUT_MS}
    keys = [packed[i:i + 16] for i in range(0, len(packed), 16)]
    spin_end, spin_far = mp.get_context("spawn").Pipe()
    spinner = mp.get_context("spawn").Process(target=stall_spinner, args=(LATE_SPIN_SECONDS, spin_far),
                                              daemon=True)
    spinner.start()
    spin_far.close()
    client = KVClient(address, timeout=60, resilient=False)
    try:
        client.register(model="check-cache", pool=pool, start_layer=0, end_layer=CACHE_LAYERS,
                        num_layers=CACHE_LAYERS, host_tokens=page, page_size=page)
        if not spin_end.poll(120):
            raise RuntimeError("the spinning engine did not start within 120 s")
        ready = spin_end.recv()

        def put(n: int, at: int, timeout_ms: int):
            return pb.PutRequest(client_id=client.registration.client_id, keys=b"".join(keys[at:at + n]),
                                 key_bytes=16, device_pages=pages[at:at + n], ready_event=ready,
                                 timeout_ms=timeout_ms)

        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.KVServerStub(channel)
            result["in_time_stored"] = stub.Put(put(1, 0, 60_000), timeout=60).stored
            spin_end.send("go")
            if not spin_end.poll(60) or spin_end.recv() != "spinning":
                raise RuntimeError("the spinning engine did not spin")
            start = time.monotonic()
            try:
                result["code"], result["stored"] = "OK", stub.Put(put(len(keys) - 1, 1, LATE_TIMEOUT_MS),
                                                                  timeout=60).stored
            except grpc.RpcError as exc:
                result["code"], result["message"] = exc.code().name, (exc.details() or "")[:300]
            result["seconds"] = round(time.monotonic() - start, 2)
        if not spin_end.poll(LATE_SPIN_SECONDS + 60):
            raise RuntimeError("the spinning engine's event never fired")
        result["lookup"] = client.lookup(packed).pages  # the leading key only
        client.unregister()
    finally:
        client.close()
        spinner.join(30)
    result["ok"] = (result["in_time_stored"] == 1 and result["code"] == "DEADLINE_EXCEEDED"
                    and "copy ended after its timeout_ms" in result.get("message", "")
                    and result["lookup"] == 1)
    return result


def cache_engine(address: str, role: str, plan: dict, out, stored) -> None:
    """One engine of the cache round trip: ``put`` stores its pages and unregisters, then sets
    ``stored``; ``get`` waits for that, then loads them into its own pool (see the module's notes)."""
    label = [0, 1] if role == "put" else [1, 2]
    result: dict = {"kind": f"cache-{role}", "range": label}

    def stage(name: str) -> None:
        out.put({"range": label, "stage": name})

    try:
        stage("import torch and allocate the pool")
        import torch

        from kvclient import CudaKVPool, KVClient, KVLayout
        from kvclient.keys import page_keys

        dev = torch.device("cuda", 0)
        layout, dtype, page = KVLayout.mha(8, 128), torch.bfloat16, plan["page_size"]
        heads, dim = layout.token_shape

        def buffers_of(seed: int) -> list[list]:
            g = torch.Generator(device=dev).manual_seed(seed)
            return [[torch.randint(0, 255, (CACHE_TOKENS, heads, dim * dtype.itemsize), dtype=torch.uint8,
                                   device=dev, generator=g).view(dtype) for _ in range(layout.num_parts)]
                    for _ in range(CACHE_LAYERS)]

        def rows(buf, pages: list[int]):
            """The bytes of ``pages`` of one buffer, [pages, page_size * token bytes]."""
            return buf.view(torch.uint8).view(CACHE_TOKENS // page, -1)[torch.tensor(pages, device=dev)]

        buffers = buffers_of(CACHE_SEEDS[role])
        stage("register")
        pool = CudaKVPool(layout, dtype, buffers)
        client = KVClient(address, timeout=60, resilient=False)
        client.register(model="check-cache", pool=pool, start_layer=0, end_layer=CACHE_LAYERS,
                        num_layers=CACHE_LAYERS, host_tokens=page, page_size=page)
        n = plan["pages"]
        if role == "put":
            stage("put")
            keys = page_keys(plan["tokens"][: n * page], page)
            ready = torch.cuda.Event(interprocess=True)
            ready.record()
            put = client.put(keys, plan["put_pages"], ready_event=ready)
            again = client.put(keys, plan["put_pages"])  # stored already: every key is present
            result.update(stored=put.stored, dropped=put.dropped, present_again=again.present,
                          stored_again=again.stored)
            stage("unregister (the pages outlive their writer)")
            client.unregister()
            stored.set()
            stage("a put whose copy ends after its deadline (behind a spinning engine's event)")
            late_keys = page_keys(plan["tokens"][: n * page], page, salt=b"late")
            late = result["late_put"] = late_put(address, pool, late_keys, plan["put_pages"], page)
            result["ok"] = put.stored == n and again.present == n and again.stored == 0 and late["ok"]
        else:
            stage("wait for the put")
            if not stored.wait(120):
                raise TimeoutError("the put engine did not store its pages within 120 s")
            want = [[rows(b, plan["put_pages"]) for b in layer] for layer in buffers_of(CACHE_SEEDS["put"])]
            extra = plan["get_pages"][n:]
            untouched = [[rows(b, extra).clone() for b in layer] for layer in buffers]
            keys = page_keys(plan["tokens"], page)  # the stored prefix, then keys never stored
            torch.cuda.synchronize()  # the pool's contents and the references exist before the Get
            stage("lookup and get")
            result["lookup"] = client.lookup(keys).pages
            handle = client.get(keys, plan["get_pages"], event_slot=0)
            result["pages"] = handle.pages(timeout=60)
            stream = torch.cuda.Stream()
            same, waited = [], []
            for layer in range(CACHE_LAYERS):
                waited.append(handle.stream_wait_layer(layer, stream))
                with torch.cuda.stream(stream):  # runs once the layer has landed, not before
                    same += [torch.equal(rows(b, plan["get_pages"][:n]), w)
                             for b, w in zip(buffers[layer], want[layer], strict=True)]
            handle.wait(60)
            torch.cuda.synchronize()
            result["layer_waits"] = all(waited)
            result["exact"] = all(same)
            result["past_prefix_untouched"] = all(torch.equal(rows(b, extra), u)
                                                  for layer, ul in zip(buffers, untouched, strict=True)
                                                  for b, u in zip(layer, ul, strict=True))
            client.unregister()
            result["ok"] = (result["lookup"] == n and result["pages"] == n and result["layer_waits"]
                            and result["exact"] and result["past_prefix_untouched"])
        client.close()
    except BaseException:
        result["error"] = traceback.format_exc()
        result["ok"] = False
        stored.set()  # the other engine stops waiting: it fails on what is not there
    result["final"] = True
    out.put(result)


def sglang_engine(address: str, kind: str, out) -> None:
    """The SGLang linker round (``gpu_check_sglang.run``) in its own engine process."""
    label = [0, 1] if kind == "mha" else [1, 2]
    result: dict = {"kind": f"sglang-linker-{kind}", "range": label}
    try:
        out.put({"range": label, "stage": "linker round"})
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_check_sglang

        result.update(gpu_check_sglang.run(address, kind, "cuda"))
    except BaseException:
        result["error"] = traceback.format_exc()
        result["ok"] = False
    result["final"] = True
    out.put(result)


def vllm_engine(address: str, kind: str, layout: str, out, device: str = "cuda") -> None:
    """The vLLM connector's worker-side round (``gpu_check_vllm.run``) in its own engine process.
    It always runs with the script's vLLM stand-in (a vLLM installed here is not imported): the
    check needs no vLLM, and runs the same on every machine."""
    label = [list(c) for c in VLLM_CASES].index([kind, layout])
    label = [label, label + 1]
    result: dict = {"kind": f"vllm-worker-{kind}-{layout}", "range": label}
    try:
        out.put({"range": label, "stage": "worker round"})
        if "vllm" not in sys.modules:
            sys.modules["vllm"] = None  # not importable: gpu_check_vllm puts its stand-in in
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_check_vllm

        result.update(gpu_check_vllm.run(address, kind, device, layout))
    except BaseException:
        result["error"] = traceback.format_exc()
        result["ok"] = False
    result["final"] = True
    out.put(result)


def preflight(address: str) -> dict:
    """What can be checked before any GPU work, and without a GPU: every module the check uses
    imports from this tree, the daemon answers its health check, and whether it can use CUDA."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    import kvclient
    import kvserver
    from kvclient import CudaKVPool, KVClient, KVLayout  # noqa: F401  (what the engines use)
    from kvserver.media.cuda import kernels, pool  # noqa: F401  (the daemon's CUDA path, sans CuPy)
    from kvserver.media.cuda.runtime import _probe

    with grpc.insecure_channel(address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    cupy, why = _probe()
    return {
        "kvserver": os.path.dirname(kvserver.__file__),
        "kvclient": os.path.dirname(os.path.realpath(kvclient.__file__)),
        "daemon_health": health_pb2.HealthCheckResponse.ServingStatus.Name(status),
        "cuda": "usable" if cupy is not None else why,
        "cupy_alone": cupy_alone(),
        "vllm_worker": _vllm_worker_imports(),
    }


# In a process that never imports torch: CuPy's device count, a kernel compiled by NVRTC and run.
CUPY_ALONE = """
import sys
import cupy
n = cupy.cuda.runtime.getDeviceCount()
k = cupy.RawKernel(r'extern "C" __global__ void one(int* x) { x[threadIdx.x] = 1; }', "one")
x = cupy.zeros(32, dtype=cupy.int32)
k((1,), (32,), (x,))
assert int(x.sum()) == 32 and "torch" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
print(f"usable: {n} device(s), a kernel compiled and run, without torch")
"""


def cupy_alone() -> str:
    """Whether CuPy finds the CUDA libraries without torch in the process (a daemon that opens a
    CUDA pool imports torch first: kvserver/media/cuda/runtime.py): what it printed, or why not."""
    try:
        run = subprocess.run([sys.executable, "-c", CUPY_ALONE], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "no answer within 120 s"
    if run.returncode == 0:
        return run.stdout.strip()
    return "failed: " + (run.stderr.strip().splitlines() or ["(no output)"])[-1][:300]


def _vllm_worker_imports() -> str:
    """kvclient's vLLM worker side imports over scripts/gpu_check_vllm.py's vLLM stand-in, as
    ``vllm_engine`` runs it (raises if not); what it imported is taken out of sys.modules again."""
    def ours(name: str) -> bool:
        return name in ("vllm", "gpu_check_vllm") or name.startswith(("vllm.", "kvclient.vllm"))

    saved = {n: m for n, m in sys.modules.items() if ours(n)}
    for name in saved:
        del sys.modules[name]
    sys.modules["vllm"] = None  # not importable, as on the GPU machine
    try:
        spec = importlib.util.spec_from_file_location(
            "gpu_check_vllm", os.path.join(ROOT, "scripts", "gpu_check_vllm.py"))
        check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(check)
        if not check.install_standin():
            raise RuntimeError("the vLLM stand-in was not installed")
        from kvclient.views_pool import KVViewsPool, SharedKVMemory  # noqa: F401
        from kvclient.vllm._worker import WorkerSide  # noqa: F401
        return "imports (vLLM stand-in)"
    finally:
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def _results(procs: dict, out, label: str, deadline: float):
    """Yields each engine's final message as it comes. Raises TimeoutError, with each engine's
    last stage, if they have not finished by ``deadline``, and RuntimeError if one dies without a
    result; engines still running then are killed."""
    stages = {r: "starting" for r in procs}
    try:
        while stages:
            try:
                msg = out.get(timeout=1.0)
            except queue.Empty:
                dead = {r: procs[r].exitcode for r in stages if not procs[r].is_alive()}
                if dead:
                    raise RuntimeError(f"{label}: engines {dead} (range: exit code) died at "
                                       f"{ {r: stages[r] for r in dead} }") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: engines still running at the deadline, at "
                                       f"{stages}") from None
                continue
            r = tuple(msg["range"])
            if "final" not in msg:
                stages[r] = msg["stage"]
                continue
            del stages[r]
            yield msg
    finally:
        for r, p in procs.items():
            p.join(0 if r in stages else 10)  # a hung engine is killed at once: GPU time is scarce
            if p.is_alive():
                p.kill()
                p.join(10)


def run_plan(ctx, address: str, kind: str, page: int, rounds: int, deadline: float, report: dict,
             target=None) -> None:
    """Two engines (layers [0, 16) and [16, 32) of one model) for one pool kind and page size;
    their results go into ``report``. Raises TimeoutError, with each engine's last stage, if they
    have not finished by ``deadline``, and RuntimeError if one dies without a result."""
    out, bench_lock = ctx.Queue(), ctx.Lock()
    ranges = [(0, 16), (16, 32)]
    # The two engines start their first loads together and begin the one-at-a-time section only
    # once both are past them (``engine``'s barrier; a stand-in target has none).
    kwargs = {} if target is not None else {"barrier": ctx.Barrier(len(ranges))}
    procs = {r: ctx.Process(target=target or engine, args=(address, kind, *r, 32, page, 65536,
                                                 16384 if page > 1 else 4096, rounds, out, bench_lock),
                            kwargs=kwargs)
             for r in ranges}
    for p in procs.values():
        p.start()
    for msg in _results(procs, out, f"{kind}/{page}", deadline):
        # Layer 0 must be readable while the last layer is still in flight wherever the
        # transfer is long enough (>= 256 MiB: tens of ms at PCIe speed) to tell.
        pipelined = msg.get("layer0_ready_before_last_layer") or msg.get("bytes", 0) < 256 << 20
        msg["ok"] = bool("error" not in msg and msg.get("exact") and msg.get("layer0_exact") and pipelined
                         and msg.get("pool_memory_returned"))
        report["ok"] &= msg["ok"]
        report["checks"].append(msg)


def run_safety(ctx, address: str, deadline: float, report: dict, target=None,
               wait_seconds: float = CUDA_WAIT_SECONDS, stall_seconds: float = STALL_SECONDS) -> None:
    """The hostile- and stuck-engine checks (``safety_engine``) in one engine process."""
    out = ctx.Queue()
    procs = {(0, 1): ctx.Process(target=target or safety_engine, args=(address, wait_seconds, stall_seconds,
                                                                       out))}
    procs[(0, 1)].start()
    for msg in _results(procs, out, "safety", deadline):
        msg["ok"] = bool(msg.get("ok"))
        report["ok"] &= msg["ok"]
        report["checks"].append(msg)


def run_cache(ctx, address: str, deadline: float, report: dict, target=None,
              plan: dict | None = None) -> None:
    """The cache round trip (``cache_engine``): a put engine and a get engine, each its own process."""
    out, stored = ctx.Queue(), ctx.Event()
    plan = plan or cache_plan()
    procs = {(i, i + 1): ctx.Process(target=target or cache_engine, args=(address, role, plan, out, stored))
             for i, role in enumerate(("put", "get"))}
    for p in procs.values():
        p.start()
    for msg in _results(procs, out, "cache", deadline):
        msg["ok"] = bool(msg.get("ok")) and "error" not in msg
        report["ok"] &= msg["ok"]
        report["checks"].append(msg)


def _start_daemon(args: list[str], socket: str, env: dict) -> subprocess.Popen:
    if os.path.exists(socket):
        os.unlink(socket)
    daemon = subprocess.Popen([sys.executable, "-m", "kvserver", "--socket", socket, *args], env=env)
    started = time.monotonic()
    while not os.path.exists(socket):
        if daemon.poll() is not None:
            raise RuntimeError(f"daemon exited {daemon.returncode}")
        if time.monotonic() > started + 60:
            daemon.kill()
            raise RuntimeError("the daemon did not listen within 60 s")
        time.sleep(0.05)
    return daemon


def _kept_stats(address: str) -> dict:
    import grpc

    from kvserver.v1 import kvserver_pb2 as pb
    from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        stats = pb_grpc.KVServerStub(ch).Stats(pb.StatsRequest(), timeout=30)
    disk = next((t for t in stats.tiers if t.name == "disk"), None)
    kept = disk.kept if disk is not None else stats.kept
    out = {"adopted_pages": kept.adopted_pages, "torn_pages": kept.torn_pages,
           "dropped_pages": kept.dropped_pages, "adopt_seconds": round(kept.adopt_seconds, 4),
           "reason": kept.reason}
    if disk is not None:
        out.update(disk_written_pages=disk.written_pages, disk_promoted_pages=disk.promoted_pages,
                   disk_bad_checks=disk.bad_checks, direct_io=disk.direct_io)
    return out


def _disk_written(address: str, pages: int, deadline: float) -> None:
    """Waits until the daemon's disk tier has written ``pages`` pages behind its host cache."""
    while _kept_stats(address).get("disk_written_pages", 0) < pages:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the disk tier did not write {pages} pages in time")
        time.sleep(0.05)


def run_kept(ctx, tmp: str, env: dict, deadline: float, report: dict, target=None,
             plan: dict | None = None, disk: bool = False) -> None:
    """The cache kept across a kill -9 (--host-memory-dir on tmpfs): the cache round's put engine
    stores its pages through a daemon keeping its cache in files, that daemon is SIGKILLed and a
    new one started on the same directory, and the get engine loads the pages from the new one,
    bit-exact. On CUDA this proves the kept arena's slabs (a shared mapping of a tmpfs file) pin
    and copy both ways, and that the restarted daemon pins what it adopted.

    ``disk``: the same through the disk tier (--disk-cache in ``tmp``, host memory not kept): the
    put engine's pages are written behind to disk before the kill, and the get engine's Get reads
    them back from disk into host memory (direct I/O into the pinned slabs) and then to the GPU."""
    plan = plan or cache_plan()
    prefix = "kvgpu-disk-" if disk else "kvgpu-kept-"
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    kept = tempfile.mkdtemp(prefix=prefix, dir=tmp if disk else shm)
    socket = os.path.join(tmp, "disk.sock" if disk else "kept.sock")
    where = ["--disk-cache", os.path.join(kept, "disk"), "--disk-size", "1GiB"] if disk else [
        "--host-memory-dir", kept]
    args = ["--host-memory", "2GiB", *where, "--progress-interval-ms", "0",
            "--cuda-wait-seconds", str(CUDA_WAIT_SECONDS)]
    name = "disk" if disk else "kept"
    address = f"unix://{socket}"
    out, stored = ctx.Queue(), ctx.Event()
    daemon = _start_daemon(args, socket, env)
    try:
        for role, label in (("put", (0, 1)), ("get", (1, 2))):
            proc = ctx.Process(target=target or cache_engine, args=(address, role, plan, out, stored))
            proc.start()
            for msg in _results({label: proc}, out, f"{name}-{role}", deadline):
                msg["kind"] = f"{name}-{msg.get('kind', role)}"
                msg["ok"] = bool(msg.get("ok")) and "error" not in msg
                report["ok"] &= msg["ok"]
                report["checks"].append(msg)
            if role == "put":
                if disk:
                    _disk_written(address, plan["pages"], deadline)
                daemon.kill()  # SIGKILL: the files keep what it stored
                daemon.wait(30)
                daemon = _start_daemon(args, socket, env)
                found = {"kind": f"{name}-restart", **_kept_stats(address)}
                found["ok"] = found["adopted_pages"] >= plan["pages"] and not found["reason"]
                report["ok"] &= found["ok"]
                report["checks"].append(found)
        if disk:  # the get engine's pages came from disk: read back, each one checked
            after = {"kind": "disk-read-back", **_kept_stats(address)}
            after["ok"] = after["disk_promoted_pages"] >= plan["pages"] and not after["disk_bad_checks"]
            report["ok"] &= after["ok"]
            report["checks"].append(after)
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(kept, ignore_errors=True)


def run_sglang(ctx, address: str, deadline: float, report: dict, target=None) -> None:
    """The SGLang linker's round (``sglang_engine``) for an MHA and an MLA pool, one after the other."""
    for kind in ("mha", "mla"):
        out = ctx.Queue()
        label = (0, 1) if kind == "mha" else (1, 2)
        procs = {label: ctx.Process(target=target or sglang_engine, args=(address, kind, out))}
        procs[label].start()
        for msg in _results(procs, out, f"sglang-{kind}", deadline):
            msg["ok"] = bool(msg.get("ok")) and "error" not in msg
            report["ok"] &= msg["ok"]
            report["checks"].append(msg)


def run_vllm(ctx, address: str, deadline: float, report: dict, target=None, device: str = "cuda") -> None:
    """The vLLM connector's worker-side round (``vllm_engine``) for each of ``VLLM_CASES``, each in
    its own engine process, all at once (small pools, a few MiB each: they share the GPU well)."""
    out = ctx.Queue()
    procs = {(i, i + 1): ctx.Process(target=target or vllm_engine, args=(address, kind, layout, out, device))
             for i, (kind, layout) in enumerate(VLLM_CASES)}
    for p in procs.values():
        p.start()
    for msg in _results(procs, out, "vllm", deadline):
        msg["ok"] = bool(msg.get("ok")) and "error" not in msg
        report["ok"] &= msg["ok"]
        report["checks"].append(msg)


def queue_bounds(probe: dict, max_queued: int, plane_max_queued: int) -> dict:
    """Whether the daemon's bounds on the driver calls one stream holds (the loop's copy workers'
    ``max_queued``, the plane's ``plane_max_queued``; kvserver/media/cuda/plan.py) stay under the
    least depth the probe measured for any kind of call: ``fit`` is False where one kind waited at
    or before a bound (the daemon's thread could then wait in the driver), None where the probe
    measured nothing, True otherwise."""
    kinds = [probe.get(k) for k in ("memcpy", "launch", "event_record") if isinstance(probe.get(k), dict)]
    depths = [k["calls_before_a_wait"] for k in kinds if k.get("calls_before_a_wait") is not None]
    bound = max(max_queued, plane_max_queued)
    if not probe.get("ok") or not kinds:
        fit = None
    elif depths:
        fit = min(depths) > bound
    else:  # no kind waited within its calls: the depth is past them all
        fit = min(k.get("calls_made", 0) for k in kinds) > bound
    return {"least_depth": min(depths) if depths else None, "max_queued": max_queued,
            "plane_max_queued": plane_max_queued, "fit": fit}


def run_queue_depth(ctx, deadline: float, target=None) -> dict:
    """``queue_depth_probe`` in a process of its own, for at most 60 s (a measurement: not
    part of the check's verdict)."""
    out = ctx.Queue()
    proc = ctx.Process(target=target or queue_depth_probe, args=(out,), daemon=True)
    proc.start()
    until = time.monotonic() + max(1.0, min(60.0, deadline - time.monotonic()))
    try:
        while time.monotonic() < until:
            try:
                result = out.get(timeout=0.5)
                proc.join(5)  # it ends once it reported
                return result
            except queue.Empty:
                if not proc.is_alive() and out.empty():
                    return {"kind": "queue_depth", "ok": False,
                            "error": f"the probe died (exit {proc.exitcode})"}
        return {"kind": "queue_depth", "ok": False, "error": "no report within its time"}
    finally:
        if proc.is_alive():  # past its time: not waited for
            proc.kill()
            proc.join(1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    ap.add_argument("--preflight", action="store_true",
                    help="only the checks that need no GPU: imports, daemon start and health")
    ap.add_argument("--host-memory", default=None,
                    help="the daemon's host memory (default 24GiB for the check, 1GiB for --preflight)")
    ap.add_argument("--plane-cuda", action="store_true",
                    help="the daemon's compiled data plane puts CUDA pools' lane Writes and Loads on the "
                         "GPU's stream itself (KVSERVER_PLANE_CUDA=1), as it will by default once "
                         "proven here")
    ap.add_argument("--deadline", type=float, default=360,
                    help="seconds for the whole check; engines still running then are killed and reported")
    args = ap.parse_args()
    host_memory = args.host_memory or ("1GiB" if args.preflight else "24GiB")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if args.plane_cuda:
        env["KVSERVER_PLANE_CUDA"] = "1"
    tmp = tempfile.mkdtemp(prefix="kvgpu-")
    socket = os.path.join(tmp, "kv.sock")
    # With --plane-cuda the daemon's log is kept, to count what its data plane put on the GPU.
    log_path = os.path.join(tmp, "daemon.log")
    log = open(log_path, "w") if args.plane_cuda else None  # noqa: SIM115 - the daemon's, closed by _finish
    daemon = subprocess.Popen([sys.executable, "-m", "kvserver", "--socket", socket,
                               "--host-memory", host_memory, "--progress-interval-ms", "0",
                               "--cuda-wait-seconds", str(CUDA_WAIT_SECONDS)], env=env, stderr=log)
    report: dict = {"checks": [], "ok": True, "plane_cuda": env.get("KVSERVER_PLANE_CUDA") == "1"}
    started = time.monotonic()
    deadline = started + args.deadline
    try:
        while not os.path.exists(socket):
            if daemon.poll() is not None:
                raise RuntimeError("daemon exited")
            if time.monotonic() > started + 60:
                raise RuntimeError("the daemon did not listen within 60 s")
            time.sleep(0.05)
        report["preflight"] = preflight(f"unix://{socket}")
        report["ok"] = report["preflight"]["daemon_health"] == "SERVING"
        if args.preflight:
            return _finish(report, daemon, tmp, started)
        if report["preflight"]["cuda"] != "usable":
            raise RuntimeError(f"the daemon cannot use CUDA here: {report['preflight']['cuda']}")
        ctx = mp.get_context("spawn")
        # The most telling plans first, so a run cut short by its deadline still says the most.
        plans = [("mha", 16), ("mla", 16)] if args.quick else [("mha", 16), ("mla", 16), ("mha", 1),
                                                                  ("mha", 64)]
        for i, (kind, page) in enumerate(plans):
            run_plan(ctx, f"unix://{socket}", kind, page, 3 if args.quick else 10, deadline, report)
            if i == 1:  # after the two most telling plans: the hostile- and stuck-engine checks
                run_safety(ctx, f"unix://{socket}", deadline, report)
                run_cache(ctx, f"unix://{socket}", deadline, report)
                run_kept(ctx, tmp, env, deadline, report)
                run_kept(ctx, tmp, env, deadline, report, disk=True)
                run_sglang(ctx, f"unix://{socket}", deadline, report)
                run_vllm(ctx, f"unix://{socket}", deadline, report)
        if args.plane_cuda or not args.quick:
            # The depth the bounds on one stream's calls must stay under (the loop's and the
            # plane's): a measurement, and a failure where a bound does not fit under it.
            from kvserver.media.cuda import plan as cuda_plan

            report["driver_queue"] = dq = run_queue_depth(ctx, deadline)
            dq["bounds"] = queue_bounds(dq, cuda_plan.MAX_QUEUED, cuda_plan.PLANE_MAX_QUEUED)
            report["ok"] &= dq["bounds"]["fit"] is not False
        if args.plane_cuda:  # the plane, not the loop, served the CUDA pools' lane calls
            counts, gave_up = plane_cuda_counts(log_path)
            report.update({f"plane_cuda_{name}": n for name, n in counts.items()})
            # by DMA and by the copy kernel, and it gave up the stuck engine's write itself (step 6)
            stuck = next((c["stall"].get("a_public_id") for c in report["checks"] if "stall" in c), None)
            report["plane_cuda_gave_up_the_stuck_write"] = stuck is not None and stuck in gave_up
            report["ok"] &= all(counts.values()) and report["plane_cuda_gave_up_the_stuck_write"]
    except BaseException:
        report["ok"] = False
        report["error"] = traceback.format_exc()
    if log is not None:
        log.close()
        with open(log_path) as f:  # the daemon's log, as it would have gone to the console
            sys.stderr.write("".join(f.readlines()[-60:]))
    return _finish(report, daemon, tmp, started)


def plane_cuda_counts(log_path: str) -> tuple[dict[str, int], set[str]]:
    """From the daemon's log (kvserver.core.kvcore logs each CUDA client's as it releases it): the
    CUDA Writes and Loads its data plane put on the GPU itself (``calls``) and those of them by the
    copy kernel (``kernel_calls``), summed over the clients; and the clients whose GPU work the
    plane gave up on (their public ids: the first 8 hex digits and "...")."""
    counts, gave_up = {"calls": 0, "kernel_calls": 0}, set()
    with open(log_path) as f:
        for line in f:
            m = re.search(r"data plane: (\d+) CUDA Writes and Loads of .* (\d+) of them by the copy kernel",
                          line)
            if m:
                counts["calls"] += int(m.group(1))
                counts["kernel_calls"] += int(m.group(2))
            m = re.search(r"data plane: gave up on the GPU work of (\S+): ", line)
            if m:
                gave_up.add(m.group(1))
    return counts, gave_up


def _finish(report: dict, daemon: subprocess.Popen, tmp: str, started: float) -> int:
    report["seconds"] = round(time.monotonic() - started, 1)
    daemon.terminate()
    try:
        report["daemon_exit"] = daemon.wait(30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        report["daemon_exit"] = f"killed: no exit 30 s after SIGTERM (then {daemon.wait(10)})"
        report["ok"] = False
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
