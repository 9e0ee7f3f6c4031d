"""transformers integration: the experts module's gate is recognised from what the module
is (its gate method is transformers' own, its activation a known class or function with no
state or hooks), never by calling it, and re-checked on every call. Everything opreg can't
prove runs transformers' own experts, with one log line naming why. Tiny modules, float64,
against HF eager."""
from __future__ import annotations

import copy
import functools
import logging
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import opreg  # noqa: E402
import opreg.integrations.transformers as oi  # noqa: E402  (registers "opreg")
from opreg.ops import moe_experts_grouped as G  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: E402

from _util import assert_matches  # noqa: E402

E, H, INTER, K, T = 4, 16, 12, 2, 9  # experts, hidden, intermediate, top-k, tokens


def experts(cls: type = MixtralExperts, impl: str = "opreg", dtype: torch.dtype = torch.float64,
            scale: float = 0.3) -> nn.Module:
    """A tiny experts module of ``cls`` (Mixtral's or GPT-OSS's config), random weights."""
    if issubclass(cls, GptOssExperts):
        config = transformers.GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                                           num_experts_per_tok=K, head_dim=8)
    else:
        config = transformers.MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                                            num_experts_per_tok=K)
    m = cls(config).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, scale)
    return set_impl(m, impl)


def set_impl(m: nn.Module, impl: str) -> nn.Module:
    m.config = copy.copy(m.config)  # each module its own implementation
    m.config._experts_implementation = impl
    return m


def set_act(m: nn.Module, act) -> None:
    """m.act_fn = act, a module or a plain function (which can't replace a child module)."""
    if hasattr(m, "act_fn"):
        del m.act_fn
    m.act_fn = act


def eager_twin(m: nn.Module) -> nn.Module:
    """The same module (weights, activation, attributes) on HF's eager experts."""
    twin = copy.deepcopy(m)
    twin.__dict__.pop("forward", None)  # opreg.optimize's rewrite
    return set_impl(twin, "eager")


def inputs(dtype: torch.dtype = torch.float64, scale: float = 1.0):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return (torch.randn(T, H, dtype=dtype) * scale, ids, torch.rand(T, K, dtype=dtype))


