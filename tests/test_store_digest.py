"""The compiled digests of wide keys (``store/csrc/digest.h``) against hashlib's BLAKE2b, the
digest a key of more than 32 bytes is kept as (``store/keys.py``): the same bytes for every
length and count, on every path this CPU has (the vector paths take keys eight or four at a time,
the scalar one the rest), and arguments checked before a byte is read; a request's keys as the
index keeps them (``_kvindex.words``) the same as numpy's and hashlib's."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from kvserver.store import keys as store_keys
from kvserver.store.keys import Keys
from kvserver.store.steps import STEP_KEYS

_kvindex = pytest.importorskip("kvserver.store._kvindex", reason="the compiled index is not built")


def reference(packed: bytes, key_bytes: int) -> bytes:
    rows = (packed[i : i + key_bytes] for i in range(0, len(packed), key_bytes))
    return b"".join(hashlib.blake2b(r, digest_size=16, person=b"kvserver-key").digest() for r in rows)


PATHS = [0, 1, 4, 8]  # the widest the CPU has; scalar; AVX2; AVX-512


@pytest.mark.parametrize("lanes", PATHS)
@pytest.mark.parametrize("key_bytes", [1, 8, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128])
def test_digests_are_hashlib_s_for_every_length_and_count(key_bytes, lanes) -> None:
    if lanes and not _kvindex.digest_lanes() & lanes:
        pytest.skip(f"this CPU has no {lanes}-key digest path")
    for n in [*range(21), 300, 1027]:
        packed = os.urandom(n * key_bytes)
        out = np.empty((n, 2), np.uint64)
        _kvindex.digests(out, packed, key_bytes, lanes)
        assert out.tobytes() == reference(packed, key_bytes), (key_bytes, n, lanes)


def test_a_path_the_cpu_lacks_is_refused() -> None:
    have = _kvindex.digest_lanes()
    assert have & 1
    for lanes in (2, 3, 16, -1, *(w for w in (4, 8) if not have & w)):
        with pytest.raises(ValueError, match="lanes"):
            _kvindex.digests(np.empty((1, 2), np.uint64), b"x" * 32, 32, lanes)


def test_a_memoryview_of_a_larger_request_is_read_only_where_it_points() -> None:
    blob = os.urandom(40 * 32 + 7)
    view = memoryview(blob)[7 : 7 + 40 * 32]
    out = np.empty((40, 2), np.uint64)
    _kvindex.digests(out, view, 32)
    assert out.tobytes() == reference(bytes(view), 32)


def kept_words(packed: bytes, key_bytes: int) -> bytes:
    """The index's 32 bytes a key: the key itself up to 32 bytes, else its digest; zero-padded."""
    rows = [packed[i : i + key_bytes] for i in range(0, len(packed), key_bytes)]
    if key_bytes > 32:
        rows = [reference(r, key_bytes) for r in rows]
    return b"".join(r.ljust(32, b"\0") for r in rows)


@pytest.mark.parametrize("key_bytes", [1, 7, 8, 16, 17, 31, 32, 33, 64])
def test_keys_unpack_the_same_with_and_without_the_compiled_path(monkeypatch, key_bytes) -> None:
    packed = os.urandom((2 * STEP_KEYS + 5) * key_bytes)  # several steps
    compiled = Keys.unpack(packed, key_bytes, 1 << 20)
    monkeypatch.setattr(store_keys, "_compiled_words", None)
    plain = Keys.unpack(packed, key_bytes, 1 << 20)
    assert np.array_equal(compiled.words, plain.words)
    assert np.array_equal(compiled.lens, plain.lens)
    if key_bytes > 32:
        assert np.array_equal(compiled.raw, plain.raw)
    else:  # kept whole: the words are the key
        assert compiled.raw is None and plain.raw is None
    assert compiled.words.tobytes() == kept_words(packed, key_bytes)
    assert Keys.of([packed[i : i + key_bytes] for i in range(0, 40 * key_bytes, key_bytes)]).words.tobytes() \
        == kept_words(packed[: 40 * key_bytes], key_bytes)


@pytest.mark.parametrize("call, args, error", [
    ("digests", (np.empty((1, 2), np.uint64), b"x" * 32, 0), "key_bytes"),
    ("digests", (np.empty((1, 2), np.uint64), b"x" * 129, 129), "key_bytes"),
    ("digests", (np.empty((1, 2), np.uint64), b"x" * 33, 32), "whole keys"),
    ("digests", (np.empty((2, 2), np.uint64), b"x" * 32, 32), "a digest for each"),
    ("digests", (np.empty((1, 1), np.uint64), b"x" * 32, 32), "a digest for each"),
    ("digests", (np.empty((1, 4), np.int32), b"x" * 32, 32), "unsigned"),
    ("digests", (np.empty((1, 2), np.float64), b"x" * 32, 32), "unsigned"),
    ("digests", (np.empty((4, 2), np.uint64)[::2], b"x" * 64, 32), "contiguous"),
    # words: a request's keys as the index keeps them (Keys.unpack's compiled path)
    ("words", (np.empty((1, 4), np.uint64), b"x" * 32, 0), "key_bytes"),
    ("words", (np.empty((1, 4), np.uint64), b"x" * 65, 65), "key_bytes"),
    ("words", (np.empty((1, 4), np.uint64), b"x" * 33, 32), "whole keys"),
    ("words", (np.empty((2, 4), np.uint64), b"x" * 32, 32), "the words for each"),
    ("words", (np.empty((1, 2), np.uint64), b"x" * 32, 32), "the words for each"),
    ("words", (np.empty((1, 5), np.uint64), b"x" * 16, 16), "the words for each"),
    ("words", (np.empty((1, 4), np.int64), b"x" * 32, 32), "unsigned"),
    ("words", (np.empty((4, 4), np.uint64)[::2], b"x" * 64, 32), "contiguous"),
])
def test_bad_arguments_are_refused_before_anything_is_written(call, args, error) -> None:
    """An output of the wrong size, type or layout, or keys that are not whole: nothing written."""
    out = args[0]
    before = out.tobytes()
    with pytest.raises((ValueError, BufferError), match=error):
        getattr(_kvindex, call)(*args)
    assert out.tobytes() == before


@pytest.mark.parametrize("call, words", [("digests", 2), ("words", 4)])
def test_a_read_only_output_or_a_non_buffer_input_is_refused(call, words) -> None:
    out = np.empty((1, words), np.uint64)
    out.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        getattr(_kvindex, call)(out, b"x" * 32, 32)
    with pytest.raises(TypeError):
        getattr(_kvindex, call)(np.empty((1, words), np.uint64), [0] * 32, 32)
