"""A vLLM 0.33 engine on a CPU for the connector tests: vLLM's real Scheduler (with the connector
built by vLLM's factory in the scheduler role), the connector again in the worker role over real
per-layer KV cache views (vLLM's own ``create_kv_cache_views`` over shared memory), and a stand-in
for the model's forward that calls the worker connector exactly as vLLM's model runner does
(``KVConnectorModelRunnerMixin._get_kv_connector_output`` and the attention layers'
``maybe_transfer_kv_layer``), in its order: each layer writes the step's K/V, waits for the
layer's load, then its "attention" reads the layer. Layer l's K/V at position p is a function of
(token, position, layer) plus what layer l - 1's attention read at p (its K at p - 1), as a real
model's K/V depend on the prefix through the layers below: a block that did not load, or was
computed on one that did not, shows bit for bit (``expected_kv``).

Call ``vllm_env.setup()`` (a module fixture) before anything here.
"""

from __future__ import annotations

import time

import torch

CONNECTOR_PATH = "kvclient.vllm.connector"
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")  # vllm_env.model_dir()'s
HEADS, HEAD_SIZE, BLOCK = 2, 16, 16
# A hybrid model: even layers attend a sliding window, odd layers everything (as gpt-oss).
HYBRID_LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
NULL_BLOCK = 0  # vLLM's null block: a sliding window's blocks below the window


def kv_value(token: int, pos: int, layer: int, part: int, carry: int = 0) -> torch.Tensor:
    """[HEADS, HEAD_SIZE] of fp16 small integers (exact), distinct per (token, position, layer,
    part), shifted by ``carry``: what the layer below read."""
    base = (token * 13 + pos * 7 + layer * 5 + part * 11 + carry) % 1000
    h = torch.arange(HEADS)[:, None] * 17
    d = torch.arange(HEAD_SIZE)[None, :]
    return ((base + h + d) % 2000).to(torch.float16)


def expected_kv(tokens, pos: int, layer: int, part: int) -> torch.Tensor:
    """The K/V the stand-in model computes for ``tokens[pos]`` in ``layer``, from the tokens alone."""
    return kv_value(tokens[pos], pos, layer, part, _carry(tuple(tokens), pos, layer))


def _carry(tokens: tuple, pos: int, layer: int) -> int:
    carries = _CARRIES.setdefault(tokens, {})
    for p in range(pos + 1):
        for layer_ in range(layer + 1):
            if (p, layer_) not in carries:
                carries[p, layer_] = 0 if layer_ == 0 or p == 0 else \
                    int(kv_value(tokens[p - 1], p - 1, layer_ - 1, 0, carries[p - 1, layer_ - 1])[0, 0])
    return carries[pos, layer]


_CARRIES: dict[tuple, dict] = {}


def sampled(pos: int) -> int:
    """The token the stand-in model samples at position ``pos`` (deterministic, never EOS)."""
    return 100 + pos % 50


def config(address: str, **extra):
    import vllm_env

    cfg = vllm_env.vllm_config(kv_connector="KVServerConnector", kv_connector_module_path=CONNECTOR_PATH,
                               kv_connector_extra_config={"address": address, "model": "vllm-test", **extra})
    return cfg


