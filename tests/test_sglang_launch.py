"""docs/integrations.md's SGLang commands, read by SGLang 0.5.23's own argument parser, and the classes
they name built from what it parsed.

Each `python -m sglang.launch_server` line of the document is extracted as tests/test_docs_readme.py
extracts blocks, split as bash would, and handed to SGLang's `prepare_server_args` (what
`sglang.launch_server` runs before it resolves the model), so a misspelled flag or broken JSON
fails here. SGLang's own validation of the cache flags (`handle_hicache`) runs on the result. The
linker commands are then built through SGLang's own factory, over a CPU stand-in for the GPU pool
(moved into shared memory as tests/test_sglang_linker.py does), against a real daemon; the HiCache
command's module and class must import and subclass SGLang's HiCacheStorage, and the PP command's
backend (HiCache: the linker refuses PP) is built for each stage as SGLang's cache controller
builds it and stores and loads a prompt. The Stats blocks run
as written against the daemon as the document starts it. Skipped where scripts/install_sglang.sh
has not run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import logging
import os
import re
import shlex
import subprocess
import time
from unittest import mock

import pytest
import sglang_env
import torch
from test_docs_readme import (  # noqa: F401  (env, home, start: fixtures of the Stats walk)
    REPO,
    RUN,
    VENV_BIN,
    block,
    blocks,
    command,
    env,
    home,
    start,
    starts_daemon,
)

if not sglang_env.sglang_installed():
    pytest.skip("sglang not installed (scripts/install_sglang.sh)", allow_module_level=True)

DOC = "docs/integrations.md"
LAUNCH = ["python", "-m", "sglang.launch_server"]
DOCUMENTED_ADDRESS = "unix:///run/kvserver/kvserver.sock"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
PAGE = 64  # the documented --page-size
NUM_LAYERS = 24  # Qwen2.5-0.5B's num_hidden_layers, as the PP command's num_layers says
KV_HEADS, HEAD_DIM = 2, 64  # its KV heads: the CPU stand-in pool has their shape
LAUNCH_MODES = {"sglang-linker", "sglang-linker-pp", "sglang-linker-dp", "sglang-hicache"}
RUN_HERE = LAUNCH_MODES | {"sglang-stats-grpcurl", "sglang-stats-python"}


@pytest.fixture(scope="module", autouse=True)
def _sglang():
    sglang_env.setup()
    yield
    sglang_env.restore()


# ---- the document's commands, as SGLang reads them ----------------------------------------------


def launch_commands(text: str) -> list[list[str]]:
    """The arguments after `python -m sglang.launch_server` of every launch line of a block: line
    continuations joined, words split as bash splits them, leading VAR=value assignments skipped."""
    out = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            words.pop(0)
        if words[:3] == LAUNCH:
            out.append(words[3:])
    return out


def documented(mode: str) -> list[str]:
    (argv,) = launch_commands(block(mode))
    return argv


def parse(argv: list[str]):
    """SGLang's prepare_server_args: its argparse parser (ServerArgs.add_cli_args), then
    ServerArgs.from_cli_args; no model is resolved. Only its logging.basicConfig(force=True) is held
    back (it would replace pytest's log handlers). A refused argument fails with argparse's message."""
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with mock.patch.object(logging, "basicConfig"), contextlib.redirect_stderr(err):
            return prepare_server_args(list(argv))
    except SystemExit as exc:
        pytest.fail(f"SGLang's parser refused {shlex.join(argv)} (exit {exc.code}):\n"
                    f"{err.getvalue()[-2000:]}")


def validate(server_args) -> None:
    """SGLang's own checks of the cache flags, in its pipeline's order (arg_groups/hicache_hook.py:
    the ratio default, then handle_hicache, which the pipeline runs once the model is resolved; it
    reads no model)."""
    from sglang.srt.arg_groups.hicache_hook import handle_hicache, handle_hicache_ratio_default

    handle_hicache_ratio_default(server_args)
    handle_hicache(server_args)


def point_at(server_args, address: str) -> None:
    """The documented address is the node's socket, /run/kvserver/kvserver.sock; the test daemon
    listens in a temporary directory, so its address replaces the documented one in the parsed
    config itself. Nothing else of the command changes."""
    extra = server_args.unified_cache_external_linker_config["linker_extra_config"]
    assert extra["address"] == DOCUMENTED_ADDRESS
    extra["address"] = address


# ---- one engine rank, as SGLang builds it from those arguments ---------------------------------


class Engine:
    """An engine rank's cache as SGLang's registry builds it: its token pool (the CPU stand-in,
    in shared memory), CacheInitParams, and the linker from SGLang's own factory with the parsed
    backend and config, then the layer counter registered on the pool."""

    def __init__(self, server_args, *, pp_rank: int = 0, config: dict | None = None) -> None:
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

        from kvclient.sglang.linker import share_cpu_pool

        pp_size = server_args.pp_size
        self.pool = sglang_env.stage_pool("mha", NUM_LAYERS, pp_size, pp_rank, size=4 * PAGE,
                                          page_size=server_args.page_size, head_num=KV_HEADS,
                                          head_dim=HEAD_DIM)
        share_cpu_pool(self.pool)
        params = sglang_env.cache_init_params(self.pool, pp_rank=pp_rank, pp_size=pp_size)
        self.alloc = params.token_to_kv_pool_allocator
        self.linker = create_unified_cache_linker(
            server_args, params, backend=server_args.unified_cache_external_linker_backend,
            config=server_args.unified_cache_external_linker_config if config is None else config,
            components={ComponentType.FULL},
        )
        self.pool.register_layer_transfer_counter(self.linker.layer_done_counter)

    @property
    def registered(self) -> dict:
        return self.linker._register_kwargs

    def _buffers(self):
        return [buf for bufs in (self.pool.k_buffer, self.pool.v_buffer) for buf in bufs]

    def rows(self, slots) -> list[torch.Tensor]:
        return [buf[slots].clone() for buf in self._buffers()]

    def offload(self, hashes: list[str], seed: int) -> list[torch.Tensor]:
        """The forward wrote these pages; write-through stores them. Returns their bytes."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        slots = self.alloc.alloc(len(hashes) * PAGE)
        g = torch.Generator().manual_seed(seed)
        for buf in self._buffers():
            buf[slots] = torch.randn(buf[slots].shape, generator=g).to(buf.dtype)
        kv = PoolTransfer(name=PoolName.KV, device_indices=slots, keys=hashes)
        assert self.linker.offload([kv], session_id=None) is True
        deadline = time.monotonic() + 10
        while self.linker.num_completed_offloads() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.linker.pop_completed_offload() is True
        return self.rows(slots)

    def lookup(self, rid: str, hashes: list[str]) -> list[int]:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        return self.linker.lookup(rid, [PoolTransfer(name=PoolName.KV, keys=hashes)])

    def load(self, rid: str, hashes: list[str]) -> list[torch.Tensor]:
        """match_prefix, load_back, the prefill's layer-wise load and its forward, finish."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        assert self.lookup(rid, hashes) == list(range(1, len(hashes) + 1))
        slots = self.alloc.alloc(len(hashes) * PAGE)
        assert self.linker.load(rid, [PoolTransfer(name=PoolName.KV, keys=hashes, device_indices=slots)])
        index = self.linker.start_layer_wise_loading()
        self.linker.layer_done_counter.set_consumer(index)
        for layer_id in self.pool.model_layer_ids:  # the attention layers wait layer by layer
            self.pool.get_key_buffer(layer_id)
        assert self.linker.finish_layer_wise_loading(index) is True
        return self.rows(slots)

    def close(self) -> None:
        self.linker.close()


def page_hashes(first_token: int, pages: int) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(list(range(first_token, first_token + pages * PAGE)), None, page_size=PAGE)


def same_bytes(expect: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return all(torch.equal(e.view(torch.uint8), g.view(torch.uint8))
               for e, g in zip(expect, got, strict=True))


# ---- every command parses ----------------------------------------------------------------------


def test_every_launch_command_is_run_here_and_parsed_by_sglang():
    doc_blocks = {key: text for key, text in blocks().items() if key[0] == DOC}
    launching = {key for key, text in doc_blocks.items() if launch_commands(text)}
    assert {RUN.get(key) for key in launching} == LAUNCH_MODES, "a launch_server block not run here"
    ran_elsewhere = {mode for (doc, _), mode in RUN.items()
                     if doc == DOC and not mode.startswith("vllm-")} - RUN_HERE  # vllm-*: test_vllm_serve.py
    # test_docs_readme.py::test_integrations_daemon_block; test_cluster_netns.py (the cluster's nodes)
    assert ran_elsewhere == {"sglang-daemon", "cluster-nodes"}
    for key in launching:
        (argv,) = launch_commands(doc_blocks[key])
        server_args = parse(argv)
        validate(server_args)
        assert server_args.model_path == MODEL and server_args.page_size == PAGE, key


def test_a_wrong_flag_or_bad_json_fails_the_parse():
    argv = documented("sglang-linker")
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --enable-unified-cache-linker"):
        parse([a.replace("-external-linker", "-linker", 1) if a.startswith("--enable") else a
               for a in argv])
    with pytest.raises(pytest.fail.Exception, match="invalid loads value"):
        parse([a[:-1] if a.startswith("{") else a for a in argv])
    # And SGLang's own validation refuses what the document says it refuses.
    server_args = parse([*argv, "--enable-hierarchical-cache"])
    with pytest.raises(ValueError, match="mutually exclusive"):
        validate(server_args)


# ---- the linker --------------------------------------------------------------------------------


def test_linker_command_builds_kvserver_linker_and_shares_pages(daemon):
    from kvclient.sglang.linker import KVServerLinker

    server_args = parse(documented("sglang-linker"))
    validate(server_args)
    assert server_args.enable_unified_cache_external_linker and not server_args.enable_hierarchical_cache
    assert server_args.unified_cache_external_linker_backend == "dynamic"
    assert server_args.unified_cache_external_linker_config == {
        "linker": "KVServerLinker", "linker_module_path": "kvclient.sglang.linker",
        "linker_extra_config": {"address": DOCUMENTED_ADDRESS}}
    assert (server_args.tp_size, server_args.pp_size, server_args.dp_size) == (1, 1, 1)
    point_at(server_args, daemon.address)
    a, b = Engine(server_args), Engine(server_args)
    try:
        assert type(a.linker) is KVServerLinker
        reg = a.registered
        # The space: the model path as its name, SGLang's page size, the whole model, no host region.
        assert (reg["model"], reg["page_size"], reg["host_tokens"]) == (MODEL, PAGE, 0)
        assert (reg["start_layer"], reg["end_layer"], reg["num_layers"]) == (0, NUM_LAYERS, NUM_LAYERS)
        hashes = page_hashes(1000, 3)
        assert a.lookup("a0", hashes) == []
        expect = a.offload(hashes, seed=1)
        assert same_bytes(expect, b.load("b0", hashes))
    finally:
        a.close()
        b.close()


def hicache_stage(server_args, address: str, *, pp_rank: int, extra: dict | None = None):
    """A PP stage's HiCache backend as SGLang's cache controller builds it from the parsed command:
    the stage's device pool and a host pool mirroring it, HiCacheController._generate_storage_config
    with the rank's place in the parallel groups and the parsed extra config (the test daemon's
    address in place of the documented one), the factory, register_mem_pool_host,
    on_host_pools_registered. Returns (backend, host pool)."""
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.runtime_context import get_parallel

    if extra is None:
        extra, *_ = HybridCacheController.parse_storage_backend_extra_config(
            server_args.hicache_storage_backend_extra_config)
    extra = dict(extra)
    assert extra["address"] == DOCUMENTED_ADDRESS
    extra["address"] = address
    pp_size = server_args.pp_size
    dev = sglang_env.stage_pool("mha", NUM_LAYERS, pp_size, pp_rank, size=4 * PAGE,
                                page_size=server_args.page_size, head_num=KV_HEADS, head_dim=HEAD_DIM)
    host = sglang_env.host_pool(dev, layout="page_first")
    controller = SimpleNamespace(mem_pool_device=dev, mem_pool_host=host, storage_host_pool=host,
                                 enable_storage_metrics=False, get_attn_cp_rank_and_size=lambda: (0, 1))
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=pp_rank, pp_size=pp_size, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        config = HiCacheController._generate_storage_config(controller, MODEL, extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    try:
        backend.register_mem_pool_host(host)
        backend.on_host_pools_registered()
    except BaseException:
        backend.close()
        raise
    return backend, host


def test_pp_command_runs_the_hicache_backend_on_every_stage(daemon):
    """The PP command is HiCache's (the linker refuses PP): each stage registers its own layers of
    the documented num_layers; engine A's stages store a prompt's pages, engine B's stages read
    them back bit for bit; without num_layers the first stage refuses to start, the last knows
    the count from its own end."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    server_args = parse(documented("sglang-linker-pp"))
    validate(server_args)
    assert server_args.pp_size == 2 and server_args.enable_hierarchical_cache
    assert not server_args.enable_unified_cache_external_linker
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(
        server_args.hicache_storage_backend_extra_config)
    assert extra == {"backend_name": "kvserver", "module_path": "kvclient.sglang.storage",
                     "class_name": "KVServerStorage", "interface_v1": 1, "address": DOCUMENTED_ADDRESS,
                     "num_layers": NUM_LAYERS}
    hashes = get_storage_hash_str(list(range(2000, 2000 + 2 * PAGE)), None, page_size=PAGE)
    slots_a = torch.arange(PAGE, 3 * PAGE)  # host pages 1 and 2
    slots_b = torch.arange(3 * PAGE, 5 * PAGE)  # host pages 3 and 4
    built = []
    try:
        for rank, (first, end) in enumerate(sglang_env.pp_split(NUM_LAYERS, 2)):
            a, host_a = hicache_stage(server_args, daemon.address, pp_rank=rank)
            built.append(a)
            b, host_b = hicache_stage(server_args, daemon.address, pp_rank=rank)
            built.append(b)
            reg = a._registrar.kwargs
            assert (reg["start_layer"], reg["end_layer"], reg["num_layers"]) == (first, end, NUM_LAYERS)
            assert (reg["pp_rank"], reg["pp_size"]) == (rank, 2)
            g = torch.Generator().manual_seed(rank)
            raw = host_a.kv_buffer.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
            assert a.batch_set_v1(hashes, slots_a) == [True, True]
            assert b.batch_exists(hashes) == 2
            assert b.batch_get_v1(hashes, slots_b) == [True, True]
            # page_first [2, tokens, layers, heads, dim]: the stage's every layer of those tokens.
            assert torch.equal(host_a.kv_buffer[:, slots_a].view(torch.uint8),
                               host_b.kv_buffer[:, slots_b].view(torch.uint8))
    finally:
        for backend in built:
            backend.close()
    without = {k: v for k, v in extra.items() if k != "num_layers"}
    with pytest.raises(ValueError, match="set extra_config num_layers"):
        hicache_stage(server_args, daemon.address, pp_rank=0, extra=without)
    last, _ = hicache_stage(server_args, daemon.address, pp_rank=1, extra=without)
    try:
        assert last._registrar.kwargs["num_layers"] == NUM_LAYERS
    finally:
        last.close()


