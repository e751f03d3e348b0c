"""Write and Load bandwidth through the daemon against the same scattered copy in this process.

The matrix: pages of 1, 16, 64 and 256 tokens; an MHA layout (8 KV heads x 128, K and V) and an
MLA one (a latent of 576, one part), bf16, 32 layers; transfers of 1 MiB to 1 GiB. For each case,
measured in turn (one of each per round, median of the rounds):

- memcpy:      one contiguous copy of the same number of bytes (the machine's copy speed);
- in-process:  the same scattered page copy done here with the daemon's own plan and kernel
               (``kvserver.copies.transfer.make_plan`` + ``copy_job``), what an engine gets by copying itself,
               into a host buffer laid out as the daemon's region is (layer first: each (layer, part) a
               block of page rows), which is also SGLang's default host layout (``layer_first``);
- daemon:      ``KVClient.write`` (device -> host) and ``KVClient.load(...).wait()`` (host -> device,
               until the last layer landed) through a daemon subprocess on a Unix socket.

Device pages are scattered over a shared-memory pool twice the transfer, host pages over the
registration's region (as large as the transfer). A case whose single page is larger than the
transfer is skipped. Ratios are daemon / in-process of the same case and round set.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch

from kvclient import KVClient, KVLayout, ShmKVPool
from kvserver.copies import transfer

from . import common

NAME = "transfer"
DTYPE = torch.bfloat16
LAYOUTS = {
    "mha": (KVLayout.mha(8, 128), "MHA, 8 KV heads x 128, K and V"),
    "mla": (KVLayout.mla(512, 64), "MLA, latent 576 (512 + 64 rope), one part"),
}
METHODS = ("memcpy", "in-process write", "in-process load", "daemon write", "daemon load")
CHECK_LIMIT = 64 << 20  # cases up to this size fill the pool with random data and check the copies


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transfer")
    g.add_argument("--transfer-mib", type=int, nargs="+", help="transfer sizes in MiB "
                   "(default 1 16 64 256 1024; --quick: 1 4)")
    g.add_argument("--transfer-page-sizes", type=int, nargs="+",
                   help="tokens per page (default 1 16 64 256; --quick: 1 16)")
    g.add_argument("--transfer-layouts", nargs="+", choices=sorted(LAYOUTS), default=["mha", "mla"])
    g.add_argument("--transfer-layers", type=int, default=32)
    g.add_argument("--transfer-repeats", type=int,
                   help="rounds per case (default: 2 GiB / size, 3 to 30; --quick: 3)")
    g.add_argument("--transfer-seed", type=int, default=0)


def _params(args: argparse.Namespace) -> dict:
    quick = args.quick
    return {
        "sizes_mib": args.transfer_mib or ([1, 4] if quick else [1, 16, 64, 256, 1024]),
        "page_sizes": args.transfer_page_sizes or ([1, 16] if quick else [1, 16, 64, 256]),
        "layouts": args.transfer_layouts,
        "layers": args.transfer_layers,
        "repeats": args.transfer_repeats or (3 if quick else None),
        "seed": args.transfer_seed,
        "dtype": str(DTYPE),
    }


def _repeats(fixed: int | None, nbytes: int) -> int:
    return fixed or max(3, min(30, (2 << 30) // nbytes))


def run(args: argparse.Namespace, progress) -> dict:
    p = _params(args)
    cases = [(lay, ps, size) for lay in p["layouts"] for ps in p["page_sizes"] for size in p["sizes_mib"]]
    biggest = max(p["sizes_mib"]) << 20
    d = common.daemon(host_memory=str(biggest + (64 << 20)))
    threads = torch.get_num_threads()
    # One thread for every torch op here, like the daemon's kernel: idle OpenMP threads spinning
    # after a parallel copy would otherwise steal the cores from whichever side runs next.
    torch.set_num_threads(1)
    rows, skipped = [], []
    try:
        with KVClient(d.address, timeout=120) as client, \
                progress(total=len(cases), desc="transfer") as bar:
            for lay, ps, size in cases:
                bar.set_postfix_str(f"{lay} page {ps} {common.mib(size << 20)}")
                row = _case(client, lay, ps, size << 20, p)
                (rows if "skipped" not in row else skipped).append(row)
                bar.update(1)
    finally:
        torch.set_num_threads(threads)
    return {"params": p, "daemon_flags": common.daemon_flags(d), "rows": rows, "skipped": skipped}


class InProcess:
    """The baseline: ``pages`` pages of a pool scattered over it (``dev``: their device tokens) and
    the same copy done in this process with the daemon's plan and kernel (``make_plan`` +
    ``copy_job``) into a host buffer laid out as the daemon's region, its pages in the order ``hp``
    (layer first; a page-first one writes ~8% faster at 16 MiB here, not the same copy:
    docs/performance.md). What an engine gets by copying itself."""

    def __init__(self, pool: ShmKVPool, page_size: int, pages: int, g: torch.Generator) -> None:
        layers, parts, pool_pages = pool.num_layers, pool.layout.num_parts, pool.num_tokens // page_size
        self.dev_pages = torch.randperm(pool_pages, generator=g)[:pages]
        self.dev = (self.dev_pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        self.hp = torch.randperm(pages, generator=g)
        # int64 words per (layer, part) of a page
        self.chunk = chunk = page_size * pool.layout.token_bytes(pool.dtype) // 8
        self.host = host = torch.zeros(layers, parts, pages, chunk, dtype=torch.int64)
        self._views = [[b.view(torch.int64).view(-1, chunk).numpy() for b in layer] for layer in pool.buffers]
        self._tokens = [[b.view(torch.int64).view(pool.num_tokens, -1).numpy() for b in layer]
                        for layer in pool.buffers]
        self._plan = transfer.make_plan(self.hp.numpy(), self.dev.numpy(), page_size, pool_pages)
        self._host_table = transfer.BufferTable(
            bases=np.array([[host[la, pa, 0].data_ptr() for pa in range(parts)] for la in range(layers)],
                           dtype=np.uint64),
            row_stride=chunk * 8, row_bytes=chunk * 8)
        self._dev_table = transfer.BufferTable.of(self._views)
        self._layers = np.arange(layers, dtype=np.int64)

    def copy(self, to_device: bool) -> None:
        if transfer.copy_job(self._plan, self._layers, self._host_table, self._dev_table, to_device) is None:
            # No compiled kernel: per (layer, part), as the daemon falls back.
            for la in range(len(self._views)):
                for pa in range(len(self._views[la])):
                    transfer.copy_part(self._plan, self.host[la, pa].numpy(), self._views[la][pa],
                                       self._tokens[la][pa], to_device)

    def holds_the_pool_pages(self) -> bool:
        """Whether the host buffer holds the pool's pages (after a write), in the order ``hp``."""
        want = np.stack([np.stack([v[self.dev_pages.numpy()] for v in views], 1) for views in self._views], 1)
        return np.array_equal(self.host.permute(2, 0, 1, 3)[self.hp].numpy(), want)