def make_views(layout_name: str, num_blocks: int, num_layers: int = len(LAYERS)):
    """(SharedKVMemory, [per-layer [B, H, N, 2 * head] views]) as vLLM's allocator lays them out."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvclient.views_pool import SharedKVMemory

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
    strides = compute_layout_strides(spec, num_blocks, num_layers, layout)
    names = [f"l{i}" for i in range(num_layers)]
    tensor = KVCacheTensor(size=spec.page_size_bytes * num_blocks * num_layers, layers=names,
                           layer_stride=strides[0], block_stride=strides[1])
    mem = SharedKVMemory(tensor.size)
    views = create_kv_cache_views(mem.tensor.view(torch.int8), spec, num_blocks, layout, tensor)
    return mem, list(views)


def hybrid_kv_cache(vllm_config, window: int, num_blocks: int, layout_name: str = "LBNHC",
                    windows_only: bool = False):
    """(KVCacheConfig, SharedKVMemory, {layer: view}) of HYBRID_LAYERS, grouped and laid out by
    vLLM's own planner (``get_kv_cache_configs``) with its hybrid KV cache manager on, as on a GPU
    (VllmConfig turns it off on a CPU platform), and the views carved by ``create_kv_cache_views``.
    ``windows_only``: every layer attends a sliding window (one group)."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvclient.views_pool import SharedKVMemory

    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.cache_config.kv_cache_layout = layout_name
    specs = {}
    for i, name in enumerate(HYBRID_LAYERS):
        kw = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
        windowed = windows_only or i % 2 == 0
        specs[name] = SlidingWindowSpec(sliding_window=window, **kw) if windowed else FullAttentionSpec(**kw)
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    page = 2 * HEADS * HEAD_SIZE * 2 * BLOCK  # a layer's block: K and V, fp16
    (kv_cfg,) = get_kv_cache_configs(vllm_config, [specs], [page * len(HYBRID_LAYERS) * num_blocks], groups)
    mem = SharedKVMemory(sum(t.size for t in kv_cfg.kv_cache_tensors))
    spec_of = {n: g.kv_cache_spec for g in kv_cfg.kv_cache_groups for n in g.layer_names}
    caches, at = {}, 0
    for t in kv_cfg.kv_cache_tensors:
        raw = mem.tensor[at:at + t.size].view(torch.int8)
        at += t.size
        views = create_kv_cache_views(raw, spec_of[t.layers[0]], kv_cfg.num_blocks,
                                      KVCacheLayout[layout_name], t)
        caches.update(zip(t.layers, views, strict=True))
    return kv_cfg, mem, {n: caches[n] for n in HYBRID_LAYERS}


def engines(vllm_config, address: str, **defaults):
    """A generator for a test fixture: yields make(model, address=..., settings=..., **Engine
    kwargs), which builds engines on ``vllm_config`` with its connector settings changed for the
    engine (``defaults`` are Engine kwargs every engine gets unless given); closes them and puts
    the settings back after."""
    made: list[Engine] = []
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    saved = dict(extra)

    def make(model: str, *, address: str | None = None, settings: dict | None = None, **kw) -> Engine:
        extra.clear()
        extra.update(saved, model=model, address=address or default_address, **(settings or {}))
        made.append(Engine(vllm_config, **{**defaults, **kw}))
        return made[-1]

    default_address = address
    try:
        yield make
    finally:
        for e in made:
            e.close()
        extra.clear()
        extra.update(saved)


def leases(daemon, settle: int | None = 0) -> int:
    """Leases the in-process ``daemon`` (a DaemonThread) holds, once they reach ``settle`` (the
    scheduler releases off its own thread) or after 5 s; ``settle=None`` reads them at once."""
    deadline = time.monotonic() + 5
    while True:
        n = daemon.run(lambda: len(daemon.core.cache.leases.leases))
        if settle is None or n == settle or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