def test_the_linker_refuses_pp_naming_the_hicache_backend(daemon):
    """SGLang's own parser takes the linker command with --pp-size 2, but every stage's linker
    refuses to start, naming what serves PP instead."""
    server_args = parse([*documented("sglang-linker"), "--pp-size", "2"])
    validate(server_args)
    point_at(server_args, daemon.address)
    for rank in (0, 1):
        with pytest.raises(ValueError, match="pipeline parallelism") as refused:
            Engine(server_args, pp_rank=rank)
        assert "--enable-hierarchical-cache" in str(refused.value) and "KVServerStorage" in str(refused.value)


def test_dp_replicas_share_and_a_restarted_engine_hits(daemon):
    server_args = parse(documented("sglang-linker-dp"))
    validate(server_args)
    assert server_args.dp_size == 2
    point_at(server_args, daemon.address)
    replica0, replica1 = Engine(server_args), Engine(server_args)  # one linker per DP scheduler
    hashes = page_hashes(3000, 3)
    try:
        expect = replica0.offload(hashes, seed=3)
        assert same_bytes(expect, replica1.load("on-replica-1", hashes))
    finally:
        replica0.close()
        replica1.close()
    restarted = Engine(server_args)  # a new process with the same command: the pages are still there
    try:
        assert same_bytes(expect, restarted.load("after-restart", hashes))
    finally:
        restarted.close()


