"""Builds the one C extension; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvserver._kvcopy", ["kvserver/csrc/kvcopy.c"], extra_compile_args=["-O3"], optional=True),
    ],
)
