"""Which memory a node of a Dynamo graph may write, and whether a rewrite is safe from it.

A replacement reads its inputs at the rewrite point (the anchor), where the original
read them earlier, along its chain of nodes. Any node in between that may write a
storage the match reads - the inputs, the chain's own values, views and aliases of
them - could make the two differ, so the match is rejected. The rule is general, not
per spelling:

* what a node writes is found from the ATen schemas of what it runs: the node is run
  again on stand-in fake tensors under a dispatch mode that records every argument a
  schema marks as written (``Tensor(a!)``). That covers ``x.relu_()``,
  ``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)``, ``out=``, ``setitem``,
  custom ops with mutable schemas, and functions that write without saying so in
  their name (``F.batch_norm``'s running stats, ``F.embedding(max_norm=...)``);
* a node whose writes cannot be found (a module call, a run that fails) may write
  anything: it rejects every match across it;
* storages are compared on the fake values Dynamo recorded, which keep the aliasing of
  views and of aliased graph inputs.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .fx_utils import meta_value, order

__all__ = ["ANYTHING", "hazard", "may_write", "written"]

ANYTHING = "anything"  # written() of a node whose writes are unknown

# Calls known to write nothing, by target: skip the fake run for the most common nodes.
_PURE_FUNCTIONS = {operator.getitem, operator.mul, operator.add, operator.sub, operator.truediv,
                   operator.floordiv, operator.neg, operator.matmul, operator.lt, operator.gt,
                   operator.le, operator.ge, operator.eq, operator.ne, getattr}
_PURE_METHODS = {"size", "dim", "stride", "numel", "view", "reshape", "unsqueeze", "squeeze",
                 "expand", "expand_as", "t", "transpose", "permute", "contiguous", "to", "float",
                 "half", "bfloat16", "double", "type_as", "unbind", "select", "narrow", "flatten",
                 "unflatten", "mul", "add", "sum", "mean", "clone", "detach"}


# ATen ops that write arguments their schema does not mark (batch norm's running stats).
_UNMARKED_WRITES = {"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm",
                    "aten::batch_norm", "aten::_batch_norm_impl_index"}


def _written_args(schema: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The argument values ``schema`` may write."""
    unmarked = schema.name in _UNMARKED_WRITES
    out = []
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if unmarked or (info is not None and info.is_write):
            out.append(args[i] if i < len(args) else kwargs.get(a.name))
    return out


class _RecordWrites(TorchDispatchMode):
    """Records the storages of every argument an op's schema marks as written."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[StorageWeakRef] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        for v in _written_args(schema, args, kwargs) if schema is not None else ():
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor):
                    self.storages.add(StorageWeakRef(t.untyped_storage()))
        return func(*args, **kwargs)


def storage(v: Any) -> StorageWeakRef | None:
    if isinstance(v, torch.Tensor) and v.layout == torch.strided:
        try:
            return StorageWeakRef(v.untyped_storage())
        except Exception:  # noqa: BLE001 - e.g. a tensor subclass without storage
            return None
    return None


def _stand_ins(node: fx.Node, fake_mode: Any) -> tuple[tuple, dict, dict[StorageWeakRef, Any]]:
    """The node's arguments with each tensor replaced by a fresh fake of the same
    shape, strides and dtype (so running it touches none of the recorded values), and
    a map from each stand-in's storage to the original value's storage."""
    back: dict[StorageWeakRef, Any] = {}
    made: dict[int, torch.Tensor] = {}

    def swap(a: Any) -> Any:
        v = meta_value(a)
        if not isinstance(v, torch.Tensor):
            return v
        if id(v) not in made:
            with fake_mode:
                t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            made[id(v)] = t
            back[StorageWeakRef(t.untyped_storage())] = storage(v)
        return made[id(v)]

    args = fx.node.map_aggregate(node.args, swap)
    kwargs = fx.node.map_aggregate(node.kwargs, swap)
    return args, kwargs, back


def _run_recorded(node: fx.Node, fake_mode: Any) -> set[Any] | str:
    args, kwargs, back = _stand_ins(node, fake_mode)
    fn = (lambda *a, **k: getattr(a[0], node.target)(*a[1:], **k)) \
        if node.op == "call_method" else node.target
    rec = _RecordWrites()
    env = getattr(fake_mode, "shape_env", None)
    quiet = env.suppress_guards() if env is not None else _nothing()
    try:
        with quiet, fake_mode, rec:
            fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - can't tell what it writes
        return ANYTHING
    # A written storage that is no argument's was made inside the call: harmless.
    return {back[s] for s in rec.storages if s in back}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def written(node: fx.Node, fake_mode: Any, cache: dict[fx.Node, Any] | None = None) -> set[Any] | str:
    """The storages ``node`` may write (possibly empty), or :data:`ANYTHING`."""
    if cache is not None and node in cache:
        return cache[node]
    if node.op in ("placeholder", "output", "get_attr"):
        got: set[Any] | str = set()
    elif node.op == "call_module" or fake_mode is None:
        got = ANYTHING
    elif (node.op == "call_function" and node.target in _PURE_FUNCTIONS and not node.kwargs) or \
            (node.op == "call_method" and node.target in _PURE_METHODS and "out" not in node.kwargs):
        got = set()
    else:
        got = _run_recorded(node, fake_mode)
    if cache is not None:
        cache[node] = got
    return got


def may_write(node: fx.Node, fake_mode: Any, cache: dict[fx.Node, Any] | None = None) -> bool:
    """Can ``node`` write any memory (so it must not be dropped as dead)?"""
    return written(node, fake_mode, cache) != set()


def hazard(reads: Iterable[Any], start: fx.Node, anchor: fx.Node, fake_mode: Any,
           cache: dict[fx.Node, Any] | None = None, own: Iterable[fx.Node] = ()) -> fx.Node | None:
    """The first node strictly between ``start`` and ``anchor`` that may write a storage
    of ``reads`` (nodes or values), or whose writes are unknown; None if there is none.
    ``own``: nodes whose writes are the match's own (proven by the pattern)."""
    own = set(own)
    guarded = {s for s in (storage(meta_value(r)) for r in reads) if s is not None}
    pos = order(anchor.graph)
    lo, hi = pos[start], pos[anchor]
    for n in anchor.graph.nodes:
        if pos[n] <= lo:
            continue
        if pos[n] >= hi:
            return None
        if n in own:
            continue
        w = written(n, fake_mode, cache)
        if w == ANYTHING or (guarded & w):  # type: ignore[operator]
            return n
    return None
