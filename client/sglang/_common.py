"""What both SGLang seams share: the storage hash keys, the fp8 dtype on the wire, and
register-or-miss.

Importing this module does not import SGLang.
"""

from __future__ import annotations

import logging

import torch

from kvclient.registrar import Registrar, daemon_away  # noqa: F401 (the seams import them from here)

logger = logging.getLogger("kvclient.sglang")

KEY_BYTES = 32  # a SHA-256 storage hash


def sglang_weights(cfg: dict, server_args=None) -> str:
    """The weights' identity of this SGLang engine (``kvclient.weights``): the ``weights`` setting,
    else read from its model path, revision, quantisation and load format: SGLang's resolved model
    settings first (``runtime_context.get_model()``, as SGLang's own store linkers read the model
    path), so the linker and the HiCache backend read the same values, then ``server_args``."""
    from kvclient.weights import weights_identity

    if cfg.get("weights"):
        return weights_identity("", override=str(cfg["weights"]))
    sources = []
    try:
        from sglang.srt.runtime_context import get_model

        sources.append(get_model())
    except Exception:
        pass
    if server_args is not None:
        sources.append(server_args)

    def read(name: str):
        for src in sources:
            try:
                value = getattr(src, name, None)
            except Exception:
                value = None
            if value:
                return value
        return None

    path = read("model_path")
    if not path:
        logger.warning("kvserver: no model path to read the weights' identity from: engines of other "
                       "weights under this model name would share KV; set a weights identity")
        return ""
    return weights_identity(str(path), read("revision"), read("quantization"),
                            cache_dir=read("download_dir"), load_format=read("load_format"))


def storage_keys(hashes) -> bytes:
    """SGLang's storage hash strings, packed as fixed-width 32-byte keys."""
    out = bytearray()
    for h in hashes:
        if not isinstance(h, str) or len(h) != 2 * KEY_BYTES:
            raise ValueError(f"not an SGLang storage hash (64 hex digits): {h!r}")
        out += bytes.fromhex(h)
    return bytes(out)


def fp8_wire_dtype(store: torch.dtype, logical: torch.dtype) -> torch.dtype:
    """SGLang keeps fp8 KV in uint8 tensors (``store_dtype``); the daemon is told the logical fp8
    dtype, whose bytes are the same. Any other pair is sent as stored."""
    if store == torch.uint8 and logical.itemsize == 1 and logical != torch.uint8:
        return logical
    return store


def _wire_dtype(kvcache, buf: torch.Tensor) -> torch.dtype:
    """The dtype a device pool's buffer ``buf`` is registered as: its logical fp8 dtype
    (``kvcache.dtype``) for an fp8 pool, else its own."""
    return fp8_wire_dtype(buf.dtype, getattr(kvcache, "dtype", buf.dtype))