def ops_run(fn) -> tuple[torch.Tensor, set[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("opreg::")}


def same_as_eager(m: nn.Module, call, dtype: torch.dtype = torch.float64) -> set[str]:
    """m(*call) equals HF eager on the same module (float64 reference); the opreg ops that ran."""
    ref = eager_twin(m).double()
    with torch.no_grad():
        got, ops = ops_run(lambda: m(*call))
        want = ref(*(t.double() if t.is_floating_point() else t for t in call))
    assert_matches(got, want, dtype)
    return ops


OPREG = "opreg::moe_experts"


# ------------------------------------------------------------------ re-checked on every call

def test_swap_act_fn_after_the_first_call():
    m, call = experts(), inputs()
    assert OPREG in same_as_eager(m, call)
    set_act(m, nn.GELU(approximate="tanh"))            # another of the op's gates: opreg, the new one
    assert OPREG in same_as_eager(m, call)
    assert oi.plan_for(m) == oi.Plan("gelu_tanh", True)
    set_act(m, nn.Tanh())                              # none of the op's: transformers' own
    assert OPREG not in same_as_eager(m, call)
    assert oi.plan_for(m) is None
    set_act(m, ACT2FN["silu"])                         # and back
    assert OPREG in same_as_eager(m, call)


def test_swap_act_fn_after_optimize():
    m, call = experts(impl="eager"), inputs()
    opreg.optimize(m, compile=False)
    assert [(f.matched, f.op) for f in m._opreg_loops] == [(True, OPREG)]
    assert OPREG in same_as_eager(m, call)
    set_act(m, nn.Tanh())                              # the rewrite must not keep computing SiLU
    assert OPREG not in same_as_eager(m, call)
    set_act(m, nn.ReLU())
    assert OPREG in same_as_eager(m, call)


def test_gpt_oss_limit_and_alpha_read_per_call():
    m, call = experts(GptOssExperts, scale=1.0), inputs(scale=3.0)
    assert OPREG in same_as_eager(m, call)
    assert oi.plan_for(m) == oi.Plan("gpt_oss", True, True, pytest.approx(1.702), 7.0)
    m.limit = 0.5
    assert OPREG in same_as_eager(m, call)
    m.alpha = 0.9
    assert OPREG in same_as_eager(m, call)
    assert oi.plan_for(m) == oi.Plan("gpt_oss", True, True, 0.9, 0.5)
    m.limit = math.inf                                # no clamp
    assert OPREG in same_as_eager(m, call)
    m.limit = None                                    # not a number: HF's own (which raises too)
    assert oi.plan_for(m) is None


@pytest.mark.parametrize("fullgraph", [False, True])
def test_gpt_oss_under_compile_without_an_eager_call(fullgraph):
    """The decision reads attributes only: under torch.compile (no eager call first) GPT-OSS's
    gate is recognised, in one graph, and a change of limit or alpha recompiles to the new gate."""
    torch._dynamo.reset()
    m, call = experts(GptOssExperts, scale=1.0), inputs(scale=3.0)
    fast = torch.compile(m, backend="eager", fullgraph=fullgraph)
    assert OPREG in same_as_eager_compiled(fast, m, call)
    m.limit = 0.5
    assert OPREG in same_as_eager_compiled(fast, m, call)
    m.alpha = 0.9
    assert OPREG in same_as_eager_compiled(fast, m, call)


def test_compiled_call_warns_of_nothing():
    """Under torch.compile the experts call the op directly: Dynamo said it traced past the
    eager fast path's functools.lru_cache ("silent incorrectness is a potential risk"), a
    warning a user would read as ours."""
    torch._dynamo.reset()
    m, call = experts(), inputs()
    fast = torch.compile(m, backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert OPREG in same_as_eager_compiled(fast, m, call)
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]


def same_as_eager_compiled(fast, m: nn.Module, call) -> set[str]:
    ref = eager_twin(m)
    with torch.no_grad():
        got, ops = ops_run(lambda: fast(*call))
        want = ref(*call)
    assert_matches(got, want, torch.float64)
    return ops


# Dynamo sees a hook added after compiling only where it guards on hooks, which it skips by
# default (skip_nnmodule_hook_guards: torch 2.14 recompiled here anyway, 2.11 did not, with or
# without opreg). With the guards on, opreg's decision must follow the hook on every version.
@torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)
def test_swap_act_fn_under_compile():
    torch._dynamo.reset()
    m, call = experts(), inputs()
    fast = torch.compile(m, backend="eager")
    assert OPREG in same_as_eager_compiled(fast, m, call)
    set_act(m, nn.GELU())
    assert OPREG in same_as_eager_compiled(fast, m, call)
    m.act_fn.approximate = "tanh"
    assert OPREG in same_as_eager_compiled(fast, m, call)
    m.act_fn.register_forward_hook(lambda mod, args, out: out * 0.5)  # transformers' own, its hook runs
    assert OPREG not in same_as_eager_compiled(fast, m, call)


