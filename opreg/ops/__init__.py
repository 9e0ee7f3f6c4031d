"""The built-in ops. Importing this package defines them (``torch.ops.opreg.*``)."""
from . import cat_linear, scatter_combine

__all__ = ["cat_linear", "scatter_combine"]
