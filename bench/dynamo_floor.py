"""Dynamo's own per-call cost on a small model, beside the opreg backend's (host time, CPU or CUDA).

    python bench/dynamo_floor.py [--device cpu] [--calls 3000]

Issue 19 asks the backend to be within 3 % of min(eager, Inductor) on every model, the seed's
small cat -> Linear model among them. Any ``torch.compile`` backend runs behind Dynamo's
frame hook and guards; this times that floor: the seed's model (``opreg.models.cat_linear``)
eager, under ``torch.compile`` with the ``eager`` backend (Dynamo alone: the captured graph is
the model's own ops), ``aot_eager`` (AOT autograd added) and ``opreg``, with and without
grad; and a backend that raises ``SkipFrame`` (asking Dynamo to run the frame as plain
Python), to show whether a backend can give a graph back to eager at no per-call cost.
Min over rounds of back-to-back calls, µs per call.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

import opreg  # noqa: F401  (registers the "opreg" backend)
from opreg.models import cat_linear as model


def per_call_us(fn: Callable[[], Any], calls: int, rounds: int = 7) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def skip_frame(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """A backend that declines every graph: Dynamo is asked to run the frame as it is."""
    raise torch._dynamo.exc.SkipFrame("dynamo_floor.py: declined")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=3000)
    a = p.parse_args()
    torch.manual_seed(0)
    m = model.Model().to(a.device)
    x = model.get_inputs(a.device)[0]
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    for grad in (True, False):
        row = {}
        with torch.set_grad_enabled(grad):
            row["eager"] = per_call_us(lambda: m(x), a.calls)
            for name, backend in (("dynamo alone", "eager"), ("aot_eager", "aot_eager"), ("opreg", "opreg"),
                                  ("backend raising SkipFrame", skip_frame)):
                torch._dynamo.reset()
                f = torch.compile(m, backend=backend)
                row[name] = per_call_us(lambda: f(x), a.calls)
            sync()
        print(f"{'grad' if grad else 'no grad'}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
              + f" us a call (torch {torch.__version__}, {a.device})")


if __name__ == "__main__":
    main()