@pytest.mark.parametrize("cls", [MixtralExperts, GptOssExperts])
def test_training_under_inductor_fullgraph(cls):
    """Training through experts_implementation="opreg" under torch.compile(fullgraph=True),
    Inductor, float32 on the CPU: the grouped path traced whole, its products one op each
    (``cpu_grouped_mm``: torch's CPU kernel, whose meta function refuses float32) where
    torch has that kernel; before torch 2.11 the grouped path would read group sizes on the
    host, which Inductor could not lower (GuardOnDataDependentSymNode), so there the op runs
    as one node, its backward an op of its own. Output and every gradient HF eager's."""
    torch._dynamo.reset()
    m = experts(cls, dtype=torch.float32)
    ref = eager_twin(m).double()
    x, ids, w = inputs(torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = torch.compile(m, fullgraph=True)(x, ids, w)
    names = {e.name for e in prof.events()}
    # cpu_grouped_mm's own event is not recorded in every process (a Python kernel at the
    # CPU key); the backward node its differentiable call makes is
    products = "GeneratedBackwardFor_opreg_cpu_grouped_mm_default" in names
    assert (G._CPU_GROUPED_MM_TRACED and products and OPREG not in names
            or not G._CPU_GROUPED_MM_TRACED and OPREG in names), sorted(n for n in names if "opreg" in n)
    xd, wd = (t.detach().double().requires_grad_(True) for t in (x, w))
    want = ref(xd, ids, wd)
    assert_matches(out, want.detach(), torch.float32)
    cot = torch.randn_like(want)
    got_g = torch.autograd.grad(out, (x, w, *m.parameters()), cot.float())
    want_g = torch.autograd.grad(want, (xd, wd, *ref.parameters()), cot)
    for g, v in zip(got_g, want_g, strict=True):
        assert_matches(g, v, torch.float32)


# ------------------------------------------------------------------ what can't be proved falls back

def test_clamped_lambda_falls_back():
    """SiLU of a clamped input is not SiLU: no sampling can tell, the structure can."""
    m = experts(scale=1.0)
    set_act(m, lambda x: F.silu(x.clamp(-20, 20)))
    call = inputs(scale=30.0)
    up = call[0] @ m.gate_up_proj[0, :INTER].T
    assert up.abs().max() > 25  # the clamp matters on these rows
    assert OPREG not in same_as_eager(m, call)
    assert oi.plan_for(m) is None


class Swish(nn.Module):
    """x * sigmoid(beta * x), beta learnable (SiLU at beta = 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.beta * x)


def test_learnable_swish_falls_back_and_trains():
    m = experts()
    set_act(m, Swish())
    ref = eager_twin(m)
    call = inputs()
    out, ops = ops_run(lambda: m(*call))
    want = ref(*call)
    assert OPREG not in ops and oi.plan_for(m) is None
    assert_matches(out, want.detach(), torch.float64)
    cot = torch.randn_like(want)
    out.backward(cot)
    want.backward(cot)
    assert m.act_fn.beta.grad is not None
    assert_matches(m.act_fn.beta.grad, ref.act_fn.beta.grad, torch.float64)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_matches(p.grad, q.grad, torch.float64)


class Observer(nn.Module):
    """A calibration-style activation: SiLU that records every input it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.detach().clone())
        return F.silu(x)


def test_observer_activation_sees_only_real_values():
    m = experts()
    set_act(m, Observer())
    ref = eager_twin(m)
    call = inputs()
    with torch.no_grad():
        got, want = m(*call), ref(*call)
    assert_matches(got, want, torch.float64)
    mine, theirs = torch.cat(m.act_fn.seen), torch.cat(ref.act_fn.seen)
    assert mine.shape == theirs.shape, (mine.shape, theirs.shape)  # nothing synthetic
    assert torch.equal(mine.sort(0).values, theirs.sort(0).values)


class ForwardSub(MixtralExperts):
    """A subclass overriding forward (around transformers' dispatch)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return 2 * super().forward(hidden_states, top_k_index, top_k_weights) + 1


@use_experts_implementation
class DecoratedSub(MixtralExperts):
    """A subclass with a decorated (eager) forward of its own, which calls its parent's."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return super().forward(hidden_states, top_k_index, top_k_weights) - 3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_subclass_overriding_forward_runs_its_forward(dtype):
    m, call = experts(ForwardSub, dtype=dtype), inputs(dtype)
    assert OPREG in same_as_eager(m, call, dtype)
    set_act(m, nn.Tanh())                              # transformers' own experts, inside its forward
    assert OPREG not in same_as_eager(m, call, dtype)


def test_decorated_subclass_falls_back_to_its_own_eager():
    """float64 fallback: the eager forward of the first decorated class in the MRO (its
    own), whose call of its parent's dispatch then runs the parent's eager: HF eager, no
    endless recursion."""
    m, call = experts(DecoratedSub), inputs()
    set_act(m, nn.Tanh())
    assert OPREG not in same_as_eager(m, call)


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_hooks_on_act_fn_fall_back(kind):
    m, call = experts(), inputs()
    assert OPREG in same_as_eager(m, call)          # decided once: SiLU
    seen = []
    if kind == "forward":
        h = m.act_fn.register_forward_hook(lambda mod, args, out: seen.append(1) or out * 0.5)
    else:
        h = m.act_fn.register_forward_pre_hook(lambda mod, args: seen.append(1) or (args[0] * 0.5,))
    with torch.no_grad():
        m(*call)
    assert seen                                     # the hook runs, as in HF eager
    assert OPREG not in same_as_eager(m, call)
    h.remove()
    assert OPREG in same_as_eager(m, call)


