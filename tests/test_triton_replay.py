"""Replaying a call's raw launches (backends/triton/replay.py), without a GPU.

Stand-in kernels of triton 3.6's launcher layout (``test_triton_launch``'s) log each C
launch. A call recorded once is replayed on other tensors of the same metadata: every C
launch gets what the call's own Python path would give it on those tensors (pointers into
this call's inputs and new buffers, descriptors encoded for their new addresses); a call
that does other tensor work, reads a tensor it was not given, or changes under the same key
gets no plan or raises under OPREG_CHECK_SPEC.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("triton")

from opreg.backends.triton import launch as L  # noqa: E402
from opreg.backends.triton import replay as R  # noqa: E402
from test_triton_launch import _kernel  # noqa: E402

SIGNATURE = {"x": "*fp32", "w_desc": "tensordesc<fp32[8, 8]>", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"}
METAS = [{"swizzle": 32}]


class JITFunction:  # the class name launch_args caches for
    def __init__(self) -> None:
        self.__name__ = "toy_kernel"
        self.signature = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                            for n in SIGNATURE])
        self.compiled = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def compile_and_run(*args: Any, **kwargs: Any) -> Any:
            self.compiled += 1
            return _kernel(SIGNATURE, METAS, "{}".format, [])  # Triton's own first launch: not logged
        return compile_and_run


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every C launch's arguments, the stand-ins cached as triton 3.6's kernels would be."""
    log: list[tuple[Any, ...]] = []
    raw_launcher = L._raw_launcher

    def logged(kernel: Any) -> Any:
        raw = raw_launcher(kernel)
        raw.c_launch = lambda *a: log.append(a)
        return raw

    monkeypatch.setattr(L, "_raw_launcher", logged)
    monkeypatch.setattr(L, "_direct_ok", True)
    monkeypatch.setattr(L, "CHECK_SPEC", False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7)
    return log


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _nan(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)  # tensor work, inside make


