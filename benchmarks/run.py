"""The benchmark suite: one entry point for every suite, with JSON results and PNG plots.

    .venv/bin/python benchmarks/run.py [SUITE ...] [--quick] [--out DIR]

SUITE is any of transfer, control, pipeline, concurrency, multiturn (default: all of them). Each
is a module ``benchmarks/suites/<name>.py`` with ``NAME``, ``add_args(parser)``,
``run(args, progress) -> dict``, ``plot(result, out_dir) -> [paths]`` and ``summary(result) -> str``
(a markdown table). For each suite this writes ``DIR/<name>.json`` (machine, command, parameters,
every measured number) and its plots ``DIR/<name>*.png``, then prints the summary. ``--quick``
runs tiny sizes (a smoke run of seconds); without it the sizes are those docs/performance.md
reports. Progress bars go to stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import shlex
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

from suites import common  # noqa: E402

SUITES = ["transfer", "control", "pipeline", "concurrency", "multiturn"]


def load_suites(names: list[str]) -> tuple[dict[str, object], dict[str, str]]:
    """The suite modules by name, and the ones that could not be imported, with why."""
    mods, missing = {}, {}
    for name in names:
        try:
            mods[name] = importlib.import_module(f"suites.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"suites.{name}":
                raise
            missing[name] = f"benchmarks/suites/{name}.py is not there"
    return mods, missing


def progress_factory(enabled: bool):
    from tqdm import tqdm

    def progress(total: int | None = None, desc: str | None = None, **kw):
        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                    disable=not enabled, **kw)
    return progress


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not {"-h", "--help", "--replot"} & set(argv):
        common.prestart()  # the daemon's start overlaps the imports of torch and matplotlib below
    import matplotlib

    matplotlib.use("Agg")
    mods, missing = load_suites(SUITES)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of seconds")
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "results", help="results folder")
    ap.add_argument("--replot", action="store_true",
                    help="measure nothing: redraw the plots and summaries from DIR's JSON files")
    ap.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                    help="progress bars on stderr (auto: when stderr is a terminal)")
    for mod in mods.values():
        mod.add_args(ap)
    args = ap.parse_args(argv)
    wanted = args.suites or SUITES
    unknown = [s for s in wanted if s not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; choose from {SUITES}")
    args.out.mkdir(parents=True, exist_ok=True)
    enabled = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    progress = progress_factory(enabled)
    command = shlex.join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
                          else sys.executable, os.path.relpath(__file__, ROOT), *argv])
    machine = None if args.replot else common.machine_info()
    try:
        for name in wanted:
            if name not in mods:
                print(f"## {name}\n\nskipped: {missing[name]}\n", flush=True)
                continue
            mod = mods[name]
            path = args.out / f"{mod.NAME}.json"
            if args.replot:
                if not path.exists():
                    print(f"## {name}\n\nskipped: no {path}\n", flush=True)
                    continue
                result = json.loads(path.read_text())
                wall = result["wall_s"]
            else:
                t0 = time.monotonic()
                result = mod.run(args, progress)
                wall = time.monotonic() - t0
                doc = {"suite": mod.NAME, "command": command, "quick": args.quick, "machine": machine,
                       "wall_s": wall, **result}
                path.write_text(json.dumps(doc, indent=1) + "\n")
            plots = mod.plot(result, args.out)
            print(f"## {mod.NAME}\n\n{mod.summary(result)}\n\n{wall:.1f} s; results {path}; plots "
                  f"{', '.join(str(p) for p in plots)}\n", flush=True)
    finally:
        common.close_daemons()
    return 0


if __name__ == "__main__":
    sys.exit(main())
