"""GPU scheduling across processes, as the daemon meets it: a probe for a lent GPU machine.

Run there as ``python3 scripts/gpu_probe_sched.py`` (torch and CuPy, about 40 s); it prints one
JSON report and writes it to ``$OUT/sched.json``. It uses no part of kvserver: it says what the GPU
allows a daemon and its engines, apart from what kvserver makes of it.

Q1 overlap: process D copies 16 "layers", recording an IPC event after each, and process E waits
on layer 0's event on its own stream, runs a small kernel, and says whether that finished before
the last layer's event. Modes: dma (cudaMemcpyAsync H2D of 64 MiB a layer), spin (a one-thread
kernel of about 1.5 ms a layer), kern (a gather kernel reading pinned host memory, as the
daemon's copy kernel does).
Q2 false dependency: D's stream A waits on E's event, recorded behind a 3 s spin in E, and D then
runs a tiny kernel on each of 40 other non-blocking streams: how many finish within 0.3 s.
Q3 time slice: D's tiny kernel latency while E's context runs that spin, and idle.
"""
import json
import multiprocessing as mp
import os
import time

L, PER = 16, 64 << 20


def d_overlap(mode, conn):
    import cupy as cp
    import torch
    dev = torch.device("cuda", 0)
    host = torch.empty(L * PER, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(L * PER, dtype=torch.uint8, device=dev)
    events = [torch.cuda.Event(interprocess=True) for _ in range(L)]
    s = torch.cuda.Stream()
    t0e, t1e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0e.record()
    torch.cuda._sleep(200_000_000)
    t1e.record()
    t1e.synchronize()
    cyc = 200_000_000 / t0e.elapsed_time(t1e)
    kern = cp.RawKernel(r'''
    extern "C" __global__ void g(unsigned long long* dst, const unsigned long long* src, long long n,
                                 long long stride) {
      for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
           i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[(i * stride) % n];
    }''', "g")
    conn.send([e.ipc_handle() for e in events])
    out = []
    for _ in range(4):
        conn.recv()
        torch.cuda.synchronize()
        t = time.monotonic()
        with torch.cuda.stream(s):
            for i in range(L):
                if mode == "dma":
                    gpu[i * PER:(i + 1) * PER].copy_(host[i * PER:(i + 1) * PER], non_blocking=True)
                elif mode == "spin":
                    torch.cuda._sleep(int(cyc * 1.5))
                else:
                    with cp.cuda.ExternalStream(s.cuda_stream):
                        n = PER // 8
                        dst, src = gpu.data_ptr() + i * PER, host.data_ptr() + i * PER
                        kern((128,), (256,), (cp.uint64(dst), cp.uint64(src), cp.int64(n), cp.int64(1)))
                events[i].record(s)
        conn.send(t)
        s.synchronize()
        out.append(time.monotonic() - t)
    conn.send(out)


def e_overlap(conn):
    import torch
    dev = torch.device("cuda", 0)
    handles = conn.recv()
    evs = [torch.cuda.Event.from_ipc_handle(dev, h) for h in handles]
    x = torch.zeros(1 << 20, device=dev)
    es = torch.cuda.Stream()
    res = []
    for _ in range(4):
        conn.send("go")
        t = conn.recv()
        es.wait_event(evs[0])
        with torch.cuda.stream(es):
            x.add_(1)
            d0 = torch.cuda.Event()
            d0.record(es)
        d0.synchronize()
        usable = time.monotonic() - t
        res.append({"layer0_usable_ms": round(usable * 1e3, 2), "before_last": not evs[-1].query()})
    whole = conn.recv()
    for r, w in zip(res, whole, strict=True):
        r["whole_ms"] = round(w * 1e3, 2)
    conn.send(res)


def q1(mode):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    c, d = ctx.Pipe()
    pd = ctx.Process(target=d_overlap, args=(mode, a))
    pe = ctx.Process(target=e_overlap, args=(c,))
    pd.start()
    pe.start()
    d.send(b.recv())  # handles
    for _ in range(4):
        b.send(d.recv())  # go
        d.send(b.recv())  # t
    d.send(b.recv())  # whole
    res = d.recv()
    pd.join(30)
    pe.join(30)
    return res


def e_spinner(conn, seconds):
    import torch
    t0e, t1e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        t0e.record()
        torch.cuda._sleep(200_000_000)
        t1e.record()
        t1e.synchronize()
    cyc = 200_000_000 / t0e.elapsed_time(t1e)
    ev = torch.cuda.Event(interprocess=True)
    s = torch.cuda.Stream()
    ev.record(s)
    torch.cuda.synchronize()
    conn.send(ev.ipc_handle())
    conn.recv()
    with torch.cuda.stream(s):
        torch.cuda._sleep(int(cyc * seconds * 1000))
        ev.record(s)
    conn.send(time.monotonic())
    t = time.monotonic()
    ev.synchronize()
    conn.send(time.monotonic() - t)


def _tiny_kernel_seconds(cp, stream, x, n: int = 20) -> list[float]:
    """Seconds from launching a one-element-a-thread kernel on ``stream`` until its event is done
    (spinning on the event), ``n`` times, sorted."""
    lat = []
    for _ in range(n):
        t1 = time.monotonic()
        with stream:
            x += 1
            e = cp.cuda.Event(disable_timing=True)
            e.record(stream)
        while not e.done:
            pass
        lat.append(time.monotonic() - t1)
    return sorted(lat)


def d_false_dep(conn, nstreams):
    import cupy as cp
    import torch  # noqa: F401
    rt = cp.cuda.runtime
    h = conn.recv()
    ev = rt.ipcOpenEventHandle(h)
    a = cp.cuda.Stream(non_blocking=True)
    others = [cp.cuda.Stream(non_blocking=True) for _ in range(nstreams)]
    xs = [cp.zeros(1024, dtype=cp.float32) for _ in range(nstreams)]
    cp.cuda.Device().synchronize()
    conn.send("go")
    conn.recv()  # spin started
    rt.streamWaitEvent(a.ptr, ev, 0)
    with a:
        ya = cp.zeros(16, dtype=cp.float32)
        ya += 1  # a kernel behind the foreign wait, as the daemon's copy
    t = time.monotonic()
    done_ev = []
    for s, x in zip(others, xs, strict=True):
        with s:
            x += 1
            e = cp.cuda.Event(disable_timing=True)
            e.record(s)
            done_ev.append(e)
    while time.monotonic() - t < 0.3 and not all(e.done for e in done_ev):
        time.sleep(0.001)
    n_done = sum(e.done for e in done_ev)
    # Q3: tiny kernel latency on a fresh stream while E's spin runs, then once it has ended
    s3 = cp.cuda.Stream(non_blocking=True)
    lat = _tiny_kernel_seconds(cp, s3, xs[0])
    conn.send({"streams": nstreams, "done_within_0.3s": n_done,
               "tiny_kernel_us_during_spin_p50": round(lat[10] * 1e6, 1),
               "tiny_kernel_us_during_spin_max": round(lat[-1] * 1e6, 1)})
    a.synchronize()
    lat = _tiny_kernel_seconds(cp, s3, xs[0])
    conn.send({"tiny_kernel_us_idle_p50": round(lat[10] * 1e6, 1)})


def q2(nstreams, connections):
    if connections:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(connections)
    else:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    c, d = ctx.Pipe()
    pe = ctx.Process(target=e_spinner, args=(a, 3.0))
    pd = ctx.Process(target=d_false_dep, args=(c, nstreams))
    pe.start()
    pd.start()
    d.send(b.recv())  # handle
    d.recv()  # D ready
    b.send("go")
    b.recv()  # spin started
    d.send("started")
    r = d.recv()
    r.update(d.recv())
    r["spin_seconds_seen_by_E"] = round(b.recv(), 2)
    r["connections"] = connections or "default"
    pd.join(30)
    pe.join(30)
    return r


if __name__ == "__main__":
    report = {}
    for mode in ("dma", "spin", "kern"):
        try:
            report[f"overlap_{mode}"] = q1(mode)
        except Exception as exc:  # noqa: BLE001
            report[f"overlap_{mode}"] = repr(exc)
        print(json.dumps({mode: report[f"overlap_{mode}"]}), flush=True)
    for conns in (None, 32):
        try:
            report[f"false_dep_{conns}"] = q2(40, conns)
        except Exception as exc:  # noqa: BLE001
            report[f"false_dep_{conns}"] = repr(exc)
        print(json.dumps(report[f"false_dep_{conns}"]), flush=True)
    print(json.dumps(report, indent=1))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "sched.json"), "w") as f:
        json.dump(report, f, indent=1)
