"""A generic test harness for an opreg op and all its implementations, public so that
plug-in authors can run it on theirs (``opreg.register_impl``, ``opreg.register_op``).

Given an op's name and ``sample_inputs(device, dtype, requires_grad=False)`` (or a list of
samples), :class:`OpTestSuite` checks the default dispatcher path (``"default"``) and
every implementation registered for a device: correctness against the reference run in
float64 (per-dtype :data:`TOL`, output memory poisoned, inputs left unchanged), float32
gradients against the reference's, ``gradcheck`` (float64, first order), ``opcheck``,
determinism (same bits twice), bad-input parity (every implementation raises the same
exception type, naming the argument) and, on CUDA, graph capture and replay.

Correctness, determinism and bad input call ``opreg.get(op, impl=name)``; gradients,
gradcheck and opcheck call ``torch.ops.opreg.<op>`` inside ``opreg.use(<op>=name)``, the
path a model takes (the autograd is the op's). A ``check_*`` method raises AssertionError
listing every failing (implementation, sample), or :class:`Unavailable` when there is
nothing to check on this machine. Example, a pytest file::

    import torch, opreg.testing as ot

    def samples(device, dtype, requires_grad=False):
        for n in (0, 1, 7, 64):
            x = torch.randn(n, 8, dtype=dtype, device=device, requires_grad=requires_grad)
            yield ot.Sample((x, 1e-6), name=f"n={n}")

    BAD = [("x rank", lambda x, eps: (x.sum(), eps), ValueError, "x")]
    SUITE = ot.OpTestSuite("rms_scale", samples, bad=BAD)
    globals().update(SUITE.pytest_tests())   # test_correctness, test_opcheck, ...

or by hand: ``SUITE.check_correctness("cpu", torch.float32, impl="mine")``. Importing this
module does not import pytest (only :meth:`OpTestSuite.pytest_tests` does), and opreg
itself never imports it.
"""
from __future__ import annotations

from .compare import (FLOAT_DTYPES, TOL, BadCase, Sample, Unavailable, assert_matches, describe,
                      map_tensors, outputs, poison, tensors, to_float64)
from .suite import OpTestSuite

__all__ = ["FLOAT_DTYPES", "TOL", "BadCase", "OpTestSuite", "Sample", "Unavailable", "assert_matches",
           "describe", "map_tensors", "outputs", "poison", "tensors", "to_float64"]