def test_subclassed_activation_overriding_forward_falls_back():
    class Tweaked(nn.SiLU):
        def forward(self, x):
            return super().forward(x) + 0.125

    m, call = experts(), inputs()
    set_act(m, Tweaked())
    assert OPREG not in same_as_eager(m, call)
    set_act(m, type("Plain", (nn.SiLU,), {})())        # a subclass with SiLU's own forward: SiLU
    assert OPREG in same_as_eager(m, call)


KNOWN = [
    (nn.SiLU(), "silu"), (ACT2FN["silu"], "silu"), (ACT2FN["swish"], "silu"), (F.silu, "silu"),
    (ACT2FN["gelu"], "gelu"), (nn.GELU(), "gelu"), (F.gelu, "gelu"), (ACT2FN["gelu_python"], "gelu"),
    (ACT2FN["gelu_pytorch_tanh"], "gelu_tanh"), (ACT2FN["gelu_python_tanh"], "gelu_tanh"),
    (ACT2FN["gelu_new"], "gelu_tanh"), (nn.GELU(approximate="tanh"), "gelu_tanh"),
    (ACT2FN["relu"], "relu"), (F.relu, "relu"), (torch.relu, "relu"), (ACT2FN["relu2"], "relu2"),
    (ACT2FN["sigmoid"], "sigmoid"), (torch.sigmoid, "sigmoid"), (ACT2FN["gelu_accurate"], "gelu_tanh"),
    (functools.partial(F.gelu, approximate="tanh"), "gelu_tanh"),
    # not the op's gates (close is not equal): transformers' own
    (ACT2FN["gelu_fast"], None), (ACT2FN["quick_gelu"], None), (ACT2FN["gelu_10"], None),
    (ACT2FN["relu6"], None), (ACT2FN["tanh"], None), (ACT2FN["mish"], None), (ACT2FN["leaky_relu"], None),
    (ACT2FN["linear"], None), (ACT2FN["prelu"], None), (ACT2FN["xielu"], None), (lambda x: F.silu(x), None),
]


def test_known_activations():
    """Each of transformers' activation classes and torch's functions: the op's activation
    it is equivalent to (the same function up to rounding), or none: transformers' own."""
    m, call = experts(scale=1.0), inputs(scale=3.0)
    for act, want in KNOWN:
        set_act(m, act.double() if isinstance(act, nn.Module) else act)
        assert oi.plan_for(m) == (oi.Plan(want, True) if want else None), (act, want)
        with torch.no_grad():
            assert_matches(m(*call), eager_twin(m)(*call), torch.float64)


def test_log_line_names_the_reason(caplog):
    m, call = experts(type("ReasonProbeExperts", (MixtralExperts,), {})), inputs()
    reasons = {}
    for name, act in [("hook", nn.SiLU()), ("parameter", Swish()), ("Tanh", nn.Tanh()),
                      ("lambda", lambda x: F.silu(x.clamp(-20, 20)))]:
        if name == "hook":
            act.register_forward_hook(lambda mod, args, out: None)
        set_act(m, act)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="opreg"):
            same_as_eager(m, call)
            same_as_eager(m, call)
        lines = [r.getMessage() for r in caplog.records if "ReasonProbeExperts" in r.getMessage()]
        assert len(lines) == 1, lines
        reasons[name] = lines[0]
    for name, line in reasons.items():
        assert name in line and "act_fn" in line, (name, line)


def test_instance_gate_override_falls_back_and_module_is_freed():
    import gc
    import weakref

    m, call = experts(), inputs()
    assert OPREG in same_as_eager(m, call)
    m._apply_gate = lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1] * 2  # closes over nothing
    assert OPREG not in same_as_eager(m, call)
    set_act(m, lambda x: m.act_scale * F.silu(x))  # an activation holding the module: no leak
    m.act_scale = 1.0
    del m._apply_gate
    assert OPREG not in same_as_eager(m, call)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------------ eager experts that ignore their weights

