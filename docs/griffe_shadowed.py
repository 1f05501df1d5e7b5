"""A Griffe extension for the API pages (``mkdocs.yml``): a package's function that has the name of one of its
submodules is documented as the function.

``sfstore.checkpoint.save`` is a function, defined in ``sfstore/checkpoint/__init__.py`` beside the submodule
``sfstore/checkpoint/save.py`` that implements it, and Python resolves the name to the function. Griffe's static
analysis keeps the submodule instead (mkdocstrings/griffe#222), so ``save`` and ``load`` would be missing from the
page. This puts the function back where the package defines one.
"""

from __future__ import annotations

from typing import Any

import griffe


class FunctionsOverSubmodules(griffe.Extension):
    """Put a package's functions back over submodules of the same name, once the package is loaded."""

    def __init__(self) -> None:
        super().__init__()
        self._functions: list[griffe.Function] = []

    def on_function_instance(self, *, node: Any, func: griffe.Function, agent: Any, **kwargs: Any) -> None:
        parent = func.parent
        if isinstance(parent, griffe.Module) and parent.is_init_module:
            self._functions.append(func)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for func in self._functions:
            parent = func.parent
            if parent is None:
                continue
            member = parent.members.get(func.name)
            if member is not None and member is not func and not member.is_alias and member.is_module:
                parent.set_member(func.name, func)
