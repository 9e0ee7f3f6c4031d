"""Replay a call's kernel launches for a fraction of its host time.

Why: the fused MoE forward's Python around its seven launches took ~225 us of host a call
on an H100 host, the whole experts call ~290 us (T = 4096, 2026-12-06, sixty-first session,
``bench/RESULTS.md``), against ~690-790 us of GPU; the block's eager router adds ~120 us. With
the host that close to the GPU, calls after an idle GPU wait on it: ``bench_moe_block.py``
read Mixtral's block forward at 838 us in batches of 5 calls and 773 in batches of 20 on
that H100, its GPU time 731. Decode-sized calls are all host.

A :class:`Recording` (:func:`record`) watches one call: its input tensors (the roots), each
buffer it makes (:func:`make`) and each launch through :mod:`.launch`'s raw C launcher. The
call returns a buffer it made, or a tuple of such buffers, views of them and Nones (the MoE
forward that saves for its backward).
Where every launch took that launcher, each tensor parameter lies in exactly one root and no
other tensor work ran (a dispatch mode sees every ATen call: views and empty tensors only,
outside :func:`make`), it becomes a :class:`Plan`: each launch's parameters as constants
and (root, byte offset) addresses, each TMA descriptor as an address and what its encoding
reads. :meth:`Plan.run` makes the buffers again, fills in this call's addresses (the C
launcher takes an int for a pointer: no ``data_ptr()`` call and no driver query per
tensor), encodes a descriptor once per address and launches on the current stream. Scratch
buffers (made, not returned, nor viewed by what is) whose maker is :func:`plain` (an empty
tensor, nothing else) are carved from one allocation, at 512-byte offsets: a ``torch.empty``
took ~5.4 us of host on the H100 box, and the MoE forward makes four scratch buffers beside
its output (sixty-first session).

:class:`Plans` keeps them per caller's key, which must determine every launch's kernel,
grid and constants (the op's spec: each input's device, dtype, shape, strides and
alignment), together with a ``state`` the caller gives (its module's knobs) that must be
equal for a plan to apply. Under OPREG_CHECK_SPEC=1 (the test suite) a replay first runs
the caller's path dry (buffers made, launches checked and recorded, none run) and raises
where it differs from the plan.
"""
from __future__ import annotations

import contextlib
import copy
import math
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import launch as L

__all__ = ["Plan", "Plans", "Recording", "make", "plain", "record"]

# ATen calls a recorded call may make outside make(): tensor metadata only, no GPU work. By
# schema name: looking an op up (torch.ops.aten.__getattr__) can replace its packet, and with
# it the Python kernels registered on it (aten.slice's: dynamic shapes then broke in Dynamo)
_VIEWS = frozenset(f"aten::{n}" for n in (
    "empty", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view", "slice", "select",
    "transpose", "t", "permute", "as_strided", "alias", "unsqueeze", "squeeze", "expand", "detach", "reshape"))
_DESC_CACHE_LIMIT = 64  # encoded descriptors per descriptor parameter (activations' addresses vary)
_POOL_ALIGN = 512  # a pooled buffer's offset: the caching allocator's own block alignment