# ---- the HiCache backend -----------------------------------------------------------------------


def test_hicache_command_names_kvserver_storage():
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    server_args = parse(documented("sglang-hicache"))
    validate(server_args)
    assert server_args.enable_hierarchical_cache and not server_args.enable_unified_cache_external_linker
    assert server_args.hicache_storage_backend == "dynamic"
    layout = resolving_view(server_args).hicache_mem_layout  # as SGLang's resolution leaves it
    assert layout in ("layer_first", "page_first", "page_first_direct")
    # The string is parsed as SGLang's cache controller parses it.
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(
        server_args.hicache_storage_backend_extra_config)
    assert extra == {"backend_name": "kvserver", "module_path": "kvclient.sglang.storage",
                     "class_name": "KVServerStorage", "interface_v1": 1, "address": DOCUMENTED_ADDRESS}
    if importlib.util.find_spec(extra["module_path"]) is None:
        pytest.fail(f"{extra['module_path']} does not exist in this tree, yet docs/integrations.md's HiCache "
                    f"command names it ({extra['module_path']}.{extra['class_name']}, the HiCacheStorage "
                    "backend); this test passes once that module is merged")
    # SGLang's own loader for the dynamic backend: imports the module, checks the subclass.
    cls = StorageBackendFactory._load_backend_class(extra["module_path"], extra["class_name"],
                                                    extra["backend_name"])
    assert issubclass(cls, HiCacheStorage) and not inspect.isabstract(cls)
    # interface_v1: the controller calls batch_get_v1/batch_set_v1, whose base versions return None.
    for name in ("batch_get_v1", "batch_set_v1"):
        assert getattr(cls, name) is not getattr(HiCacheStorage, name), f"{cls.__name__} must override {name}"


