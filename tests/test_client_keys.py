"""kvclient.keys: chained page keys, stable across processes, and key packing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvclient.keys import KEY_BYTES, pack_keys, page_keys, split_keys

PAGE = 16
TOKENS = np.random.default_rng(7).integers(0, 150_000, size=PAGE * 9 + 5).tolist()


def keys_of(tokens, page_size=PAGE, **kw) -> list[bytes]:
    return split_keys(page_keys(tokens, page_size, **kw))


def test_each_key_is_the_digest_of_the_previous_key_and_the_page_tokens():
    """The documented formula, recomputed with hashlib from the first key on."""
    keys = keys_of(TOKENS)
    prev = keys[0]
    for i, key in enumerate(keys[1:], start=1):
        page = np.asarray(TOKENS[i * PAGE : (i + 1) * PAGE], dtype="<i8").tobytes()
        assert key == hashlib.blake2b(prev + page, digest_size=KEY_BYTES).digest(), i
        prev = key
    parent = b"p" * 16
    first = np.asarray(TOKENS[:PAGE], dtype="<i8").tobytes()
    want = hashlib.blake2b(parent + first, digest_size=KEY_BYTES).digest()
    assert keys_of(TOKENS, parent=parent)[0] == want


def test_keys_are_the_same_in_processes_with_other_hash_seeds():
    here = page_keys(TOKENS, PAGE, salt=b"lora-7").hex()
    code = ("import sys, json; from kvclient.keys import page_keys; "
            f"print(page_keys(json.loads(sys.stdin.read()), {PAGE}, salt=b'lora-7').hex())")
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], input=json.dumps(TOKENS), env=env,
                             capture_output=True, text=True, check=True, timeout=120)
        assert out.stdout.strip() == here, f"PYTHONHASHSEED={seed}"


def test_only_whole_pages_get_a_key_and_a_prefix_keeps_its_keys():
    keys = keys_of(TOKENS)
    assert len(keys) == len(TOKENS) // PAGE == 9
    assert len(set(keys)) == len(keys)
    for n in (0, 1, PAGE - 1, PAGE, 3 * PAGE + 7, 9 * PAGE):
        assert keys_of(TOKENS[:n]) == keys[: n // PAGE], n
    assert page_keys(TOKENS[: PAGE - 1], PAGE) == b""


def test_a_changed_token_changes_its_page_and_every_later_one():
    keys = keys_of(TOKENS)
    changed = list(TOKENS)
    changed[4 * PAGE + 3] += 1
    other = keys_of(changed)
    assert other[:4] == keys[:4]
    assert all(a != b for a, b in zip(other[4:], keys[4:], strict=True))


@pytest.mark.parametrize("kw", [{"salt": b"adapter"}, {"parent": b"\x01" * KEY_BYTES}])
def test_salt_or_parent_changes_every_key(kw):
    keys, other = keys_of(TOKENS), keys_of(TOKENS, **kw)
    assert len(other) == len(keys)
    assert all(a != b for a, b in zip(other, keys, strict=True))
    assert keys_of(TOKENS, **kw) == other  # and is itself stable


def test_a_parent_continues_a_chain():
    whole = keys_of(TOKENS)
    head = keys_of(TOKENS[: 4 * PAGE])
    tail = keys_of(TOKENS[4 * PAGE :], parent=head[-1])
    assert head + tail == whole


def test_lists_arrays_and_tensors_give_the_same_keys():
    want = page_keys(TOKENS, PAGE)
    assert page_keys(np.asarray(TOKENS, dtype=np.int32), PAGE) == want
    assert page_keys(np.asarray(TOKENS, dtype=np.uint32), PAGE) == want
    assert page_keys(torch.tensor(TOKENS), PAGE) == want
    assert page_keys(torch.tensor(TOKENS)[::1], PAGE) == want
    # a strided view of a longer array holds the same tokens
    doubled = np.repeat(np.asarray(TOKENS, dtype=np.int64), 2)
    assert page_keys(doubled[::2], PAGE) == want


def test_page_size_changes_the_keys():
    assert keys_of(TOKENS, 8)[:1] != keys_of(TOKENS, 16)[:1]
    assert len(keys_of(TOKENS, 1)) == len(TOKENS)


@pytest.mark.parametrize("tokens, page_size, text", [
    (TOKENS, 0, "page_size"),
    ([[1, 2], [3, 4]], 1, "one-dimensional"),
    ([1.5, 2.0], 1, "integers"),
])
def test_bad_input_is_refused(tokens, page_size, text):
    with pytest.raises(ValueError, match=text):
        page_keys(tokens, page_size)


def test_split_and_pack():
    packed = page_keys(TOKENS, PAGE)
    keys = split_keys(packed)
    assert b"".join(keys) == packed and all(len(k) == KEY_BYTES for k in keys)
    assert split_keys(b"abcdef", 3) == [b"abc", b"def"]
    assert pack_keys(keys) == (packed, KEY_BYTES, len(keys))
    assert pack_keys([b"abc", b"def"], KEY_BYTES) == (b"abcdef", 3, 2)
    assert pack_keys(bytearray(b"abcdef"), 2) == (b"abcdef", 2, 3)
    assert pack_keys([]) == (b"", KEY_BYTES, 0)
    for bad in (lambda: split_keys(b"abcde", 3), lambda: split_keys(b"", 0),
                lambda: split_keys(b"a" * 65, 65), lambda: pack_keys(b"abcde", 2),
                lambda: pack_keys([b"ab", b"abc"])):
        with pytest.raises(ValueError):
            bad()