class Engine:
    """One vLLM engine: scheduler + one worker, on ``address``'s daemon. ``window``: the hybrid
    model of HYBRID_LAYERS (sliding windows of that many tokens and full attention), in vLLM's
    KV cache groups."""

    def __init__(self, vllm_config, *, layout: str = "LBNHC", num_blocks: int = 64, on_layer=None,
                 before_load=None, spec_order: bool = False, window: int | None = None,
                 windows_only: bool = False) -> None:
        import vllm_env
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.config = vllm_config
        if window is None:
            kv_cfg = vllm_env.kv_cache_config(BLOCK, num_blocks, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                              layers=LAYERS)
            self.mem, views = make_views(layout, num_blocks)
            self.layers = LAYERS
            self.caches = dict(zip(LAYERS, views, strict=True))
        else:
            kv_cfg, self.mem, self.caches = hybrid_kv_cache(vllm_config, window, num_blocks, layout,
                                                            windows_only)
            self.layers = HYBRID_LAYERS
        self.kv_cache_config = kv_cfg
        self.group_of = {n: gi for gi, g in enumerate(kv_cfg.kv_cache_groups) for n in g.layer_names}
        self.scheduler = vllm_env.scheduler(vllm_config, kv_cfg)
        self.connector = self.scheduler.connector
        self.worker = KVConnectorFactory.create_connector(config=vllm_config, role=KVConnectorRole.WORKER,
                                                          kv_cache_config=kv_cfg)
        self.worker.register_kv_caches(self.caches)
        self.on_layer = on_layer  # on_layer(engine, layer_index, scheduler_output) after each layer's wait
        self.before_load = before_load  # before_load(engine, scheduler_output) before start_load_kv
        self.spec_order = spec_order  # wait_for_save after get_finished, as under speculative decoding
        self.steps = 0
        self.invalid: set[int] = set()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.admitted: dict[str, list[int]] = {}  # request -> computed tokens at each admission
        self.preempted: set[str] = set()

    # ---- vLLM's side --------------------------------------------------------------------------

    def add(self, req_id: str, tokens, max_tokens: int = 4):
        import vllm_env

        req = vllm_env.request(req_id, tokens, max_tokens=max_tokens, block_size=BLOCK)
        self.scheduler.add_request(req)
        return req

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def layer_blocks(self, req_id: str, layer: int) -> list[int]:
        return self.block_ids(req_id, self.group_of[self.layers[layer]])

    def kv(self, block: int, slot: int, layer: int, part: int) -> torch.Tensor:
        v = self.caches[self.layers[layer]]
        return v[block, :, slot, part * HEAD_SIZE:(part + 1) * HEAD_SIZE]

    def expect_kv(self, req_id: str, tokens, upto: int) -> int:
        """The request's first ``upto`` tokens' K/V in its blocks are the model's, bit for bit
        (a sliding window's: those in the blocks vLLM still holds). Returns the entries checked."""
        checked = 0
        for layer in range(len(self.layers)):
            ids = self.layer_blocks(req_id, layer)
            for pos in range(upto):
                if ids[pos // BLOCK] == NULL_BLOCK:
                    continue
                for part in (0, 1):
                    got = self.kv(ids[pos // BLOCK], pos % BLOCK, layer, part)
                    want = expected_kv(tokens, pos, layer, part)
                    assert torch.equal(got, want), (req_id, pos, layer, part)
                    checked += 1
        return checked

    def _scheduled(self, so) -> list[tuple[str, int, int]]:
        """(request, first position, tokens) of every request the step computes."""
        out = [(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id])
               for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        out += [(rid, cached.num_computed_tokens[i], so.num_scheduled_tokens[rid])
                for i, rid in enumerate(cached.req_ids)]
        return out

    def step(self):
        """One engine step; returns the SchedulerOutput."""
        so = self.scheduler.schedule()
        self.scheduler.update_from_output(so, self.execute(so))
        self.steps += 1
        return so

    def overlapped(self, between=None):
        """Two steps as vLLM's engine runs them under async scheduling (a batch queue of two): step
        N is scheduled and executed, ``between(engine)`` runs, step N+1 is scheduled before N's
        output reached the scheduler and executed, then both outputs are given back in order.
        Returns both SchedulerOutputs."""
        first = self.scheduler.schedule()
        out1 = self.execute(first)
        if between is not None:
            between(self)
        second = self.scheduler.schedule()
        out2 = self.execute(second)
        self.scheduler.update_from_output(first, out1)
        self.scheduler.update_from_output(second, out2)
        self.steps += 2
        return first, second

    def execute(self, so):
        """The worker's side of a scheduled step: the connector's calls around a forward whose K/V
        depend on the layer below. Returns the ModelRunnerOutput (not yet given to the scheduler)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        for r in so.scheduled_new_reqs:
            self.admitted.setdefault(r.req_id, []).append(r.num_computed_tokens)
        for i, rid in enumerate(so.scheduled_cached_reqs.req_ids):
            if rid in so.scheduled_cached_reqs.resumed_req_ids:
                self.admitted.setdefault(rid, []).append(so.scheduled_cached_reqs.num_computed_tokens[i])
        self.preempted |= set(so.preempted_req_ids or ())
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)  # gpu_model_runner.execute_model, before the inputs
        w.bind_connector_metadata(meta)
        if self.before_load is not None:
            self.before_load(self, so)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        work = self._scheduled(so)
        carry: dict[tuple[str, int], int] = {}  # (request, position) -> what the layer below read
        if so.total_num_scheduled_tokens:
            for layer, name in enumerate(self.layers):
                for rid, start, n in work:  # the layer writes the step's K/V (before its wait: 0.33)
                    req = self.scheduler.requests[rid]
                    ids = self.layer_blocks(rid, layer)
                    for pos in range(start, start + n):
                        # Under async scheduling a decode step's input may still be a placeholder:
                        # the runner feeds the token it sampled last step, which is sampled(pos).
                        tok = req.all_token_ids[pos] if pos < req.num_tokens else sampled(pos)
                        for part in (0, 1):
                            dst = self.kv(ids[pos // BLOCK], pos % BLOCK, layer, part)
                            dst.copy_(kv_value(tok, pos, layer, part, carry.get((rid, pos), 0)))
                w.wait_for_layer_load(name)
                if self.on_layer is not None:
                    self.on_layer(self, layer, so)
                for rid, start, n in work:  # its attention reads the prefix: K at p - 1 for p
                    ids = self.layer_blocks(rid, layer)
                    for pos in range(start, start + n):
                        prev = self.kv(ids[(pos - 1) // BLOCK], (pos - 1) % BLOCK, layer, 0) if pos else 0
                        carry[rid, pos] = int(prev[0, 0]) if pos else 0
                w.save_kv_layer(name, self.caches[name], None)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        if not self.spec_order:
            w.wait_for_save()
        results = w.get_transfer_results(so.finished_req_ids)  # as vLLM's model runner asks
        sending, recving = results.finished_sending, results.finished_recving
        invalid = w.get_block_ids_with_load_errors()
        worker_meta = w.build_connector_worker_meta()
        if self.spec_order:  # speculative decoding: finalize_kv_connector after the draft model
            w.wait_for_save()
        w.clear_connector_metadata()
        self.invalid |= invalid
        self.finished_sending |= sending or set()
        ids = [rid for rid, _, _ in work]
        tokens = []
        for rid, start, n in work:
            req = self.scheduler.requests[rid]
            tokens.append([sampled(start + n)] if start + n >= req.num_tokens else [])
        self.finished_recving |= recving
        self.failed_recving |= results.failed_recving
        kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                   failed_recving=results.failed_recving, invalid_block_ids=invalid,
                                   kv_connector_worker_meta=worker_meta)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=tokens, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=None, kv_connector_output=kv_out)

    def run(self, max_steps: int = 400, timeout: float = 30.0) -> None:
        """Steps until nothing is left (finished requests' blocks freed included). As vLLM's engine
        loop, it keeps stepping while finished requests wait for their Puts; empty steps pause a
        millisecond here."""
        deadline = time.monotonic() + timeout
        steps = 0
        while self.scheduler.has_requests():
            so = self.step()
            steps += bool(so.total_num_scheduled_tokens)
            if steps > max_steps or time.monotonic() > deadline:
                raise AssertionError(f"still busy after {steps} steps")
            if not so.total_num_scheduled_tokens:
                time.sleep(0.001)

    def time_schedules(self) -> list[float]:
        """From now on, each ``schedule()`` call's length in seconds is appended to the returned
        list."""
        took: list[float] = []
        real = self.scheduler.schedule

        def schedule():
            t = time.monotonic()
            try:
                return real()
            finally:
                took.append(time.monotonic() - t)

        self.scheduler.schedule = schedule
        return took

    def count_lookups(self) -> list[int]:
        """From now on, each lookup the connector's scheduler side sends appends 1 to the list."""
        view = self.connector._scheduler.view
        calls: list[int] = []
        real = view.lookup
        view.lookup = lambda *args, **kw: calls.append(1) or real(*args, **kw)
        return calls

    def count_gets(self) -> list[int]:
        """From now on, the worker's Get calls to the daemon in each step (one entry a step)."""
        w = self.worker._worker
        calls: list[int] = []
        for link in w.links:
            for name in ("get", "get_parts"):
                real = getattr(link.client, name)

                def counted(*args, _real=real, **kw):
                    calls[-1] += 1
                    return _real(*args, **kw)

                setattr(link.client, name, counted)
        start = w.start_load_kv

        def start_load_kv(meta):
            calls.append(0)
            return start(meta)

        w.start_load_kv = start_load_kv
        return calls

    def time_start_load(self) -> list[float]:
        """From now on, each step's ``start_load_kv`` length in ms (one entry a step)."""
        w = self.worker._worker
        took: list[float] = []
        start = w.start_load_kv

        def start_load_kv(meta):
            t = time.perf_counter()
            try:
                return start(meta)
            finally:
                took.append((time.perf_counter() - t) * 1e3)

        w.start_load_kv = start_load_kv
        return took

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
        self.caches.clear()
        self.mem.close()
