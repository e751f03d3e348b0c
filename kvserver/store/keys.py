"""Cache keys as fixed-size numpy rows: no Python object per key, whatever a request holds.

A key of up to 32 bytes is kept whole, zero-padded into four 64-bit words, with its length beside it
(so ``b"a"`` and ``b"a\\x00"`` stay different keys): SGLang's and vLLM's keys (32-byte hashes of
token prefixes) are found by their own bytes, with no digest to compute. A wider key (up to 64
bytes) is kept as its 16-byte BLAKE2b digest, zero-padded alike and marked by its length: keys are
themselves digests of token prefixes, and a collision of a 128-bit digest is out of reach, even for
a tenant choosing its own keys (and a tenant's keys only ever name its own pages). Wide keys also
carry their bytes (``raw``, a view of the request where it can be), which the page table keeps
beside the digest so that KV events can name a page by the engine's own key (``kvserver.events``).

Primitives: ``Keys`` (``unpack`` a request's packed field, at once or in steps, ``of`` a list of
keys, slices, ``take``, ``firsts`` and ``distinct``) and ``leading`` (length of a mask's leading
run).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from hashlib import blake2b
from typing import Literal, overload

import numpy as np

from kvserver.errors import InvalidArgument, NoCapacity
from kvserver.protocol import compiled
from kvserver.store.steps import STEP_KEYS, run_steps

MAX_KEY_BYTES = 64
WORD_BYTES = 32  # bytes of a key kept whole; a wider key is kept as its digest, zero-padded
WORDS = WORD_BYTES // 8
DIGEST_BYTES = 16
SMALL = 64  # up to this many keys, ``firsts`` first asks a set whether they are distinct
_PERSON = b"kvserver-key"


# A request's keys as the index keeps them, in one call: padded, or digested as hashlib does
# (``store/csrc/hit.h``, ``store/csrc/digest.h``); None where the index is not built (no
# compiler) or built from other sources.
_kvindex = compiled.extension("kvserver.store._kvindex")
_compiled_words = None if _kvindex is None else _kvindex.words


def _digests(rows: Sequence[bytes]) -> bytes:
    return b"".join(blake2b(bytes(r), digest_size=DIGEST_BYTES, person=_PERSON).digest() for r in rows)


def _digest_into(out: np.ndarray, packed: memoryview, key_bytes: int) -> None:
    """``out`` (k, 2) uint64: the digests of the ``k`` keys packed in ``packed``, by hashlib."""
    rows = [packed[i * key_bytes : (i + 1) * key_bytes] for i in range(len(out))]
    out[:] = np.frombuffer(_digests(rows), np.uint64).reshape(-1, 2)


class Keys:
    """``n`` keys: ``words`` (n, WORDS) uint64 and ``lens`` (n,) uint8; ``raw`` (n, w) uint8, the
    bytes of wide keys (row i's first ``lens[i]`` bytes), or None where they are not known."""

    __slots__ = ("words", "lens", "raw")

    def __init__(self, words: np.ndarray, lens: np.ndarray, raw: np.ndarray | None = None) -> None:
        self.words = words
        self.lens = lens
        self.raw = raw

    @classmethod
    def unpack(cls, packed: bytes, key_bytes: int, max_keys: int) -> Keys:
        """The keys packed in ``packed``, ``key_bytes`` bytes each, in order."""
        return run_steps(cls.unpack_steps(packed, key_bytes, max_keys))

    @classmethod
    def unpack_steps(cls, packed: bytes, key_bytes: int, max_keys: int) -> Generator[None, None, Keys]:
        """``unpack`` in steps: keys of up to 32 bytes in one pass, wider ones digested
        ``STEP_KEYS`` at a time (in C, 0.05–0.15 µs a key as the CPU allows; hashlib's 0.6 µs a
        key where the package was built without a compiler), yielding between two."""
        if not 1 <= key_bytes <= MAX_KEY_BYTES:
            raise InvalidArgument(f"key_bytes must be between 1 and {MAX_KEY_BYTES}, got {key_bytes}")
        if len(packed) % key_bytes:
            raise InvalidArgument(
                f"keys are {len(packed)} bytes, not a whole number of {key_bytes}-byte keys"
            )
        n = len(packed) // key_bytes
        if n > max_keys:
            raise NoCapacity(f"{n} keys in one request; at most {max_keys} are allowed")
        raw = np.frombuffer(packed, np.uint8).reshape(n, key_bytes)
        if _compiled_words is not None:  # padded or digested in C (numpy pads a few bytes a row slowly)
            words = np.empty((n, WORDS), np.uint64)
            view = memoryview(packed)
            step = max(1, n if key_bytes <= WORD_BYTES else STEP_KEYS)
            for start in range(0, n, step):
                end = min(n, start + step)
                _compiled_words(words[start:end], view[start * key_bytes : end * key_bytes], key_bytes)
                if end < n:
                    yield
        elif key_bytes == WORD_BYTES:
            words = raw.view(np.uint64).copy()
        elif key_bytes < WORD_BYTES:
            padded = np.zeros((n, WORD_BYTES), np.uint8)
            padded[:, :key_bytes] = raw
            words = padded.view(np.uint64)
        else:
            digests = np.empty((n, 2), np.uint64)
            view = memoryview(packed)
            for start in range(0, n, STEP_KEYS):
                end = min(n, start + STEP_KEYS)
                _digest_into(digests[start:end], view[start * key_bytes : end * key_bytes], key_bytes)
                if end < n:
                    yield
            words = np.zeros((n, WORDS), np.uint64)
            words[:, :2] = digests
        wide = raw if key_bytes > WORD_BYTES else None
        return cls(words.reshape(n, WORDS), np.full(n, key_bytes, np.uint8), wide)

    @classmethod
    def of(cls, keys: Sequence[bytes]) -> Keys:
        """Keys given one by one (of any lengths up to ``MAX_KEY_BYTES``)."""
        keys = [bytes(k) for k in keys]
        lens = np.fromiter(map(len, keys), np.int64, len(keys))
        if len(keys) and (lens.max() > MAX_KEY_BYTES or lens.min() < 1):
            raise InvalidArgument(f"keys must be 1 to {MAX_KEY_BYTES} bytes long")
        rows = [k if len(k) <= WORD_BYTES else _digests([k]) for k in keys]  # "S" pads with zeros
        words = np.array(rows, dtype=f"S{WORD_BYTES}").view(np.uint64) if rows else np.empty(0, np.uint64)
        raw = None
        if len(keys) and lens.max() > WORD_BYTES:
            raw = np.zeros((len(keys), int(lens.max())), np.uint8)
            for i, k in enumerate(keys):
                if len(k) > WORD_BYTES:
                    raw[i, : len(k)] = np.frombuffer(k, np.uint8)
        return cls(words.reshape(len(keys), WORDS), lens.astype(np.uint8), raw)

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, sl: slice) -> Keys:
        return Keys(self.words[sl], self.lens[sl], None if self.raw is None else self.raw[sl])

    def take(self, positions: np.ndarray) -> Keys:
        return Keys(self.words[positions], self.lens[positions],
                    None if self.raw is None else self.raw[positions])

    def copy(self) -> Keys:
        """Keys that own their arrays (no view of a request)."""
        return Keys(self.words.copy(), self.lens.copy(), None if self.raw is None else self.raw.copy())

    def as_bytes(self) -> list[bytes | None]:
        """Each key's bytes: whole up to 32 bytes; a wider one from ``raw``, None where unknown
        (a page adopted from a kept cache keeps no wide key's bytes). One pass per key length."""
        n = len(self)
        out: list[bytes | None] = [None] * n
        words = self.words.view(np.uint8).reshape(n, WORD_BYTES)
        for length in np.unique(self.lens).tolist():
            at = np.flatnonzero(self.lens == length)
            if length <= WORD_BYTES:
                rows = words[at, :length]
            elif self.raw is not None and self.raw.shape[1] >= length:
                known = self.raw[at, :length].any(axis=1)
                at = at[known]
                rows = self.raw[at, :length]
            else:
                continue
            flat = np.ascontiguousarray(rows).tobytes()
            for j, i in enumerate(at.tolist()):
                out[i] = flat[j * length : (j + 1) * length]
        return out

    @overload
    def firsts(self, ranks: Literal[False] = False) -> np.ndarray: ...
    @overload
    def firsts(self, ranks: Literal[True]) -> tuple[np.ndarray, np.ndarray]: ...

    def firsts(self, ranks: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Ascending positions of the first occurrence of each distinct key; with ``ranks``, also
        for every key the index of its first occurrence in those positions."""
        n = len(self)
        words, lens = self.words, self.lens
        if n <= SMALL and len(set(zip(*(words[:, i].tolist() for i in range(WORDS)), lens.tolist(),
                                      strict=True))) == n:
            every = np.arange(n, dtype=np.int64)  # distinct, as a Put's keys nearly always are
            return (every, every.copy()) if ranks else every
        # Equal keys made adjacent, each run in position order (a stable sort by their words), by
        # the words that can differ: the last two are zero but for keys of 17 to 32 bytes.
        used = WORDS if ((lens > DIGEST_BYTES) & (lens <= WORD_BYTES)).any() else 2
        cols = [words[:, i] for i in range(used - 1, -1, -1)]  # lexsort's last key first
        same_len = n == 0 or bool((lens == lens[0]).all())
        order = np.lexsort(cols if same_len else [lens, *cols])
        new = np.ones(n, bool)
        if n > 1:
            a, b = order[1:], order[:-1]
            new[1:] = lens[a] != lens[b]
            for c in cols:
                new[1:] |= c[a] != c[b]
        first = order[new]  # per group (in key order), its first position
        by_pos = np.argsort(first, kind="stable")
        firsts = first[by_pos].astype(np.int64)
        if not ranks:
            return firsts
        rank_of_group = np.empty(len(first), np.int64)
        rank_of_group[by_pos] = np.arange(len(first))
        rank = np.empty(n, np.int64)
        rank[order] = rank_of_group[np.cumsum(new) - 1]
        return firsts, rank

    def distinct(self) -> bool:
        """True if no key repeats."""
        return len(self) < 2 or len(self.firsts()) == len(self)

    def __repr__(self) -> str:
        return f"Keys({len(self)})"


def as_keys(keys: Keys | Sequence[bytes]) -> Keys:
    return keys if isinstance(keys, Keys) else Keys.of(keys)


def leading(mask: np.ndarray) -> int:
    """How many leading entries of a boolean mask are true."""
    if mask.all():
        return len(mask)
    return int(mask.argmin())
