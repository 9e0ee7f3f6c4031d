"""The eager MoE expert loop (issue 13, item 3): ``opreg.optimize`` rewrites HF
transformers' eager experts (Mixtral, Qwen3-MoE) and the loops people write themselves
(range over experts, ``self.experts[e]`` MLPs, ``where``/``nonzero``, ids == e) into one
grouping and one ``scatter_combine``, with outputs and gradients equal to eager in
float64; and leaves every loop it can't prove row-wise, with the reason ``explain``
prints (row reductions, state mutation, value branches, non-fresh outputs, gates
normalised across rows, values used after the loop). Run-time misfits run the loop."""
from __future__ import annotations

import copy
import importlib.util
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opreg
from opreg.loops import find_loops, rewrite_function, rewrite_loops

OP = "opreg::scatter_combine"
T, H, FFN, E, K = 9, 6, 5, 4, 2


def ops_ran(fn: Any) -> tuple[Any, set[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("opreg::")}


def routing(t: int, e: int, k: int, sentinel: bool = False,
            min_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k ids (t, k) and gates; redrawn until every expert has min_rows rows."""
    while True:
        ids = torch.stack([torch.randperm(e + sentinel)[:k] for _ in range(t)])
        if min_rows == 0 or torch.bincount(ids.flatten(), minlength=e)[:e].min() >= min_rows:
            return ids, torch.rand(t, k, dtype=torch.float64)


def grads(out: torch.Tensor, leaves: list[torch.Tensor], cot: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, leaves, cot, allow_unused=True, materialize_grads=True))


def assert_close(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ============================================================ HF transformers' experts

def hf_eager(family: str) -> tuple[nn.Module, int, int]:
    """(an HF experts module whose forward is the class's own eager loop, E, k), float64."""
    transformers = pytest.importorskip("transformers")
    if family == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as mod
        cls, cfg = mod.MixtralExperts, transformers.MixtralConfig(
            hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=K)
    else:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as mod
        cls, cfg = mod.Qwen3MoeExperts, transformers.Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=FFN, num_experts=E, num_experts_per_tok=K)
    # The class's forward dispatches on config._experts_implementation (a decorator the
    # rewriter leaves alone); its "eager" implementation is the loop, the undecorated forward.
    eager = type(f"Eager{cls.__name__}", (cls,), {"forward": cls.forward.__wrapped__})
    m = eager(cfg).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.4)
    return m, E, K


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("sentinel", [False, True], ids=["", "ep_sentinel"])
def test_hf_eager_experts(family: str, sentinel: bool) -> None:
    m, e, k = hf_eager(family)
    ref = copy.deepcopy(m)
    found = rewrite_loops(m)
    assert [(f.matched, f.idiom, f.op) for f in found] == [(True, "experts", OP)], found
    assert "modeling_" in found[0].file and found[0].code == "expert_idx = expert_idx[0]"
    for _ in range(3):  # fresh routing each time
        x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
        ids, w = routing(T, e, k, sentinel)  # sentinel: id E (an expert on another rank) is skipped
        w.requires_grad_(True)
        try:
            want = ref(x, ids, w)
        except RuntimeError as err:
            # transformers < 5.2x: the eager block's one_hot(num_classes=E), before the loop,
            # refuses the sentinel id E. The rewritten module must do what the original does.
            assert sentinel and "num_classes" in str(err), err
            with pytest.raises(RuntimeError, match="num_classes"):
                m(x, ids, w)
            continue
        got, ran = ops_ran(lambda x=x, ids=ids, w=w: m(x, ids, w))
        assert OP in ran
        assert_close(got, want)
        cot = torch.randn_like(want)
        assert_close(grads(got, [x, w, *m.parameters()], cot), grads(want, [x, w, *ref.parameters()], cot))


def test_hf_eager_experts_under_optimize() -> None:
    m, e, k = hf_eager("qwen3_moe")
    ref = copy.deepcopy(m)
    fast = opreg.optimize(m, options={"inner": "eager"})
    for t in (T, 5):
        x = torch.randn(t, H, dtype=torch.float64)
        ids, w = routing(t, e, k)
        got, ran = ops_ran(lambda x=x, ids=ids, w=w: fast(x, ids, w))
        assert OP in ran
        assert_close(got, ref(x, ids, w))


# ============================================================== hand-written loops

class MLP(nn.Module):
    """Mixtral's old per-expert MLP: w2(act(w1 x) * w3 x)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN), nn.Linear(FFN, H)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        current = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current)


class RangeExperts(nn.Module):
    """range over experts, ``where(ids == e)``, an empty-expert guard, Sequential experts."""

    def __init__(self, make: Any = None) -> None:
        super().__init__()
        make = make or (lambda: nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H)))
        self.experts = nn.ModuleList(make() for _ in range(E))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape)
        for e in range(len(self.experts)):
            tok, pos = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            h = self.experts[e](x[tok])
            out.index_add_(0, tok, h * w[tok, pos, None])
        return out


class MaskExperts(nn.Module):
    """The one-hot mask, nonzero(as_tuple=True), the expert bound to a name, gate first."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(MLP() for _ in range(E))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        final = torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype)
        expert_mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        for expert_idx in range(E):
            idx, top_x = torch.nonzero(expert_mask[expert_idx], as_tuple=True)
            expert_layer = self.experts[expert_idx]
            current_state = x[top_x]
            current = w[top_x, idx, None] * expert_layer(current_state)
            final.index_add_(0, top_x, current.to(final.dtype))
        return final


class WeightExperts(nn.Module):
    """3-D weights, matmuls, chunk, a list of ids, method-style nonzero."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(E, H, 2 * FFN) * 0.4)
        self.down = nn.Parameter(torch.randn(E, FFN, H) * 0.4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in [0, 1, 3]:  # expert 2 is never run
            tok, pos = (ids == e).nonzero(as_tuple=True)
            g, u = (x[tok] @ self.up[e]).chunk(2, dim=-1)
            h = (torch.tanh(g) * u) @ self.down[e]
            h = h * w[tok, pos][:, None]
            out.index_add_(0, tok, h)
        return out


@pytest.mark.parametrize("make", [RangeExperts, lambda: RangeExperts(MLP), MaskExperts, WeightExperts],
                         ids=["range_sequential", "range_mlp", "mask_nonzero", "weights_list"])
def test_hand_written_loops(make: Any) -> None:
    torch.manual_seed(0)
    m = make().double()
    ref = copy.deepcopy(m)
    found = rewrite_loops(m)
    assert [(f.matched, f.idiom) for f in found if f.idiom == "experts"] == [(True, "experts")], found
    for t in (T, 3):
        x = torch.randn(t, H, dtype=torch.float64, requires_grad=True)
        ids, w = routing(t, E, K)
        got, ran = ops_ran(lambda x=x, ids=ids, w=w: m(x, ids, w))
        want = ref(x, ids, w)
        assert OP in ran
        assert_close(got, want)
        cot = torch.randn_like(want)
        assert_close(grads(got, [x, *m.parameters()], cot), grads(want, [x, *ref.parameters()], cot))


class ItemExperts(nn.Module):
    """Nemotron-H's form: the hit experts as a tensor of ids, ``e = e.item()``, an empty
    guard, an ungated MLP; the loop variable is read after the loop."""

    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        self.squeeze = squeeze
        self.up = nn.Parameter(torch.randn(E, FFN, H) * 0.4)
        self.down = nn.Parameter(torch.randn(E, H, FFN) * 0.4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        out = torch.zeros_like(x, dtype=w.dtype)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        hit = hit.squeeze(-1) if self.squeeze else hit
        for e in hit:
            e = e.item()
            pos, tok = torch.where(mask[e])
            if tok.numel() == 0:
                continue
            h = F.linear(F.relu(F.linear(x[tok], self.up[e])), self.down[e])
            h = h * w[tok, pos, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out, e


@pytest.mark.parametrize("squeeze", [True, False], ids=["ids_1d", "ids_n_by_1"])
def test_item_unpack(squeeze: bool) -> None:
    m = ItemExperts(squeeze).double()
    ref = copy.deepcopy(m)
    found = rewrite_loops(m)
    assert [(f.matched, f.idiom, f.code) for f in found] == [(True, "experts", "e = e.item()")], found
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    ids, w = routing(T, E, K)
    (got, last), ran = ops_ran(lambda: m(x, ids, w))
    want, want_last = ref(x, ids, w)
    assert OP in ran and type(last) is int and last == want_last == int(ids.max())
    assert_close(got, want)
    cot = torch.randn_like(want)
    assert_close(grads(got, [x, *m.parameters()], cot), grads(want, [x, *ref.parameters()], cot))


def test_runtime_misfit_runs_the_loop() -> None:
    """A BatchNorm expert (normalises over the rows) is seen only at run time: the guard
    runs the user's loop, so nothing changes and scatter_combine doesn't run."""
    m = RangeExperts(lambda: nn.Sequential(nn.Linear(H, FFN), nn.BatchNorm1d(FFN), nn.Linear(FFN, H))).double()
    ref = copy.deepcopy(m)
    assert [f.matched for f in rewrite_loops(m)] == [True]
    x = torch.randn(T, H, dtype=torch.float64)
    ids, w = routing(T, E, K, min_rows=2)  # BatchNorm in training needs 2 rows per expert
    got, ran = ops_ran(lambda x=x, ids=ids, w=w: m(x, ids, w))
    assert OP not in ran
    assert_close(got, ref(x, ids, w))


# ========================================================================= traps

TRAP = """
import torch
import torch.nn.functional as F

def experts(x, ids, w, w1, w2, log):
    {make}
    for e in range(w1.shape[0]):
        tok, pos = torch.where(ids == e)
        cur = x[tok]
        h = F.silu(cur @ w1[e].T) @ w2[e].T
        {extra}
        h = h * {gate}
        out.index_add_(0, tok, h.to(out.dtype))
    return {ret}
"""
BASE = dict(make="out = torch.zeros_like(x)", extra="h = +h", gate="w[tok, pos, None]", ret="out")
TRAPS = {  # name: (what changes, a word of the reason)
    "row_mean": (dict(extra="h = h - h.mean(0)"), "mean"),
    "layer_norm_rows": (dict(extra="h = F.layer_norm(h, h.shape)"), "layer_norm"),
    "shape_of_rows": (dict(extra="h = h / h.shape[0]"), "all the rows"),
    "append": (dict(extra="log.append(h)"), "only plain assignments"),
    "counter": (dict(extra="log[0] += 1"), "only plain assignments"),
    "branch": (dict(extra="if cur.sum() > 0: h = h * 2"), "only plain assignments"),
    "not_fresh": (dict(make="out = log[1]"), "not a fresh tensor"),
    "not_zeros": (dict(make="out = torch.ones_like(x)"), "zeros"),
    "gates_across_rows": (dict(gate="w[tok, pos].softmax(0)[:, None]"), "softmax"),
    "gates_by_column": (dict(gate="w[:, pos].sum(0)[:, None]"), "first index"),
    "used_after": (dict(ret="out, cur"), "cur, which the loop body binds"),
}


def _module(tmp_path: Any, name: str, src: str) -> Any:
    path = tmp_path / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _trap_args() -> list[Any]:
    ids, w = routing(T, E, K)
    x = torch.randn(T, H, dtype=torch.float64)
    return [x, ids, w, torch.randn(E, FFN, H, dtype=torch.float64), torch.randn(E, H, FFN, dtype=torch.float64),
            [0, torch.zeros(T, H, dtype=torch.float64)]]


def test_trap_base_is_rewritten(tmp_path: Any) -> None:
    fn = _module(tmp_path, "experts_trap_base", TRAP.format(**BASE)).experts
    new, found = rewrite_function(fn)
    assert [f.matched for f in found] == [True]
    args = _trap_args()
    got, ran = ops_ran(lambda: new(*copy.deepcopy(args)))
    assert OP in ran
    assert_close(got, fn(*args))


@pytest.mark.parametrize("trap", sorted(TRAPS))
def test_traps_are_left_with_the_reason(tmp_path: Any, trap: str) -> None:
    change, word = TRAPS[trap]
    fn = _module(tmp_path, f"experts_trap_{trap}", TRAP.format(**{**BASE, **change})).experts
    found = find_loops(fn)
    assert [f.matched for f in found] == [False], found
    assert word in found[0].reason, found[0].reason
    new = opreg.optimize(fn, compile=False)
    args = _trap_args()
    got, ran = ops_ran(lambda: new(*copy.deepcopy(args)))
    assert OP not in ran
    torch.testing.assert_close(got, fn(*copy.deepcopy(args)), rtol=0, atol=0)
