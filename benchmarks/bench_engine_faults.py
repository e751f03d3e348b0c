"""Engines against a daemon that fails them: how long their scheduler waits, how many hits a burst
keeps, and how long finished requests hold their blocks behind a stuck Put.

vLLM 0.33's real Scheduler with KVServerConnector and a worker over shared-memory per-layer views
(tests/vllm_engine.py), SGLang 0.5.23's real linker seam (KVServerLinker built by SGLang's
factory), one daemon subprocess that is SIGSTOPped (it neither answers nor closes anything):
1. a stopped daemon: a fresh vLLM engine admits one new request a step (--steps steps); printed:
   its worst schedule() and how many steps waited over 0.1 s, against lookup_timeout_s (the
   documented bound) and its median schedule() with the daemon answering, measured first; the same
   for SGLang's lookup + load + offload on its scheduler's thread;
2. a burst: --burst requests whose 2-block prefixes another engine stored, admitted together
   (max_num_seqs above the burst): how many got their hit (against the burst), the prefill tokens
   computed (against the burst's if every one hit) and the lookups per request;
3. a stuck Put: with the daemon stopped, --finished requests finish and are stored: seconds until
   every one has its blocks back, against the bound (the first admission's lookup wait, then one
   Put's deadline and the Unregister that confirms it stopped).

Run: python benchmarks/bench_engine_faults.py [--steps 6] [--burst 64] [--finished 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from daemon_proc import DaemonProcess  # noqa: E402

SETTINGS = {"lookup_timeout_s": 1.0, "timeout_s": 2.0, "load_timeout_s": 5.0}
PAGE = 16


def _prompt(i: int, blocks: int) -> list[int]:
    return [(11 * i + 5 * j) % 400 + 3 for j in range(blocks * PAGE + 1)]


class Vllm:
    """vLLM engines on one ModelConfig (building one inspects the model in a subprocess)."""

    def __init__(self, address: str) -> None:
        import vllm_engine

        self.config = vllm_engine.config(address)
        self.extra = self.config.kv_transfer_config.kv_connector_extra_config
        self.base = dict(self.extra)
        self.made: list = []

    def engine(self, model: str, address: str, num_blocks: int = 64, **settings):
        from vllm_engine import Engine

        self.extra.clear()
        self.extra.update(self.base, model=model, address=address, **SETTINGS, **settings)
        self.made.append(Engine(self.config, num_blocks=num_blocks))
        return self.made[-1]

    def close(self) -> None:
        for e in self.made:
            e.close()


def stopped_scheduler(v: Vllm, d: DaemonProcess, steps: int) -> dict:
    warm = v.engine("faults-stop", d.address)
    warm.add("w", _prompt(0, 4), max_tokens=1)
    warm.run()
    idle = v.engine("faults-stop", d.address)
    idle_took = idle.time_schedules()
    for i in range(steps):
        idle.add(f"i{i}", _prompt(100 + i, 4), max_tokens=1)
        idle.step()
    idle.run()
    e = v.engine("faults-stop", d.address)  # its space not opened yet: a ticket is its first step
    took = e.time_schedules()
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        for i in range(steps):
            e.add(f"s{i}", _prompt(200 + i, 4), max_tokens=1)
            e.step()
            time.sleep(0.6)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    return {"idle_median": statistics.median(idle_took), "worst": max(took),
            "waits": sum(t > 0.1 for t in took), "steps": len(took)}


def stopped_sglang(d: DaemonProcess, steps: int) -> dict | None:
    import sglang_env

    if not sglang_env.sglang_installed():
        return None
    sglang_env.setup()
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        from kvclient.sglang.linker import share_cpu_pool

        pool = sglang_env.stage_pool("mha", 4, 1, 0, size=128, page_size=PAGE)
        share_cpu_pool(pool)
        params = sglang_env.cache_init_params(pool, pp_rank=0, pp_size=1)
        config = {"linker": "KVServerLinker", "linker_module_path": "kvclient.sglang.linker",
                  "linker_extra_config": {"address": d.address, "model": "faults-sglang", "num_layers": 4,
                                          **SETTINGS}}
        linker = create_unified_cache_linker(sglang_env.server_args(pp_size=1), params, backend="dynamic",
                                             config=config, components={ComponentType.FULL})
        pool.register_layer_transfer_counter(linker.layer_done_counter)
        slots = params.token_to_kv_pool_allocator.alloc(2 * PAGE)
        keys = get_storage_hash_str(list(range(2 * PAGE)), None, page_size=PAGE)
        kv = PoolTransfer(name=PoolName.KV, keys=keys)
        dev = PoolTransfer(name=PoolName.KV, keys=keys, device_indices=slots)
        linker.lookup("warm", [kv])
        os.kill(d.proc.pid, signal.SIGSTOP)
        took = []
        try:
            for i in range(steps):
                t = time.monotonic()
                linker.lookup(f"r{i}", [kv])
                linker.load(f"r{i}", [dev])
                linker.offload([dev])
                took.append(time.monotonic() - t)
                time.sleep(0.6)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        linker.close()
        return {"worst": max(took), "waits": sum(t > 0.1 for t in took), "steps": len(took)}
    finally:
        sglang_env.restore()


def burst(v: Vllm, d: DaemonProcess, n: int) -> dict:
    sc = v.config.scheduler_config
    saved = sc.max_num_seqs, sc.max_num_batched_tokens
    sc.max_num_seqs, sc.max_num_batched_tokens = 2 * n, 4096
    try:
        a = v.engine("faults-burst", d.address, num_blocks=4 * n)
        prompts = {f"q{i}": _prompt(i, 2) for i in range(n)}
        for rid, tokens in prompts.items():
            a.add(rid, tokens, max_tokens=1)
        a.run(max_steps=4 * n)
        b = v.engine("faults-burst", d.address, num_blocks=4 * n)
        lookups = b.count_lookups()
        gets, load_ms = b.count_gets(), b.time_start_load()
        computed = []
        for rid, tokens in prompts.items():
            b.add(rid, tokens, max_tokens=1)
        while b.scheduler.has_requests():
            so = b.step()
            computed += [n_ for rid, n_ in so.num_scheduled_tokens.items() if rid in prompts]
        hits = sum(b.admitted[rid] == [2 * PAGE] for rid in prompts)
        # One token a request past its hit (its last, whose output is the answer: max_tokens 1).
        loading = [i for i, ms in enumerate(load_ms) if gets[i]]
        return {"hits": hits, "n": n, "lookups": len(lookups), "prefill": sum(computed),
                "load_steps": len(loading), "gets": sum(gets),
                "start_load_ms": max((load_ms[i] for i in loading), default=0.0),
                "prefill_if_all_hit": n * 1, "prefill_if_none_hit": n * (2 * PAGE + 1)}
    finally:
        sc.max_num_seqs, sc.max_num_batched_tokens = saved


def stuck_put(v: Vllm, d: DaemonProcess, n: int) -> dict:
    e = v.engine("faults-put", d.address, num_blocks=8 * n, max_queued_puts=4)
    e.add("warm", _prompt(0, 4), max_tokens=1)
    e.run()
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        names = {f"p{i}" for i in range(n)}
        for i in range(n):
            e.add(f"p{i}", _prompt(300 + i, 4), max_tokens=1)
        t0 = time.monotonic()
        e.run(max_steps=400, timeout=120)
        held = time.monotonic() - t0
        assert e.finished_sending >= names
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    timeout = SETTINGS["timeout_s"]
    # The first admission's lookup (it finds the daemon stopped), then the Put that ran: its
    # deadline (timeout_s and its grace) and the Unregister that confirms it stopped.
    bound = SETTINGS["lookup_timeout_s"] + timeout + max(1.0, timeout / 2) + timeout
    return {"held": held, "bound": bound,
            "dropped": getattr(e.worker._worker, "dropped_puts", 0), "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--finished", type=int, default=20)
    args = ap.parse_args()
    import vllm_env

    if not vllm_env.vllm_installed():
        sys.exit("vllm not installed (scripts/install_vllm.sh)")
    vllm_env.setup()
    with tempfile.TemporaryDirectory(prefix="kvfaults-") as tmp:
        d = DaemonProcess(os.path.join(tmp, "kv.sock"), host_memory="256MiB")
        v = Vllm(d.address)
        try:
            stop = stopped_scheduler(v, d, args.steps)
            sgl = stopped_sglang(d, args.steps)
            b = burst(v, d, args.burst)
            put = stuck_put(v, d, args.finished)
        finally:
            v.close()
            d.stop()
            vllm_env.restore()
    bound = SETTINGS["lookup_timeout_s"]
    print(f"stopped daemon, vLLM scheduler: worst schedule() {stop['worst'] * 1e3:.0f} ms "
          f"(bound lookup_timeout_s {bound * 1e3:.0f} ms; {stop['worst'] / bound:.2f}x), "
          f"{stop['waits']} of {stop['steps']} steps waited over 100 ms; "
          f"median step answering {stop['idle_median'] * 1e3:.2f} ms")
    if sgl is not None:
        print(f"stopped daemon, SGLang scheduler thread: worst lookup+load+offload "
              f"{sgl['worst'] * 1e3:.0f} ms "
              f"(bound {bound * 1e3:.0f} ms; {sgl['worst'] / bound:.2f}x), "
              f"{sgl['waits']} of {sgl['steps']} waited over 100 ms")
    print(f"burst of {b['n']}: {b['hits']} of {b['n']} hits ({b['hits'] / b['n']:.2f}), "
          f"{b['prefill']} prefill tokens computed (every hit: {b['prefill_if_all_hit']}; "
          f"none: {b['prefill_if_none_hit']}), "
          f"{b['lookups'] / b['n']:.2f} lookups a request; {b['gets']} Get calls in its "
          f"{b['load_steps']} steps that load ({b['gets'] / max(1, b['load_steps']):.2f} a step), "
          f"slowest start_load_kv {b['start_load_ms']:.2f} ms")
    print(f"stuck Put: {put['n']} finished requests had their blocks back after {put['held']:.1f} s "
          f"(bound: one lookup's wait, one Put's deadline and confirmation, {put['bound']:.1f} s; "
          f"{put['held'] / put['bound']:.2f}x); {put['dropped']} Puts dropped")


if __name__ == "__main__":
    main()