def plain(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Mark a buffer maker for :func:`make` as ``torch.empty(shape, dtype=dtype, device=device)``
    and nothing else: a plan may then carve the buffers it makes from one allocation (where
    the buffer is scratch, not the call's result). Returns ``fn``."""
    fn._opreg_plain = True  # type: ignore[attr-defined]
    return fn


class _Watch(TorchDispatchMode):
    """Fails the recording on any ATen call that may do tensor work (not a view, not an empty
    tensor), except inside :func:`make` (the plan makes its buffers the same way)."""

    def __init__(self, rec: "Recording") -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.rec.making and func._schema.name not in _VIEWS:
            self.rec.fail(f"{func} ran in the recorded call", final=True)
        return func(*args, **(kwargs or {}))


class Recording:
    """One call's roots, buffers and raw launches (see the module docstring). ``dry``: the
    launches are recorded, not run."""

    def __init__(self, roots: Sequence[Optional[torch.Tensor]], dry: bool) -> None:
        self.roots: list[Optional[torch.Tensor]] = list(roots)
        self.inputs = len(self.roots)
        self.buffers: list[tuple[Callable[..., torch.Tensor], tuple[int, ...], torch.dtype]] = []
        self.launches: list[tuple[Any, tuple[int, int, int], tuple[Any, ...], tuple[Any, ...]]] = []
        self.dry = dry
        self.making = 0
        self.failed: Optional[str] = None
        self.final = False  # failed for a reason the next call would meet again
        self.result: Any = None  # what the call returned: a tensor, or a tuple of tensors and Nones

    def fail(self, why: str, final: bool = False) -> None:
        if self.failed is None or (final and not self.final):  # the reason that lasts, if any
            self.failed = why
        self.final = self.final or final

    def launch(self, raw: Any, grid: tuple[int, int, int], args: tuple[Any, ...], tail: tuple[Any, ...]) -> bool:
        """Note a raw launch; True where it must not run (``dry``)."""
        self.launches.append((raw, grid, args, tail))
        return self.dry

    def plan(self, state: Any) -> Optional["Plan"]:
        """The :class:`Plan` of this call (``state``: the caller's), or None (``failed`` says why)."""
        if self.failed is None and self.result is None:
            self.fail("the call returned no tensor of its own", final=True)
        if self.failed is not None:
            return None
        try:
            return Plan(self, state)
        except _Unplannable as e:
            self.fail(str(e), final=True)
            return None


class _Unplannable(Exception):
    pass


class _Addr:
    """A tensor descriptor's base for the encoder: an address (it reads ``data_ptr()``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _Desc:
    """One TMA descriptor parameter: what its encoding reads but the address, encoded per address."""

    __slots__ = ("template", "meta", "encode", "encoded", "size", "key")

    def __init__(self, built: Any, meta: Any, encode: Any, ptr: int) -> None:
        self.template = copy.copy(built)
        self.template.base = None  # keeps no tensor alive
        self.meta, self.encode, self.encoded = meta, encode, {}
        self.size = len(self(ptr))  # [encoded descriptor (or address), *shape, *strides, ...]: one length
        self.key = (type(built), tuple(built.shape), tuple(built.strides), tuple(built.block_shape),
                    getattr(built, "padding", None), getattr(built, "layout", None), id(meta))

    def _at(self, ptr: int) -> Any:
        d = copy.copy(self.template)
        d.base = _Addr(ptr) if self.meta is not None else ptr  # no TMA: the address is the parameter
        return d

    def __call__(self, ptr: int) -> list[Any]:
        got = self.encoded.get(ptr)
        if got is None:
            if len(self.encoded) >= _DESC_CACHE_LIMIT:
                self.encoded.clear()
            got = self.encoded[ptr] = self.encode(self._at(ptr), self.meta)
        return got


class Plan:
    """A recording's launches, to run on other roots of the same metadata (see the module
    docstring). ``state``: the caller's, compared before a replay."""

    def __init__(self, rec: Recording, state: Any) -> None:
        self.state = state
        self.inputs = rec.inputs
        self.buffers = list(rec.buffers)
        spans = [(i, t.data_ptr(), t.data_ptr() + _extent(t)) for i, t in enumerate(rec.roots)
                 if t is not None and t.numel()]
        # the result: one tensor, or a tuple of tensors (each a buffer the call made, or a view
        # of one) and Nones
        self.single = isinstance(rec.result, torch.Tensor)
        self.results = tuple(self._returned(t, rec) for t in ((rec.result,) if self.single else rec.result))
        whole = self.single and self.results[0] is not None and self.results[0][1] is None
        self.result = self.results[0][0] if whole else None  # the one buffer returned as is
        self.launches = [self._launch(raw, grid, args + tail, spans) for raw, grid, args, tail in rec.launches]
        # scratch from plain makers: one allocation, each at its offset; the rest (and any
        # buffer the call returns) made one by one
        returned = {r[0] for r in self.results if r is not None}
        self.made: list[tuple[int, Callable[..., torch.Tensor], tuple[int, ...], torch.dtype]] = []
        self.pooled: list[tuple[int, int]] = []  # (buffer's root index, byte offset in the pool)
        self.pool_bytes = 0
        for j, (fn, shape, dtype) in enumerate(self.buffers):
            root = self.inputs + j
            if getattr(fn, "_opreg_plain", False) and root not in returned:
                self.pooled.append((root, self.pool_bytes))
                size = math.prod(shape) * dtype.itemsize
                self.pool_bytes += -(-size // _POOL_ALIGN) * _POOL_ALIGN
            else:
                self.made.append((root, fn, shape, dtype))

    @staticmethod
    def _returned(t: Any, rec: Recording) -> Optional[tuple[int, Optional[tuple[Any, ...]]]]:
        """(root, None) for a buffer the call made and returned as is, (root, (size, stride,
        storage offset)) for a view of one in its dtype, None for None."""
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise _Unplannable(f"the call returned a {type(t).__name__}, not a tensor")
        made = rec.roots[rec.inputs:]
        for j, b in enumerate(made):
            if t is b:
                return rec.inputs + j, None
        for j, b in enumerate(made):
            if (b.dtype == t.dtype and b.numel() and b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                    and b.storage_offset() == 0):
                return rec.inputs + j, (tuple(t.shape), tuple(t.stride()), t.storage_offset())
        raise _Unplannable("the call returned a tensor it did not make")

    @staticmethod
    def _where(ptr: int, spans: list[tuple[int, int, int]]) -> tuple[int, int]:
        hits = [(i, ptr - lo) for i, lo, hi in spans if lo <= ptr < hi]
        if len(hits) != 1:
            raise _Unplannable(f"a pointer parameter lies in {len(hits)} of the call's tensors (one wanted)")
        return hits[0]

    def _launch(self, raw: Any, grid: tuple[int, int, int], params: tuple[Any, ...],
                spans: list[tuple[int, int, int]]) -> tuple[Any, ...]:
        descs = dict(raw.descs)
        flat: list[Any] = []
        ptrs: list[tuple[int, int, int]] = []  # (flat index, root, offset)
        encs: list[tuple[int, int, int, _Desc]] = []  # (flat index, root, offset, encoder)
        for pos, p in enumerate(params):
            if pos in descs:
                lazy = type(p) is L.LazyDescriptor
                base = p.tensor if lazy else p.base
                r, off = self._where(base.data_ptr(), spans)
                enc = _Desc(p.build() if lazy else p, descs[pos], raw.encode, base.data_ptr())
                encs.append((len(flat), r, off, enc))
                flat += [None] * enc.size
            elif isinstance(p, torch.Tensor):
                r, off = self._where(p.data_ptr(), spans)
                ptrs.append((len(flat), r, off))
                flat.append(None)
            elif type(p) is L.LazyDescriptor or hasattr(p, "block_shape"):
                raise _Unplannable("a tensor descriptor at a parameter its launcher does not encode")
            else:
                flat.append(p)
        return (raw.c_launch, grid, (raw.function, *raw.head), tuple(flat), tuple(ptrs), tuple(encs))

    def signature(self) -> tuple[Any, ...]:
        """What a replay launches, comparable between plans of one key (OPREG_CHECK_SPEC)."""
        return (self.inputs, tuple((fn, shape, dtype) for fn, shape, dtype in self.buffers), self.single, self.results,
                tuple((c, grid, head, flat, ptrs, tuple((i, r, off, e.key) for i, r, off, e in encs))
                      for c, grid, head, flat, ptrs, encs in self.launches))

    def run(self, roots: Sequence[Optional[torch.Tensor]]) -> Any:
        """The recorded launches on ``roots`` (the call's inputs, as recorded): its result (a
        tensor, or the recorded call's tuple with this call's tensors)."""
        x = roots[0]
        device = x.device
        addrs = [0 if t is None else t.data_ptr() for t in roots] + [0] * len(self.buffers)
        result = None
        made = {}
        for root, fn, shape, dtype in self.made:
            t = fn(shape, dtype, device)
            addrs[root] = t.data_ptr()
            if root == self.result:
                result = t
            else:
                made[root] = t
        # the pool lives to the end of this call: freed after its launches are queued on the
        # current stream, which the caching allocator orders after them, as it would each buffer
        pool = _pool(self.pool_bytes, device) if self.pooled else None
        if pool is not None:
            base = pool.data_ptr()
            for root, off in self.pooled:
                addrs[root] = base + off
        current = torch._C._cuda_getDevice()
        if device.index is None or device.index == current:  # launches go to the current device
            self._launch_all(addrs, current)
        else:
            with torch.cuda.device(device.index):
                self._launch_all(addrs, device.index)
        if result is not None:
            return result
        got = tuple(None if r is None else made[r[0]] if r[1] is None else made[r[0]].as_strided(*r[1])
                    for r in self.results)
        return got[0] if self.single else got

    def _launch_all(self, addrs: list[int], device: int) -> None:
        stream = torch._C._cuda_getCurrentRawStream(device)
        for c_launch, (g0, g1, g2), head, flat, ptrs, encs in self.launches:
            params = list(flat)
            for i, r, off in ptrs:
                params[i] = addrs[r] + off
            for i, r, off, enc in encs:
                params[i:i + enc.size] = enc(addrs[r] + off)
            c_launch(g0, g1, g2, stream, *head, *params)


def _pool(nbytes: int, device: torch.device) -> torch.Tensor:
    """The allocation a replay carves its plain scratch buffers from."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (non-negative strides)."""
    if any(s < 0 for s in t.stride()):
        raise _Unplannable("a tensor with a negative stride")
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _current() -> Optional[Recording]:
    """This thread's recording, if one runs."""
    return L._recorders.get(threading.get_ident()) if L._recorders else None


def make(fn: Callable[..., torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """``fn(shape, dtype, device)``: a buffer the call fills; in a recording, noted (a replay
    makes it again with ``fn``) and free to do tensor work (a NaN fill in tests)."""
    rec = _current()
    if rec is None:
        return fn(shape, dtype, device)
    rec.making += 1
    try:
        t = fn(shape, dtype, device)
    finally:
        rec.making -= 1
    rec.roots.append(t)
    rec.buffers.append((fn, tuple(shape), dtype))
    return t


@contextlib.contextmanager
def record(roots: Sequence[Optional[torch.Tensor]], dry: bool = False) -> Iterator[Recording]:
    """Record the launches of the call run inside (this thread's); ``dry``: without running them."""
    rec = Recording(roots, dry)
    me = threading.get_ident()
    prev = L._recorders.get(me)
    L._recorders[me] = rec
    try:
        with _Watch(rec):
            yield rec
    finally:
        if prev is None:
            del L._recorders[me]
        else:
            L._recorders[me] = prev


class Plans:
    """Plans per key (see the module docstring), at most ``limit``."""

    def __init__(self, limit: int = 4096) -> None:
        self.memo: dict[Any, Any] = {}  # key -> Plan, or (state, why) where none can be made
        self.limit = limit

    def call(self, key: Any, state: Any, roots: Sequence[Optional[torch.Tensor]], body: Callable[[], Any]) -> Any:
        """``body()``, the call on ``roots``: replayed where this key's plan has ``state``,
        else run (and recorded, while no plan is made). ``body`` returns a tensor, or a tuple
        of tensors and Nones; each tensor a buffer it made (:func:`make`) or a view of one."""
        got = self.memo.get(key)
        if type(got) is Plan and got.state == state and not L._hooks() and _current() is None:
            if L.CHECK_SPEC and not self._checked(key, got, state, roots, body):
                return body()  # the plan was dropped
            return got.run(roots)
        if got is not None and type(got) is not Plan and got[0] == state:
            return body()  # no plan for this key and state
        if _current() is not None or L._hooks():
            return body()
        with record(roots) as rec:
            out = body()
            rec.result = out
        plan = rec.plan(state)
        if plan is not None or rec.final:
            if len(self.memo) >= self.limit:
                self.memo.clear()
            self.memo[key] = plan if plan is not None else (state, rec.failed)
        return out

    def _checked(self, key: Any, plan: Plan, state: Any, roots: Sequence[Optional[torch.Tensor]],
                 body: Callable[[], Any]) -> bool:
        """OPREG_CHECK_SPEC: does the Python path, run dry, launch what ``plan`` does? Raises
        where not; False (the plan dropped) where the dry run met a kernel that the launch
        cache no longer held (compiled and run again: its call's results are incomplete)."""
        with record(roots, dry=True) as rec:
            rec.result = body()
        dry = rec.plan(state)
        if dry is None and not rec.final:
            del self.memo[key]
            return False
        if dry is None or dry.signature() != plan.signature():
            raise RuntimeError(f"opreg replay: the plan of key {key!r} no longer matches its call's launches "
                               f"({rec.failed or 'other launches, grids, constants or buffers'}): a plan's key "
                               f"and state must determine them (backends/triton/replay.py)")
        return True
