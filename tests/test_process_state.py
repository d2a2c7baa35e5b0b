"""State with one owner (issue 44 item 5): what a process keeps for its whole life is made by
`resilient_strategy.process.PROCESS`, named and described there. Counted here by AST over src:
a module-level container the module mutates, a ``global`` statement, a module-level instance of
a class of ours that holds state, a cached function (``functools.cache`` / ``lru_cache``) that is
no class built once. What the owner makes (``PROCESS.hold(...)``) is the owner's, not counted.
At most five others, each with its owner and reason."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "resilient_strategy"
MAX_ALLOWED = 5
#: (path under src/resilient_strategy, name) -> its owner, and why it is not the process's
ALLOWED: dict[tuple[str, str], str] = {
    ("process.py", "PROCESS"): "the owner itself: every other holder of the process is its",
    ("run/cmdline.py", "torch_launcher"): "run's command line: whether torch's launcher imports "
                                          "here, asked once (a fact of the interpreter)",
    ("frameworks/sharded_checkpoint.py", "_instance_types"): "the checkpoint reader: torch's "
                                                             "metadata classes, found once",
    ("frameworks/sharded_checkpoint.py", "_field_names"): "the checkpoint reader: a metadata "
                                                          "class's fields, read once per class",
}
_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
_CONSTRUCTORS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter",
                 "WeakSet", "WeakValueDictionary", "WeakKeyDictionary"}
_MUTATORS = {"append", "extend", "add", "update", "pop", "popitem", "clear", "remove",
             "discard", "setdefault", "insert", "appendleft", "__setitem__"}


def _callee(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return ""


def _stateful_classes(root: Path) -> set[str]:
    """Our classes that hold state: an ``__init__`` of their own, or a dataclass not frozen."""
    out: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            init = any(isinstance(b, ast.FunctionDef) and b.name == "__init__" for b in node.body)
            loose = any("dataclass" in ast.unparse(d) and "frozen=True" not in ast.unparse(d)
                        for d in node.decorator_list)
            if init or loose:
                out.add(node.name)
    return out


def holders(root: Path = SRC) -> set[tuple[str, str]]:
    """Every process-wide holder made outside the owner, by (path, name)."""
    stateful = _stateful_classes(root)
    found: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        containers: set[str] = set()
        for node in tree.body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            if not isinstance(target, ast.Name) or value is None:
                continue
            if isinstance(value, _CONTAINERS) or _callee(value) in _CONSTRUCTORS:
                containers.add(target.id)
            elif _callee(value) in stateful:
                found.add((where, target.id))  # a singleton of ours
        for fn in tree.body:  # a cached module function: state, unless a class built once
            if isinstance(fn, ast.FunctionDef) and any(
                    ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] in ("cache", "lru_cache")
                    for d in fn.decorator_list) and not (
                    fn.name.endswith("_class") or (fn.returns is not None
                    and ast.unparse(fn.returns).startswith("type"))):
                found.add((where, fn.name))
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Global):
                        found.update((where, name) for name in node.names)
                    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                            and isinstance(node.func.value, ast.Name) \
                            and node.func.value.id in containers and node.func.attr in _MUTATORS:
                        found.add((where, node.func.value.id))
                    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                        targets = node.targets if not isinstance(node, ast.AugAssign) \
                            else [node.target]
                        found.update((where, t.value.id) for t in targets
                                     if isinstance(t, ast.Subscript)
                                     and isinstance(t.value, ast.Name)
                                     and t.value.id in containers)
    return found


def test_every_process_wide_holder_is_the_owners_or_listed_with_its_owner() -> None:
    assert len(ALLOWED) <= MAX_ALLOWED
    assert all(reason.strip() for reason in ALLOWED.values())
    found = holders()
    assert found - set(ALLOWED) == set()
    assert set(ALLOWED) - found == set()  # a listed holder that is gone leaves the list


def test_the_owner_lists_each_holder_with_what_it_holds() -> None:
    from resilient_strategy.process import PROCESS

    for module in ("machine.files", "machine.nvml", "machine.guard", "nodes.store",
                   "probing.forkserver", "frameworks.checkpoint_writer", "frameworks.teardown",
                   "records.handoff", "run.preempt", "run.warm", "run.worker",
                   "core.knowledge.data"):
        importlib.import_module(f"resilient_strategy.{module}")
    held = {h.name: h for h in PROCESS.holders()}
    assert {"machine.files.warned", "machine.nvml.stuck", "machine.guard.import_watch",
            "nodes.store.hosted", "probing.forkserver.lost", "frameworks.teardown.failed",
            "records.handoff.worker", "run.preempt.current", "run.worker.keep",
            "core.knowledge.data.tables"} <= set(held)
    assert all(h.what.strip() for h in held.values())
    from resilient_strategy.machine import files, guard

    # the module's name for its holder is the owner's value, not a copy
    assert files._warned is held["machine.files.warned"].value
    assert guard.IMPORT_WATCH is held["machine.guard.import_watch"].value
    assert PROCESS.hold("machine.files.warned", set, "again") is files._warned


def test_the_count_sees_each_kind_of_holder(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "import functools\n"
        "from x import PROCESS\n"
        "SEEN = []\n"
        "KEPT = PROCESS.hold('m.kept', list, 'what')\n"
        "CONSTANT = {'a': 1}\n"
        "class Box:\n    def __init__(self):\n        self.n = 0\n"
        "BOX = Box()\n"
        "def f():\n    global N\n    SEEN.append(1)\n    KEPT.append(1)\n    return CONSTANT['a']\n"
        "@functools.cache\ndef table() -> dict:\n    return {}\n"
        "@functools.cache\ndef box_class() -> type:\n    return Box\n", encoding="utf-8")
    assert holders(tmp_path) == {("m.py", "SEEN"), ("m.py", "BOX"), ("m.py", "N"),
                                 ("m.py", "table")}