def test_whether_an_eager_forward_reads_its_routing_weights():
    """``_reads_third_argument`` reads the bytecode: a load of the weights' name anywhere (a
    nested function's cell included) is a read; a forward that never names them is not."""
    def reads(self, x, ids, w):
        return x * w.sum()

    def reads_late(self, x, ids, w):
        y = x.clone()
        for _ in range(2):
            y = y + 1
        return y * (w if ids is not None else 1)

    def reads_in_a_lambda(self, x, ids, w):
        return (lambda: x * w)()

    def ignores(self, x, ids, w):
        ids = ids.squeeze(-1)
        return x * (ids >= 0).unsqueeze(-1)

    def too_few(self, x, ids):
        return x

    assert oi._reads_third_argument(reads) and oi._reads_third_argument(reads_late)
    assert oi._reads_third_argument(reads_in_a_lambda)
    assert not oi._reads_third_argument(ignores)
    assert oi._reads_third_argument(too_few)  # can't tell: counts as reading (the weighted sum)
    assert oi._weights_use(MixtralExperts) == oi._weights_use(GptOssExperts) == "read"


class _OneRoute(nn.Module):
    """Mixtral's experts (weights, gate) taking one route per row of unit weight: its eager
    forward never reads top_k_weights, as transformers 5.25's ErgoExpertProjections."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * INTER, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, INTER))
        self.act_fn = ACT2FN["silu"]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        idx = top_k_index.squeeze(-1)
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            mask = idx == e
            gate, up = F.linear(hidden_states[mask], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[mask] = F.linear(self.act_fn(gate) * up, self.down_proj[e])
        return out


OneRoute = use_experts_implementation(_OneRoute)


class OneRouteChild(OneRoute):
    """A subclass whose own dispatched forward reads the weights its parent's ignores."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return super().forward(hidden_states, top_k_index, top_k_weights) * top_k_weights


OneRouteChild = use_experts_implementation(OneRouteChild)


def _one_route_call():
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, E, (T, 1))
    return x, ids, torch.rand(T, 1, dtype=torch.float64, requires_grad=True)


def test_experts_that_never_read_their_weights_run_unweighted():
    """An experts class whose eager forward never reads top_k_weights runs the op with unit
    weights: random weights change nothing and get no gradient, as in its eager forward."""
    assert oi._weights_use(OneRoute) == "unread"
    m = experts(OneRoute)
    x, ids, w = _one_route_call()
    got, ops = ops_run(lambda: m(x, ids, w))  # with gradients: the grouped path on the CPU
    with torch.no_grad():
        got_ng, ops_ng = ops_run(lambda: m(x, ids, w))
    assert "opreg::scatter_combine" in ops and OPREG in ops_ng
    want = eager_twin(m)(x, ids, w)
    assert_matches(got, want.detach(), torch.float64)
    assert_matches(got_ng, want.detach(), torch.float64)
    cot = torch.randn_like(want)
    g = torch.autograd.grad(got, (x, w), cot, allow_unused=True, materialize_grads=True)
    gw = torch.autograd.grad(want, (x, w), cot, allow_unused=True, materialize_grads=True)
    assert_matches(g[0], gw[0], torch.float64)
    assert torch.count_nonzero(g[1]) == 0 and torch.count_nonzero(gw[1]) == 0


def test_experts_whose_classes_disagree_on_the_weights_fall_back(caplog):
    """A subclass's dispatched forward reads the weights and its parent's does not: which of the
    two wrappers called can't be told, so transformers' own experts run, with the reason."""
    assert oi._weights_use(OneRouteChild) == "mixed"
    m = experts(OneRouteChild)
    x, ids, w = _one_route_call()
    with caplog.at_level(logging.WARNING, logger="opreg"):
        got, ops = ops_run(lambda: m(x, ids, w))
    assert not ops and any("disagree on reading top_k_weights" in r.getMessage() for r in caplog.records)
    assert_matches(got, eager_twin(m)(x, ids, w).detach(), torch.float64)
