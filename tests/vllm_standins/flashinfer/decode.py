"""Stand-in for flashinfer.decode (see the package docstring): placeholders that raise if called."""

from flashinfer import _Placeholder

KVSERVER_STANDIN = True


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(f"decode.{name}")
