"""Where users train (issue 32): frameworks that choose a device themselves (transformers' Trainer,
accelerate, Lightning) and torch.compile keep a lazymem model on lazymem.

Public extension points are used where a framework has one. Where a framework function must be
patched, the patch lives in one module per framework here, is applied by an import hook when the
user's program imports that framework (torch_lazymem never imports a framework itself), checks the
framework's version, and warns, naming the version, when it is not one that was tested.

``disable()`` turns the integrations off (patches already applied then defer to the framework's own
behaviour); ``enabled()`` tells whether they are on.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType

_enabled = True
_lock = threading.RLock()
# Framework module name -> the function that patches it once imported.
_hooks: dict[str, Callable[[ModuleType], None]] = {}
_applied: set[str] = set()


def enabled() -> bool:
    """Whether the framework integrations choose lazymem (see the module's docstring)."""
    return _enabled


def disable() -> None:
    """Frameworks choose their device as if torch_lazymem were not imported."""
    global _enabled
    _enabled = False


def enable() -> None:
    global _enabled
    _enabled = True


_checked: set[str] = set()


def installed_version(framework: str) -> str:
    """The version of the installed `framework`: its module's ``__version__``, else its distribution's."""
    version = getattr(sys.modules.get(framework), "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version(framework.replace("_", "-"))
    return str(version).split("+")[0]


def check_version(framework: str, tested: tuple[str, ...], version: str | None = None) -> None:
    """Warns, once per framework, when `framework` (at `version`, or the installed one) is at a version
    the integration was not tested with."""
    with _lock:
        if framework in _checked:
            return
        _checked.add(framework)
    version = version if version is not None else installed_version(framework)
    if not any(version == t or version.startswith(t + ".") for t in tested):
        warnings.warn(
            f"lazymem: the {framework} integration was tested with {framework} {', '.join(tested)}, "
            f"not {version}; it may not choose lazymem",
            stacklevel=3,
        )


def lazymem_is_default() -> bool:
    """Whether a framework's automatic device choice is lazymem: the integrations are on and lazymem is
    the current accelerator (it is once torch_lazymem is imported, unless another PrivateUse1 backend
    is; PyTorch puts a registered PrivateUse1 backend before CUDA)."""
    if not _enabled:
        return False
    import torch

    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "lazymem"


class _Loader(importlib.abc.Loader):
    """Wraps a framework module's loader: runs the module, then its lazymem hook."""

    def __init__(self, name: str, inner: importlib.abc.Loader) -> None:
        self._name = name
        self._inner = inner

    def create_module(self, spec):  # noqa: ANN001 - importlib's protocol
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _apply(self._name, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a hooked framework module, wraps the loader the other finders give."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001 - importlib's protocol
        if name not in _hooks or name in _applied:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _Loader):
                    spec.loader = _Loader(name, spec.loader)
                return spec
        return None


_finder = _Finder()


def _apply(name: str, module: ModuleType) -> None:
    with _lock:
        if name in _applied:
            return
        _applied.add(name)
    try:
        _hooks[name](module)
    except Exception as e:  # noqa: BLE001 - a broken integration must not break the user's import
        warnings.warn(f"lazymem: the integration with {name} could not be applied: {e!r}", stacklevel=2)


def on_import(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Runs `hook(module)` once module `name` is imported: now if it already is, else right after its
    import (an import hook on sys.meta_path)."""
    with _lock:
        _hooks[name] = hook
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    module = sys.modules.get(name)
    if module is not None and importlib.util.find_spec(name) is not None:
        _apply(name, module)


# One module per framework, each with an install() that registers its hooks (on_import) or extension
# points.
_MODULES = ("compile", "transformers", "accelerate", "lightning")


def install() -> None:
    """Registers every framework's hook (called once at import of torch_lazymem)."""
    for name in _MODULES:
        mod = f"{__name__}.{name}"
        try:
            importlib.import_module(mod).install()
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