# ---- seeing the hits ---------------------------------------------------------------------------


def test_stats_blocks_show_the_linkers_hits(env, start, tmp_path,  # noqa: F811 (test_docs_readme's fixtures)
                                            default_socket_lock):
    """Step 2's daemon, two engines from step 3's command as written (the daemon is at the documented
    socket), then step 5's grpcurl and Python blocks as written. It alone in this module runs a
    daemon on the node's default socket, so it alone takes the lock (conftest)."""
    if os.geteuid() != 0:
        pytest.skip("the blocks are written for root (/run/kvserver/kvserver.sock), as in SGLang's container")
    daemon = None
    for line in block("sglang-daemon").splitlines():
        cmd = command(line)
        if not cmd:
            continue
        if starts_daemon(cmd):
            daemon = start(line, env)
            assert daemon.wait_listening()[0] == [DOCUMENTED_ADDRESS]
        else:
            subprocess.run(["bash", "-c", line], cwd=REPO, env=env, check=True, timeout=60)
    assert daemon is not None

    server_args = parse(documented("sglang-linker"))
    a, b = Engine(server_args), Engine(server_args)
    try:
        hashes = page_hashes(4000, 3)
        assert a.lookup("a0", hashes) == []  # 3 misses
        expect = a.offload(hashes, seed=4)
        assert same_bytes(expect, b.load("b0", hashes))  # 3 hits

        script = tmp_path / "stats.sh"
        script.write_text(block("sglang-stats-grpcurl"))
        res = subprocess.run(["bash", "-e", "-o", "pipefail", str(script)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
        stats = json.loads(res.stdout)
        (space,) = [s for s in stats["spaces"] if s["space"]["model"] == MODEL]
        counters = space["counters"]
        assert (int(counters["hits"]), int(counters["misses"]), int(counters["pages"])) == (3, 3, 3), space
        assert int(space["space"]["page_size"]) == PAGE and int(space["space"]["num_layers"]) == NUM_LAYERS
        assert int(space["complete_pages"]) == 3
        assert len([c for c in stats["clients"] if c["model"] == MODEL]) == 2  # one per engine

        (tmp_path / "stats.py").write_text(block("sglang-stats-python"))
        res = subprocess.run([str(VENV_BIN / "python"), "stats.py"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        # No tenant token: the totals line only.
        assert res.stdout.splitlines() == [f"2 registrations, {stats['cache_bytes']} bytes of cached pages"]
    finally:
        a.close()
        b.close()
    daemon.stop()


def test_a_tenant_token_shows_its_spaces_to_kvclient_stats(daemon_factory, tmp_path):
    """What step 5 says of kvclient's stats(): totals without a tenant token, the engines' spaces
    with theirs (the daemon's --tenant-tokens, the linker's tenant_token)."""
    from kvclient import KVClient

    token = "tenant-token-of-the-sglang-engines"
    tokens = tmp_path / "tenants"
    tokens.write_text(f"sglang {token}\n")
    d = daemon_factory(tenant_tokens=str(tokens))
    server_args = parse(documented("sglang-linker"))
    point_at(server_args, d.address)
    server_args.unified_cache_external_linker_config["linker_extra_config"]["tenant_token"] = token
    a, b = Engine(server_args), Engine(server_args)
    try:
        hashes = page_hashes(5000, 2)
        expect = a.offload(hashes, seed=5)
        assert same_bytes(expect, b.load("b0", hashes))
        with KVClient(d.address, tenant_token=token) as client:
            st = client.stats(all_clients=True)
        (space,) = st.spaces
        assert (space.tenant, space.space.model) == ("sglang", MODEL)
        assert (space.counters.hits, space.counters.pages) == (2, 2)
        with KVClient(d.address) as client:
            st = client.stats(all_clients=True)
        assert not st.spaces and not st.tenants
        assert st.num_clients == 2 and st.cache_bytes > 0
    finally:
        a.close()
        b.close()
