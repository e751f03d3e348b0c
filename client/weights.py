"""The weights' identity beyond a model's name, for the KV space (``KVSpace.weights``): KV
computed by other weights is never served, even under the same model name.

``weights_identity`` derives it from what an engine knows of its checkpoint, cheaply (no weight
is read):

- a local checkpoint directory: a digest of its weight and config files' names, sizes and
  modification times, so weights replaced in place (a new file, or the same file rewritten) give
  a new identity;
- a Hugging Face hub id: the commit of the snapshot in the local hub cache (the directory name of
  ``snapshots/<commit>``), else the revision asked for;
- the quantisation, when the engine names one.

An operator can name the identity instead (``weights`` in the connector's settings): a release
tag, a training step. Weights updated inside a running engine (RL weight syncs) change nothing on
disk: such an engine must be given a new identity, or stop using the cache, when its weights
change (docs/integrations.md, "Weights").
"""

from __future__ import annotations

import hashlib
import logging
import os

logger = logging.getLogger("kvclient")

MAX_WEIGHTS = 256  # characters: the daemon's bound
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
CONFIG_FILES = ("config.json", "quantization_config.json", "quant_config.json", "hf_quant_config.json")


def _files_digest(path: str) -> str | None:
    """Names, sizes and modification times of the directory's weight and config files (not their
    bytes), or None if it holds none."""
    entries = []
    for root, _, files in os.walk(path):
        for name in files:
            if not (name.endswith(WEIGHT_SUFFIXES) or name in CONFIG_FILES):
                continue
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            entries.append(f"{os.path.relpath(full, path)}\0{st.st_size}\0{st.st_mtime_ns}")
    if not entries:
        return None
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()[:16]


def _hub_commit(repo_id: str, revision: str | None) -> str | None:
    """The commit of the locally cached snapshot of a hub model, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:
        return None
    if not isinstance(found, str):
        return None
    parent = os.path.basename(os.path.dirname(found))
    return parent if os.path.basename(os.path.dirname(os.path.dirname(found))) == "snapshots" else None


def weights_identity(model_path: str, revision: str | None = None, quantization: str | None = None,
                     override: str | None = None) -> str:
    """The identity of the weights at ``model_path`` (a directory or a hub id), as described in the
    module's notes; ``override`` (an operator's) wins. At most MAX_WEIGHTS characters."""
    if override:
        ident = str(override)
    else:
        parts = []
        digest = _files_digest(model_path) if os.path.isdir(model_path) else None
        if digest is not None:
            parts.append(f"files={digest}")
        else:
            commit = _hub_commit(model_path, revision)
            if commit:
                parts.append(f"commit={commit}")
            elif revision:
                parts.append(f"revision={revision}")
            else:
                logger.warning("kvserver: the weights of %s have no identity the connector can read (no "
                               "local files, no cached hub snapshot, no revision): engines of other weights "
                               "under this name would share KV; set a weights identity", model_path)
        if quantization:
            parts.append(f"quant={quantization}")
        ident = ";".join(parts)
    if len(ident) > MAX_WEIGHTS:
        ident = "sha256=" + hashlib.sha256(ident.encode()).hexdigest()
    return ident
