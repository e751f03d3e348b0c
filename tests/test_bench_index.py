"""benchmarks/bench_index.py runs end to end on a small budget: it prints the bookkeeping bytes a
cached page costs, the baseline's and their ratio, and the cache's bookkeeping stays within its
budget (the figures are the benchmark's; test_store_arena.py checks the charge itself)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_index_prints_bytes_per_page_and_the_ratio():
    run = subprocess.run([sys.executable, "benchmarks/bench_index.py", "--mib", "32"], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    (pages, page_mib), = re.findall(r"(\d+) pages cached \(([\d.]+) MiB of pages\)", run.stdout)
    (book_mib, _), = re.findall(r"bookkeeping: [\d.]+ bytes a page measured \(\d+ charged to the "
                                r"budget\); ([\d.]+) MiB, (\d+)% of the budget", run.stdout)
    assert int(pages) > 0 and float(page_mib) + float(book_mib) <= 32 * 1.1, run.stdout
    assert "ratio index / baseline" in run.stdout, run.stdout
