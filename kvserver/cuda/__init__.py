"""The CUDA side of the daemon. Nothing here imports CuPy or touches a GPU at import time:
``runtime.load()`` does, the first time a CUDA client registers."""
