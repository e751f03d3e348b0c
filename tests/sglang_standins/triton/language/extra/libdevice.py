"""STAND-IN for triton.language.extra.libdevice: device math functions called only inside @triton.jit
kernel bodies, which the stand-in never runs; any attribute is a function that raises."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _device_fn(*args, **kwargs):
        raise RuntimeError(f"triton stand-in: libdevice.{name} cannot run in CPU tests")

    _device_fn.__name__ = name
    return _device_fn
