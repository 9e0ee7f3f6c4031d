"""Hugging Face transformers: ``"opreg"`` as an experts implementation of sparse-MoE blocks.

    import opreg.integrations.transformers          # registers "opreg" (or call register())
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="opreg")
    model.set_experts_implementation("opreg")       # or switch a loaded model

Every experts class transformers decorates with ``@use_experts_implementation`` (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...) then runs ``torch.ops.opreg.moe_experts``
(a plain eager no-grad call skips the dispatcher: :func:`opreg._entry.python_call`):
its layout flags (``has_gate``, ``has_bias``, ``is_transposed``) map onto the op's
arguments, and its gate (``_apply_gate`` / ``act_fn``) onto one of the op's activations.

Its gate is recognised from what the module *is*, never by calling it, and re-checked on
every call (:mod:`opreg.integrations.transformers_gate`). So is its use of the routing weights:
an experts class whose eager forward never reads ``top_k_weights`` (one route per row of unit
weight, as transformers 5.25's ``ErgoExpertProjections``) runs the op with unit weights.

What the op can't express (a post-expert norm, a gate or activation not proved, quantized
or sharded weights) runs transformers' own experts for that module (``grouped_mm``; for
float64, which grouped_mm does not take, the eager loop of the first class in the MRO
whose ``forward`` is transformers' dispatch wrapper), with one log line naming why
(``logging.getLogger("opreg")``).

Training: when gradients are needed and the op runs its ``triton`` implementation there,
the fused kernels forward and backward (:mod:`opreg.backends.triton.moe_experts_train`),
but under ``torch.compile`` where the step's GEMMs are too small to hide the fused ops' host
work (``moe_experts_train.traced_host_bound``, logged once per size); otherwise
:func:`opreg.ops.moe_experts_grouped.grouped`, the same grouped computation differentiated by torch
autograd (scatter_combine's own backward for the combine), compiled by Inductor where traced.
Never the op's reference gradients.
"""
from __future__ import annotations

import contextvars
import dataclasses
import dis
import functools
import logging
import types
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from transformers.integrations import moe as hf_moe

from .. import registry
from .._entry import python_call
from .._log import log_once
from ..loops import LoopFinding, ModuleRewrite, find_loops, register_module_rewrite, rewrap
from ..loops.wrappers import wrapped
from ..ops import moe_experts as spec
from ..ops import moe_experts_grouped as grouped_impl
from .transformers_gate import Plan, decision, plan_for

try:  # the fused kernels' training path (needs triton; without it, training takes the grouped path)
    from ..backends.triton import moe_experts_train as _fused_train
except ImportError:
    _fused_train = None

__all__ = ["NAME", "Plan", "eager_forward", "experts_forward", "plan_for", "register"]

NAME = "opreg"

def register(name: str = NAME) -> None:
    """Make ``name`` an experts implementation of transformers (done on import)."""
    hf_moe.ExpertsInterface.register(name, experts_forward)


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


_IN_EAGER: contextvars.ContextVar[tuple[tuple[int, type], ...]] = \
    contextvars.ContextVar("opreg_transformers_eager", default=())


def _dispatching_eager(module: nn.Module) -> Optional[tuple[type, Callable[..., Any]]]:
    """(class, its eager forward) of the first class in the module's MRO whose own
    ``forward`` is transformers' dispatch wrapper and whose eager forward is not running on
    this module already (a subclass's decorated forward calling its parent's), or None."""
    running = _IN_EAGER.get()
    for klass in type(module).__mro__:
        inner = _dispatch_inner(vars(klass).get("forward"))
        if inner is not None and (id(module), klass) not in running:
            return klass, inner
    return None


