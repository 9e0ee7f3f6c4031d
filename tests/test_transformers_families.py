"""Every experts class transformers builds with ``@use_experts_implementation`` (67 families
in transformers 5.24, 72 in 5.25), found in its source, on a tiny random instance in float64 (no
downloads): with ``experts_implementation="opreg"`` (output and every gradient) and under
``opreg.optimize`` on the eager experts (output), the result equals HF eager's, and either
opreg's ops ran or the module ran transformers' own experts with one log line naming why
(the known cases in FALLBACKS, each with the reason). A family this file can't build
generically is skipped with the reason."""
from __future__ import annotations

import copy
import importlib
import inspect
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import opreg  # noqa: E402
import opreg.integrations.transformers as oi  # noqa: E402
from opreg.testing import assert_matches  # noqa: E402

MODELS = Path(transformers.__file__).parent / "models"
# Tiny sizes for whatever of these a family's config has.
SIZES = dict(hidden_size=16, intermediate_size=12, moe_intermediate_size=8, expert_intermediate_size=8,
             moe_hidden_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
             num_experts_per_tok=2, moe_topk=2, moe_latent_size=None)
# Experts transformers' own implementation runs, not opreg: class -> why (the log line says it).
FALLBACKS = {
    "BeamExperts": "gate",           # _apply_gate computes in float32 (act(gate.float()) * up.float())
    "Inkling2Experts": "gate",       # a two-argument activation, act_fn(gate, up)
    "Inkling2LoopExperts": "gate",
    "MuseSparkExperts": "norm",      # a post-expert norm (has_post_expert_norm)
}
# Eager loops that compute in float32 whatever the weights' dtype: compared at float32's tolerance.
FLOAT32_EAGER = {"OpenAIPrivacyFilterExperts"}
# Experts whose eager forward takes one route per row (it squeezes top_k_index's last dim) and
# never reads top_k_weights (a unit weight): called with k = 1 and random weights, which must
# change nothing; opreg.optimize finds no loop of its idioms there.
ONE_ROUTE = {"ErgoExpertProjections"}  # transformers 5.25


def families() -> list[str]:
    """The model folders whose modeling file decorates a class with @use_experts_implementation."""
    found = []
    for f in sorted(MODELS.glob("*/modeling_*.py")):
        if f.stem == f"modeling_{f.parent.name}" and "@use_experts_implementation" in f.read_text():
            found.append(f.parent.name)
    return found


def experts_classes(module: Any) -> list[type]:
    """Classes of ``module`` whose forward is an experts-interface dispatch wrapper."""
    return [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, torch.nn.Module)
            and c.__module__ == module.__name__ and oi.eager_forward(c) is not None]


def _set(config: Any, name: str, value: Any) -> None:
    try:
        old = getattr(config, name)
    except Exception:  # noqa: BLE001 - absent, or a per-layer attribute transformers refuses globally
        return
    if isinstance(old, (list, tuple)) and value is not None:
        value = type(old)([value] * len(old))
    try:
        setattr(config, name, value)
    except Exception:  # noqa: BLE001 - a read-only or validated attribute: leave it
        pass


def tiny(family: str, cls: type) -> torch.nn.Module | str:
    """A float64 instance of ``cls`` from the family's own config with SIZES, or why not."""
    configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    candidates = sorted((c for c in vars(configs).values() if isinstance(c, type)
                         and issubclass(c, transformers.PretrainedConfig) and c.__module__ == configs.__name__),
                        key=lambda c: ("Text" not in c.__name__, len(c.__name__)))
    why = []
    for config_cls in candidates:
        try:
            config = config_cls()
            for sub in ("text_config",):
                if isinstance(getattr(config, sub, None), transformers.PretrainedConfig):
                    for k, v in SIZES.items():
                        _set(getattr(config, sub), k, v)
            for k, v in SIZES.items():
                _set(config, k, v)
            # (Ernie-4.5-VL's experts take their width as an argument: one per modality.)
            kw = {"intermediate_size": SIZES["moe_intermediate_size"]} \
                if "intermediate_size" in inspect.signature(cls.__init__).parameters else {}
            with torch.device("meta"):
                n = sum(p.numel() for p in cls(config, **kw).parameters())
            if n > 1e6:
                why.append(f"{config_cls.__name__}: {n} parameters")
                continue
            m = cls(config, **kw).double()
        except Exception as e:  # noqa: BLE001 - reported as the skip reason
            why.append(f"{config_cls.__name__}: {type(e).__name__}: {str(e)[:120]}")
            continue
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.3)
        return m
    return "; ".join(why) or "no config class"


