"""Finds the packages and builds the C extensions; everything else is in pyproject.toml.

Packages are found, not listed: kvserver and every subpackage under kvserver/, and kvclient with
any subpackage from client/ (pyproject.toml maps the name to the folder). A new subpackage ships
without an edit here; tests/test_ship_wheel.py checks that every module of the tree is in the wheel.
"""

from setuptools import Extension, find_packages, setup


def packages() -> list[str]:
    server = find_packages(include=["kvserver", "kvserver.*"])
    client = find_packages(include=["client", "client.*"])
    return server + ["kvclient" + name.removeprefix("client") for name in client]


setup(
    packages=packages(),
    ext_modules=[
        Extension("kvserver.copies._kvcopy", ["kvserver/copies/csrc/kvcopy.c"],
                  depends=["kvserver/copies/csrc/stream.h"], extra_compile_args=["-O3"], optional=True),
        Extension("kvserver.store._kvindex", ["kvserver/store/csrc/index.c"],
                  depends=["kvserver/store/csrc/index.h", "kvserver/store/csrc/digest.h",
                           "kvserver/store/csrc/hit.h"],
                  extra_compile_args=["-O2", "-Wall"],
                  optional=True),
        Extension("kvserver.lane._kvlane", ["kvserver/lane/csrc/kvlane.c"],
                  depends=["kvserver/lane/csrc/request.h", "kvserver/copies/csrc/stream.h"],
                  extra_compile_args=["-O2", "-Wall"], optional=True),
        Extension("kvserver.api._packed", ["kvserver/api/csrc/packed.c"],
                  depends=["kvserver/api/csrc/varint.h"], extra_compile_args=["-O2", "-Wall"],
                  optional=True),
        Extension("kvserver.protocol._wire", ["kvserver/protocol/csrc/wire.c"],
                  depends=["kvserver/lane/csrc/request.h"], extra_compile_args=["-O2", "-Wall"],
                  optional=True),
    ],
)
