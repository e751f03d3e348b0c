"""The cluster tier's parts that need no cluster: what a page is called (every node alike, no two
pages alike), the breaker's states on a fake clock, the route to the master, and what a daemon
without Mooncake installed says."""

from __future__ import annotations

import socket

import pytest

from kvserver.cluster.breaker import Breaker
from kvserver.cluster.names import names, part_prefix
from kvserver.cluster.store import local_address
from kvserver.protocol.layout import KVLayout, dtype_named
from kvserver.store import Keys, PartKey, SpaceKey
from kvserver.store.spaces import Part as PartOf
from kvserver.store.spaces import PartCounts, Space

MHA = KVLayout.mha(2, 64)
F16 = dtype_named("float16")


def part(tenant="t", model="m", weights="", tp_shard=0, pp_rank=0, layers=(0, 4), page_bytes=4096,
         dtype=F16, layout=MHA):
    key = SpaceKey(tenant, model, layout, dtype, 16, 4, 1, 1, weights)
    return PartOf(Space(key, PartCounts(4)), PartKey(tp_shard, pp_rank, *layers, page_bytes), 0)


def test_a_page_name_is_the_same_on_every_node_and_its_parts_are_all_named():
    p = part()
    (name,) = names(part_prefix(p), Keys.of([b"abc"]))
    assert name == part_prefix(part()) + "616263"  # another process's Part of the same space and layers
    assert name.startswith("kvs2/t/") and len(name.split("/")[2]) == 32
    # A key of 32 bytes (SGLang's, vLLM's) names itself; a wider one, kept as its digest, names the
    # digest and the key's length.
    assert names(part_prefix(p), Keys.of([b"x" * 32]))[0].rsplit("/", 1)[1] == "78" * 32
    wide = names(part_prefix(p), Keys.of([b"x" * 33]))[0].rsplit("/", 1)[1]
    assert wide.endswith(".33") and len(wide) == 32 + 3


@pytest.mark.parametrize("other", [
    dict(tenant="u"), dict(model="m2"), dict(weights="sha256:1"), dict(tp_shard=1), dict(pp_rank=1),
    dict(layers=(0, 2)), dict(page_bytes=8192), dict(dtype=dtype_named("bfloat16")),
    dict(layout=KVLayout.mla(512, 64)),
])
def test_any_field_of_the_space_or_part_changes_every_name(other):
    assert part_prefix(part(**other)) != part_prefix(part())


def test_keys_that_differ_only_in_length_or_padding_have_distinct_names():
    prefix = part_prefix(part())
    got = names(prefix, Keys.of([b"a", b"a\x00", b"a" * 16, b"a" * 17, b"a" * 32, b"a" * 32 + b"\x00",
                                 b"\xff" * 64]))
    assert len(set(got)) == 7


def test_tenant_names_are_escaped_into_one_path_segment():
    assert part_prefix(part(tenant="a/b c")).split("/")[1] == "a%2Fb%20c"


def test_the_breaker_opens_backs_off_and_closes():
    now = [0.0]
    b = Breaker(first_wait=0.5, max_wait=2.0, clock=lambda: now[0])
    assert b.allow() and not b.probe_due()
    assert b.failed()  # it opened
    assert not b.allow() and b.trips == 1
    assert not b.probe_due()  # not before its wait
    for _ in range(6):  # calls failing while it is open change nothing: no longer wait for them
        assert not b.failed()
    now[0] = 0.6
    assert b.probe_due() and not b.probe_due()  # one probe at a time
    b.failed(probe=True)  # the probe failed: twice as long
    now[0] = 1.5
    assert not b.probe_due()
    now[0] = 1.7
    assert b.probe_due()
    b.failed(probe=True)
    now[0] = 1.7 + 2.0
    assert b.probe_due()  # bounded by max_wait
    b.succeeded()
    assert b.allow() and b.trips == 1


def test_a_failure_of_a_call_older_than_the_breaker_s_last_closing_is_old_news():
    b = Breaker(first_wait=0.5, clock=lambda: 0.0)
    started = b.epoch
    b.failed()
    b.succeeded()  # a probe found the store answering
    assert not b.failed(started) and b.allow()  # a call made before that failing now: ignored
    assert b.failed(b.epoch) and not b.allow() and b.trips == 2


def test_the_local_address_is_the_one_that_routes_to_the_master():
    assert local_address("127.0.0.1:50051") == "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.1", 9))
        except OSError:
            pytest.skip("no route off this host")
        assert local_address("10.255.255.1:9") == s.getsockname()[0]


def test_a_cluster_without_mooncake_installed_is_a_clear_error(monkeypatch, capsys, tmp_path):
    import builtins

    import kvserver.__main__ as cli

    real = builtins.__import__

    def no_mooncake(name, *args, **kw):
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    monkeypatch.setattr(cli.uvloop, "run", lambda *_: pytest.fail("main() went on to serve"))
    rc = cli.main(["--socket", str(tmp_path / "s.sock"), "--cluster-master", "127.0.0.1:50051"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'kvserver[cluster]'" in err and "libibverbs1" in err, err