def _fallback(module: nn.Module, why: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """transformers' own experts for this module: its default, grouped_mm, or for float64
    (which torch's grouped_mm does not take) the eager loop of the class whose dispatch
    called this (:func:`_dispatching_eager`; batched_mm if there is none)."""
    if not (isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64):
        return _run_theirs(module, why, "grouped_mm", hf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"], *args, **kwargs)
    found = _dispatching_eager(module)
    if found is None:
        return _run_theirs(module, why, "batched_mm", hf_moe.ALL_EXPERTS_FUNCTIONS["batched_mm"], *args, **kwargs)
    token = _IN_EAGER.set(_IN_EAGER.get() + ((id(module), found[0]),))
    try:
        return _run_theirs(module, why, "eager", found[1], *args, **kwargs)
    finally:
        _IN_EAGER.reset(token)


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
    plan = decision(module)  # re-checked on every call
    if isinstance(plan, str):
        return fallback(module, plan, *call)
    w1, b1, w2, b2 = weights
    use = _weights_use(type(module))
    if use == _MIXED:  # which class's dispatch called this can't be told: its eager decides
        return fallback(module, "its experts classes' eager forwards disagree on reading top_k_weights", *call)
    if use == _UNREAD:
        # its eager forward never reads top_k_weights (each row one route of unit weight,
        # e.g. transformers 5.25's ErgoExpertProjections): the op runs with unit weights, so
        # the routing weights change nothing and get no gradient, as there
        log_once(("unweighted", type(module)), logging.INFO, "opreg: %s's eager experts never read top_k_weights: "
                 "moe_experts runs them with unit weights", type(module).__name__)
        top_k_weights = torch.ones_like(top_k_weights)
    # as transformers' grouped_mm does (autocast leaves them apart); .to of the same dtype
    # returns its input, at ~1-2 us of host a call, twice per call here
    x = hidden_states if hidden_states.dtype == w1.dtype else hidden_states.to(w1.dtype)
    op_args = (x, top_k_index, top_k_weights, w1, b1, w2, b2, plan.activation, plan.gated,
               bool(getattr(module, "is_transposed", False)), plan.interleaved, plan.alpha, plan.limit)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, top_k_weights, w1, b1, w2, b2))
    out = _experts(op_args, needs_grad)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def _experts(op_args: tuple[Any, ...], needs_grad: bool) -> torch.Tensor:
    """Without gradients: the op (traced: its fused kernels inline, or its grouped path where
    that traces whole, or the op, one node). Training: the fused kernels forward and backward where
    the op runs its Triton implementation (:mod:`opreg.backends.triton.moe_experts_train`,
    eager and traced); else the differentiable grouped path (its backward is grouped GEMMs
    too), except where tracing it would leave data-dependent sizes in the graph (one GEMM
    per expert after a host read: off ``_grouped_mm``, which traces with bf16 on sm90+ and,
    through ``cpu_grouped_mm``, on the CPU from torch 2.11), which Inductor can't lower
    (GuardOnDataDependentSymNode) and Dynamo without fullgraph splits at every projection:
    there the op itself, one node whose backward is an op of its own."""
    if not needs_grad:
        if not torch.compiler.is_compiling():
            return _op_call()(*op_args)
        # traced: the fused kernels in the graph; or where the op would run its grouped path
        # and that traces whole, the path itself: the same work, with Inductor fusing its
        # gather, masks and combine, and none of the op's Python at run time (a compiled CPU
        # block's forward at T = 64: 423-427 us with the op against eager opreg's 378-390,
        # 335-348 traced; bench/RESULTS.md, thirty-ninth session); else the op, one node
        out = _fused_train.inline_forward(*op_args) if _fused_train is not None else None
        if out is not None:
            return out
        x, w1, w2, transposed = op_args[0], op_args[3], op_args[5], op_args[9]
        if _op_runs_grouped(op_args) and grouped_impl.grouped_traces_whole(x, w1, w2, transposed):
            return grouped_impl.grouped(*op_args)
        return torch.ops.opreg.moe_experts(*op_args)
    compiling = torch.compiler.is_compiling()
    if _trains_fused(op_args, compiling):
        return _fused_train.train(*op_args)
    x, w1, w2, transposed = op_args[0], op_args[3], op_args[5], op_args[9]
    if compiling and not grouped_impl.grouped_traces_whole(x, w1, w2, transposed):
        return torch.ops.opreg.moe_experts(*op_args)
    return grouped_impl.grouped(*op_args)


