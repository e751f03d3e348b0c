"""The C extensions are taken only if built from the sources beside them (kvserver.protocol.compiled):
each exports ABI, and its caller names the number it was written for. A build that matches is used
by every caller; a stale one (another ABI, or none) is not, and the daemon and the client serve
through their fallbacks, with the same answers."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from kvserver.protocol import compiled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def _callers() -> dict[str, list[tuple[str, str]]]:
    """Each extension, and the attributes of the modules that hold it once taken."""
    return {
        "kvserver.protocol._wire": [("kvserver.protocol.lane_request", "_wire"),
                                    ("kvclient._transport.lane", "_wire")],
        "kvserver.lane._kvlane": [("kvserver.lane.plane", "_kvlane")],
        "kvserver.store._kvindex": [("kvserver.store.keys", "_kvindex"),
                                    ("kvserver.store.index", "_kvindex")],
        "kvserver.api._packed": [("kvserver.api.wire", "_compiled")],
        "kvserver.copies._kvcopy": [("kvserver.copies.transfer", "_kvcopy"), ("kvserver.disk.io", "_kvcopy")],
    }


def test_every_extension_of_this_build_is_taken_by_each_of_its_callers() -> None:
    for name, holders in _callers().items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # a build without a compiler: the fallbacks' own tests cover it
        assert isinstance(module.ABI, int) and module.ABI >= 1, name
        for holder, attr in holders:
            # A caller whose number differs from its source's would run its fallback here, slower
            # and silently but for one log line: a change to one side without the other.
            assert getattr(importlib.import_module(holder), attr) is module, (name, holder)


def test_a_module_of_another_abi_or_none_is_not_taken_and_the_log_says_why(tmp_path, monkeypatch,
                                                                             caplog) -> None:
    (tmp_path / "kvtest_built.py").write_text("ABI = 3\n")
    (tmp_path / "kvtest_unnumbered.py").write_text("def call():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvserver.protocol.compiled"):
        assert compiled.extension("kvtest_built", 3).ABI == 3
        assert not caplog.records
        assert compiled.extension("kvtest_built", 4) is None
        assert compiled.extension("kvtest_unnumbered", 1) is None
        assert compiled.extension("kvtest_not_built_at_all", 1) is None  # no compiler: no warning
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "kvtest_built was built from other sources (ABI 3; this code needs 4)" in messages[0]
    assert "kvtest_unnumbered was built from other sources (ABI None; this code needs 1)" in messages[1]
    assert all("rebuilt" in m for m in messages)


STALE = textwrap.dedent("""
    import logging, os, sys, types
    import torch

    class Stale(types.ModuleType):  # a build of older sources: an ABI of 0, and calls never to be made
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise AssertionError(f"{self.__name__}.{name} was used")

    for name in sys.argv[2:]:
        module = Stale(name)
        module.ABI = 0
        sys.modules[name] = module
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(message)s")

    from conftest import DaemonThread
    from kvclient import KVClient, KVLayout, ShmKVPool
    from kvclient._transport import lane as lane_mod
    from kvserver.config import ServerConfig
    from kvserver.copies import transfer
    from kvserver.lane import plane

    assert lane_mod._wire is None and plane._kvlane is None and transfer.copy_rows is None
    d = DaemonThread(ServerConfig(socket=os.path.join(sys.argv[1], "kv.sock"), host_memory=64 << 20))
    try:
        assert d.core.plane is None  # the event loop serves the lane
        layout = KVLayout.mha(2, 16)
        with ShmKVPool(layout, torch.bfloat16, 4, 256) as pool:
            for layer in pool.buffers:
                for buf in layer:
                    buf.view(torch.int16).random_()
            kept = [[b.clone() for b in layer] for layer in pool.buffers]
            with KVClient(d.address, timeout=5, resilient=False) as c:
                c.register(model="stale", pool=pool, start_layer=0, end_layer=4, num_layers=4,
                           host_tokens=256, page_size=16)
                assert c.lane is not None  # the lane, written from Python
                host, dev = c.alloc(64), torch.arange(64, 128)
                assert c.write(host_indices=host, device_indices=dev) > 0
                for layer in pool.buffers:
                    for b in layer:
                        b[64:128].zero_()
                c.load(host_indices=host, device_indices=dev).wait()
                for layer, was in zip(pool.buffers, kept):
                    for b, w in zip(layer, was):
                        assert torch.equal(b.view(torch.int16), w.view(torch.int16))  # bits: NaNs too
                c.unregister()
    finally:
        d.stop()
    print("SERVED")
""")


def test_a_daemon_and_client_with_stale_extensions_serve_through_their_fallbacks(tmp_path) -> None:
    names = list(_callers())
    script = tmp_path / "stale.py"
    script.write_text(STALE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script), str(tmp_path), *names], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "SERVED" in res.stdout
    for name in names:  # each stale extension is named in the log, once for each module that asked
        assert f"{name} was built from other sources (ABI 0;" in res.stdout, name


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
