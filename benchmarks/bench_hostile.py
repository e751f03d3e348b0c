"""Hostile peers: one engine's small Loads while other processes send the largest valid requests
of every kind, against the same Loads with the node idle, in the same run.

The daemon runs as a subprocess (--host-memory, default 1 GiB) with /metrics on. A victim engine
(MHA 2 x 64 fp16, 2 layers) loads one 16-token page back to back, first alone (--seconds), then
while these run, each in its own process, as fast as the daemon answers them (--seconds again):
- tiny pages: Register of a region of the smallest pages (64 bytes: MLA rank 1, fp8, one layer,
  64 tokens a page) as large as the budget allows, then Unregister;
- evicting Puts: Puts of 128 Ki new keys in turn into four page sizes of 64 to 256 bytes, the
  cache full: every Put evicts across size classes;
- pinned Lookups: whole-space Lookups of 128 Ki stored keys pinning them for 60 s, then Release;
- a large region: Register of a 256 MiB region, a Write populating all of it, Unregister;
- descriptors: tickets of 253 memfds each (accepted, never redeemed) and of 253 TCP sockets
  (refused), back to back;
- large messages: a RegisterRequest of buffer references as large as the daemon takes (16 MiB at
  its default --max-request-indices; refused unparsed) and a Free of the most indices it takes
  (1 Mi, each 9 bytes on the wire) naming no registration (read, then refused), in turn, over gRPC;
- full lanes: 16 registrations whose lanes' slots all hold a Lookup of the most keys a call walks
  (1024, stored), each slot submitted again the moment it is answered, written into the ring as a
  peer may (not through the client's calls): the data plane's thread, which also serves the
  victim's Loads, never runs out of them;
- doorbell flood: 8 registrations whose lanes' submit doorbells are rung without end, their slots
  empty (each ring costs the daemon's plane a wake-up and a read, and the peer nothing).
A Register or a pin the budget refuses (the other attackers hold the memory) counts as a round,
as an engine would try again.
A third phase runs as many processes that only spin on the CPU, sending nothing: what the victim
loses to sharing the machine's cores alone, which no daemon can give back.
Prints the victim's Load p50 / p99 and the event loop's lag p99 (kvserver_event_loop_lag_seconds,
the bucket it falls in) for each phase, their ratios, and how many of each attack the daemon
served. Targets: victim p99 within 2x of idle, loop lag p99 under 20 ms.

Run: python benchmarks/bench_hostile.py [--seconds 10] [--host-memory 1GiB] [--attacks "tiny pages,..."]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import urllib.request

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from daemon_proc import DaemonProcess  # noqa: E402

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool  # noqa: E402
from kvclient._transport import lane  # noqa: E402
from kvclient._transport.fd_socket import fd_socket_path  # noqa: E402
from kvserver.api.message_size import request_message_bytes  # noqa: E402
from kvserver.config import DEFAULT_MAX_REQUEST_INDICES  # noqa: E402
from kvserver.protocol import ring as R  # noqa: E402
from kvserver.protocol.fd_socket import FDS_PER_MESSAGE, TicketRefused, request_ticket  # noqa: E402
from kvserver.v1 import kvserver_pb2 as pb  # noqa: E402

MAX_KEYS = 1 << 17
LANE_KEYS = 1024  # the most keys the data plane walks for one lane call
LANES = 16
FLOOD_LANES = 8
PAGE = 64  # tokens a page: with MLA rank 1 fp8, the smallest page the daemon takes (64 bytes)
LAG_METRIC = "kvserver_event_loop_lag_seconds_bucket"
# An attacker's calls wait as long as it takes: each is the largest of its kind, sent with every
# other attack at once on a machine whose cores they all share, and is served late, not refused.
ATTACK_TIMEOUT = 60.0
MOST_INDICES = DEFAULT_MAX_REQUEST_INDICES  # the daemon's defaults: the most it takes at once
MOST_BYTES = request_message_bytes(MOST_INDICES)


# ---- the attacks (each in its own process, until ``stop``) ----------------------------------------

def _registered(c: KVClient, **kw) -> bool:
    """Registers; False (a round all the same) when the budget has no room: the other attackers
    hold it, and an engine would try again."""
    return _tried(c.register, **kw) is not None


def _tried(call, *args, **kw):
    """``call``'s answer; None (a round all the same) when the daemon has no room for it:
    the other attackers hold the memory, and an engine would try again."""
    try:
        return call(*args, **kw)
    except KVClientError as exc:
        if exc.code.name != "RESOURCE_EXHAUSTED":
            raise
        time.sleep(0.01)
        return None


def _tiny_register(address: str, stop, ready) -> int:
    rounds = 0
    with ShmKVPool(KVLayout.mla(1, 0), torch.float8_e4m3fn, 1, 1024) as pool:
        ready()
        while not stop.is_set():
            with KVClient(address, resilient=False, timeout=ATTACK_TIMEOUT) as c:
                if _registered(c, model="tiny", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                               host_tokens=1 << 30, min_host_tokens=PAGE, page_size=PAGE):
                    c.unregister()
            rounds += 1
    return rounds


def _evicting_puts(address: str, stop, ready) -> int:
    rounds = 0
    pools = [ShmKVPool(KVLayout.mla(r, 0), torch.float8_e4m3fn, 1, MAX_KEYS * PAGE) for r in (1, 2, 3, 4)]
    clients = [KVClient(address, resilient=False, timeout=ATTACK_TIMEOUT) for _ in pools]
    try:
        for i, (c, pool) in enumerate(zip(clients, pools, strict=True)):
            c.register(model=f"evict{i}", pool=pool, start_layer=0, end_layer=1, num_layers=1,
                       host_tokens=0, page_size=PAGE)
        pages = list(range(MAX_KEYS))
        ready()
        while not stop.is_set():
            clients[rounds % len(clients)].put(os.urandom(16 * MAX_KEYS), pages)
            rounds += 1
    finally:
        for c in clients:
            c.close()
        for pool in pools:
            pool.close()
    return rounds


def _pinned_lookups(address: str, stop, ready) -> int:
    rounds = 0
    keys = os.urandom(16 * MAX_KEYS)
    with ShmKVPool(KVLayout.mla(1, 0), torch.float8_e4m3fn, 1, MAX_KEYS * PAGE) as pool, \
            KVClient(address, resilient=False, timeout=ATTACK_TIMEOUT) as c:
        c.register(model="pin", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                   page_size=PAGE)
        c.put(keys, list(range(MAX_KEYS)))
        ready()
        while not stop.is_set():
            got = _tried(c.lookup, keys, pin_ms=60_000, whole_space=True)
            if got is not None and got.lease_id:
                c.release(got.lease_id)
            rounds += 1
    return rounds


def _large_region(address: str, stop, ready) -> int:
    rounds = 0
    layout = KVLayout.mha(8, 128)  # 4 KiB a token and part, 2 parts, 2 layers: 16 KiB a token
    tokens = (256 << 20) // (16 << 10)
    with ShmKVPool(layout, torch.float16, 2, 1024) as pool:
        ready()
        while not stop.is_set():
            with KVClient(address, resilient=False, timeout=ATTACK_TIMEOUT) as c:
                if not _registered(c, model="big", pool=pool, start_layer=0, end_layer=2, num_layers=2,
                                   host_tokens=tokens, page_size=16):
                    rounds += 1
                    continue
                host = c.alloc(tokens)
                for s in range(0, tokens, 1024):
                    c.write(host_indices=host[s : s + 1024], device_indices=np.arange(1024))
                c.unregister()
            rounds += 1
    return rounds


def _descriptors(address: str, stop, ready) -> int:
    rounds = 0
    path = fd_socket_path(address)
    memfds = [os.memfd_create("flood", os.MFD_CLOEXEC) for _ in range(FDS_PER_MESSAGE)]
    tcp = [socket.socket() for _ in range(FDS_PER_MESSAGE)]
    ready()
    try:
        while not stop.is_set():
            for fds in (memfds, [s.fileno() for s in tcp]):
                try:
                    request_ticket(path, fds)
                except (TicketRefused, OSError):
                    pass
            rounds += 1
    finally:
        for fd in memfds:
            os.close(fd)
        for s in tcp:
            s.close()
    return rounds


def _large_messages(address: str, stop, ready) -> int:
    rounds = 0
    part = pb.BufferRef(offset=1, token_stride=2)
    part.shm.name = "x"
    layer = pb.LayerBuffers(parts=[part] * 1000)
    register = pb.RegisterRequest(model="bomb")
    register.device_pool.layers.extend([layer] * ((MOST_BYTES - (64 << 10)) // (layer.ByteSize() + 4)))
    free = pb.FreeRequest(client_id="none", host_indices=np.arange(MOST_INDICES) | (1 << 62))
    assert max(register.ByteSize(), free.ByteSize()) <= MOST_BYTES
    # Each answered by the daemon, never refused by this side's channel (RESOURCE_EXHAUSTED too):
    # the Register refused for its size, or, by a daemon that parses it whole, for its lack of a
    # peer ticket; the Free for the registration it names.
    answers = {"Register": {(grpc.StatusCode.RESOURCE_EXHAUSTED, "RegisterRequest of"),
                            (grpc.StatusCode.UNAUTHENTICATED, "peer ticket")},
               "Free": {(grpc.StatusCode.NOT_FOUND, "unknown client id")}}
    calls = [("Register", register.SerializeToString()), ("Free", free.SerializeToString())]
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        methods = [(name, ch.unary_unary(f"/kvserver.v1.KVServer/{name}"), data) for name, data in calls]
        ready()
        while not stop.is_set():
            name, call, data = methods[rounds % len(methods)]
            try:
                call(data, timeout=ATTACK_TIMEOUT)
            except grpc.RpcError as exc:
                got = (exc.code(), exc.details() or "")
                if not any(got[0] == code and said in got[1] for code, said in answers[name]):
                    raise
            rounds += 1
    return rounds


def _full_lanes(address: str, stop, ready) -> int:
    rounds = 0
    keys = os.urandom(16 * LANE_KEYS)
    with ShmKVPool(KVLayout.mla(1, 0), torch.float8_e4m3fn, 1, LANE_KEYS * PAGE) as pool:
        clients = [KVClient(address, resilient=False, timeout=ATTACK_TIMEOUT) for _ in range(LANES)]
        try:
            requests = {}
            for c in clients:
                c.register(model="lanes", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                           page_size=PAGE)
                _tried(c.put, keys, list(range(LANE_KEYS)))
                if c.lane is None:
                    raise RuntimeError("a registration got no lane (its opening failed): gRPC only")
                lane, real = c.lane, c.lane.unary

                def kept(rpc, data, timeout, real=real, lane=lane):  # the request, as the client packs it
                    requests[lane] = data
                    return real(rpc, data, timeout)

                lane.unary = kept
                c.lookup(keys)  # (the first is the loop's: it gives the registration its part)
                lane.unary = real
            slots = [(lane, i) for lane in requests
                     for i in iter(lambda lane=lane: lane._take(requests[lane]), None)]
            ready()
            for lane, i in slots:
                lane._put(i, "Lookup", requests[lane])
            while not stop.is_set():
                for lane, i in slots:
                    if lane._state(i) == R.DONE:
                        rounds += 1
                        lane._put(i, "Lookup", requests[lane])
            # The last answers read, so that the lanes close cleanly; one that never comes is said.
            end, unanswered = time.monotonic() + 30, 0
            for lane, i in slots:
                while lane._state(i) != R.DONE and time.monotonic() < end:
                    time.sleep(0.001)
                answered = lane._state(i) == R.DONE
                unanswered += not answered
                lane._end(i, done=answered)
            if unanswered:
                raise RuntimeError(f"{unanswered} of {len(slots)} lane Lookups were never answered")
        finally:
            for c in clients:
                c.close()
    return rounds


def _doorbell_flood(address: str, stop, ready) -> int:
    """Rounds: thousands of rings sent."""
    sent = 0
    with ShmKVPool(KVLayout.mla(1, 0), torch.float8_e4m3fn, 1, PAGE) as pool:
        clients = [KVClient(address, resilient=False, timeout=ATTACK_TIMEOUT) for _ in range(FLOOD_LANES)]
        try:
            bells = []
            for c in clients:
                c.register(model="flood", pool=pool, start_layer=0, end_layer=1, num_layers=1, host_tokens=0,
                           page_size=PAGE)
                if c.lane is None:
                    raise RuntimeError("a registration got no lane (its opening failed): gRPC only")
                bells.append(c.lane._submit)
            ready()
            while not stop.is_set():
                for bell in bells:
                    try:
                        bell.send(b"x", socket.MSG_DONTWAIT)
                        sent += 1
                    except BlockingIOError:  # its queue is full: the daemon has rings to read
                        pass
        finally:
            for c in clients:
                c.close()
    return sent // 1000


ATTACKS = {"tiny pages": _tiny_register, "evicting Puts": _evicting_puts, "pinned Lookups": _pinned_lookups,
           "large region": _large_region, "descriptors": _descriptors, "large messages": _large_messages,
           "full lanes": _full_lanes, "doorbell flood": _doorbell_flood}


def _spin(stop) -> None:
    """Takes a core and nothing else: the victim's share of the CPU, with no request sent."""
    while not stop.is_set():
        for _ in range(100_000):
            pass


