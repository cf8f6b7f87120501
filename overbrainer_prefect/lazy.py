"""Packages whose names are imported when first used, not with the package.

A flow-run process imports one flow's module, and so its package first: a
package that imported every flow (or asyncssh for `SshExecutor`) with itself
made every start pay for all of them. `lazy_exports` lets a package name what
it exports and where each comes from; each is imported on first use and then
kept. A package's own `if TYPE_CHECKING:` imports (`from m import x as x`)
give mypy the same names."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any

_WHERE = "_lazy_where"
"""The attribute of a lazy package holding its name -> module map."""


class LazyPackage(types.ModuleType):
    """A package module whose exported names come from their modules on first
    use, and whose submodule of an exported name's name (`flows.train`, the
    module) never replaces the name (`train`, the flow) when it is imported."""

    def __getattr__(self, name: str) -> Any:
        """The exported `name`, imported from its module (then kept here);
        AttributeError for a name the package does not export."""
        module = self.__dict__[_WHERE].get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and name in self.__dict__[_WHERE]:
            return  # the import system naming a submodule: it stays in sys.modules only
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        """The package's names, its exported ones included before their import."""
        return sorted({*self.__dict__, *self.__dict__[_WHERE]})


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Makes the imported package `package` export each name of `exports`
    (module -> the names it gives) from its module on first use; returns every
    name, sorted, for the package's `__all__`. Raises KeyError when `package`
    is not imported yet (call it from the package's own `__init__`)."""
    module = sys.modules[package]
    module.__dict__[_WHERE] = {name: where for where, names in exports.items() for name in names}
    module.__class__ = LazyPackage
    return sorted(module.__dict__[_WHERE])
