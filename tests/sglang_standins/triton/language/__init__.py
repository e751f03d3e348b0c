"""STAND-IN for `triton.language` (see tests/sglang_standins/triton/__init__.py): the names SGLang's
kernels use in annotations and default arguments at import time, nothing that computes."""


class constexpr:
    def __init__(self, value=None):
        self.value = value

    def __class_getitem__(cls, item):
        return cls


class dtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"triton.language.{self.name}"


for _n in ("int1", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "bfloat16", "float32", "float64", "float8e4nv", "float8e5", "float8e4b8",
           "float8e4b15", "float8e5b16"):
    globals()[_n] = dtype(_n)
