"""The generic op harness (:class:`OpTestSuite`); see :mod:`opreg.testing`."""
from __future__ import annotations

import contextlib
import inspect
import re
from typing import Any, Callable, ContextManager, Iterable, Mapping, Sequence

import torch

from .. import registry
from .compare import (FLOAT_DTYPES, Args, BadCase, Sample, SampleFn, Unavailable, assert_outputs_match,
                      assert_same_bits, grad_leaves, grads_wrt, map_tensors, need_device, outputs, poison,
                      samples_from_list, tensors, to_float64)

__all__ = ["OpTestSuite"]


# ----------------------------------------------------------------------------- suite

class OpTestSuite:
    """The generic checks of one op over ``samples(device, dtype, requires_grad=False)``
    (an iterable of :class:`Sample` or argument tuples; fresh random values per call), or
    over a fixed list of them (moved to the device, floats cast to the dtype; the CUDA-graph
    check rescales their floats in place).

    ``bad``: bad-input rows, applied to ``bad_sample(device)`` (default: the first
    float32 sample) inside ``bad_context()`` (e.g. ``opreg.check_indices``).
    ``small_samples``: the few small samples gradcheck and opcheck run on (they cost per
    element and per call; default: the samples with at most 256 float elements).
    ``thread_invariant``: implementations whose CPU results must not depend on the
    thread count; ``not_deterministic``: {implementation: why} exempt from determinism
    (reported as a skip). ``reference``: default the op's own.
    """

    def __init__(self, op: str, samples: SampleFn | Sequence[Any], *, bad: Sequence[BadCase] = (),
                 bad_sample: Callable[[str], Any] | None = None,
                 bad_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 dtypes: Sequence[torch.dtype] = FLOAT_DTYPES, small_samples: SampleFn | None = None,
                 thread_invariant: Sequence[str] = (), not_deterministic: Mapping[str, str] | None = None,
                 reference: Callable[..., Any] | None = None) -> None:
        self.op = op
        self._op = registry.lookup(op)
        self.samples_fn = samples if callable(samples) else samples_from_list(list(samples))
        self.bad = list(bad)
        self.bad_sample = bad_sample
        self.bad_context = bad_context
        self.dtypes = tuple(dtypes)
        self.small_fn = small_samples
        self.thread_invariant = frozenset(thread_invariant)
        self.not_deterministic = dict(not_deterministic or {})
        self.reference = reference or self._op.reference

    # ------------------------------------------------------------------ plumbing

    def implementations(self, device: str, dtype: torch.dtype | None = None) -> list[str]:
        """``"default"`` and every registered implementation that runs on ``device``
        (and ``dtype``), whether or not it is available on this machine."""
        names = ["default"]
        for name, impl in self._op.impls.items():
            if impl.supports(device) and (dtype is None or impl.dtypes is None or dtype in impl.dtypes):
                names.append(name)
        return names

    def samples(self, device: str, dtype: torch.dtype, requires_grad: bool = False,
                fn: SampleFn | None = None) -> list[Sample]:
        need_device(device)
        got = (fn or self.samples_fn)(device, dtype, requires_grad=requires_grad)
        return [s if isinstance(s, Sample) else Sample(tuple(s)) for s in got]

    def _impls(self, device: str, dtype: torch.dtype | None, impl: str | None,
               dispatch: bool = False) -> list[str]:
        """The named one (Unavailable if it can't run here), or all that can; for checks
        through the dispatcher (``dispatch``), not the one "default" runs a second time."""
        need_device(device)
        names = self.implementations(device, dtype)
        why = {n: self._op.impls[n].unavailable(device) for n in names if n != "default"}
        if impl is None:
            twin = self.default_impl(device) if dispatch else None
            return [n for n in names if not why.get(n) and n != twin]
        if impl not in names or why.get(impl):
            raise Unavailable(f"{self.op}/{impl} can't run on {device}/{dtype}: {why.get(impl, 'not for it')}")
        return [impl]

    def default_impl(self, device: str) -> str:
        """The implementation the dispatcher runs by default on ``device`` now."""
        return registry.resolve(self.op, device).name

    def runner(self, impl: str) -> Callable[..., Any]:
        """The callable ``impl`` names: the dispatcher for "default", else ``opreg.get``."""
        return self._op.torch_op if impl == "default" else registry.get(self.op, impl=impl)

    def scope(self, impl: str) -> ContextManager[Any]:
        """Bind ``impl`` into the dispatcher for a block (nothing for "default")."""
        return contextlib.nullcontext() if impl == "default" else registry.use(**{self.op: impl})

    def _ref64(self, s: Sample, keep_grad: bool = False) -> tuple[Args, list[torch.Tensor]]:
        args = to_float64(s.args, keep_grad)
        return args, outputs(self.reference(*args))

    # ------------------------------------------------------------------ checks

    def _run(self, what: str, impls: list[str], samples: Iterable[Sample],
             once: Callable[[str, Sample], None]) -> None:
        """``once(impl, sample)`` for every pair; one AssertionError listing all that
        failed (an implementation raising on valid input fails too), or if none ran."""
        failed, ran = [], 0
        for s in samples:
            for name in impls:
                ran += 1
                try:
                    once(name, s)
                except Exception as e:
                    failed.append(f"  {name} {s.label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if ran == 0:
            raise AssertionError(f"{self.op} {what}: nothing to check (a check that cannot fail)")
        if failed:
            raise AssertionError(f"{self.op} {what}: {len(failed)} of {ran} failed\n" + "\n".join(failed))

    def check_correctness(self, device: str, dtype: torch.dtype, impl: str | None = None) -> None:
        """Every sample, every implementation, against the float64 reference."""
        def once(name: str, s: Sample) -> None:
            want = self._ref64(s)[1]
            before = [t.clone() for t in tensors(s.args)]
            poison(max(w.numel() for w in want) * dtype.itemsize, device)
            got = outputs(self.runner(name)(*s.args))
            assert_outputs_match(got, want, [s.dtype or dtype] * len(want))
            if not all(torch.equal(b, t) for b, t in zip(before, tensors(s.args), strict=True)):
                raise AssertionError("an input was modified")

        self._run(f"correctness on {device}/{dtype}", self._impls(device, dtype, impl),
                  self.samples(device, dtype), once)

    def check_gradients(self, device: str, impl: str | None = None) -> None:
        """float32 gradients (random output cotangents) against the float64 reference's."""
        def once(name: str, s: Sample) -> None:
            args64, want = self._ref64(s, keep_grad=True)
            cot = [torch.randn_like(w) for w in want]
            with self.scope(name):
                out = outputs(self._op.torch_op(*s.args))
            got = grads_wrt(out, grad_leaves(s.args), [c.to(o.dtype) for c, o in zip(cot, out, strict=True)])
            assert_outputs_match(got, grads_wrt(want, grad_leaves(args64), cot), [t.dtype for t in got])

        samples = [s for s in self.samples(device, torch.float32, True) if grad_leaves(s.args)]
        self._run(f"gradients on {device}", self._impls(device, torch.float32, impl, True), samples, once)

    def _small(self, device: str, dtype: torch.dtype, requires_grad: bool) -> list[Sample]:
        if self.small_fn is not None:
            return self.samples(device, dtype, requires_grad, self.small_fn)
        return [s for s in self.samples(device, dtype, requires_grad)
                if sum(t.numel() for t in tensors(s.args) if t.is_floating_point()) <= 256]

    def check_gradcheck(self, device: str, impl: str | None = None) -> None:
        """``torch.autograd.gradcheck`` in float64 on the small samples."""
        def once(name: str, s: Sample) -> None:
            leaves = grad_leaves(s.args)
            if not leaves:
                raise AssertionError("no input requires grad (sample_inputs ignored requires_grad?)")

            def fn(*xs: torch.Tensor) -> Any:
                swap = {id(a): b for a, b in zip(leaves, xs, strict=True)}
                return self._op.torch_op(*map_tensors(lambda t: swap.get(id(t), t), s.args))

            with self.scope(name):
                torch.autograd.gradcheck(fn, tuple(leaves), raise_exception=True)

        self._run(f"gradcheck on {device}", self._impls(device, torch.float64, impl, True),
                  self._small(device, torch.float64, True), once)

    def check_opcheck(self, device: str, impl: str | None = None) -> None:
        """``torch.library.opcheck`` on the small float32 samples, with and without grad."""
        def once(name: str, s: Sample) -> None:
            with self.scope(name):
                torch.library.opcheck(self._op.torch_op, s.args)

        samples = self._small(device, torch.float32, False) + self._small(device, torch.float32, True)
        self._run(f"opcheck on {device}", self._impls(device, torch.float32, impl, True), samples, once)

    def check_deterministic(self, device: str, dtype: torch.dtype = torch.float32,
                            impl: str | None = None) -> None:
        """The same bits on a second call (and, on the CPU for the implementations named
        in ``thread_invariant``, on one thread)."""
        if impl in self.not_deterministic:
            raise Unavailable(f"{self.op}/{impl} is not deterministic: {self.not_deterministic[impl]}")
        impls = [n for n in self._impls(device, dtype, impl) if n not in self.not_deterministic]
        self._run(f"determinism on {device}/{dtype}", impls,
                  self.samples(device, dtype), lambda name, s: assert_same_bits(
                      self.runner(name), s.args, device == "cpu" and name in self.thread_invariant))

    def check_bad_input(self, device: str, case: str | None = None, impl: str | None = None) -> None:
        """Each bad-input row (or the one named ``case``) raises the same exception type,
        naming the argument, in every implementation."""
        rows = [b for b in self.bad if case is None or b[0] == case]
        need_device(device)
        base = self.bad_sample(device) if self.bad_sample else self.samples(device, torch.float32)[0]
        base_args = base.args if isinstance(base, Sample) else tuple(base)
        bad = [Sample(tuple(mutate(*base_args)), what) for what, mutate, _, _ in rows]
        expect = {what: (exc, words) for what, _, exc, words in rows}
        self._run(f"bad input on {device}", self._impls(device, None, impl), bad,
                  lambda name, s: self._raises(self.runner(name), s.args, *expect[s.name], device))

    def _raises(self, run: Callable[..., Any], args: Args, exc: type[BaseException],
                words: str, device: str) -> None:
        try:
            with self.bad_context():
                run(*args)
                if device == "cuda":
                    torch.cuda.synchronize()  # a kernel-side check reports here
        except exc as e:
            if not re.search(words, str(e)):
                raise AssertionError(f"{type(e).__name__} not matching {words!r}: {e}") from None
            return
        except Exception as e:
            raise AssertionError(f"raised {type(e).__name__}, expected {exc.__name__}: {e}") from None
        raise AssertionError(f"did not raise {exc.__name__}")

    def check_cuda_graphs(self, dtype: torch.dtype = torch.float32) -> None:
        """The default path captured in a CUDA graph; the float inputs rescaled in place
        (signs and ranges kept); replayed: the result is the float64 reference's on the
        new values, and differs from the first call's."""
        self._run(f"CUDA graphs/{dtype}", ["default"], self.samples("cuda", dtype),
                  lambda _, s: self._graph_once(s, s.dtype or dtype))

    def _graph_once(self, s: Sample, dtype: torch.dtype) -> None:
        op = self._op.torch_op
        eager = [o.clone() for o in outputs(op(*s.args))]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            op(*s.args)  # warm-up off the capture (allocator, lazy initialisation)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = outputs(op(*s.args))
        old = self._ref64(s)[1]
        with torch.no_grad():
            for t in tensors(s.args):
                if t.is_floating_point():
                    t.mul_(0.5 + torch.rand_like(t))
        graph.replay()
        torch.cuda.synchronize()
        new = self._ref64(s)[1]
        assert_outputs_match(captured, new, [dtype] * len(captured))
        for c, e, o, n in zip(captured, eager, old, new, strict=True):
            if torch.equal(c, e) and not torch.equal(o, n):  # (an output that can't change may not)
                raise AssertionError("the replay did not recompute (same result as before)")

    # ------------------------------------------------------------------ pytest

    def _unless_default(self, check: Callable[..., None]) -> Callable[..., None]:
        """``check``, except for the implementation "default" already runs (same path)."""
        def run(device: str, impl: str) -> None:
            if impl != "default" and impl == self.default_impl(device):
                raise Unavailable(f"{impl} is what {device}-default runs (checked there)")
            check(device, impl)

        run.__doc__ = check.__doc__
        return run

    def pytest_tests(self, prefix: str = "", devices: Sequence[str] = ("cpu", "cuda"),
                     device_marks: Mapping[str, Sequence[Any]] | None = None) -> dict[str, Any]:
        """Parametrized pytest test functions, ``test_<prefix><check>``, for a test
        module's ``globals().update(...)``: per (device, implementation registered now)
        and dtype; a check with nothing to run here is skipped, with the reason."""
        import pytest  # only here: importing opreg.testing must not need pytest

        def marks(d: str) -> list[Any]:
            got = list((device_marks or {}).get(d, ()))
            if d == "cuda":
                got.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))
            return got

        pairs = [pytest.param(d, i, marks=marks(d), id=f"{d}-{i}")
                 for d in devices for i in self.implementations(d)]
        dtypes = [pytest.param(t, id=str(t).removeprefix("torch.")) for t in self.dtypes]
        cases = [pytest.param(b[0], id=b[0]) for b in self.bad]
        tests = {
            "correctness": (self.check_correctness, {"device,impl": pairs, "dtype": dtypes}),
            "gradients": (self._unless_default(self.check_gradients), {"device,impl": pairs}),
            "gradcheck": (self._unless_default(self.check_gradcheck), {"device,impl": pairs}),
            "opcheck": (self._unless_default(self.check_opcheck), {"device,impl": pairs}),
            "deterministic": (self.check_deterministic, {"device,impl": pairs}),
            "bad_input": (self.check_bad_input, {"device": [pytest.param(d, marks=marks(d), id=d) for d in devices],
                                                 "case": cases}),
            "cuda_graphs": (self.check_cuda_graphs, {"dtype": [pytest.param(*p.values, marks=marks("cuda"), id=p.id)
                                                               for p in dtypes]}),
        }
        if not self.bad:
            del tests["bad_input"]
        if "cuda" not in devices:
            del tests["cuda_graphs"]
        return {f"test_{prefix}{k}": _pytest_test(pytest, f"test_{prefix}{k}", fn, params)
                for k, (fn, params) in tests.items()}


def _pytest_test(pytest: Any, name: str, check: Callable[..., None], params: Mapping[str, list[Any]]) -> Any:
    """A test function ``name(<params>)`` calling ``check``, skipping on Unavailable."""
    argnames = [a for names in params for a in names.split(",")]

    def test(**kw: Any) -> None:
        try:
            check(**kw)
        except Unavailable as e:
            pytest.skip(str(e))

    test.__name__ = test.__qualname__ = name
    test.__doc__ = check.__doc__
    test.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(a, inspect.Parameter.KEYWORD_ONLY) for a in argnames])
    for names, values in params.items():
        test = pytest.mark.parametrize(names, values)(test)
    return test


