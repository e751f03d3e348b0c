"""The CUDA path's parts that need no GPU: handle and UUID parsing, span checks, copy planning,
the client's export, and how a daemon without a usable GPU answers CUDA registrations."""

from __future__ import annotations

import grpc
import pytest
import torch
from fake_cupy import UUID_HEX, make_fake_cupy
from ticketing import ticketing_stub

from kvclient import KVClient, KVClientError, KVLayout, ShmKVPool
from kvclient._messages import register_request
from kvclient._transport.fd_socket import ticketed
from kvclient.cuda_pool import buffer_ref
from kvserver.errors import InvalidArgument
from kvserver.media.cuda import plan
from kvserver.media.cuda.devices import ordinal_for
from kvserver.media.cuda.runtime import _probe
from kvserver.protocol.cuda_ipc import (
    check_span,
    normalize_pci_bus_id,
    normalize_uuid,
    raw_ipc_handle,
    uuid_from_bytes,
)
from kvserver.v1 import kvserver_pb2 as pb

HANDLE = bytes(range(64))
UUID = "GPU-1a2b3c4d-5e6f-7a8b-9c0d-112233445566"


def test_raw_handle_forms():
    assert raw_ipc_handle(HANDLE) == HANDLE
    for version in (1, 2, 3):  # torch's versioned cudaMalloc handle: 2 up to torch 2.12, 3 from 2.13
        assert raw_ipc_handle(bytes([version]) + b"c" + HANDLE) == HANDLE
    for version in (2, 3):
        with pytest.raises(InvalidArgument, match="expandable_segments:False"):
            raw_ipc_handle(bytes([version]) + b"e" + b"\0" * 40)  # torch's expandable-segment form
    with pytest.raises(InvalidArgument, match="version 9, which this daemon does not know"):
        raw_ipc_handle(b"\x09c" + HANDLE)
    for bad in (b"", HANDLE[:63], HANDLE + b"\0", b"\x02c" + HANDLE[:63], b"\x02x" + HANDLE):
        with pytest.raises(InvalidArgument, match="64-byte"):
            raw_ipc_handle(bad)


def test_pci_bus_id_spellings():
    assert normalize_pci_bus_id("0000:3B:00.0") == "00000000:3b:00.0"
    assert normalize_pci_bus_id("00000000:3b:00.0") == "00000000:3b:00.0"
    assert normalize_pci_bus_id("") == ""
    for bad in ("3b:00.0", "0000:3b:00", "0000:3b:00.8", "GPU-0"):
        with pytest.raises(InvalidArgument, match="not a PCI bus id"):
            normalize_pci_bus_id(bad)


@pytest.mark.parametrize("uuid_bytes", [
    bytes.fromhex(UUID_HEX),  # what CUDA fills in
    bytes.fromhex(UUID_HEX) + b"\x7f\x01",  # no zero byte: the C string ran on into the next field
])
def test_device_found_by_uuid(uuid_bytes):
    cupy = make_fake_cupy()
    cupy.cuda.runtime.uuid_bytes = uuid_bytes
    assert ordinal_for(cupy, UUID) == 0
    assert ordinal_for(cupy, UUID.upper()[4:], "0000:3b:00.0") == 0
    with pytest.raises(InvalidArgument, match="is not visible to the daemon"):
        ordinal_for(cupy, "GPU-ffffffff-5e6f-7a8b-9c0d-112233445566")


def test_device_with_a_cut_uuid_found_by_pci_bus_id():
    """CuPy hands cudaUUID_t over as a C string, cut at its first zero byte."""
    cupy = make_fake_cupy()
    cupy.cuda.runtime.uuid_bytes = bytes.fromhex(UUID_HEX)[:5]
    assert ordinal_for(cupy, UUID, "0000:3B:00.0") == 0
    with pytest.raises(InvalidArgument, match="no full UUIDs"):
        ordinal_for(cupy, UUID)
    with pytest.raises(InvalidArgument, match="at 00000000:3c:00.0 is not visible"):
        ordinal_for(cupy, UUID, "0000:3c:00.0")


def test_uuid_spellings():
    assert normalize_uuid(UUID) == UUID
    assert normalize_uuid(UUID.upper().replace("GPU-", "")) == UUID
    assert normalize_uuid("1a2b3c4d5e6f7a8b9c0d112233445566") == UUID
    assert uuid_from_bytes(bytes.fromhex("1a2b3c4d5e6f7a8b9c0d112233445566")) == UUID
    for bad in ("", "GPU-xyz", "0", UUID + "0", "MIG-1a2b3c4d-5e6f-7a8b-9c0d-112233445566"):
        with pytest.raises(InvalidArgument, match="not a GPU UUID"):
            normalize_uuid(bad)


def test_span_must_end_inside_the_allocation():
    check_span(offset=4096, token_stride=256, num_tokens=16, token_bytes=256, allocation_size=4096 + 4096,
               what="b")
    with pytest.raises(InvalidArgument, match="needs 8193 bytes"):
        check_span(4097, 256, 16, 256, 8192, "b")
    with pytest.raises(InvalidArgument, match="smaller than one token"):
        check_span(0, 128, 16, 256, 1 << 20, "b")


