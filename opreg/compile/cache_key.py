"""What Inductor's caches are keyed on: hashes of the files a pattern's behaviour
depends on. A pattern depends on its own source, on every opreg module that source uses
(its op spec in ``opreg/ops`` above all), on every opreg module *those* import, and so
on (the dtype sets and checks in ``opreg/ops/_common.py`` that every ``unsupported()``
uses, say), and on the framework (this package) with its own imports likewise.

Dependencies are read from the modules' source (their ``import`` statements, function
bodies included) rather than from their globals, so a constant imported by name counts
too. Over-inclusion only costs a cache miss; a missing file could serve a stale graph."""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path
from typing import Any, Iterable

__all__ = ["framework_digest", "framework_files", "pattern_digest", "pattern_files"]

# The framework: every pattern's behaviour depends on these files of opreg/compile.
FRAMEWORK = ("cache_key", "fx_utils", "mutation", "pattern", "pass_manager", "permutation",
             "replacement")
ROOT = "opreg"


def _module_file(obj: Any) -> str | None:
    mod = obj if isinstance(obj, types.ModuleType) else sys.modules.get(getattr(obj, "__module__", ""))
    path = getattr(mod, "__file__", None)
    return str(Path(path).resolve()) if path else None


def _opreg_modules_used(obj: Any) -> set[str]:
    """Names of the opreg modules ``obj``'s module uses through its globals (modules,
    or objects defined in one): e.g. a pattern's op spec in ``opreg/ops``. Catches
    modules a pattern defined outside opreg uses (its source is not an opreg file)."""
    mod = sys.modules.get(getattr(obj, "__module__", ""))
    names = set()
    for v in vars(mod).values() if mod is not None else ():
        name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
        if isinstance(name, str) and name.split(".")[0] == ROOT:
            names.add(name)
    return names


def _imports(name: str, path: str) -> set[str]:
    """The opreg modules a module's source imports (anywhere in it), by absolute name;
    ``from pkg import mod`` counts ``pkg.mod`` where that is a module. Parsed once per
    version of the file (its size and mtime): the key is computed on every compile."""
    st = Path(path).stat()
    return _parsed_imports(name, path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1024)
def _parsed_imports(name: str, path: str, mtime_ns: int, size: int) -> frozenset[str]:
    try:
        tree = ast.parse(Path(path).read_bytes())
    except SyntaxError:
        return frozenset()
    package = name if _is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else (node.module or "")
            except (ImportError, ValueError):
                continue
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return frozenset(n for n in found if n.split(".")[0] == ROOT and _file_of(n))


def _is_package(name: str) -> bool:
    mod = sys.modules.get(name)
    return mod is not None and hasattr(mod, "__path__")


def _file_of(name: str) -> str | None:
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError, AttributeError):
            return None
        path = spec.origin if spec is not None and spec.has_location else None
    return str(Path(path).resolve()) if path and path.endswith(".py") else None


def _closure(names: Iterable[str]) -> list[str]:
    """Files of ``names`` and of every opreg module they import, transitively."""
    todo, seen, files = list(names), set(), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        f = _file_of(name)
        if f is None:
            continue
        files.add(f)
        todo.extend(_imports(name, f) - seen)
    return sorted(files)


def _hash_object(h: Any, obj: Any) -> None:
    """Hash ``obj``'s source file, else its source, else (exec'd) its bytecode."""
    try:
        h.update(Path(inspect.getsourcefile(obj)).read_bytes())  # type: ignore[arg-type]
        return
    except (OSError, TypeError):
        pass
    try:
        h.update(inspect.getsource(obj).encode())
    except (OSError, TypeError):
        code = getattr(obj, "__code__", None)
        h.update(repr((getattr(obj, "__qualname__", repr(obj)), code.co_code if code else b"",
                       code.co_consts if code else ())).encode())


def pattern_files(sources: Iterable[Any]) -> list[str]:
    """The opreg files ``sources`` (a pattern's class, or its functions) depend on."""
    names: set[str] = set()
    for obj in sources:
        names |= _opreg_modules_used(obj)
        mod = getattr(obj, "__module__", None)
        if isinstance(mod, str) and mod.split(".")[0] == ROOT:
            names.add(mod)
    return _closure(names)


def pattern_digest(sources: Iterable[Any]) -> str:
    """Hash of ``sources`` and of every opreg file they depend on."""
    sources = list(sources)
    h = hashlib.sha256()
    for obj in sources:
        _hash_object(h, obj)
    for f in pattern_files(sources):
        h.update(f.encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()


def framework_files() -> list[str]:
    """The framework's files and every opreg file they import, transitively."""
    return _closure(f"{__package__}.{name}" for name in FRAMEWORK)


def framework_digest() -> str:
    """Hash of the framework's files (read now: an edit shows at once)."""
    h = hashlib.sha256()
    for f in framework_files():
        h.update(f.encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()
