"""The package's named logger (``logging.getLogger("opreg")``); silent unless configured."""
import logging

logger = logging.getLogger("opreg")
logger.addHandler(logging.NullHandler())
