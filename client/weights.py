"""The weights' identity beyond a model's name, for the KV space (``KVSpace.weights``): KV
computed by other weights is never served, even under the same model name.

``weights_identity`` derives it from what an engine knows of its checkpoint, cheaply (a few KiB
of each weight file are read, not the weights):

- a local checkpoint (a directory, or one file such as a GGUF): a digest of its weight and config
  files' names, sizes and three 4 KiB samples of each (start, middle, end), so weights replaced in
  place, or another fine-tune of the same shapes, are other weights, while copies of one
  checkpoint are the same weights. Only the directory's own files count, as the loaders read
  them (not a trainer's checkpoint-N/ subdirectories);
- a Hugging Face hub id: the repository and the commit of the snapshot in the local hub cache
  (``cache_dir``, the engine's download directory, or the default), else the revision asked for;
- the quantisation, and "dummy" weights (random, ``load_format`` dummy), when the engine says so.

An operator can name the identity instead (``weights`` in the connector's settings): a release
tag, a training step. Weights updated inside a running engine (RL weight syncs) change nothing on
disk: such an engine must be given a new identity, or stop using the cache, when its weights
change (docs/integrations.md, "Weights"). Settings that change K and V without changing the
weights (RoPE scaling overrides, say) are not read: name them in ``weights`` if engines of one
checkpoint differ in them.
"""

from __future__ import annotations

import hashlib
import logging
import os

logger = logging.getLogger("kvclient")

MAX_WEIGHTS = 256  # characters: the daemon's bound
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
CONFIG_FILES = ("config.json", "quantization_config.json", "quant_config.json", "hf_quant_config.json")


SAMPLE = 4096  # bytes read at the start, the middle and the end of each file


def _file_entry(full: str, name: str) -> str | None:
    try:
        size = os.path.getsize(full)
        with open(full, "rb") as f:
            samples = []
            for at in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
                f.seek(at)
                samples.append(f.read(SAMPLE))
    except OSError:
        return None
    return f"{name}\0{size}\0{hashlib.sha256(b''.join(samples)).hexdigest()}"


def _files_digest(path: str) -> str | None:
    """Names, sizes and sampled bytes of a checkpoint's weight and config files (a directory's own
    files, or the one file ``path``), or None if there are none."""
    if os.path.isfile(path):
        entries = [_file_entry(path, os.path.basename(path))]
    else:
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return None
        entries = [_file_entry(os.path.join(path, n), n) for n in names
                   if (n.endswith(WEIGHT_SUFFIXES) or n in CONFIG_FILES)
                   and os.path.isfile(os.path.join(path, n))]
    entries = [e for e in entries if e is not None]
    if not entries:
        return None
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def _hub_commit(repo_id: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The commit of the locally cached snapshot of a hub model, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision, cache_dir=cache_dir)
    except Exception:
        return None
    if not isinstance(found, str):
        return None
    parent = os.path.basename(os.path.dirname(found))
    return parent if os.path.basename(os.path.dirname(os.path.dirname(found))) == "snapshots" else None


def weights_identity(model_path: str, revision: str | None = None, quantization: str | None = None,
                     override: str | None = None, *, cache_dir: str | None = None,
                     load_format: str | None = None) -> str:
    """The identity of the weights at ``model_path`` (a directory, a file or a hub id), as the
    module's notes describe; ``override`` (an operator's) wins. At most MAX_WEIGHTS characters."""
    if override:
        ident = str(override)
    else:
        parts = []
        digest = _files_digest(model_path) if os.path.exists(model_path) else None
        if digest is not None:
            parts.append(f"files={digest}")
        else:
            commit = _hub_commit(model_path, revision, cache_dir)
            if commit:
                parts.append(f"hub={model_path}@{commit}")
            elif revision:
                parts.append(f"hub={model_path}@{revision}")
            else:
                parts.append(f"path={model_path}")
                logger.warning("kvserver: the weights of %s have no identity the connector can read (no "
                               "local files, no cached hub snapshot, no revision): engines of other weights "
                               "at this path would share KV; set a weights identity", model_path)
        if quantization:
            parts.append(f"quant={quantization}")
        if load_format and str(load_format).lower().endswith("dummy"):
            parts.append("load=dummy")
        ident = ";".join(parts)
    if len(ident) > MAX_WEIGHTS:
        ident = "sha256=" + hashlib.sha256(ident.encode()).hexdigest()
    return ident
