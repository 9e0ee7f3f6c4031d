"""Hugging Face transformers: ``"opreg"`` as an experts implementation of sparse-MoE blocks.

    import opreg.integrations.transformers          # registers "opreg" (or call register())
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="opreg")
    model.set_experts_implementation("opreg")       # or switch a loaded model

Every experts class transformers decorates with ``@use_experts_implementation`` (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...) then runs ``torch.ops.opreg.moe_experts``:
its layout flags (``has_gate``, ``has_bias``, ``is_transposed``) map onto the op's
arguments, and its gate (``_apply_gate`` / ``act_fn``) onto one of the op's activations.
The gate is identified once per module by running the module's own gate on float64 probe
values and comparing with the op's (so a family with an unusual gate is recognised, not
assumed). What the op can't express (a post-expert norm, an unknown gate, quantized or
sharded weights) runs transformers' own experts for that module (``grouped_mm``; the eager
loop for float64, which grouped_mm does not take), with one log line
(``logging.getLogger("opreg")``).

Training: when gradients are needed the module runs :func:`opreg.ops.moe_experts.grouped`,
the same grouped computation differentiated by torch autograd (scatter_combine's own
backward for the combine), not the op's reference gradients. Under ``torch.compile`` with
no eager call before, only the default gate with a known activation class is trusted
(probing would trace into the graph); others fall back until an eager call has probed.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import types
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from transformers import activations as hf_act
from transformers.integrations import moe as hf_moe

from .._log import log_once, logger
from ..loops import LoopFinding, ModuleRewrite, find_loops, register_module_rewrite, rewrap
from ..loops.wrappers import wrapped
from ..ops import moe_experts as spec

__all__ = ["NAME", "Plan", "eager_forward", "experts_forward", "plan_for", "register"]

NAME = "opreg"

# Activation modules whose forward is known to be the op's activation of that name: the
# classes trusted without a probe (under torch.compile). GELUTanh/NewGELU differ from
# F.gelu(approximate="tanh") by rounding only.
_KNOWN_ACT: dict[type, str] = {
    hf_act.SiLUActivation: "silu", nn.SiLU: "silu", hf_act.GELUTanh: "gelu_tanh",
    hf_act.NewGELUActivation: "gelu_tanh", nn.ReLU: "relu", hf_act.ReLUSquaredActivation: "relu2",
    nn.Sigmoid: "sigmoid",
}
_PROBE_TOL = 1e-9  # float64: a match is exact up to rounding; the next-closest gate is ~1e-4 off


@dataclasses.dataclass(frozen=True)
class Plan:
    """The op's gate arguments for one experts module."""

    activation: str
    gated: bool
    interleaved: bool = False
    alpha: float = 1.0
    limit: float = math.inf


def register(name: str = NAME) -> None:
    """Make ``name`` an experts implementation of transformers (done on import)."""
    hf_moe.ExpertsInterface.register(name, experts_forward)


# ----------------------------------------------------------------------------- the gate

def _known_act(act: Any) -> Optional[str]:
    if isinstance(act, hf_act.GELUActivation):
        return "gelu"  # F.gelu, or its erf formula (use_gelu_python): the same function
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    return _KNOWN_ACT.get(type(act))


def _number(module: nn.Module, *names: str) -> Optional[float]:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _candidates(module: nn.Module) -> list[Plan]:
    """Gates this module's may be, most likely first (the structural guess)."""
    gated = bool(getattr(module, "has_gate", True))
    guess = _known_act(getattr(module, "act_fn", None))
    acts = [guess] if guess else []
    acts += [a for a in spec.ACTIVATIONS if a != guess]
    if not gated:
        return [Plan(a, False) for a in acts]
    if type(module)._apply_gate is hf_moe._default_apply_gate:
        return [Plan(a, True) for a in acts]
    limit = _number(module, "limit", "swiglu_limit")
    alpha = _number(module, "alpha", "swiglu_alpha")
    limits = [math.inf] if limit is None else [limit, math.inf]
    got = [Plan(spec.GPT_OSS, True, inter, alpha, lim)
           for inter in (False, True) for lim in limits if alpha is not None]
    return got + [Plan(a, True, inter, 1.0, lim) for lim in limits for inter in (False, True) for a in acts]


def _trusted(module: nn.Module) -> Optional[Plan]:
    """The plan known without running anything: the default gate with a known activation."""
    act = _known_act(getattr(module, "act_fn", None))
    if act is None:
        return None
    if not getattr(module, "has_gate", True):
        return Plan(act, False)
    return Plan(act, True) if type(module)._apply_gate is hf_moe._default_apply_gate else None