def test_span_is_checked_against_the_real_allocation():
    """The declared size can only narrow the driver's: 2^63 declared reaches no further."""
    check_span(0, 256, 16, 256, 1 << 63, "b", real_size=4096)
    with pytest.raises(InvalidArgument, match="the allocation the handle opens is 4095 bytes"):
        check_span(0, 256, 16, 256, 1 << 63, "b", real_size=4095)
    with pytest.raises(InvalidArgument, match="the allocation is 2048 bytes"):
        check_span(0, 256, 16, 256, 2048, "b", real_size=4096)


def test_stand_in_reports_real_allocation_ranges():
    rt = make_fake_cupy().cuda.runtime
    _, mem = rt.export(8192)
    assert rt.address_range(mem.ctypes.data + 100) == (mem.ctypes.data, 8192)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_NOT_FOUND"):
        rt.address_range(mem.ctypes.data + 8192)


def test_copy_method_by_chunk_size():
    assert plan.choose_method(16 << 10) == "kernel"
    assert plan.choose_method(28 << 10) == "dma"
    assert plan.choose_method(64 << 10, dma_min_chunk_bytes=128 << 10) == "kernel"
    assert plan.choose_method(64 << 10, num_copies=plan.DMA_MAX_COPIES + 1) == "kernel"


def test_kernel_launch_shape():
    assert plan.kernel_launch(num_rows=1000, row_bytes=4096, max_blocks=8) == (8, 128)
    assert plan.kernel_launch(num_rows=3, row_bytes=64, max_blocks=8) == (1, 128)
    assert plan.kernel_launch(num_rows=3, row_bytes=6, max_blocks=8, word_bytes=2) == (1, 128)
    with pytest.raises(ValueError, match="multiple of 8"):
        plan.kernel_launch(10, 12, 8)


def test_copy_word_is_the_widest_that_divides_everything():
    import numpy as np

    assert plan.word_bytes(4096, np.array([0, 8, 64], dtype=np.uint64)) == 8
    assert plan.word_bytes(4096, np.array([0, 12]), np.array([4])) == 4
    assert plan.word_bytes(6, np.array([0, 6, 12])) == 2
    assert plan.word_bytes(4096, np.array([0, 1 << 40]), np.array([3])) == 1
    assert plan.word_bytes(8, np.array([], dtype=np.int64)) == 8


def test_client_export_from_a_share_tuple():
    # What storage._share_cuda_() returns: device, handle, storage size, offset in the allocation, ...
    for handle in (b"\x02c" + HANDLE, b"\x03c" + HANDLE, HANDLE):
        share = (0, handle, 1 << 20, 3 << 20, b"ref", 0, b"event", False)
        ref = buffer_ref(share, tensor_offset_bytes=512, token_stride=256, device_uuid=UUID.upper(),
                         pci_bus_id="0000:3B:00.0")
        assert ref.cuda.ipc_handle == HANDLE  # raw, whatever torch's prefix version
        assert ref.cuda.device_uuid == UUID
        assert ref.cuda.pci_bus_id == "00000000:3b:00.0"
        assert ref.offset == (3 << 20) + 512
        assert ref.cuda.allocation_size == (4 << 20)
        assert ref.token_stride == 256
        assert (ref.block_tokens, ref.block_stride, ref.head_stride) == (0, 0, 0)  # plain token rows
    # FlashInfer HND, 16-token blocks of 8 heads x 256 B: K of block b at b * 2 * 16 * 2048.
    ref = buffer_ref(share, 0, 256, UUID, block_tokens=16, block_stride=2 * 16 * 2048, head_stride=16 * 256)
    assert (ref.block_tokens, ref.block_stride, ref.token_stride, ref.head_stride) == (16, 65536, 256, 4096)
    with pytest.raises(ValueError, match="expandable"):
        buffer_ref((0, b"\x02e" + b"\0" * 30, 1 << 20, 0), 0, 256, UUID)


