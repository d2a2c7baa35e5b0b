"""Know where a framework was first imported, and refuse changes a started framework cannot see.

CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when the process first initializes CUDA; a framework that
already did so keeps the GPUs it saw. To name the line that imported it too early, importing this
package puts a finder at the front of ``sys.meta_path`` that never finds anything: it only notes
the first import of each watched top-level name. Other imports pay one set lookup.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable, Sequence
from types import FrameType, ModuleType

from ..errors import FrameworkInitializedError
from ..process import PROCESS

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~8 ms (mypy knows both)
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

    from ..core.values.facts import Facts

WATCHED = frozenset({"torch", "tensorflow", "keras", "jax"})
ALREADY_IMPORTED = "already imported before resilient_strategy was imported"

#: the package root (this module lives one folder below it)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(importlib.__file__ or "")) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep

class ImportWatch:
    """A registry of where watched names were first imported, and the ``MetaPathFinder`` that
    fills it: it finds nothing, and records the ``file:line`` of the first real import of each
    watched name (``sites``). The package installs one (`IMPORT_WATCH`); tests make their
    own and pass it where a watch is read (``detect_facts(imports=...)``).

    Duck-typed: subclassing ``importlib.abc.MetaPathFinder`` would import importlib.abc (~20 ms).
    """

    def __init__(self, names: Iterable[str] = WATCHED) -> None:
        self.pending = set(names)
        self.sites: dict[str, str] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname in self.pending:
            site = _import_site(sys._getframe(1))
            if site is not None:
                self.record(fullname, site)
        return None

    def invalidate_caches(self) -> None:
        pass

    def record(self, name: str, site: str) -> None:
        """Record the first import of ``name`` (a later one is ignored)."""
        self.pending.discard(name)  # set.discard and dict.setdefault are atomic under the GIL
        self.sites.setdefault(name, site)

    def site(self, name: str) -> str | None:
        """``"file:line"`` of the first import of ``name`` seen, `ALREADY_IMPORTED`, or
        None."""
        return self.sites.get(name)

    def install(self, modules: Iterable[str] | None = None) -> bool:
        """Put this watch first on ``sys.meta_path`` unless a watch is there already; names in
        ``modules`` (default ``sys.modules``) are imported already. Returns whether it did."""
        if any(isinstance(f, ImportWatch) for f in sys.meta_path):
            return False
        for name in self.pending & set(sys.modules if modules is None else modules):
            self.record(name, ALREADY_IMPORTED)
        sys.meta_path.insert(0, self)
        return True


#: The package's watch, installed when ``resilient_strategy`` is imported.
IMPORT_WATCH = PROCESS.hold("machine.guard.import_watch", ImportWatch,
                            "where each framework was imported in this process")


def install_import_watch() -> None:
    """Start watching framework imports (idempotent)."""
    IMPORT_WATCH.install()


def first_import_site(name: str, watch: ImportWatch | None = None) -> str | None:
    """``"file:line"`` of the first import of ``name`` seen, `ALREADY_IMPORTED`, or None."""
    return (IMPORT_WATCH if watch is None else watch).site(name)


def check_visible_devices_settable(
    facts: Facts, framework_names: Iterable[str], wanted: str | None, current: str | None
) -> None:
    """Raise if a framework already initialized its GPUs and ``CUDA_VISIBLE_DEVICES`` would change.

    ``wanted``: the value about to be set (None: nothing to set); ``current``: the value the
    process started with. A framework merely imported is fine: it has not read the variable yet.
    """
    if wanted is None or wanted == current:
        return
    for name in framework_names:
        info = facts.framework(name)
        if info.gpu_initialized:
            raise FrameworkInitializedError(name, info.imported_at, wanted)


def _import_site(frame: FrameType | None) -> str | None:
    """The ``file:line`` that caused this import, or None when this is no import at all.

    ``importlib.util.find_spec`` also asks every finder; only a real import passes through
    ``_find_and_load``. Above it, the first frame outside importlib and this package is where the
    import was written; a frame outside third-party and standard-library folders is preferred, so
    ``import transformers`` in the user's file is named rather than transformers' own import.
    """
    while frame is not None and frame.f_code.co_name != "_find_and_load":
        frame = frame.f_back
    if frame is None or not _in_importlib(frame.f_code.co_filename):
        return None
    fallback: str | None = None
    while (frame := frame.f_back) is not None:
        path = frame.f_code.co_filename
        if _in_importlib(path) or path.startswith(_OWN_DIR):
            continue
        site = f"{path}:{frame.f_lineno}"
        if not _third_party_or_stdlib(path):
            return site
        fallback = fallback or site
    return fallback


def _in_importlib(path: str) -> bool:
    return path.startswith(("<frozen importlib", _IMPORTLIB_DIR))


def _third_party_or_stdlib(path: str) -> bool:
    parts = path.split(os.sep)
    third_party = "site-packages" in parts or "dist-packages" in parts
    return third_party or path.startswith(("<frozen ", _STDLIB_DIR))