@R.plain
def _plain(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


class Toy:
    """A call of two launches: its inputs x (N,) and w (16, 8), a scratch buffer read through
    a view at an offset, w through a lazy descriptor, an output buffer; ``extra``: another
    tensor launched with (one the call was not given); ``work``: tensor work besides."""

    def __init__(self) -> None:
        self.fn = JITFunction()
        self.grid = 4
        self.extra: torch.Tensor | None = None
        self.work = False
        self.scratch = _empty  # the scratch buffer's maker
        self.second: tuple[int, ...] | None = None  # the shape of a second scratch buffer, launch 2's input
        self.returns: bool | str = False  # True: (out, a view of scratch, the second buffer, None); "view": scratch[1]
        self.made: list[torch.Tensor] = []

    def make(self, fn: Callable[..., torch.Tensor], shape: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        return R.make(self.kept[fn], shape, x.dtype, x.device)

    @functools.cached_property
    def kept(self) -> dict[Any, Callable[..., torch.Tensor]]:
        """Each maker, keeping what it made (in order) in ``made``."""
        def keeping(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def kept(*a: Any) -> torch.Tensor:
                t = fn(*a)
                self.made.append(t)
                return t
            return R.plain(kept) if getattr(fn, "_opreg_plain", False) else kept
        return {fn: keeping(fn) for fn in (_empty, _nan, _plain)}

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        scratch = self.make(self.scratch, (2, n), x)
        second = self.make(self.scratch, self.second, x) if self.second else None
        out = self.make(_nan, (n,), x)
        wd = L.LazyDescriptor(w, [8, 8], (w.dtype, tuple(w.shape), w.stride(), (8, 8)))
        L.launch_args(self.fn, (self.grid,), (x, wd, scratch[1], n), "spec", {"BLOCK": 32})
        if self.work:
            x.abs()
        first = self.extra if self.extra is not None else second if second is not None else scratch[1]
        L.launch_args(self.fn, (2,), (first, wd, out, n), "spec2", {"BLOCK": 32})
        if self.returns == "view":
            return scratch[1]
        return (out, scratch[1], second, None) if self.returns else out


def _normal(entry: tuple[Any, ...], made: list[torch.Tensor]) -> tuple[Any, ...]:
    """A C launch's arguments with each address inside a made buffer as (buffer, offset)."""
    def norm(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            v = v.data_ptr()
        if isinstance(v, tuple) and v and v[0] == "tmap":
            return ("tmap", norm(v[1])) + v[2:]
        if isinstance(v, int) and not isinstance(v, bool):
            for j, b in enumerate(made):
                if b.data_ptr() <= v < b.data_ptr() + b.numel() * b.element_size():
                    return ("buffer", j, v - b.data_ptr())
        return v
    return tuple(map(norm, entry))


def test_a_replay_launches_what_the_call_would(launches: list[tuple[Any, ...]]) -> None:
    toy, plans = Toy(), R.Plans()
    w = torch.randn(16, 8)
    replays = 0
    for i in range(5):
        x = torch.randn(64)  # new tensors of the same metadata each call
        toy.made.clear()
        before = len(launches)
        planned = "key" in plans.memo
        out = plans.call("key", ("state",), (x, w), lambda: toy(x, w))
        replayed = launches[before:]
        made = list(toy.made)
        assert len(made) == 2 and out is made[1] and torch.isnan(out).all(), "buffers made again, with make's fn"
        if i < 2:  # the first launch (Triton's path), misses per key: compiled, not recorded
            assert not planned and "key" not in plans.memo and toy.fn.compiled == (2, 3)[i]
        if not planned:
            continue
        replays += 1
        assert type(plans.memo["key"]) is R.Plan and toy.fn.compiled == 3
        toy.made.clear()
        launches_before = len(launches)
        toy(x, w)  # the Python path on the same inputs: the oracle
        oracle = launches[launches_before:]
        assert len(replayed) == len(oracle) == 2
        assert [_normal(a, made) for a in replayed] == [_normal(a, toy.made) for a in oracle]
        assert replayed[0][13] == x.data_ptr() and replayed[0][14][1] == w.data_ptr()
        assert replayed[0][0] == 4 and replayed[0][3] == 7, "grid and the current stream"
    assert replays == 2


def test_plain_scratch_buffers_share_one_allocation(launches: list[tuple[Any, ...]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Scratch from a plain maker is carved from one allocation, each buffer at a 512-byte
    offset; the result is still made by its own maker; the launches get what the Python path
    gives them, with each scratch address moved into the pool."""
    pools: list[torch.Tensor] = []
    pool = R._pool
    monkeypatch.setattr(R, "_pool", lambda nbytes, device: pools.append(pool(nbytes, device)) or pools[-1])
    toy, plans = Toy(), R.Plans()
    toy.scratch, toy.second = _plain, (3,)
    w = torch.randn(16, 8)
    for i in range(4):
        x = torch.randn(40)  # scratch (2, 40) fp32: 320 bytes, so the second starts at 512
        toy.made.clear()
        before = len(launches)
        planned = type(plans.memo.get("key")) is R.Plan
        out = plans.call("key", (), (x, w), lambda: toy(x, w))
        if not planned:
            continue
        replayed, made = launches[before:], list(toy.made)
        assert made == [out] and torch.isnan(out).all(), "the result alone made by its maker"
        assert len(pools) == 1 and pools[0].numel() == 512 + 512
        plan = plans.memo["key"]
        assert plan.pooled == [(2, 0), (3, 512)] and plan.pool_bytes == 1024
        toy.made.clear()
        at = len(launches)
        toy(x, w)  # the Python path: the oracle
        oracle, python_made = launches[at:], list(toy.made)
        p = pools.pop()
        in_pool = [p[:320].view(torch.float32), p[512:524].view(torch.float32), out]
        assert [_normal(a, in_pool) for a in replayed] == [_normal(a, python_made) for a in oracle]
        assert ("buffer", 0, 160) in _normal(replayed[0], in_pool), "scratch[1], in the pool"
        assert _normal(replayed[1], in_pool)[13] == ("buffer", 1, 0), "the second scratch at offset 512"
    assert type(plans.memo["key"]) is R.Plan


def test_a_call_returning_buffers_and_views(launches: list[tuple[Any, ...]]) -> None:
    """A call that returns a tuple (a MoE forward saving for its backward): the replay returns
    the same structure, each tensor this call's buffer or the same view of it (shape, strides,
    offset), the Nones as None; a returned buffer is made by its own maker, not carved from the
    pool, so what the caller keeps holds no other scratch."""
    toy, plans = Toy(), R.Plans()
    toy.scratch, toy.second, toy.returns = _plain, (3,), True
    w = torch.randn(16, 8)
    for i in range(4):
        x = torch.randn(40)
        toy.made.clear()
        planned = type(plans.memo.get("key")) is R.Plan
        got = plans.call("key", (), (x, w), lambda: toy(x, w))
        assert type(got) is tuple and len(got) == 4 and got[3] is None
        out, view, second = got[:3]
        scratch = toy.made[0]
        assert out is toy.made[-1] and torch.isnan(out).all()
        assert view.data_ptr() == scratch[1].data_ptr() and view.shape == (40,) and view.stride() == (1,)
        assert view.untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr()
        assert second is toy.made[1] and second.shape == (3,)
        if planned:
            plan = plans.memo["key"]
            assert plan.pooled == [] and len(plan.made) == 3, "every buffer is returned: none pooled"
            assert plan.results == ((4, None), (2, ((40,), (1,), 40)), (3, None), None)
    assert type(plans.memo["key"]) is R.Plan


def test_a_call_returning_one_view(launches: list[tuple[Any, ...]]) -> None:
    """A call whose one result is a view of a buffer it made gets that view again on each
    replay (not the whole buffer), the buffer made on its own."""
    toy, plans = Toy(), R.Plans()
    toy.scratch, toy.returns = _plain, "view"
    w = torch.randn(16, 8)
    for i in range(4):
        x = torch.randn(40)
        toy.made.clear()
        got = plans.call("key", (), (x, w), lambda: toy(x, w))
        scratch = toy.made[0]
        assert got.shape == (40,) and got.data_ptr() == scratch[1].data_ptr()
    plan = plans.memo["key"]
    assert type(plan) is R.Plan and plan.single and plan.result is None and plan.results == ((2, ((40,), (1,), 40)),)


def test_descriptors_are_encoded_for_each_new_address(launches: list[tuple[Any, ...]]) -> None:
    toy, plans = Toy(), R.Plans()
    x = torch.randn(64)
    for i in range(5):
        w = torch.randn(16, 8)  # a weight at another address each call
        plans.call("key", (), (x, w), lambda: toy(x, w))
        if i >= 2:  # replayed (the first two calls compile, the third records)
            assert type(plans.memo["key"]) is R.Plan
            assert launches[-1][14][1] == w.data_ptr() and launches[-2][14][1] == w.data_ptr()


@pytest.mark.parametrize("why", ["tensor work", "a tensor it was not given", "no tensor of its own"])
def test_calls_that_cannot_be_replayed_get_no_plan(why: str, launches: list[tuple[Any, ...]]) -> None:
    toy, plans = Toy(), R.Plans()
    x, w = torch.randn(64), torch.randn(16, 8)
    toy.work = why == "tensor work"
    toy.extra = torch.randn(64) if why == "a tensor it was not given" else None
    body = (lambda: toy(x, w)) if why != "no tensor of its own" else (lambda: (toy(x, w), x)[1])
    calls = 0

    def counted() -> torch.Tensor:
        nonlocal calls
        calls += 1
        return body()

    for _ in range(4):
        plans.call("key", (), (x, w), counted)
    assert calls == 4, "the Python path ran every call"
    refused = plans.memo["key"]
    assert type(refused) is tuple, "refused for good: not recorded again"
    assert {"tensor work": "aten.abs", "a tensor it was not given": "lies in 0 of the call's tensors",
            "no tensor of its own": "a tensor it did not make"}[why] in refused[1]


def test_another_state_records_anew(launches: list[tuple[Any, ...]]) -> None:
    toy, plans = Toy(), R.Plans()
    x, w = torch.randn(64), torch.randn(16, 8)
    for _ in range(3):
        plans.call("key", ("a",), (x, w), lambda: toy(x, w))
    first = plans.memo["key"]
    toy.grid = 5  # the call's launches change with the state
    plans.call("key", ("b",), (x, w), lambda: toy(x, w))
    assert plans.memo["key"] is not first and plans.memo["key"].state == ("b",)
    plans.call("key", ("b",), (x, w), lambda: toy(x, w))
    assert launches[-1][0] == 2 and launches[-2][0] == 5


def test_check_spec_raises_where_a_key_no_longer_determines_the_launches(
        launches: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    toy, plans = Toy(), R.Plans()
    x, w = torch.randn(64), torch.randn(16, 8)
    for _ in range(3):
        plans.call("key", (), (x, w), lambda: toy(x, w))
    plan = plans.memo["key"]
    assert type(plan) is R.Plan
    monkeypatch.setattr(L, "CHECK_SPEC", True)
    before = len(launches)
    plans.call("key", (), (x, w), lambda: toy(x, w))  # checked (a dry run), then replayed
    assert len(launches) == before + 2 and plans.memo["key"] is plan, "checked, replayed: the dry run launched nothing"
    toy.fn._opreg_launch_cache.clear()  # its kernels left the launch cache: the plan is dropped
    out = plans.call("key", (), (x, w), lambda: toy(x, w))
    assert "key" not in plans.memo and toy.fn.compiled == 5 and torch.isnan(out).all()
    for _ in range(2):
        plans.call("key", (), (x, w), lambda: toy(x, w))
    assert type(plans.memo["key"]) is R.Plan
    toy.grid = 5  # a change the key and state do not see
    with pytest.raises(RuntimeError, match="no longer matches"):
        plans.call("key", (), (x, w), lambda: toy(x, w))


def test_threads_record_their_own_launches(launches: list[tuple[Any, ...]]) -> None:
    """Two threads recording at once (their calls interleaved at a barrier) each get their
    own call's launches, none of the other's."""
    import threading

    toys, plans = [Toy(), Toy()], [R.Plans(), R.Plans()]
    x, w = torch.randn(64), torch.randn(16, 8)
    for toy in toys:
        for _ in range(2):  # compiled and cached
            toy(x, w)
    meet = threading.Barrier(2)

    def body(toy: Toy) -> torch.Tensor:
        meet.wait()  # both recordings open
        out = toy(x, w)
        meet.wait()  # both calls launched before either recording closes
        return out

    threads = [threading.Thread(target=lambda j=j: plans[j].call("key", (), (x, w), lambda: body(toys[j])))
               for j in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for toy, p in zip(toys, plans):
        plan = p.memo["key"]
        own = {id(entry[2].c_launch) for entry in toy.fn._opreg_launch_cache.values()}  # its kernels' launchers
        assert type(plan) is R.Plan and len(plan.launches) == 2
        assert all(id(c) in own for c, *_ in plan.launches), "another thread's launch was recorded"
