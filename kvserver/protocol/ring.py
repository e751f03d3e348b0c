"""The data-plane fast lane's ring: a fixed little-endian layout both sides agree on (torch-free:
the client library imports it). See docs/lane.md.

The ring is one memfd, made by the client and sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
of exactly ``ring_bytes(slots)`` bytes:

    header (64 B): magic b"KVL1", version u32, slots u32, slot_bytes u32, request_bytes u32,
                   response_bytes u32, error_bytes u32,
                   28 features u32 (the client's, read once by the daemon: FEATURE_QUIET_DONE),
                   32 awake u32 (the daemon's: nonzero while its data plane looks at the slots
                   without being rung, so a submit need not ring),
                   36 plane u32 (the daemon's: nonzero while its data plane reads the submit
                   doorbell, PLANE_ASLEEP while it sleeps, so that a client rings it ahead of a
                   call, PLANE_RUNNING while it runs: docs/lane.md, "Ringing ahead"), then zeros
    slot i at HEADER_BYTES + i * SLOT_BYTES:
      0  state u32          FREE -> SUBMITTED (client) -> TAKEN (daemon) -> DONE (daemon) -> FREE (client)
      4  rpc u32            RPC_WRITE, RPC_LOAD, RPC_PUT, RPC_GET, RPC_LOOKUP (protobuf requests),
                            RPC_WRITE_B, RPC_LOAD_B (the binary format of kvserver.protocol.lane_request)
      8  seq u64            the client's; the daemon echoes it in done_seq with DONE
      16 request_len u32    bytes of the serialized request at REQUEST_AT
      20 code u32           final gRPC status code (0: OK), valid once DONE
      24 response_len u32   bytes of the serialized response at RESPONSE_AT (Write, Put, Lookup)
      28 error_len u32      bytes of the UTF-8 status message at ERROR_AT
      32 layers_done u32    Load/Get progress, as LoadProgress says it
      36 last_layer u32
      40 bytes u64
      48 events_recorded u32
      52 pages u32          Get: the stored prefix
      56 step u32           incremented by the daemon after each progress update
      60 flags u32          FLAG_DONE: the progress says done; FLAG_JOB_ENDED: the job is dead;
                            FLAG_PLANE_GET: a Get the data plane served whole
      64 done_seq u64
      72 waiting u32        the client's: nonzero while it sleeps on the slot's done doorbell (a
                            FEATURE_QUIET_DONE ring's daemon rings that doorbell only then)
      76 (zero)
      80 busy_us u32        the daemon's data plane's time on the call, from taking it to its
                            answer, in microseconds (0: not the plane's); the client clears it
      84 (zero)
      88 expires u64        the client's: when it stops waiting for the call, in nanoseconds of the
                            daemon's CLOCK_MONOTONIC (OpenLaneResponse.clock_ns); a call the daemon
                            takes at or after it is answered DEADLINE_EXCEEDED, job ended, and never
                            started (a daemon stopped past it, then resumed, runs nothing its
                            clients gave up on); a Write or Put the compiled plane serves itself
                            whose copy ends after it (or after its timeout_ms, as any) is not
                            done (DEADLINE_EXCEEDED, job ended, nothing kept). 0: none
      96 (zeros up to REQUEST_AT)
      REQUEST_AT  request bytes  (REQUEST_BYTES)
      RESPONSE_AT response bytes (RESPONSE_BYTES)
      ERROR_AT    status message (ERROR_BYTES)

Doorbells are SOCK_SEQPACKET socket pairs, not eventfds: the daemon reads and writes its ends with
MSG_DONTWAIT, a per-call flag, whereas an eventfd's O_NONBLOCK lives in the open file description
that the peer shares and may clear (a blocking eventfd read or write would stall the daemon's
event loop). One pair rings the daemon ("submit"); one pair per slot rings the client ("done").
The client connects each to the daemon's fd socket, whose accepts are the daemon's ends
(kvserver.protocol.fd_socket, ``KVF2`` and ``KVB1``).
A closed end reads as end-of-file on the other: a dead daemon wakes every waiting client at once.
Neither side rings a peer that is known awake (docs/lane.md, "Ringing only a sleeper"): a submit skips the
submit doorbell while the header's awake word is set, and a quiet ring's slot is rung done only
while its waiting word is set; each side stores its own word, fences, then reads the other's.

The daemon copies a request out of the ring before parsing it, bounds every length it reads there,
and computes every address from these constants, never from the ring.
"""

