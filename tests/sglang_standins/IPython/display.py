"""STAND-IN for IPython.display (see IPython/__init__.py): HTML and display, which sglang/utils.py
imports for notebook output. display() prints the object's repr; nothing here renders."""


class HTML:
    def __init__(self, data=None):
        self.data = data

    def __repr__(self):
        return f"HTML({self.data!r})"


def display(*objs, **kwargs):
    for o in objs:
        print(repr(o))