def _op_runs_grouped(op_args: tuple[Any, ...]) -> bool:
    """Would the op run its grouped path on these arguments: the implementation bound for
    their device (a constant when traced, :func:`opreg.registry.running`) is ``grouped``, or
    ``triton`` where its fused kernels don't take them (its fallback)?"""
    if _fused_train is not None and _fused_train.runs_fused(op_args):
        return False
    return registry.running(spec.NAME, op_args[0].device.type) in ("grouped", "triton")


def _trains_fused(op_args: tuple[Any, ...], compiling: bool) -> bool:
    """Does a training call take the fused kernels (:func:`_experts`)? Where they take it
    (``moe_experts_train.fused_trains``), but not when ``compiling`` where Inductor can
    compile the grouped path whole and the step would wait on the fused ops' host work
    (``moe_experts_train.traced_host_bound``): there the compiled grouped path is faster."""
    if _fused_train is None or not _fused_train.fused_trains(op_args):
        return False
    x, w1, w2, transposed = op_args[0], op_args[3], op_args[5], op_args[9]
    return not (compiling and grouped_impl.grouped_traces_whole(x, w1, w2, transposed)
                and _fused_train.traced_host_bound(op_args))


@functools.lru_cache(maxsize=None)
def _op_call() -> Callable[..., torch.Tensor]:
    """``torch.ops.opreg.moe_experts`` with less host cost on a plain eager call
    (:func:`opreg._entry.python_call`)."""
    return python_call(spec.NAME)


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
    wrapper wraps), or None if ``cls``'s forward is not such a wrapper."""
    return _dispatch_inner(getattr(cls, "forward", None))


_READ, _UNREAD, _MIXED = "read", "unread", "mixed"


@torch.compiler.assume_constant_result
def _weights_use(cls: type) -> str:
    """Whether the eager forwards of ``cls``'s experts dispatch (each class of its MRO whose
    own forward is transformers' dispatch wrapper) read their routing weights, the third
    argument: "read" (all, or none found), "unread" (none) or "mixed" (a subclass's and its
    parent's disagree: the one whose wrapper called can't be told apart). Read from the
    functions' bytecode, once per class; a constant to Dynamo."""
    got = _WEIGHTS_USE.get(cls)
    if got is None:
        eagers = [e for e in (_dispatch_inner(vars(k).get("forward")) for k in cls.__mro__) if e is not None]
        reads = {_reads_third_argument(e) for e in eagers}
        got = _WEIGHTS_USE[cls] = _MIXED if len(reads) > 1 else _UNREAD if reads == {False} else _READ
    return got


_WEIGHTS_USE: dict[type, str] = {}


def _reads_third_argument(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` (self, hidden_states, top_k_index, top_k_weights, ...) load its fourth
    positional parameter anywhere? Any LOAD_* instruction naming it counts (LOAD_FAST and its
    3.12-3.14 variants, some of which name two locals), as does a cell for a nested function;
    a function this can't read (no fourth positional parameter) counts as reading them."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount < 4:
        return True
    name = code.co_varnames[3]
    if name in code.co_cellvars:
        return True
    for ins in dis.get_instructions(code):
        if ins.opname.startswith("LOAD_") and (ins.argval == name
                                               or (isinstance(ins.argval, tuple) and name in ins.argval)):
            return True
    return False


def _dispatch_inner(wrapper: Any) -> Optional[Callable[..., Any]]:
    """What ``wrapper`` wraps, if it is transformers' experts dispatch wrapper, else None."""
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