from __future__ import annotations

import struct

MAGIC = b"KVL1"
VERSION = 1
# magic, version, slots, slot_bytes, request_bytes, response_bytes, error_bytes
HEADER = struct.Struct("<4s6I")
HEADER_BYTES = 64
MAX_SLOTS = 64
DEFAULT_SLOTS = 8

FREE, SUBMITTED, TAKEN, DONE = 0, 1, 2, 3
RPC_WRITE, RPC_LOAD, RPC_PUT, RPC_GET = 1, 2, 3, 4
# Write and Load in the lane's binary request format (kvserver.protocol.lane_request): what the
# compiled data plane serves (docs/design.md); the daemon answers them as it answers Write and Load.
RPC_WRITE_B, RPC_LOAD_B = 5, 6
# Lookup of the engine's own part (no space_id): served on the event loop, as its RPC is.
RPC_LOOKUP = 7
RPC_NAMES = {RPC_WRITE: "Write", RPC_LOAD: "Load", RPC_PUT: "Put", RPC_GET: "Get", RPC_WRITE_B: "WriteB",
             RPC_LOAD_B: "LoadB", RPC_LOOKUP: "Lookup"}
RPC_IDS = {v: k for k, v in RPC_NAMES.items()}
# OpenLaneResponse.rpc_mask: bit i for each id i the daemon serves. A daemon older than the field
# sends 0 and serves ids 1 to 4 (and 5 and 6 where its request_format is 1).
RPC_MASK = sum(1 << i for i in RPC_NAMES)
OLD_RPC_MASK = sum(1 << i for i in (RPC_WRITE, RPC_LOAD, RPC_PUT, RPC_GET, RPC_WRITE_B, RPC_LOAD_B))
# What a space's lane (a scheduler's, opened with OpenLaneRequest.space_id) carries: its Lookups.
SPACE_RPC_MASK = 1 << RPC_LOOKUP
STREAMS = frozenset({"Load", "Get", "LoadB"})
PLANE_STREAMS = frozenset({"LoadB"})  # the streams the compiled data plane may serve (docs/design.md)

FLAG_DONE = 1
FLAG_JOB_ENDED = 2
FLAG_PLANE_GET = 4  # a Get the daemon's data plane served whole: the lane's next one likely is too
# The ring header's features word: what the client does beyond version 1's protocol (the daemon
# ignores bits it does not know). QUIET_DONE: the client stores a slot's waiting word before it
# sleeps on the slot's done doorbell, so the daemon need ring it only then.
FEATURES_AT = 28
FEATURE_QUIET_DONE = 1
AWAKE_AT = 32
PLANE_AT = 36
PLANE_ASLEEP, PLANE_RUNNING = 1, 2

# Offsets inside a slot.
STATE = 0
CALL = struct.Struct("<IQI")  # rpc, seq, request_len at RPC_AT
RPC_AT = 4
RESULT = struct.Struct("<III")  # code, response_len, error_len at CODE_AT
CODE_AT = 20
PROGRESS = struct.Struct("<IIQIIII")  # layers_done, last_layer, bytes, events_recorded, pages, step, flags
PROGRESS_AT = 32
DONE_SEQ = struct.Struct("<Q")
DONE_SEQ_AT = 64
WAITING_AT = 72
BUSY_AT = 80
EXPIRES_AT = 88
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")

SLOT_HEADER_BYTES = 128
REQUEST_BYTES = 64 * 1024
RESPONSE_BYTES = 1024
ERROR_BYTES = 3 * 1024
REQUEST_AT = SLOT_HEADER_BYTES
RESPONSE_AT = REQUEST_AT + REQUEST_BYTES
ERROR_AT = RESPONSE_AT + RESPONSE_BYTES
SLOT_BYTES = ERROR_AT + ERROR_BYTES  # 69,760 B


def ring_bytes(slots: int) -> int:
    return HEADER_BYTES + slots * SLOT_BYTES


def slot_offset(i: int) -> int:
    return HEADER_BYTES + i * SLOT_BYTES


def header(slots: int, features: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, slots, SLOT_BYTES, REQUEST_BYTES, RESPONSE_BYTES,
                       ERROR_BYTES) + U32.pack(features)
