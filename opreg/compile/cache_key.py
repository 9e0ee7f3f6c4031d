"""What Inductor's caches are keyed on: hashes of the files a pattern's behaviour
depends on. A pattern depends on its own source, on every opreg module that source uses
(its op spec in ``opreg/ops`` above all), and on the framework (this package)."""
from __future__ import annotations

import hashlib
import inspect
import sys
import types
from pathlib import Path
from typing import Any, Iterable

__all__ = ["framework_digest", "pattern_digest", "pattern_files"]

# The framework: every pattern's behaviour depends on these files of opreg/compile.
FRAMEWORK = ("cache_key", "fx_utils", "mutation", "pattern", "pass_manager", "permutation",
             "replacement")


def _module_file(obj: Any) -> str | None:
    mod = obj if isinstance(obj, types.ModuleType) else sys.modules.get(getattr(obj, "__module__", ""))
    path = getattr(mod, "__file__", None)
    return str(Path(path).resolve()) if path else None


def _opreg_modules_used(obj: Any) -> set[str]:
    """Files of the opreg modules ``obj``'s module uses (its globals that are opreg
    modules, or come from one): e.g. a pattern's op spec in ``opreg/ops``."""
    mod = sys.modules.get(getattr(obj, "__module__", ""))
    files = set()
    for v in vars(mod).values() if mod is not None else ():
        name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
        if isinstance(name, str) and name.split(".")[0] == "opreg":
            f = _module_file(v)
            if f:
                files.add(f)
    return files


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
    """The opreg files ``sources`` (a pattern's class, or its functions) use."""
    files: set[str] = set()
    for obj in sources:
        files |= _opreg_modules_used(obj)
    return sorted(files)


def pattern_digest(sources: Iterable[Any]) -> str:
    """Hash of ``sources`` and of every opreg file they use."""
    sources = list(sources)
    h = hashlib.sha256()
    for obj in sources:
        _hash_object(h, obj)
    for f in pattern_files(sources):
        h.update(Path(f).read_bytes())
    return h.hexdigest()


def framework_digest() -> str:
    """Hash of the framework's own files (read now: an edit shows at once)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in FRAMEWORK:
        h.update((here / f"{name}.py").read_bytes())
    return h.hexdigest()
