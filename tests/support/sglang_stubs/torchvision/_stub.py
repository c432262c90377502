"""The placeholders of the torchvision stand-in (see __init__.py): importable, usable in type hints and as a
base class, and raising as soon as anything calls them."""

import sys
import types


class Placeholder:
    """Any torchvision name. Attributes are placeholders too (`T.InterpolationMode.BICUBIC`)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a torchvision stand-in (tests/support/sglang_stubs): not available here")

    def __mro_entries__(self, bases):  # `class X(torchvision.Something)` at import
        return (object,)

    def __or__(self, other):  # type hints evaluated at import: `PILImageResampling | InterpolationMode`
        return self

    __ror__ = __or__

    def __getitem__(self, item):  # `Optional[...]`-style subscripts
        return self

    def __repr__(self):
        return f"<torchvision stand-in {self._name}>"


def module_getattr(module: str):
    """A module `__getattr__` that answers a placeholder for any public name (dunders stay missing, so
    `hasattr(m, "__file__")` and the import system see an ordinary module)."""

    def getattr_(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{module}.{attr}")

    return getattr_


def placeholder_module(name: str) -> types.ModuleType:
    """A package `name` of placeholders, registered in sys.modules."""
    module = types.ModuleType(name)
    module.__getattr__ = module_getattr(name)
    module.__path__ = []  # a package, so its submodules import
    sys.modules[name] = module
    return module
