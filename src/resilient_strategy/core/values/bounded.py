"""Bounded parsing of JSON and TOML text, and bounded reading of a file the user names (rules,
``--simulate`` machine files). No ``os`` (pathlib only), so the planner's modules and the pure
probe parser can use it. Anything that is not JSON/TOML, nests deeper than `MAX_DEPTH`, or
is larger than its limit is a `FileFormatError`, never a
``RecursionError`` or ``MemoryError`` from deep inside; a FIFO or directory is an
`UnsafePathError` (opening a FIFO would block forever). Files
this package keeps itself (cache, agreement) are read by `machine.files`, which also checks owner
and mode and never follows a symlink.
"""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...errors import FileFormatError, UnsafePathError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Deepest nesting of arrays/objects (tables) any file of this package may hold. What this package
#: writes nests at most 4 deep; 64 leaves room for every honest file.
MAX_DEPTH = 64
#: Byte limits of the files a user names: far above an honest file, far below a memory problem.
MAX_RULES_BYTES = 4 << 20
MAX_MACHINE_BYTES = 16 << 20
NOT_REGULAR = "is not a regular file"


def read_user_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of a file the user named (a symlink is fine), at most ``max_bytes``. Raises
    OSError when it cannot be read, UnsafePathError when it is not a regular file (checked before
    opening it), FileFormatError when it is larger than ``max_bytes``."""
    path = Path(path)
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(str(path), NOT_REGULAR, "Name a regular file.")
    if st.st_size > max_bytes:
        raise FileFormatError(str(path), f"is {st.st_size} bytes, more than the {max_bytes} "
                              "this reader takes")
    with path.open("rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while read
        raise FileFormatError(str(path), f"holds more than the {max_bytes} bytes this reader takes")
    return data


def parse_json(data: bytes | str, what: str, *, max_depth: int = MAX_DEPTH,
               allow_nan: bool = False) -> Any:
    """JSON text (UTF-8 bytes or str) as Python values; FileFormatError for anything that is not
    JSON, nested deeper than ``max_depth``, or holds NaN/Infinity (unless ``allow_nan``)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text, parse_constant=None if allow_nan else _no_constant)
    except RecursionError:
        raise FileFormatError(what, f"nested deeper than {max_depth} levels") from None
    except (ValueError, MemoryError) as exc:  # UnicodeDecodeError, JSONDecodeError too
        raise FileFormatError(what, f"not valid JSON: {_short(exc)}") from None
    check_depth(value, what, max_depth)
    return value


def parse_toml(text: str, what: str, *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """A TOML document as a dict; FileFormatError when it is not TOML or nests too deep."""
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise FileFormatError(what, f"nested deeper than {max_depth} levels") from None
    except (tomllib.TOMLDecodeError, ValueError, MemoryError) as exc:
        raise FileFormatError(what, f"not valid TOML: {_short(exc)}") from None
    check_depth(value, what, max_depth)
    return value


def check_depth(value: Any, what: str, max_depth: int = MAX_DEPTH) -> None:
    """FileFormatError when lists/dicts in ``value`` nest deeper than ``max_depth`` (iterative:
    no recursion however deep the value)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise FileFormatError(what, f"nested deeper than {max_depth} levels")
        stack.extend((c, depth + 1) for c in children)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _short(exc: BaseException) -> str:
    return str(exc)[:200] or type(exc).__name__
