"""Finds the packages and builds the C extensions; everything else is in pyproject.toml.

Packages are found, not listed: kvserver and every subpackage under kvserver/, and kvclient with
any subpackage from client/ (pyproject.toml maps the name to the folder). A new subpackage ships
without an edit here; tests/test_ship_wheel.py checks that every module of the tree is in the wheel.
"""

import importlib.util

from setuptools import Extension, find_packages, setup

# The extensions' sources and their digest (kvserver/protocol/compiled.py), loaded by path: the
# package is not importable before it is built.
_spec = importlib.util.spec_from_file_location("kvserver_compiled", "kvserver/protocol/compiled.py")
compiled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled)

FLAGS = {"kvserver.copies._kvcopy": ["-O3"]}  # the others: -O2 -Wall


def packages() -> list[str]:
    server = find_packages(include=["kvserver", "kvserver.*"])
    client = find_packages(include=["client", "client.*"])
    return server + ["kvclient" + name.removeprefix("client") for name in client]


def extension(name: str) -> Extension:
    """``name`` built from its entry in compiled.SOURCES, their digest compiled in as KV_SOURCES."""
    files = compiled.SOURCES[name]
    # compiled.py too: a change to the table changes the digest, and must rebuild.
    return Extension(name, [files[0]], depends=[*files[1:], "kvserver/protocol/compiled.py"],
                     define_macros=[("KV_SOURCES", f'"{compiled.digest(".", files)}"')],
                     extra_compile_args=FLAGS.get(name, ["-O2", "-Wall"]), optional=True)


setup(
    packages=packages(),
    ext_modules=[extension(name) for name in compiled.SOURCES],
)