def _case(client: KVClient, lay: str, page_size: int, nominal: int, p: dict) -> dict:
    layout, _ = LAYOUTS[lay]
    layers, parts = p["layers"], layout.num_parts
    token_bytes = layout.token_bytes(DTYPE) * parts * layers
    head = {"layout": lay, "page_size": page_size, "size_mib": nominal >> 20}
    if page_size * token_bytes > nominal:
        return {**head, "skipped": f"one page ({page_size * token_bytes} B) is larger than the transfer"}
    pages = nominal // token_bytes // page_size
    tokens = pages * page_size
    nbytes = tokens * token_bytes
    pool_tokens = 2 * tokens
    repeats = _repeats(p["repeats"], nbytes)
    g = torch.Generator().manual_seed(p["seed"])
    check = nbytes <= CHECK_LIMIT
    with ShmKVPool(layout, DTYPE, layers, pool_tokens) as pool:
        for layer in pool.buffers:
            for buf in layer:
                if check:
                    buf.view(torch.int16).random_(generator=g)
                else:
                    buf.view(torch.int16).fill_(1)  # first touch outside the timings
        base = InProcess(pool, page_size, pages, g)
        dev, hp = base.dev, base.hp

        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        src.fill_(1)

        client.register(model=f"bench-{lay}-{page_size}", pool=pool, start_layer=0, end_layer=layers,
                        num_layers=layers, host_tokens=tokens, page_size=page_size)
        try:
            all_host = client.alloc(tokens)
            host_idx = all_host.view(-1, page_size)[hp].reshape(-1)
            times = common.interleaved({
                "memcpy": lambda: dst.copy_(src),
                "in-process write": lambda: base.copy(False),
                "in-process load": lambda: base.copy(True),
                "daemon write": lambda: client.write(host_indices=host_idx, device_indices=dev),
                "daemon load": lambda: client.load(host_indices=host_idx, device_indices=dev).wait(),
            }, repeats)
        finally:
            client.unregister()
        if check and not base.holds_the_pool_pages():
            raise AssertionError(f"in-process copy is wrong ({lay}, page {page_size}, {nbytes} B)")
    out = {**head, "bytes": nbytes, "tokens": tokens, "pages": pages,
           "page_chunk_bytes": base.chunk * 8, "repeats": repeats, "checked": check, "methods": {}}
    for name, ts in times.items():
        s = common.stats_of(ts)
        out["methods"][name] = {**s, "gb_per_s": nbytes / s["median_s"] / 1e9, "times_s": ts}
    m = out["methods"]
    out["ratio_write"] = m["in-process write"]["median_s"] / m["daemon write"]["median_s"]
    out["ratio_load"] = m["in-process load"]["median_s"] / m["daemon load"]["median_s"]
    return out


