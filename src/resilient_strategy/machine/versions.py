"""Framework facts read without importing any framework.

Versions come from package metadata; build facts from the frameworks' own generated files
(``torch/version.py``, ``tensorflow/python/platform/build_info.py``) parsed with ``ast``. The
package folder is found with a top-level ``importlib.util.find_spec(name)``, which does not import
it; a dotted ``find_spec("tensorflow.python...")`` WOULD import the parent package: never use one.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..core.values.facts import FrameworkInfo

#: The distributions that provide each framework, in the order they are looked up.
DISTRIBUTIONS: Mapping[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "tensorflow": (
        "tensorflow",
        "tensorflow-cpu",
        "tensorflow-gpu",
        "tf-nightly",
        "tf-nightly-cpu",
        "tf-nightly-gpu",
        "tensorflow-macos",
        "tensorflow-intel",
        "intel-tensorflow",
        "tensorflow-rocm",
    ),
    "keras": ("keras", "keras-nightly"),
}
_NCCL_WHEEL = re.compile(r"nvidia-nccl-cu\d+")  # a canonicalized distribution name
#: The extra of TensorFlow's wheel that pins the CUDA libraries (``pip install tensorflow[and-cuda]``).
_TF_CUDA_EXTRAS = ("and-cuda",)


class MetadataSource(Protocol):
    """Where installed packages are read from (``importlib.metadata``'s calls, and a package's
    folder found without importing it). Tests pass their own, as ``packaging.markers`` takes an
    ``environment``."""

    def distribution(self, name: str) -> Any:
        """The distribution (``.version``, ``.requires``); raises PackageNotFoundError."""

    def version(self, name: str) -> str:
        """The installed version of a distribution; raises PackageNotFoundError."""

    def package_dir(self, name: str) -> str | None:
        """The folder of top-level package ``name``, or None."""


class InstalledPackages:
    """The packages installed for this interpreter (the default `MetadataSource`)."""

    def distribution(self, name: str) -> Any:
        return metadata.distribution(name)

    def version(self, name: str) -> str:
        return metadata.version(name)

    def package_dir(self, name: str) -> str | None:
        """Found without importing it (``name`` must be top level)."""
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # ValueError: in sys.modules with no __spec__
            return None
        locations = spec.submodule_search_locations if spec else None
        return next(iter(locations), None) if locations else None


def detect_frameworks(
    modules: Mapping[str, object] | None = None, packages: MetadataSource | None = None,
) -> tuple[FrameworkInfo, ...]:
    """torch, tensorflow and keras as installed (read from ``packages``, default this
    interpreter's); ``modules`` (default ``sys.modules``) says which are imported. Costs a few
    milliseconds and imports nothing."""
    mods: Mapping[str, object] = sys.modules if modules is None else modules
    src = InstalledPackages() if packages is None else packages
    return (_torch(mods, src), _tensorflow(mods, src), _keras(mods, src))


def _torch(mods: Mapping[str, object], src: MetadataSource) -> FrameworkInfo:
    dist, dist_name = _distribution("torch", src)
    folder = src.package_dir("torch")
    if dist is None and folder is None:
        return FrameworkInfo(name="torch")
    built = literals(os.path.join(folder, "version.py")) if folder else {}
    version = dist.version if dist else _str_or_none(built.get("__version__"))
    tagged_cuda, tagged_rocm = local_build(version or "")
    cuda = _str_or_none(built.get("cuda")) or tagged_cuda
    hip = _str_or_none(built.get("hip")) or tagged_rocm
    return FrameworkInfo(
        name="torch",
        version=version or "unknown",
        distribution=dist_name,
        cuda=cuda,
        nccl=_required_nccl(dist, (), src) if cuda else None,
        imported="torch" in mods,
        gpu_initialized=torch_initialized(mods),
        hip=None if cuda else hip,
    )


_LOCAL_CUDA = re.compile(r"\+cu(\d+?)(\d)$")
_LOCAL_ROCM = re.compile(r"\+rocm(\d+(?:\.\d+)*)$")


def local_build(version: str) -> tuple[str | None, str | None]:
    """``(cuda, rocm)`` from a wheel's local version tag: ``2.8.0+cu128`` -> ("12.8", None),
    ``2.5.1+rocm6.2`` -> (None, "6.2"), ``+cpu`` or no tag -> (None, None). The tag is what
    PyTorch's own index names its builds by; ``torch/version.py`` says the same in more detail
    and wins where it is readable."""
    m = _LOCAL_CUDA.search(version)
    if m:
        return f"{int(m.group(1))}.{m.group(2)}", None
    m = _LOCAL_ROCM.search(version)
    return None, (m.group(1) if m else None)


def _tensorflow(mods: Mapping[str, object], src: MetadataSource) -> FrameworkInfo:
    dist, dist_name = _distribution("tensorflow", src)
    folder = src.package_dir("tensorflow")
    if dist is None and folder is None:
        return FrameworkInfo(name="tensorflow")
    info_path = os.path.join(folder, "python", "platform", "build_info.py") if folder else ""
    info = build_info(info_path) if info_path else {}
    cuda = _str_or_none(info.get("cuda_version") or info.get("cuda_version_number"))
    archs = info.get("cuda_compute_capabilities") or ()
    # The nvidia-nccl wheel counts only where TF pins it (its "and-cuda" extra); older TF wheels
    # carry their own NCCL and say nothing about it.
    nccl = _str_or_none(info.get("nccl_version")) or (
        _required_nccl(dist, _TF_CUDA_EXTRAS, src) if cuda else None)
    return FrameworkInfo(
        name="tensorflow",
        version=dist.version if dist else "unknown",
        distribution=dist_name,
        cuda=cuda,
        nccl=nccl,
        archs=tuple(str(a) for a in archs) if isinstance(archs, (list, tuple)) else (),
        imported="tensorflow" in mods,
        gpu_initialized=tensorflow_initialized(mods),
    )


def _keras(mods: Mapping[str, object], src: MetadataSource) -> FrameworkInfo:
    dist, dist_name = _distribution("keras", src)
    if dist is None:
        return FrameworkInfo(name="keras")
    return FrameworkInfo(
        name="keras", version=dist.version, distribution=dist_name,
        imported="keras" in mods,
    )


def torch_initialized(mods: Mapping[str, object]) -> bool:
    """``torch.cuda.is_initialized()``, which does not initialize CUDA itself."""
    try:
        cuda = getattr(mods.get("torch"), "cuda", None)
        return bool(cuda.is_initialized()) if cuda is not None else False
    except Exception:
        return False


def tensorflow_initialized(mods: Mapping[str, object]) -> bool:
    """Whether TF's eager context has listed (initialized) its physical devices.

    Checked against TF 2.21: a fresh import, ``context.context()`` alone and building a Keras layer
    leave ``_physical_devices`` None; ``tf.config.list_physical_devices()``,
    ``set_visible_devices`` and any op set it (an op also sets ``_context_handle``). Listing devices
    is what makes CUDA read CUDA_VISIBLE_DEVICES, so either one means it is too late to change.
    """
    try:
        context = mods.get("tensorflow.python.eager.context")
        ctx = getattr(context, "context_safe", lambda: None)()
        if ctx is None:
            return False
        return (
            getattr(ctx, "_physical_devices", None) is not None
            or getattr(ctx, "_context_handle", None) is not None
        )
    except Exception:
        return False


def _distribution(framework: str, src: MetadataSource) -> tuple[Any, str]:
    """The installed distribution providing ``framework`` and its name as we looked it up."""
    for name in DISTRIBUTIONS[framework]:
        try:
            return src.distribution(name), name
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return None, ""


def _required_nccl(
    dist: Any, extras: Sequence[str] = (), src: MetadataSource | None = None,
) -> str | None:
    """The installed version of the nvidia-nccl-cuXX wheel that ``dist`` requires, if any.

    Only requirements that apply here count: markers are evaluated for this interpreter and
    platform, with ``extras`` (TensorFlow's ``and-cuda``) as the extras asked for. And only an
    installed version that satisfies the requirement's specifier is reported: another package
    (torch) may have installed a different NCCL wheel, which is not the one ``dist`` uses. None
    ("unknown") otherwise.
    """
    for text in (dist.requires or ()) if dist else ():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        name = canonicalize_name(req.name)
        if not _NCCL_WHEEL.fullmatch(name) or not _applies(req, extras):
            continue
        try:
            installed = (src or InstalledPackages()).version(name)
            if req.specifier.contains(Version(installed), prereleases=True):
                return installed
        except (metadata.PackageNotFoundError, InvalidVersion):
            continue
    return None


def _applies(req: Requirement, extras: Sequence[str]) -> bool:
    """Whether a requirement's marker holds here for one of ``extras`` (or for none)."""
    if req.marker is None:
        return True
    for extra in (*extras, ""):
        try:
            if req.marker.evaluate({"extra": extra}):
                return True
        except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName):
            return False
    return False


def literals(path: str) -> dict[str, Any]:
    """Module-level ``name = <literal>`` assignments of a Python file, never executing it."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.expr):
            try:
                out[target.id] = _literal(value)
            except (ValueError, TypeError):
                continue
    return out


def _literal(node: ast.expr) -> Any:
    """A literal, also seeing through ``dict(...)`` / ``collections.OrderedDict([...])`` calls."""
    func = node.func if isinstance(node, ast.Call) else None
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if isinstance(node, ast.Call) and name in ("dict", "OrderedDict"):
        result: dict[Any, Any] = {}
        for arg in node.args:
            result.update(_literal(arg))
        result.update({k.arg: _literal(k.value) for k in node.keywords if k.arg})
        return result
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(str(exc)) from None


def build_info(path: str) -> dict[str, Any]:
    """TF's build info: the ``build_info`` mapping (2.3+), or older module-level constants."""
    found = literals(path)
    info = found.pop("build_info", None)
    return {**found, **info} if isinstance(info, Mapping) else found


def _str_or_none(value: object) -> str | None:
    return str(value) if isinstance(value, (str, int, float)) and value != "" else None
