"""Loop idioms: Python loops Dynamo can't trace, rewritten into opreg ops by
:func:`opreg.optimize` after a proof from the source that nothing observable changes.

Generic machinery in :mod:`opreg.loops.rewriter` (one function: source, scan, template,
recompile), :mod:`opreg.loops.modules` (a model: module rewrites, then each method),
:mod:`opreg.loops.wrappers` (decorators seen through), :mod:`opreg.loops.idiom` (the
plug-in API and the proof helpers) and :mod:`opreg.loops.registry`; one file per idiom (:mod:`opreg.loops.scatter_combine`). Adding one::

    opreg.loops.register_loop_idiom(LoopIdiom(name=..., op=..., candidate=..., prove=..., runtime=...))
"""
from __future__ import annotations

from . import experts, scatter_combine
from .idiom import (Fresh, LoopFinding, LoopIdiom, LoopSite, Plan, Reject, fresh_origin, names_in, plain_tensors,
                    positive_count, prove_fresh, range_loop, subscript_of)
from .registry import (ModuleRewrite, register_loop_idiom, register_module_rewrite, registered_loop_idioms,
                       registered_module_rewrites, unregister_loop_idiom, unregister_module_rewrite)
from .modules import module_findings, rewrite_loops, user_functions
from .rewriter import find_loops, rewrite_function
from .wrappers import rewrap

#: The idioms opreg ships, tried in this order.
BUILTIN = [scatter_combine.IDIOM, experts.IDIOM]

for _idiom in BUILTIN:
    register_loop_idiom(_idiom)

__all__ = ["BUILTIN", "Fresh", "LoopFinding", "LoopIdiom", "LoopSite", "ModuleRewrite", "Plan", "Reject",
           "find_loops", "fresh_origin", "module_findings", "names_in", "plain_tensors", "positive_count",
           "prove_fresh", "range_loop", "register_loop_idiom", "register_module_rewrite",
           "registered_loop_idioms", "registered_module_rewrites", "rewrap", "rewrite_function",
           "rewrite_loops", "subscript_of", "unregister_loop_idiom", "unregister_module_rewrite",
           "user_functions"]