def _probe(module: nn.Module, width: int) -> Optional[Plan]:
    """The first candidate whose gate equals the module's on float64 probe rows (values
    past every clamp included)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, width, generator=gen, dtype=torch.float64) * 4
    x[0] = torch.linspace(-12, 12, width, dtype=torch.float64)
    gated = bool(getattr(module, "has_gate", True))
    try:
        with torch.no_grad():
            want = module._apply_gate(x.clone()) if gated else module.act_fn(x.clone())
    except Exception as e:  # a gate that needs its own device or parameters: not ours
        logger.debug("opreg: probing %s's gate failed: %s", type(module).__name__, e)
        return None
    for plan in _candidates(module):
        got = spec.apply_gate(x, plan.activation, plan.gated, plan.interleaved, plan.alpha, plan.limit)
        if got.shape == want.shape and want.dtype == torch.float64 and \
                torch.allclose(got, want, rtol=_PROBE_TOL, atol=_PROBE_TOL):
            return plan
    return None


_UNSET = object()


def plan_for(module: nn.Module) -> Optional[Plan]:
    """The module's gate as op arguments (cached on it), or None: not expressible."""
    got = module.__dict__.get("_opreg_plan", _UNSET)
    if got is not _UNSET:
        return got  # type: ignore[return-value]
    if torch.compiler.is_compiling():
        return _trusted(module)  # not cached: an eager call may still probe
    w1 = _weights(module)
    plan = None if isinstance(w1, str) else _probe(module, _up_width(module, w1[0]))
    module.__dict__["_opreg_plan"] = plan
    return plan


def _up_width(module: nn.Module, w1: torch.Tensor) -> int:
    return int(w1.shape[2] if getattr(module, "is_transposed", False) else w1.shape[1])


# ----------------------------------------------------------------------------- weights

def _plain(t: Optional[torch.Tensor]) -> bool:
    # DTensor / quantized subclasses: the op takes dense strided tensors of one float dtype.
    return t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided)


Weights = tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]


def _weights(module: nn.Module) -> Weights | str:
    """(gate_up or up, its bias, down, its bias), or why the op can't take them."""
    if getattr(module, "has_post_expert_norm", False):
        return "it applies a norm after each expert (has_post_expert_norm)"
    gated, bias = getattr(module, "has_gate", True), getattr(module, "has_bias", False)
    up = "gate_up_proj" if gated else "up_proj"
    w1, w2 = getattr(module, up, None), getattr(module, "down_proj", None)
    b1 = getattr(module, up + "_bias", None) if bias else None
    b2 = getattr(module, "down_proj_bias", None) if bias else None
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor) or w1.dim() != 3:
        return f"it has no 3-D {up} / down_proj parameters"
    if bias and (b1 is None or b2 is None):
        return "has_bias is set but a bias is missing"
    if not all(_plain(t) for t in (w1, b1, w2, b2)):
        return "its expert weights are not dense tensors (sharded or quantized)"
    if not w1.is_floating_point() or any(t is not None and t.dtype != w1.dtype for t in (b1, w2, b2)):
        return "its expert weights are not all of one float dtype"
    if getattr(module, "num_experts", w1.shape[0]) != w1.shape[0]:
        return "num_experts differs from the weights' expert count"
    return w1, b1, w2, b2


# ----------------------------------------------------------------------------- forward

def _run_theirs(module: nn.Module, why: str, name: str, forward: Callable[..., torch.Tensor],
                *args: Any, **kwargs: Any) -> torch.Tensor:
    """transformers' ``name`` experts ``forward`` for this module, said once per class and reason."""
    log_once(("transformers fallback", type(module), why), logging.WARNING,
             "opreg: %s runs transformers' %s experts, not opreg: %s", type(module).__name__, name, why)
    return forward(module, *args, **kwargs)