def test_client_device_identity(monkeypatch):
    """UUID and PCI bus id as torch reports them; older torch builds without the PCI fields send
    the UUID alone."""
    import types

    from kvclient.cuda_pool import device_identity

    props = types.SimpleNamespace(uuid="1a2b3c4d-5e6f-7a8b-9c0d-112233445566", pci_domain_id=0,
                                  pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    uuid = "1a2b3c4d-5e6f-7a8b-9c0d-112233445566"
    assert device_identity(torch.device("cuda", 0)) == (uuid, "0000:3b:00.0")
    assert normalize_pci_bus_id(device_identity(0)[1]) == "00000000:3b:00.0"
    del props.pci_device_id
    assert device_identity(0) == (uuid, "")


def cuda_register_request(handle: bytes = HANDLE, uuid: str = UUID, allocation_size: int = 1 << 20,
                          pci_bus_id: str = ""):
    layout = KVLayout.mha(2, 64)  # 256 B per token
    pool = pb.DevicePool(num_tokens=1024, layers=[
        pb.LayerBuffers(parts=[
            pb.BufferRef(cuda=pb.CudaIpcLocation(ipc_handle=handle, device_uuid=uuid,
                                                 allocation_size=allocation_size, pci_bus_id=pci_bus_id),
                         offset=part * (256 << 10), token_stride=256)
            for part in range(2)
        ])
        for _ in range(2)
    ])

    class Described:
        def __init__(self):
            self.layout, self.dtype = layout, torch.float16

        def descriptor(self):
            return pool

    return register_request(model="gpu", pool=Described(), start_layer=0, end_layer=2, num_layers=2,
                            host_tokens=256, page_size=16, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


needs_no_gpu = pytest.mark.skipif(_probe()[0] is not None, reason="a usable GPU is present")


@needs_no_gpu
def test_daemon_without_gpu_refuses_cuda_pools_and_keeps_serving_shm(daemon):
    with grpc.insecure_channel(daemon.address) as ch:
        stub = ticketing_stub(ch, daemon.address)
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(cuda_register_request(), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cannot register CUDA pools" in err.value.details()
        assert "Shared-memory pools still work" in err.value.details()
        assert stub.Stats(pb.StatsRequest()).num_clients == 0
    with ShmKVPool(KVLayout.mha(2, 8), torch.bfloat16, 2, 64) as pool, KVClient(daemon.address) as c:
        c.register(model="m", pool=pool, start_layer=0, end_layer=2, num_layers=2, host_tokens=16)
        assert c.write(host_indices=c.alloc(16), device_indices=torch.arange(16)) > 0


@pytest.mark.parametrize(("kwargs", "text"), [
    ({"handle": b"\x02e" + b"\0" * 40}, "expandable_segments:False"),
    ({"handle": HANDLE[:10]}, "64-byte"),
    ({"uuid": "3"}, "not a GPU UUID"),
    ({"pci_bus_id": "3b:00"}, "not a PCI bus id"),
    ({"allocation_size": 4096}, "the allocation is 4096 bytes"),
])
def test_bad_cuda_descriptions_are_invalid_on_any_daemon(daemon, kwargs, text):
    """Checked before the daemon looks for a GPU, so the answer does not depend on having one."""
    with grpc.insecure_channel(daemon.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ticketing_stub(ch, daemon.address).Register(cuda_register_request(**kwargs), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert text in err.value.details()


@needs_no_gpu
def test_kvclient_reports_the_refusal(daemon):
    client = KVClient(daemon.address)
    req = cuda_register_request()
    with pytest.raises(KVClientError) as err:
        client._call(client._stub.Register, ticketed(daemon.address, None, req))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    client.close()


def test_cuda_wait_seconds_flag_and_variable(monkeypatch):
    from kvserver.__main__ import build_parser, config_from_args
    from kvserver.config import ServerConfig

    assert config_from_args(build_parser().parse_args(["--socket", "/tmp/x.sock"])).cuda_wait_seconds == 20
    args = build_parser().parse_args(["--socket", "/tmp/x.sock", "--cuda-wait-seconds", "2.5"])
    assert config_from_args(args).cuda_wait_seconds == 2.5
    monkeypatch.setenv("KVSERVER_CUDA_WAIT_SECONDS", "7")
    assert config_from_args(build_parser().parse_args(["--socket", "/tmp/x.sock"])).cuda_wait_seconds == 7
    for bad in (0, -1, 1e9):
        with pytest.raises(ValueError, match="CUDA wait seconds"):
            ServerConfig(socket="/tmp/x.sock", cuda_wait_seconds=bad)


@pytest.mark.parametrize("case", ["event_slots", "token_strides", "two_devices"])
def test_descriptions_no_gpu_could_take_are_invalid_on_a_daemon_without_one(case):
    """Bad input is INVALID_ARGUMENT on any daemon, found before the GPU is looked for (this one
    has none: it would answer FAILED_PRECONDITION)."""
    from kvserver.media.cuda import open_cuda

    u1, u2 = "GPU-1a2b3c4d-5e6f-7a8b-9c0d-112233445566", "GPU-ffffffff-5e6f-7a8b-9c0d-112233445566"

    def ref(stride=256, uuid=u1, offset=0):
        where = pb.CudaIpcLocation(ipc_handle=bytes(range(64)), device_uuid=uuid, allocation_size=1 << 20)
        return pb.BufferRef(cuda=where, offset=offset, token_stride=stride)

    refs, slots = {"event_slots": ([ref(), ref(offset=1 << 18)], 1000),
                   "token_strides": ([ref(), ref(512, offset=1 << 18)], 2),
                   "two_devices": ([ref(), ref(uuid=u2, offset=1 << 18)], 2)}[case]
    with pytest.raises(InvalidArgument):
        open_cuda(refs, 64, KVLayout.mha(2, 64), torch.float16, 16, slots)
