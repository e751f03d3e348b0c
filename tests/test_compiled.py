"""The C extensions are taken only if built from the sources beside them (kvserver.protocol.compiled):
each carries the digest of the files it was built from. A build of this tree's sources is used by
every caller; a stale one (another digest, or none) is not, and the daemon and the client serve
through their fallbacks, with the same answers."""

from __future__ import annotations

import importlib
import logging
import os
import re
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
    assert set(_callers()) == set(compiled.SOURCES)
    for name, holders in _callers().items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # a build without a compiler: the fallbacks' own tests cover it
        assert module.SOURCES == compiled.digest(ROOT, compiled.SOURCES[name]), name
        for holder, attr in holders:
            assert getattr(importlib.import_module(holder), attr) is module, (name, holder)


def test_the_sources_named_for_each_extension_are_every_file_it_includes() -> None:
    # A header left out of an entry would change the C code without changing its digest.
    for name, files in compiled.SOURCES.items():
        named = {os.path.normpath(f) for f in files}
        todo, seen = [files[0]], set()
        while todo:
            path = todo.pop()
            seen.add(path)
            with open(os.path.join(ROOT, path)) as f:
                for inc in re.findall(r'^\s*#\s*include\s*"([^"]+)"', f.read(), re.M):
                    dep = os.path.normpath(os.path.join(os.path.dirname(path), inc))
                    if dep not in seen:
                        todo.append(dep)
        assert seen == named, name


def test_a_build_of_other_sources_or_of_none_is_not_taken_and_the_log_says_why(tmp_path, monkeypatch,
                                                                                caplog) -> None:
    src = tmp_path / "kvtest.c"
    src.write_text("int x;\n")
    monkeypatch.setitem(compiled.SOURCES, "kvtest_built", ("kvtest.c",))
    monkeypatch.setitem(compiled.SOURCES, "kvtest_unmarked", ("kvtest.c",))
    built = compiled.digest(str(tmp_path), ("kvtest.c",))
    (tmp_path / "kvtest_built.py").write_text(f"SOURCES = {built!r}\n")
    (tmp_path / "kvtest_unmarked.py").write_text("def call():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvserver.protocol.compiled"):
        assert compiled.check("kvtest_built", str(tmp_path)).SOURCES == built
        elsewhere = str(tmp_path / "elsewhere")  # no sources beside the package to compare with
        assert compiled.check("kvtest_built", elsewhere).SOURCES == built
        assert not caplog.records
        assert compiled.check("kvtest_unmarked", str(tmp_path)) is None
        assert compiled.check("kvtest_unmarked", elsewhere) is None
        monkeypatch.setitem(compiled.SOURCES, "kvtest_built", ("kvtest.c", "kvtest.h"))
        assert compiled.check("kvtest_built", str(tmp_path)) is None  # a header missing: not these
        monkeypatch.setitem(compiled.SOURCES, "kvtest_built", ("kvtest.c",))
        src.write_text("int x, y;\n")  # the tree moved on; the build did not
        assert compiled.check("kvtest_built", str(tmp_path)) is None
        monkeypatch.setitem(compiled.SOURCES, "kvtest_absent", ("kvtest.c",))
        assert compiled.check("kvtest_absent", str(tmp_path)) is None  # never built: no warning
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4, messages
    assert "kvtest_unmarked was built from other sources" in messages[0]
    assert "kvtest_built was built from other sources" in messages[2]
    assert f"kvtest_built was built from other sources than {tmp_path} (digest {built})" in messages[3]
    assert all("rebuilt" in m for m in messages)


STALE = textwrap.dedent("""
    import logging, os, sys, types
    import torch

    class Stale(types.ModuleType):  # a build of older sources, whose calls are never to be made
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise AssertionError(f"{self.__name__}.{name} was used")

    for name in sys.argv[2:]:
        module = Stale(name)
        module.SOURCES = "0" * 16  # the digest of no sources of this tree
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
    for name in names:  # named in the log once, however many modules asked
        assert res.stdout.count(f"{name} was built from other sources") == 1, name


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
