"""An engine-side process for the fd-passing tests, run as another user (``python -m fd_peer``):
it tries to make the daemon map memory it has no right to, and reports each status as JSON.

Usage (as root): fd_peer.py UID SOCKET NAME. It imports what it needs, then becomes UID (in
group 0, so a 0660 root socket lets it in) before it opens anything: the interpreter's own files
may not be readable by UID. NAME is a /dev/shm object UID cannot open itself.
"""

from __future__ import annotations

import json
import os
import sys

import grpc

from kvserver.protocol.fd_socket import fd_socket_path, request_ticket
from kvserver.protocol.shared_memory import SHM_DIR, create_memfd
from kvserver.v1 import kvserver_pb2 as pb
from kvserver.v1 import kvserver_pb2_grpc as pb_grpc

TOKENS = 64
TOKEN_BYTES = 2 * 8 * 2  # MHA 2 heads x 8 dims, fp16


def request(where: dict, ticket: str) -> pb.RegisterRequest:
    buf = TOKENS * TOKEN_BYTES
    return pb.RegisterRequest(
        model="peer", start_layer=0, end_layer=1, num_layers=1,
        layout=pb.KVLayout(mha=pb.MHALayout(num_heads=2, head_dim=8)), dtype=pb.DTYPE_FLOAT16,
        page_size=16, host_tokens=64, peer_ticket=ticket,
        device_pool=pb.DevicePool(num_tokens=TOKENS, layers=[pb.LayerBuffers(parts=[
            pb.BufferRef(**where, offset=part * buf, token_stride=TOKEN_BYTES) for part in range(2)])]),
    )


def become(uid: int) -> None:
    os.setgroups([0])
    os.setgid(uid)
    os.setuid(uid)


def main(socket: str, name: str) -> None:
    out: dict = {"uid": os.getuid()}
    try:
        os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        out["can_open"] = True
    except PermissionError:
        out["can_open"] = False
    fd_path = fd_socket_path(socket)
    stub = pb_grpc.KVServerStub(grpc.insecure_channel(f"unix://{socket}"))
    own, _ = create_memfd("kvpeer-own", 2 * TOKENS * TOKEN_BYTES)
    named = {"shm": pb.ShmLocation(name=name)}
    cases = {
        "named": (named, []),
        "named-no-ticket": (named, None),
        "fd-not-sent": ({"fd": pb.FdLocation(index=0)}, []),
        "fd-not-sent-no-ticket": ({"fd": pb.FdLocation(index=0)}, None),
        "fd-past-own": ({"fd": pb.FdLocation(index=1)}, [own]),
        "own-memfd": ({"fd": pb.FdLocation(index=0)}, [own]),  # the control: this one is allowed
    }
    for case, (where, fds) in cases.items():
        ticket = "" if fds is None else request_ticket(fd_path, fds)
        try:
            resp = stub.Register(request(where, ticket), timeout=10)
            out[case] = ["OK", resp.client_id]
        except grpc.RpcError as exc:
            out[case] = [exc.code().name, exc.details()]
    print(json.dumps(out))


if __name__ == "__main__":
    become(int(sys.argv[1]))
    main(sys.argv[2], sys.argv[3])
