"""The built-in ops. Importing this package defines them (``torch.ops.opreg.*``)."""
from . import cat_linear, scatter_combine
from . import moe_experts  # noqa: F401  (after scatter_combine, which it calls)

__all__ = ["cat_linear", "scatter_combine"]
