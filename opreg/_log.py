"""The package's named logger (``logging.getLogger("opreg")``); silent unless configured."""
import logging

from typing import Any, Hashable

logger = logging.getLogger("opreg")
logger.addHandler(logging.NullHandler())

_said: set[Hashable] = set()


def log_once(key: Hashable, level: int, msg: str, *args: Any) -> None:
    """``logger.log(level, msg, *args)`` the first time ``key`` is seen (for things that
    happen on every call, such as a run-time fallback)."""
    if key not in _said:
        _said.add(key)
        logger.log(level, msg, *args)
