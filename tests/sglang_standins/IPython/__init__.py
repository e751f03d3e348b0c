"""STAND-IN for IPython, for kvserver's CPU-only tests.

Not IPython. `import sglang` reaches sglang/utils.py (via sglang.lang), which does
`from IPython.display import HTML, display` at module level for notebook helpers. The real
IPython pulls in about ten more packages (jedi, prompt_toolkit, traitlets, pexpect...) that the
KV-cache classes never use, so only that one import is provided (IPython/display.py).
"""

KVSERVER_STANDIN = True