def _fallback(module: nn.Module, why: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """transformers' own experts for this module: its default, grouped_mm, or for float64
    (which torch's grouped_mm does not take) the class's eager loop."""
    if isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
        return _run_theirs(module, why, "eager", type(module).forward.__wrapped__, *args, **kwargs)
    return _run_theirs(module, why, "grouped_mm", hf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"], *args, **kwargs)


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The experts interface function: (T, H) hidden states, (T, k) expert ids and routing
    weights -> (T, H) weighted sum of the chosen experts' outputs."""
    return _forward(module, (hidden_states, top_k_index, top_k_weights) + args, kwargs, _fallback)


Fallback = Callable[..., torch.Tensor]  # (module, why, *call, **kwargs)


def _forward(module: nn.Module, call: tuple[Any, ...], kwargs: dict[str, Any], fallback: Fallback
             ) -> torch.Tensor:
    """moe_experts on ``call`` = (hidden_states, top_k_index, top_k_weights), or ``fallback``."""
    if len(call) != 3 or kwargs or not isinstance(call[0], torch.Tensor) or call[0].dim() != 2:
        return fallback(module, "an unexpected call signature", *call, **kwargs)
    hidden_states, top_k_index, top_k_weights = call
    weights = _weights(module)
    if isinstance(weights, str):
        return fallback(module, weights, *call)
    plan = plan_for(module)
    if plan is None:
        return fallback(module, "its gate is none of moe_experts' activations", *call)
    w1, b1, w2, b2 = weights
    x = hidden_states.to(w1.dtype)  # as transformers' grouped_mm does (autocast leaves them apart)
    op_args = (x, top_k_index, top_k_weights, w1, b1, w2, b2, plan.activation, plan.gated,
               bool(getattr(module, "is_transposed", False)), plan.interleaved, plan.alpha, plan.limit)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, top_k_weights, w1, b1, w2, b2))
    out = spec.grouped(*op_args) if needs_grad else torch.ops.opreg.moe_experts(*op_args)
    return out.to(hidden_states.dtype)


# ----------------------------------------------------------------------------- opreg.optimize
# A module whose experts implementation is "eager" runs transformers' per-expert loop;
# opreg.optimize makes it run moe_experts instead (the module rewrite below), where the
# loop idiom proves the eager forward is the expert loop and the op can express the
# module. The class's @use_experts_implementation wrapper is rebuilt around the new eager
# function, so set_experts_implementation() still switches implementations.

OPTIMIZE_NAME = "transformers_experts"
_proved: dict[Callable[..., Any], Optional[LoopFinding]] = {}


def eager_forward(cls: type) -> Optional[Callable[..., Any]]:
    """The eager forward of an experts class (what its @use_experts_implementation
    wrapper wraps), or None if ``cls`` is not one."""
    wrapper = getattr(cls, "forward", None)
    inner = getattr(wrapper, "__wrapped__", None)
    cells = getattr(wrapper, "__closure__", None) or ()
    holds_interface = any(isinstance(_contents(c), hf_moe.ExpertsInterface) for c in cells)
    return inner if holds_interface and callable(inner) else None


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _proved_loop(eager: Callable[..., Any]) -> Optional[LoopFinding]:
    """The expert loop the loop idiom proves in ``eager`` (once per function), or None."""
    if eager not in _proved:
        _proved[eager] = next((f for f in find_loops(eager) if f.matched and f.idiom == "experts"), None)
    return _proved[eager]


def _optimize_check(module: nn.Module) -> Optional[LoopFinding]:
    eager = eager_forward(type(module))
    config = getattr(module, "config", None)
    if eager is None or getattr(config, "_experts_implementation", None) != "eager" \
            or "forward" in vars(module):  # someone's hook on this instance (accelerate's): leave it
        return None
    loop = _proved_loop(eager)
    if loop is None or isinstance(wrapped(type(module).forward), str) or isinstance(_weights(module), str) \
            or plan_for(module) is None:
        return None  # the loop idioms may still take it
    return dataclasses.replace(loop, op="opreg::moe_experts", idiom=OPTIMIZE_NAME)


def _optimize_apply(module: nn.Module) -> None:
    eager = eager_forward(type(module))

    def fallback(m: nn.Module, why: str, *call: Any, **kwargs: Any) -> torch.Tensor:
        return _run_theirs(m, why, "eager", eager, *call, **kwargs)  # the loop the user chose

    def eager_via_opreg(self: nn.Module, *call: Any, **kwargs: Any) -> torch.Tensor:
        return _forward(self, call, kwargs, fallback)

    new = rewrap(type(module).forward, eager_via_opreg)
    assert not isinstance(new, str), new  # _optimize_check saw that it can be rebuilt
    module.forward = types.MethodType(new, module)


register()
register_module_rewrite(ModuleRewrite(
    OPTIMIZE_NAME, "opreg::moe_experts", _optimize_check, _optimize_apply,
    note="transformers' eager experts, one expert at a time; the module runs opreg's experts instead "
         "(set_experts_implementation still switches)"))