CASES = []
for _family in families():
    _module = importlib.import_module(f"transformers.models.{_family}.modeling_{_family}")
    CASES += [pytest.param(_family, c, id=f"{_family}-{c.__name__}") for c in experts_classes(_module)]


def inputs(m: torch.nn.Module, t: int = 9, k: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states (t, H), distinct expert ids (t, k) and routing weights, float64."""
    e = m.num_experts
    h = next(p for name, p in m.named_parameters() if re.search(r"(gate_)?up_proj$", name))
    width = h.shape[1] if getattr(m, "is_transposed", False) else h.shape[2]
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    return (torch.randn(t, width, dtype=torch.float64, requires_grad=True), ids,
            torch.rand(t, k, dtype=torch.float64, requires_grad=True))


def close(got: torch.Tensor, want: torch.Tensor, tol: torch.dtype) -> None:
    assert_matches(got.to(tol), want.detach(), tol)


def ran(fn: Any) -> tuple[Any, set[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("opreg::")}


def test_every_decorated_family_is_found():
    assert len(CASES) >= len(families()) >= 1


@pytest.mark.parametrize("family, cls", CASES)
def test_family(family: str, cls: type, caplog: pytest.LogCaptureFixture) -> None:
    m = tiny(family, cls)
    if isinstance(m, str):
        pytest.skip(f"no tiny {cls.__name__} from its config: {m}")
    tol = torch.float32 if cls.__name__ in FLOAT32_EAGER else torch.float64
    x, ids, w = inputs(m, k=1 if cls.__name__ in ONE_ROUTE else 2)
    params = list(m.parameters())
    m.config._experts_implementation = "eager"
    want = m(x, ids, w)
    cot = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, w, *params], cot, allow_unused=True, materialize_grads=True)

    m.config._experts_implementation = oi.NAME
    with caplog.at_level(logging.WARNING, logger="opreg"):
        got, ops = ran(lambda: m(x, ids, w))
        with torch.no_grad():
            _, ops_inference = ran(lambda: m(x, ids, w))
    close(got, want, tol)
    got_grads = torch.autograd.grad(got, [x, w, *params], cot, allow_unused=True, materialize_grads=True)
    for a, b in zip(got_grads, want_grads):
        close(a, b, tol)
    fell_back = [r.getMessage() for r in caplog.records if cls.__name__ in r.getMessage()]
    if cls.__name__ in FALLBACKS:
        assert not ops and fell_back and FALLBACKS[cls.__name__] in fell_back[0], (ops, fell_back)
        return
    assert "opreg::scatter_combine" in ops and "opreg::moe_experts" in ops_inference and not fell_back, \
        (ops, ops_inference, fell_back)

    # opreg.optimize on the eager experts: moe_experts (the module rewrite)
    m.config._experts_implementation = "eager"
    fast = copy.deepcopy(m)
    opreg.optimize(fast, compile=False)
    if cls.__name__ in ONE_ROUTE:  # a masked assignment per expert, no weighted sum: left as written
        assert not any(f.matched for f in fast._opreg_loops), fast._opreg_loops
        close(fast(x, ids, w), want, tol)
        return
    assert [(f.matched, f.op) for f in fast._opreg_loops] == [(True, "opreg::moe_experts")], fast._opreg_loops
    with torch.no_grad():
        out, ops = ran(lambda: fast(x, ids, w))
    assert "opreg::moe_experts" in ops
    close(out, want, tol)
