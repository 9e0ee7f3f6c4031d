"""The backend's timed choice per graph (opreg/compile/choose.py): the fastest of the
rewritten and the captured graph, each eager or through Inductor; never timed where a rerun
would repeat a write; training timed without touching ``.grad``."""
from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from opreg.compile import choose


class Head(nn.Module):
    """LayerNorm -> cat of R slices -> Linear: the issue's head, tiny."""

    def __init__(self, r: int = 4, d: int = 8, k: int = 12) -> None:
        super().__init__()
        self.r = r
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(r * d, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.proj(torch.cat([x[i] for i in range(self.r)], -1))


def compiled(model: nn.Module, how: str = "time") -> Any:
    torch._dynamo.reset()
    return torch.compile(model, backend="opreg", options={"choose": how})


def test_times_every_candidate_and_runs_the_fastest() -> None:
    torch.manual_seed(0)
    model, x = Head().requires_grad_(False), torch.randn(4, 16, 8)
    before = len(choose.log)
    out = compiled(model)(x)
    torch.testing.assert_close(out, model(x))
    (c,) = choose.log[before:]
    assert set(c.times_ms) == {"rewritten/eager", "rewritten/inductor", "captured/eager", "captured/inductor"}, c
    fastest = min(c.times_ms, key=c.times_ms.__getitem__)
    best_captured = min((k for k in c.times_ms if k.startswith("captured/")), key=c.times_ms.__getitem__)
    rewrite_pays = c.times_ms[fastest] <= (1 - choose.REWRITE_MARGIN) * c.times_ms[best_captured]
    assert c.chosen == (fastest if rewrite_pays else best_captured), c
    assert all(v > 0 for v in c.times_ms.values())
    assert "test_backend_choose.py" in c.where and c.chosen in str(c)


def test_choose_picks_the_fastest_candidate() -> None:
    """The choice itself, on candidates of known speed (one sleeps 3 ms per call)."""
    gm = fx.symbolic_trace(lambda x: x * 2)

    def slow(x: torch.Tensor) -> torch.Tensor:
        time.sleep(3e-3)
        return x * 2

    def fast(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    for order in (("slow", "fast"), ("fast", "slow")):
        fns = {"slow": slow, "fast": fast}
        name, fn, c = choose.choose({k: (lambda f=fns[k]: f) for k in order}, [torch.randn(3)], gm)
        assert name == "fast" and fn is fast, c
        assert c.times_ms["slow"] > 3.0 > c.times_ms["fast"]


@pytest.mark.parametrize("rewrite_ms,wins", [(0.97, False), (0.951, False), (0.949, True), (0.5, True)])
def test_a_rewrite_wins_only_by_the_margin(rewrite_ms: float, wins: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate that is not the captured graph runs only where it is ahead of the fastest
    captured one by REWRITE_MARGIN (5 %): against 1 ms captured, a rewrite at 0.97 or 0.951
    ms leaves the captured graph running, one at 0.949 or 0.5 runs. (The timings are given:
    the rule, not the clock, is under test here.)"""
    gm = fx.symbolic_trace(lambda x: x * 2)
    times = {"rewritten/eager": rewrite_ms, "captured/inductor": 1.4, "captured/eager": 1.0}
    monkeypatch.setattr(choose, "_time", lambda fns, inputs, g: {k: times[k] for k in fns})
    fns = {k: (lambda x, k=k: x * 2) for k in times}
    name, fn, c = choose.choose({k: (lambda f=f: f) for k, f in fns.items()}, [torch.randn(3)], gm,
                                captured=lambda k: k.startswith("captured/"))
    assert name == ("rewritten/eager" if wins else "captured/eager") and fn is fns[name], c
    assert c.chosen == name and ("runs as captured" in c.why) != wins, c
    # without captured candidates named, the fastest runs, as before
    name, _, _ = choose.choose({k: (lambda f=f: f) for k, f in fns.items()}, [torch.randn(3)], gm)
    assert name == "rewritten/eager"


def test_a_candidate_that_fails_is_left_out() -> None:
    gm = fx.symbolic_trace(lambda x: x * 2)

    def broken() -> Any:
        raise RuntimeError("no such compiler")

    name, _, c = choose.choose({"default": lambda: (lambda x: x * 2), "broken": broken}, [torch.randn(3)], gm)
    assert name == "default" and set(c.times_ms) == {"default"}


class Writes(nn.Module):
    def forward(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.add_(1)
        return self_cat(x)


def self_cat(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[0], x[1]], -1) * 2


def test_a_graph_that_writes_is_not_timed() -> None:
    """Running it again would repeat the write: the rules decide, and the log says why."""
    buf = torch.zeros(3)
    before = len(choose.log)
    compiled(Writes())(torch.randn(2, 3, 4), buf)
    assert torch.equal(buf, torch.ones(3))  # written once, not once per timed run
    (c,) = choose.log[before:]
    assert c.chosen.startswith("rules") and not c.times_ms
    assert "writes into an input" in c.why and "add_" in c.why


class Combine(nn.Module):
    """A combine written with index_add_ into a tensor the graph makes itself."""

    def forward(self, h: torch.Tensor, idx: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(8, h.shape[1], dtype=h.dtype)
        return out.index_add_(0, idx, h * g[:, None]) * 2


def test_a_write_into_a_fresh_tensor_is_timed() -> None:
    """Every run makes that tensor afresh: a rerun repeats nothing."""
    h, idx, g = torch.randn(16, 4), torch.arange(8).repeat(2), torch.rand(16)
    before = len(choose.log)
    out = compiled(Combine())(h, idx, g)
    torch.testing.assert_close(out, Combine()(h, idx, g))
    (c,) = choose.log[before:]
    assert c.times_ms, c


class WritesAView(nn.Module):
    def forward(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf[1:].mul_(2)  # a view of an input
        return x * 2


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) * 2  # training mode: the running stats are written


@pytest.mark.parametrize("case", ["view of an input", "batch norm's running stats"])
def test_writes_reaching_inputs_or_attributes_are_not_timed(case: str) -> None:
    before = len(choose.log)
    if case == "view of an input":
        buf = torch.ones(4)
        compiled(WritesAView())(torch.randn(3), buf)
        assert torch.equal(buf, torch.tensor([1.0, 2.0, 2.0, 2.0]))  # once
    else:
        m = Norm()
        compiled(m)(torch.randn(8, 4))
        assert int(m.bn.num_batches_tracked) == 1  # once
    (c,) = choose.log[before:]
    assert c.chosen.startswith("rules") and "not timed" in c.why and "running it again" in c.why, c


def test_training_timed_without_touching_grad() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(4, 16, 8)
    ref = Head()
    ref.load_state_dict(model.state_dict())
    before = len(choose.log)
    out = compiled(model)(x)
    (c,) = choose.log[before:]
    assert c.times_ms, c
    assert all(p.grad is None for p in model.parameters())  # the timing's backwards left no .grad
    out.sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_rules_and_cpu_default_do_not_time() -> None:
    before = len(choose.log)
    model, x = Head().requires_grad_(False), torch.randn(4, 16, 8)
    compiled(model, "rules")(x)
    compiled(model, "auto")(x)  # on the CPU, "auto" leaves it to the rules
    assert choose.log[before:] == []


@pytest.mark.parametrize("options, match", [
    ({"choose": "bogus"}, "choose must be one of"),
    ({"choose": "time", "inner": "inductor"}, "choose='time' picks the inner compiler"),
])
def test_bad_choose_options(options: dict[str, Any], match: str) -> None:
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(lambda x: x + 1, backend="opreg", options=options)(torch.randn(2))


def test_explain_reports_the_choice() -> None:
    """``explain(..., choose=True)`` compiles with the real backend and lists each graph's
    timed candidates and what runs."""
    from opreg.explain import explain

    torch.manual_seed(0)
    model, x = Head().requires_grad_(False), torch.randn(4, 16, 8)
    report = explain(model, [x], print_report=False, choose=True)
    (c,) = report.choices
    assert c.times_ms and c.chosen in c.times_ms
    text = str(report)
    assert "what the backend runs, timed per graph (1):" in text and f"ran {c.chosen}" in text
    assert explain(model, [x], print_report=False).choices == []  # without choose: nothing compiled


def test_not_timed_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several ranks each would time alone and could choose differently: rules."""
    monkeypatch.setattr(choose, "world_size", lambda: 2)
    model, x = Head().requires_grad_(False), torch.randn(4, 16, 8)
    before = len(choose.log)
    out = compiled(model)(x)
    torch.testing.assert_close(out, model(x))
    (c,) = choose.log[before:]
    assert c.chosen.startswith("rules") and "ranks could choose differently" in c.why



def test_not_timed_while_a_cuda_graph_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing synchronizes, which a capture forbids: rules (the check itself, faked here)."""
    gm = fx.symbolic_trace(lambda x: x * 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    why = choose.timing_refusal(gm, [torch.randn(3)], fake_mode=object())
    assert why is not None and "CUDA graph is being captured" in why


def test_the_captured_candidate_keeps_dynamos_metadata() -> None:
    """The captured graph's copy (the "captured/*" candidates) carries what AOTAutograd reads
    to recognise a Dynamo graph: the parameters' sources on the module and each
    placeholder's source. Without them Inductor compiled the copy otherwise than
    torch.compile's own Inductor compiles the same graph (another order of the saved
    tensors, another fusion of the backward's kernels), so "captured/inductor" was not
    what it claims to be."""
    from opreg.compile.backend import _copy

    seen: dict[str, Any] = {}

    def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        seen["gm"], seen["copy"] = gm, _copy(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Head(), backend=backend)(torch.randn(4, 16, 8))
    gm, copy = seen["gm"], seen["copy"]
    assert hasattr(gm, "_param_name_to_source")  # what the copy must carry, as Dynamo made it
    assert copy._param_name_to_source is gm._param_name_to_source
    originals = list(gm.graph.find_nodes(op="placeholder"))
    copies = list(copy.graph.find_nodes(op="placeholder"))
    assert len(originals) == len(copies) == 5  # x and the four parameters
    for a, b in zip(originals, copies, strict=True):
        assert a is not b and b._dynamo_source is a._dynamo_source