def plot(result: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    layouts = [lay for lay in result["params"]["layouts"] if any(r["layout"] == lay for r in rows)]
    paths = []
    fig, axes = plt.subplots(len(layouts), 2, figsize=(9, 3.2 * len(layouts)), squeeze=False)
    for i, lay in enumerate(layouts):
        for j, (key, what) in enumerate((("ratio_write", "Write"), ("ratio_load", "Load"))):
            ax = axes[i][j]
            for ps in result["params"]["page_sizes"]:
                rs = sorted((r for r in rows if r["layout"] == lay and r["page_size"] == ps),
                            key=lambda r: r["bytes"])
                if rs:
                    ax.plot([r["bytes"] / (1 << 20) for r in rs], [r[key] for r in rs], "o-",
                            label=f"page {ps}")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.axhline(0.95, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("transfer (MiB)")
            ax.set_ylabel("daemon / in-process")
            ax.set_title(f"{lay.upper()}: daemon {what} vs in-process copy")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    paths.append(out_dir / "transfer_ratio.png")
    common.save_figure(fig, paths[-1])

    fig, axes = plt.subplots(1, len(layouts), figsize=(5.5 * len(layouts), 3.8), squeeze=False)
    for i, lay in enumerate(layouts):
        ax = axes[0][i]
        for ps in result["params"]["page_sizes"]:
            rs = sorted((r for r in rows if r["layout"] == lay and r["page_size"] == ps),
                        key=lambda r: r["bytes"])
            if not rs:
                continue
            x = [r["bytes"] / (1 << 20) for r in rs]
            (line,) = ax.plot(x, [r["methods"]["daemon load"]["gb_per_s"] for r in rs], "o-",
                              label=f"daemon load, page {ps}")
            ax.plot(x, [r["methods"]["in-process load"]["gb_per_s"] for r in rs], "x:",
                    color=line.get_color(), label=f"in-process load, page {ps}")
        rs = sorted({r["bytes"]: r for r in rows if r["layout"] == lay}.values(), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] / (1 << 20) for r in rs], [r["methods"]["memcpy"]["gb_per_s"] for r in rs],
                "k--", label="memcpy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("transfer (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{lay.upper()}: Load bandwidth")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    paths.append(out_dir / "transfer_gbs.png")
    common.save_figure(fig, paths[-1])
    return paths


def summary(result: dict) -> str:
    lines = ["| layout | page | transfer | memcpy | in-process write / load | daemon write | daemon load |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m = r["methods"]
        lines.append(
            f"| {r['layout'].upper()} | {r['page_size']} | {common.mib(r['size_mib'] << 20)} "
            f"| {m['memcpy']['gb_per_s']:.2f} GB/s "
            f"| {m['in-process write']['gb_per_s']:.2f} / {m['in-process load']['gb_per_s']:.2f} GB/s "
            f"| {m['daemon write']['gb_per_s']:.2f} GB/s (**{r['ratio_write']:.2f}×**) "
            f"| {m['daemon load']['gb_per_s']:.2f} GB/s (**{r['ratio_load']:.2f}×**) |")
    for r in result["skipped"]:
        lines.append(f"| {r['layout'].upper()} | {r['page_size']} | {r['size_mib']} MiB | skipped: "
                     f"{r['skipped']} | | | |")
    return "\n".join(lines)
