"""How a lane call's waits shape a large transfer: ringing ahead and napping through a Write.

A ``--mib`` Write and Load (every layer) of scattered pages through a daemon subprocess on the
fast lane, against the same copy in this process (the transfer suite's baseline,
``suites.transfer.InProcess``: the daemon's plan and kernel into a layer-first host buffer), in the
transfer suite's order each round: a memcpy of the transfer's size (the caches emptied, as an
engine's own work would), the in-process write and load, the daemon's write and load. Five ways
of waiting, one per round in turn, so that the machine's drift hits all alike (docs/lane.md):

- ``nudge+nap``: the client's defaults, a ring ahead of each call (``ClientLane.nudge``) and a nap
  through a Write whose copy it expects to be long, from the least pace of the lane's last Writes;
- ``nudge+nap, mean pace``: the same, the nap expecting the Write to take the moving average of
  the plane's pace (a quarter for each new answer: the client's estimate before the least);
- ``nudge``: no nap (``KVCLIENT_LANE_NAP_LEAD_US=0``);
- ``nap``: no ring ahead;
- ``neither``: the client as before both.

Each way keeps its own learnt pace. For each: the median over its rounds of the in-process time /
the daemon's time of the same round (1.00x: as fast as in-process); the CPU time this thread spent
per daemon Write (what a Write costs the engine's thread, spins included); the median of the
Write's time beyond the data plane's own time on it (the answer's busy word: the client's Python,
the submit and the wait's wake-up); and in how many Writes the client was asleep when the answer
came, as the compiled call reports it (``ClientLane.woken``: the answer found on waking, from the
doorbell or the nap's timer, not while looking): a nap that outlasted the copy, a spin after the
nap that ran out before it, or (without a nap) a copy longer than the 30 us spin.

Run: python benchmarks/bench_lane_waits.py [--rounds 400] [--page-sizes 16 64] [--layouts mha mla]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time

import torch
from bench_lane import start_daemon  # benchmarks/ is this script's directory
from suites.transfer import InProcess

from kvclient import KVClient, KVLayout, ShmKVPool
from kvserver.copies import transfer

LAYOUTS = {"mha": KVLayout.mha(8, 128), "mla": KVLayout.mla(512, 64)}
# (name, ring ahead, nap, the pace the nap expects: "least" of the last writes, or their "mean")
MODES = (("nudge+nap", True, True, "least"), ("nudge+nap, mean pace", True, True, "mean"),
         ("nudge", True, False, "least"), ("nap", False, True, "least"), ("neither", False, False, "least"))
WARMUP = 8


def case(client: KVClient, lay: str, page: int, mib: int, layers: int, rounds: int) -> list[str]:
    if transfer.copy_rows is None:
        raise SystemExit("the copy kernel is not built: no in-process baseline")
    layout, dtype = LAYOUTS[lay], torch.bfloat16
    parts = layout.num_parts
    token_bytes = layout.token_bytes(dtype) * parts * layers
    pages = max(1, (mib << 20) // token_bytes // page)
    tokens, pool_tokens = pages * page, 2 * pages * page
    g = torch.Generator().manual_seed(0)
    with ShmKVPool(layout, dtype, layers, pool_tokens) as pool:
        for layer in pool.buffers:
            for buf in layer:
                buf.view(torch.int16).random_(generator=g)
        base = InProcess(pool, page, pages, g)
        nbytes = tokens * token_bytes
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        client.register(model=f"waits-{lay}-{page}", pool=pool, start_layer=0, end_layer=layers,
                        num_layers=layers, host_tokens=tokens, page_size=page)
        try:
            lane = client.lane
            if lane is None:
                raise SystemExit("the fast lane did not open")
            if lane._c is None:  # kvserver.protocol._wire: the waits in Python take no nap
                raise SystemExit("the compiled client calls are not built (or stale): no nap to time")
            lead, nudge, learn = lane.nap_lead, lane.nudge, lane._learn
            units = pages * layers
            answer: list[int] = []

            def record(n: int, busy_us: int) -> None:  # the plane's time on each answered Write
                answer.append(busy_us)
                learn(n, busy_us)

            lane._learn = record
            paces = {m[0]: (None, collections.deque(maxlen=lane._paces.maxlen)) for m in MODES}
            host_idx = client.alloc(tokens).view(-1, page)[base.hp].reshape(-1)
            dev = base.dev
            got: dict[str, tuple[list[float], ...]] = {m[0]: ([], [], [], [], []) for m in MODES}
            for r in range(-WARMUP, rounds):
                name, ahead, nap, rule = MODES[r % len(MODES)]
                lane.nudge = nudge if ahead else (lambda: None)
                lane.nap_lead = lead if nap else 0.0
                lane.write_pace, lane._paces = paces[name]
                answer.clear()
                woken = lane.woken
                dst.copy_(src)
                t = time.perf_counter()
                base.copy(False)
                in_write = time.perf_counter() - t
                t = time.perf_counter()
                base.copy(True)
                in_load = time.perf_counter() - t
                c = time.thread_time()
                t = time.perf_counter()
                client.write(host_indices=host_idx, device_indices=dev)
                write = time.perf_counter() - t
                cpu = time.thread_time() - c
                slept = lane.woken - woken
                busy = answer[0] * 1e-6 if answer else float("nan")  # 0 if the loop served it
                if rule == "mean" and answer and answer[0] > 0:
                    old = paces[name][0]
                    pace = busy / units
                    lane.write_pace = pace if old is None else 0.75 * old + 0.25 * pace
                paces[name] = (lane.write_pace, lane._paces)
                t = time.perf_counter()
                client.load(host_indices=host_idx, device_indices=dev).wait()
                load = time.perf_counter() - t
                if r >= 0:
                    w, ld, cp, beyond, late = got[name]
                    w.append(in_write / write)
                    ld.append(in_load / load)
                    cp.append(cpu)
                    if busy > 0:
                        beyond.append(write - busy)
                        late.append(slept)
        finally:
            lane._learn = learn
            client.unregister()
    out = []
    for name, (w, ld, cp, beyond, late) in got.items():
        past = f"{sum(late)} of {len(late)}"
        extra = statistics.median(beyond) * 1e6 if beyond else float("nan")
        out.append(f"| {lay.upper()} | {page} | {nbytes / (1 << 20):.1f} MiB | {name} | "
                   f"{statistics.median(w):.3f}x | {statistics.median(ld):.3f}x | "
                   f"{statistics.median(cp) * 1e6:.0f} us | "
                   f"{extra:.0f} us | {past} | {len(w)} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["mha", "mla"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=400, help="rounds per case, shared by the ways of waiting")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the daemon's kernel runs one thread too
    rows = ["| layout | page | transfer | waits | write vs in-process | load vs in-process "
            "| engine thread CPU per write (median) | write beyond the plane's time (median) "
            "| asleep at the answer | rounds |", "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="kvwaits-") as tmp:
        socket = os.path.join(tmp, "kv.sock")
        daemon = start_daemon(socket, f"{2 * args.mib + 64}MiB")
        try:
            with KVClient(socket, timeout=60) as client:
                for lay in args.layouts:
                    for page in args.page_sizes:
                        rows += case(client, lay, page, args.mib, args.layers, args.rounds)
        finally:
            daemon.terminate()
            daemon.wait(30)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