def _attack(name: str, address: str, stop, out) -> None:
    try:
        out.put((name, ATTACKS[name](address, stop, lambda: out.put((name, None, ""))), ""))
    except Exception as exc:  # said, whatever it is: the main process waits for every attack's word
        out.put((name, -1, f"{type(exc).__name__}: {exc}"))


# ---- the victim and the loop's lag ------------------------------------------------------------------

def _lag_buckets(port: int) -> dict[float, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(LAG_METRIC):
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def _p99_bucket(before: dict[float, float], after: dict[float, float]) -> tuple[float, int]:
    """(the upper bound of the bucket the 99th percentile falls in, samples) between two scrapes."""
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts[float("inf")]
    return next(le for le, c in counts.items() if c >= 0.99 * total), int(total)


def _loads(c: KVClient, host, device, seconds: float) -> tuple[np.ndarray, int]:
    """The victim's Loads for ``seconds``: each one's time, and the spins of its waits that found the
    CPU shared meanwhile (``kvclient._transport.lane.crowded``)."""
    times, shared = [], lane.crowded()[2]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        c.load(host_indices=host, device_indices=device).wait(timeout=60)
        times.append(time.perf_counter() - t)
    return np.array(times), lane.crowded()[2] - shared


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="each phase's length")
    ap.add_argument("--host-memory", default="1GiB")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="which attacks, comma separated")
    args = ap.parse_args()
    attacks = [a.strip() for a in args.attacks.split(",")]
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvhostile-") as tmp:
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), "--metrics-listen", f"127.0.0.1:{port}",
                          "--log-level", "ERROR", host_memory=args.host_memory)
        try:
            with ShmKVPool(KVLayout.mha(2, 64), torch.float16, 2, 256) as pool, \
                    KVClient(d.address, resilient=False) as victim:
                victim.register(model="victim", pool=pool, start_layer=0, end_layer=2, num_layers=2,
                                host_tokens=256, page_size=16)
                host, device = victim.alloc(16), np.arange(16)
                victim.write(host_indices=host, device_indices=device)
                _loads(victim, host, device, 1.0)  # warm
                lag0 = _lag_buckets(port)
                idle, idle_shared = _loads(victim, host, device, args.seconds)
                lag1 = _lag_buckets(port)
                spin_stop = ctx.Event()
                spinners = [ctx.Process(target=_spin, args=(spin_stop,)) for _ in attacks]
                for p in spinners:
                    p.start()
                time.sleep(1.0)
                busy, busy_shared = _loads(victim, host, device, args.seconds)
                spin_stop.set()
                for p in spinners:
                    p.join(timeout=60)
                stop, out = ctx.Event(), ctx.Queue()
                procs = [ctx.Process(target=_attack, args=(name, d.address, stop, out)) for name in attacks]
                for p in procs:
                    p.start()
                served: dict[str, tuple[int, str]] = {}
                waiting = set(attacks)
                while waiting:  # every attack set up (pools built, registered) and under way
                    name, n, err = out.get(timeout=300)
                    waiting.discard(name)
                    if n is not None:
                        served[name] = (n, err)
                time.sleep(1.0)
                lag2 = _lag_buckets(port)
                hostile, hostile_shared = _loads(victim, host, device, args.seconds)
                lag3 = _lag_buckets(port)
                stop.set()
                while len(served) < len(procs):
                    name, n, err = out.get(timeout=300)
                    served[name] = (n, err)
                for p in procs:
                    p.join(timeout=60)
        finally:
            d.stop()
    idle_lag, idle_n = _p99_bucket(lag0, lag1)
    hostile_lag, hostile_n = _p99_bucket(lag2, lag3)
    i50, i99 = np.percentile(idle, [50, 99]) * 1e3
    b50, b99 = np.percentile(busy, [50, 99]) * 1e3
    h50, h99 = np.percentile(hostile, [50, 99]) * 1e3
    print(f"victim Loads of one 16-token page, {args.seconds:.0f} s a phase, budget {args.host_memory}")
    print(f"  idle:    {len(idle)} Loads, p50 {i50:.2f} ms, p99 {i99:.2f} ms; "
          f"loop lag p99 <= {idle_lag * 1e3:g} ms ({idle_n} ticks)")
    print(f"  cpu:     {len(busy)} Loads, p50 {b50:.2f} ms, p99 {b99:.2f} ms "
          f"({len(attacks)} processes spinning, no requests)")
    print(f"  hostile: {len(hostile)} Loads, p50 {h50:.2f} ms, p99 {h99:.2f} ms; "
          f"loop lag p99 <= {hostile_lag * 1e3:g} ms ({hostile_n} ticks)")
    print(f"  victim p99 ratio hostile / idle: {h99 / i99:.2f}; hostile / cpu: {h99 / b99:.2f}")
    print(f"  the victim's spins that found the CPU shared (idle, cpu, hostile): {idle_shared}, "
          f"{busy_shared}, {hostile_shared}")
    for name, (n, err) in served.items():
        print(f"  {name}: {n} rounds" + (f" (stopped: {err})" if err else ""))


if __name__ == "__main__":
    main()
