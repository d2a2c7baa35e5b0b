"""The environment variables a candidate may set: an allow-list, checked wherever a candidate's
variables come from outside this process (a probe node 0 sent through the job's store) and
where a probe worker's environment is built from them.

A candidate sets the knobs of the collective libraries and of torch's process group, the GPUs
it runs on and a few TensorFlow GPU settings: what the shipped remedies (``remedies.toml``),
known-issue rules (``known_issues.toml``), the remedies between nodes (`nodes.routes`) and
the planner set (``tests/test_candidate_env.py`` checks every one of them is allowed). Never the
loader's, the interpreter's or the shell's (``LD_PRELOAD``, ``LD_LIBRARY_PATH``,
``PYTHONPATH``, ``PATH``, ...), and never, even under an allowed prefix, a variable that names
a file, a directory or a library to load (``NCCL_NET_PLUGIN``, ``NCCL_DEBUG_FILE``,
``NCCL_CONF_FILE``, ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, ...): such a variable runs or writes
what it names as the process that reads it. Pure data: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Prefixes of the variables a candidate may set (less `REFUSED_WORDS`).
PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
#: Variables a candidate may set, named one by one.
NAMES = frozenset({
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_DEVICE_MAX_CONNECTIONS",
    "USE_LIBUV",  # torch's TCPStore transport (remedies.toml: store_libuv)
    "TF_FORCE_GPU_ALLOW_GROWTH", "TF_GPU_ALLOCATOR", "TF_GPU_THREAD_MODE",
    "TF_GPU_THREAD_COUNT",
})
#: A word of a name (split at ``_``) that makes it a path, a library or a plugin to load: refused
#: whatever its prefix.
REFUSED_WORDS = frozenset({"FILE", "FILES", "PATH", "PATHS", "DIR", "DIRS", "PLUGIN", "LIB",
                           "LIBRARY", "PRELOAD", "HOME", "CMD", "COMMAND", "EXEC", "SCRIPT"})
#: The longest value a candidate's variable may hold (an interface list, an HCA list).
MAX_VALUE_CHARS = 4096


def refusal(name: str, value: str) -> str:
    """Why a candidate may not set ``name`` to ``value`` ("" when it may). Pure."""
    if not name.isascii() or not name.replace("_", "").isalnum() or name != name.upper():
        return f"{name!r} is not an environment variable's name"
    if not (name in NAMES or name.startswith(PREFIXES)):
        return (f"{name} is not a variable a candidate sets (only {', '.join(PREFIXES)}* and "
                f"{', '.join(sorted(NAMES))})")
    if REFUSED_WORDS & set(name.split("_")):
        return f"{name} names a file, a directory or a library to load"
    if len(value) > MAX_VALUE_CHARS:
        return f"{name}'s value is longer than {MAX_VALUE_CHARS} characters"
    if any(not ch.isprintable() for ch in value):
        return f"{name}'s value holds a control character"
    return ""


def refused(env: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs of ``env`` a candidate may not set, each with why: ``(name, why)``. Pure."""
    return [(name, why) for name, value in env if (why := refusal(name, value))]
