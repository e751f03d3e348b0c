"""The shape of the code (docs/design.md): the import contracts in pyproject.toml hold on this tree,
and the checker really fails on a circle; the client and the cache index load what the contracts
say at run time too; every package says what it owns and what it may import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

import kvserver
from kvserver.errors import Code

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
DAEMON_PACKAGES = ["api", "lane", "core", "media", "store", "peers", "host", "copy", "config", "server"]


def lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_tree_keeps_every_contract():
    run = lint_imports(REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "7 kept, 0 broken" in run.stdout, run.stdout


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """kvserver and kvclient copied as importable packages, with the project's contracts."""
    skip = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(REPO / "kvserver", tmp_path / "kvserver", ignore=skip)
    shutil.copytree(REPO / "client", tmp_path / "kvclient", ignore=skip)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def broken(tree: Path) -> str:
    run = lint_imports(tree, {**os.environ, "PYTHONPATH": str(tree)})
    assert run.returncode == 1, run.stdout + run.stderr
    return run.stdout


def add_import(module: Path, line: str) -> None:
    text = module.read_text()
    module.write_text(text.replace("from __future__ import annotations\n",
                                   f"from __future__ import annotations\n\n{line}\n", 1))


def test_a_circle_between_two_modules_of_a_package_is_caught(tree_copy):
    # stats imports counters; counters importing stats back closes a circle inside store/.
    add_import(tree_copy / "kvserver/store/counters.py", "from kvserver.store import stats  # noqa: F401")
    out = broken(tree_copy)
    assert "No import circles" in out and "BROKEN" in out
    assert "acyclic by removing 1 dependency" in out and "- .counters -> .stats (1 import)" in out, out


def test_an_upward_import_is_caught_by_the_layers_and_as_a_circle(tree_copy):
    # The copy jobs reaching up into the copier: copy <-> core.
    add_import(tree_copy / "kvserver/copies/job.py", "from kvserver.core import copier  # noqa: F401")
    out = broken(tree_copy)
    assert "The daemon's layers: arrows point down BROKEN" in out.replace("\n", " ")
    assert "kvserver.copies.job -> kvserver.core.copier" in out, out
    assert "No cycles are allowed in kvserver." in out and "- .copies -> .core (1 import)" in out, out


def test_the_client_reaching_into_the_daemon_is_caught(tree_copy):
    add_import(tree_copy / "kvclient/keys.py", "from kvserver.core import epochs  # noqa: F401")
    out = broken(tree_copy).replace("\n", " ")
    assert "The client imports nothing of the daemon" in out and "BROKEN" in out


def test_the_cache_index_importing_grpc_is_caught(tree_copy):
    add_import(tree_copy / "kvserver/store/keys.py", "import grpc  # noqa: F401")
    out = broken(tree_copy).replace("\n", " ")
    assert "The cache index imports no gRPC and no copy code BROKEN" in out


def test_grpc_below_the_edge_is_caught(tree_copy):
    add_import(tree_copy / "kvserver/core/epochs.py", "import grpc  # noqa: F401")
    out = broken(tree_copy).replace("\n", " ")
    assert "Only the gRPC edge (api, server) imports gRPC BROKEN" in out


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    return set(run.stdout.split())


def test_importing_the_client_loads_nothing_of_the_daemon():
    loaded = loaded_after("import kvclient, kvclient.keys, kvclient.views_pool, kvclient.registrar")
    daemon = {m for m in loaded if any(m == f"kvserver.{p}" or m.startswith(f"kvserver.{p}.")
                                       for p in DAEMON_PACKAGES)}
    assert daemon == set()
    assert "kvserver.protocol.layout" in loaded


def test_the_cache_index_loads_no_grpc_and_no_copy_code():
    loaded = loaded_after("import kvserver.store")
    assert "grpc" not in loaded
    assert not {m for m in loaded if m.startswith(("kvserver.copies", "kvserver.media", "kvserver.core"))}


def test_status_codes_are_grpcs_by_name_and_number():
    assert {c.name: c.value for c in Code} == {s.name: s.value[0] for s in grpc.StatusCode}


def test_every_package_says_what_it_owns_and_may_import():
    root = Path(kvserver.__file__).parent
    packages = [p for p in root.rglob("__init__.py") if "v1" not in p.parts]
    packages += list((REPO / "client" / "_transport").glob("__init__.py"))
    missing = []
    for init in packages:
        doc = init.read_text().split('"""')[1] if init.read_text().startswith('"""') else ""
        if init.parent != root and not ("Owns" in doc and "May import" in doc):
            missing.append(str(init.relative_to(REPO)))
    assert missing == []
