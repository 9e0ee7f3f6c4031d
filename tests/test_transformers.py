"""transformers integration: ``experts_implementation="opreg"`` on tiny random models of
several MoE families (no downloads). The MoE block's and the whole model's outputs and
gradients equal HF eager run in float64; the opreg ops ran (profiler); unexpressible gates
fall back to HF with one log line; on CUDA: bf16 via grouped_mm, CUDA-graph capture of the
block, bit-identical reruns."""
from __future__ import annotations

import contextlib
import copy
import os
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import opreg  # noqa: E402
import opreg.integrations.transformers as oi  # noqa: E402  (registers "opreg")

from _util import assert_matches  # noqa: E402

COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
FAMILIES = {  # name: (config class name, its MoE arguments)
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                         head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2)),
    # shared experts (gated by a sigmoid of their own)
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32)),
    # expert biases, transposed interleaved weights, its own clamped gate
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
    # routed scaling, group-limited top-k, shared experts
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                             n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16,
                                             q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                             v_head_dim=8, n_group=2, topk_group=1, num_key_value_heads=4,
                                             routed_scaling_factor=2.5)),
    "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
}
DTYPES = [pytest.param(torch.float64, id="float64"), pytest.param(torch.float32, id="float32")]


def tiny_model(family: str, layers: int = 1) -> torch.nn.Module:
    """A float64 causal LM of the family with every parameter random (none zero)."""
    cls, moe = FAMILIES[family]
    config = getattr(transformers, cls)(**{**COMMON, **moe, "num_hidden_layers": layers})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def moe_block(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if any(c in experts_modules(model) for c in m.children()))


def first_tensor(out):
    return out if isinstance(out, torch.Tensor) else first_tensor(out[0])


def run(fn, inputs: list[torch.Tensor], params: list[torch.Tensor], cot: torch.Tensor | None = None):
    """fn(*inputs) and the gradients of <out, cot> w.r.t. inputs and params."""
    out = first_tensor(fn(*inputs))
    cot = torch.randn_like(out) if cot is None else cot.to(out.dtype)
    grads = torch.autograd.grad(out, inputs + params, cot, allow_unused=True)
    return out, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs + params)], cot


def compare(model64: torch.nn.Module, dtype: torch.dtype, make_call) -> None:
    """``make_call(model) -> (fn, inputs, params)``: opreg in ``dtype`` against HF eager in float64."""
    # The reference computes in float64 from the same (dtype-rounded) parameters and inputs
    # the opreg run gets, so only the computation differs, not the rounding of its data.
    ref = copy.deepcopy(model64).to(dtype).double()
    ref.set_experts_implementation("eager")
    model = copy.deepcopy(model64).to(dtype)
    model.set_experts_implementation("opreg")
    fn, inputs, params = make_call(model)
    out, grads, cot = run(fn, inputs, params)
    fn64, inputs64, params64 = make_call(ref, [t.detach().double() for t in inputs])
    want, want_grads, _ = run(fn64, inputs64, params64, cot.double())
    assert_matches(out, want, dtype)
    for got, ref_grad in zip(grads, want_grads):
        assert_matches(got, ref_grad, dtype)
    assert all(m.__dict__.get("_opreg_plan") is not None for m in experts_modules(model)), \
        "an experts module fell back to HF"


def block_call(model, inputs=None):
    block = moe_block(model)
    dtype = next(model.parameters()).dtype
    x = inputs[0] if inputs else torch.randn(2, 7, COMMON["hidden_size"], dtype=dtype)
    x = x.detach().requires_grad_()
    return block, [x], [p for p in block.parameters() if p.requires_grad]


def _model_call_pair():
    """model_call that hands the first model's token ids to the reference model."""
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))

    def call(model, inputs=None):
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()
        return (lambda e: model(inputs_embeds=e).logits), [emb], [p for p in model.parameters()]

    return call


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_matches_eager(family, dtype):
    compare(tiny_model(family), dtype, block_call)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_model_matches_eager(family):
    """A whole 2-layer model, in float64: the integration changes nothing but the experts."""
    compare(tiny_model(family, layers=2), torch.float64, _model_call_pair())


def _model_errors(model64: torch.nn.Module, impl: str) -> float:
    """Worst normwise error, over the logits and every parameter's gradient, of the model
    in float32 with experts ``impl`` against HF eager in float64 (same rounded weights)."""
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    cot = torch.randn(2, 7, COMMON["vocab_size"], dtype=torch.float64)

    def run32(m: torch.nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
        out = m(input_ids=ids).logits
        out.backward(cot.to(dtype))
        return [out.detach().double(), *(p.grad.double() for p in m.parameters())]

    ref = copy.deepcopy(model64).float().double()
    ref.set_experts_implementation("eager")
    mine = copy.deepcopy(model64).float()
    mine.set_experts_implementation(impl)
    want, got = run32(ref, torch.float64), run32(mine, torch.float32)
    return max(float((g - w).norm() / w.norm().clamp_min(1e-30)) for g, w in zip(got, want))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_model_float32_no_worse_than_hf(family):
    """The whole model in float32: its error against float64 is mostly the model's own
    (attention, norms; HF eager and opreg both ~1e-6 worst gradient, one CI draw 1.26e-5 for
    GPT-OSS), so the bar is HF's own float32 model on the same draw, not one op's band."""
    model64 = tiny_model(family, layers=2)
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    hf = _model_errors(model64, "eager")
    torch.manual_seed(seed)
    mine = _model_errors(model64, "opreg")
    assert mine <= 2 * hf + 1e-6, (mine, hf)


def _ran(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("opreg::")}


def test_opreg_ops_ran():
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("opreg")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 5))
    with torch.no_grad():  # inference: the fused op
        assert {"opreg::moe_experts", "opreg::scatter_combine"} <= _ran(lambda: model(ids))
    # training: the grouped path, combined by scatter_combine
    assert "opreg::scatter_combine" in _ran(lambda: model(ids).logits.sum().backward())
    model.set_experts_implementation("eager")
    with torch.no_grad():
        assert not _ran(lambda: model(ids))


def test_from_pretrained(tmp_path):
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="opreg",
                                                               dtype=torch.float64)
    assert loaded.config._experts_implementation == "opreg"
    ids = torch.randint(0, COMMON["vocab_size"], (2, 6))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        assert "opreg::moe_experts" in _ran(lambda: loaded(ids))
        assert_matches(loaded(ids).logits, model(ids).logits, torch.float64)


def test_unexpressible_gate_falls_back(caplog):
    """A gate none of the op's activations is: HF's grouped_mm runs, with one log line."""
    model = tiny_model("mixtral")
    experts = experts_modules(model)[0]
    cls = type(experts)
    odd = type("OddGateExperts", (cls,), {"_apply_gate": lambda self, h: h.chunk(2, -1)[0] * torch.tanh(
        h.chunk(2, -1)[1])})
    experts.__class__ = odd
    block = moe_block(model)
    x = torch.randn(2, 5, COMMON["hidden_size"], dtype=torch.float64)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        want = first_tensor(block(x))
        model.set_experts_implementation("opreg")
        with caplog.at_level(logging.WARNING, logger="opreg"):
            got, again = first_tensor(block(x)), first_tensor(block(x))
    assert oi.plan_for(experts) is None
    assert_matches(got, want, torch.float64)
    assert torch.equal(got, again)
    lines = [r for r in caplog.records if "OddGateExperts" in r.getMessage()]
    assert len(lines) == 1 and "gate" in lines[0].getMessage()


def test_gates_identified():
    plans = {f: oi.plan_for(experts_modules(tiny_model(f))[0]) for f in ("mixtral", "gpt_oss")}
    assert plans["mixtral"] == oi.Plan("silu", True)
    assert plans["gpt_oss"].activation == "gpt_oss" and plans["gpt_oss"].interleaved
    assert plans["gpt_oss"].limit == 7.0 and plans["gpt_oss"].alpha == pytest.approx(1.702)


# ------------------------------------------------------------------------------ CUDA

def _cuda_block(family: str):
    model = tiny_model(family).cuda()
    return model, moe_block(model)


needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                                reason="needs a CUDA device of sm90 or newer")


def _routing(tokens: int, experts: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token and positive weights: a routing fixed for both runs."""
    idx = torch.rand(tokens, experts, device=device).argsort(-1)[:, :k]
    return idx, torch.rand(tokens, k, device=device).softmax(-1)


def _experts_pair(family: str, dtype: torch.dtype, device: str):
    """(opreg experts in ``dtype``, HF eager experts in float64 from the same rounded weights)."""
    experts = experts_modules(tiny_model(family).to(device))[0]
    mine = copy.deepcopy(experts).to(dtype)
    mine.config = copy.copy(mine.config)
    mine.config._experts_implementation = "opreg"
    ref = copy.deepcopy(mine).double()
    ref.config = copy.copy(ref.config)
    ref.config._experts_implementation = "eager"
    return mine, ref


def _bf16_call(mine: torch.nn.Module, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, expert ids, routing weights) for ``mine`` on CUDA, bf16 leaves."""
    idx, w = _routing(tokens, mine.num_experts, 2, "cuda")
    h = torch.randn(tokens, COMMON["hidden_size"], device="cuda").bfloat16().requires_grad_()
    return h, idx, w.bfloat16().requires_grad_()


def _matches_in_float64(out: torch.Tensor, ref: torch.nn.Module, h: torch.Tensor, idx: torch.Tensor,
                        w16: torch.Tensor, mine: torch.nn.Module) -> None:
    """``out`` (mine on (h, idx, w16)) and its gradients for a random cotangent against HF
    eager in float64 (``ref``: the same rounded weights), within bf16's tolerance."""
    h64 = h.detach().double().requires_grad_()
    w64 = w16.detach().double().requires_grad_()
    want = ref(h64, idx, w64)
    assert_matches(out, want, torch.bfloat16)
    cot = torch.randn_like(want)
    out.backward(cot.bfloat16())
    want.backward(cot)
    assert_matches(h.grad, h64.grad, torch.bfloat16)
    assert_matches(w16.grad, w64.grad, torch.bfloat16)
    for p16, p64 in zip(mine.parameters(), ref.parameters()):
        assert_matches(p16.grad, p64.grad, torch.bfloat16)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_cuda_bf16_experts(family):
    """bf16 (grouped_mm): the experts' output and gradients vs HF eager in float64, on the same
    rounded weights and inputs and one fixed routing (a block-level bf16 comparison is not a
    test of the experts: bf16 router logits flip near-tied top-k choices, and HF's own bf16
    block then differs from float64 by ~2 % normwise, H200 2026-12-01); two runs identical."""
    mine, ref = _experts_pair(family, torch.bfloat16, "cuda")
    h, idx, w16 = _bf16_call(mine, 256)
    _matches_in_float64(mine(h, idx, w16), ref, h, idx, w16, mine)
    with torch.no_grad():
        assert torch.equal(mine(h, idx, w16), mine(h, idx, w16))


def _op_args(tokens: int, experts: int, k: int, hidden: int, inter: int) -> tuple:
    """moe_experts' arguments of these sizes, on the meta device (only sizes are read)."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    return (torch.empty(tokens, hidden, **meta), torch.empty(tokens, k, device="meta", dtype=torch.long),
            torch.empty(tokens, k, **meta), torch.empty(experts, 2 * inter, hidden, **meta), None,
            torch.empty(experts, hidden, inter, **meta), None, "silu", True, False, False, 1.0, float("inf"))


def test_compiled_training_takes_the_grouped_path_where_host_bound(monkeypatch):
    """A training call traced by torch.compile takes the fused kernels only where their
    GEMMs outlast the fused ops' host work (moe_experts_train.TRACED_MIN_FLOPS): Mixtral's
    sizes at T = 512 go to the grouped path, which Inductor compiles whole; at T = 16384 the
    fused ops stay; eager calls always take them; and where Inductor could not compile the
    grouped path whole they stay too."""
    train = pytest.importorskip("opreg.backends.triton.moe_experts_train")
    monkeypatch.setattr(oi, "_fused_train", train)
    monkeypatch.setattr(train, "fused_trains", lambda args: True)  # as on an H200
    whole = [True]
    monkeypatch.setattr(oi.grouped_impl, "grouped_traces_whole", lambda *a: whole[0])
    small, large = _op_args(512, 8, 2, 2048, 4096), _op_args(16384, 8, 2, 2048, 4096)
    flops = lambda t: 6.0 * t * 2 * 2048 * (8192 + 4096)  # noqa: E731
    assert flops(512) < train.TRACED_MIN_FLOPS <= flops(16384)
    assert train.traced_host_bound(small) and not train.traced_host_bound(large)
    assert not oi._trains_fused(small, compiling=True)
    assert oi._trains_fused(large, compiling=True)
    assert oi._trains_fused(small, compiling=False)
    whole[0] = False
    assert oi._trains_fused(small, compiling=True)


def test_compiled_forward_traces_the_grouped_path():
    """Without gradients under torch.compile, where the op would run its grouped path and
    that path traces whole (float32 on the CPU from torch 2.11), the path itself is in the
    graph: no op call at run time, and Inductor fuses its gather, masks and combine. Under a
    ``use(moe_experts="reference")`` scope at compile time the op stays, one node, and runs
    the reference. Both equal HF eager in float64."""
    mine, ref = _experts_pair("qwen3_moe", torch.float32, "cpu")
    idx, w = _routing(9, mine.num_experts, 2, "cpu")
    h = torch.randn(9, COMMON["hidden_size"])
    want = ref(h.double(), idx, w.double())
    whole = oi.grouped_impl.grouped_traces_whole(h, mine.gate_up_proj, mine.down_proj, False)
    assert whole == oi.grouped_impl._CPU_GROUPED_MM_TRACED
    for scope, op_runs in ((contextlib.nullcontext(), not whole), (opreg.use(moe_experts="reference"), True)):
        torch._dynamo.reset()
        with torch.no_grad(), scope:
            fast = torch.compile(mine, fullgraph=True)
            ran = _ran(lambda: assert_matches(fast(h, idx, w), want, torch.float32))
        assert ("opreg::moe_experts" in ran) == op_runs, ran
    torch._dynamo.reset()


@pytest.mark.cuda
@needs_sm90
def test_cuda_compiled_forward_traces_the_grouped_path():
    """bf16 on sm90+ under a ``use(moe_experts="grouped")`` scope: the compiled no-grad
    forward holds the grouped path (no op call at run time), within bf16's tolerance of HF
    eager in float64."""
    mine, ref = _experts_pair("mixtral", torch.bfloat16, "cuda")
    h, idx, w16 = (t.detach() for t in _bf16_call(mine, 64))
    want = ref(h.double(), idx, w16.double())
    torch._dynamo.reset()
    with torch.no_grad(), opreg.use(moe_experts="grouped"):
        fast = torch.compile(mine, fullgraph=True)
        ran = _ran(lambda: assert_matches(fast(h, idx, w16), want, torch.bfloat16))
    torch._dynamo.reset()
    assert "opreg::moe_experts" not in ran, ran


@pytest.mark.cuda
@needs_sm90
def test_cuda_compiled_training_small_step():
    """A compiled bf16 training step below TRACED_MIN_FLOPS: the grouped path, traced whole
    (no opreg op in the graph), with the same output and gradients as eager opreg's fused
    kernels within bf16's tolerance of float64."""
    mine, ref = _experts_pair("mixtral", torch.bfloat16, "cuda")
    h, idx, w16 = _bf16_call(mine, 64)
    torch._dynamo.reset()
    ran = _ran(lambda: torch.compile(mine, fullgraph=True)(h, idx, w16))
    assert not {n for n in ran if n.startswith("opreg::moe_experts")}, ran
    _matches_in_float64(torch.compile(mine, fullgraph=True)(h, idx, w16), ref, h, idx, w16, mine)


@pytest.mark.cuda
@needs_sm90
def test_cuda_graph_capture_block():
    model, _ = _cuda_block("qwen3_moe")
    model = model.bfloat16()
    model.set_experts_implementation("opreg")
    block = moe_block(model)
    x = torch.randn(2, 32, COMMON["hidden_size"], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first_tensor(block(x))  # warm-up (plans, allocator) off the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = first_tensor(block(x))
        x.copy_(torch.randn_like(x))  # new tokens: new routing, new groups
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first_tensor(block(x)))


def _optimized_matches_eager(family: str, ops: set[str], caplog) -> list:
    """``opreg.optimize`` on a model running HF's eager experts: logits and gradients equal
    HF eager in float64; under no_grad exactly ``ops`` of opreg's ran. Returns the findings."""
    model = tiny_model(family).double()  # deepseek_v3 keeps a float32 router parameter otherwise
    model.set_experts_implementation("eager")
    ref = copy.deepcopy(model)
    assert opreg.optimize(model, compile=False) is model
    found = [f for m in experts_modules(model) for f in m._opreg_loops]
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="opreg"):
        assert _ran(lambda: model(ids)) == ops
    params, ref_params = list(model.parameters()), list(ref.parameters())
    out, grads, cot = run(lambda: model(ids).logits, [], params)
    want, want_grads, _ = run(lambda: ref(ids).logits, [], ref_params, cot)
    assert_matches(out, want, torch.float64)
    for got, ref_grad in zip(grads, want_grads):
        assert_matches(got, ref_grad, torch.float64)
    model.set_experts_implementation("batched_mm")  # the wrapper still dispatches
    with torch.no_grad():
        assert not _ran(lambda: model(ids))
        assert_matches(model(ids).logits, want, torch.float64)
    return found


@pytest.mark.parametrize("family", list(FAMILIES))
def test_optimize_runs_moe_experts_for_the_eager_loop(family, caplog):
    """An HF experts module on the eager implementation whose loop the idiom proves and
    whose gate the op expresses runs moe_experts after ``opreg.optimize`` (the module
    rewrite: HF's wrapper rebuilt around opreg's experts)."""
    found = _optimized_matches_eager(family, {"opreg::moe_experts", "opreg::scatter_combine"}, caplog)
    assert found and all((f.matched, f.idiom, f.op) == (True, "transformers_experts", "opreg::moe_experts")
                         and "modeling_" in f.file for f in found), found


@pytest.mark.parametrize("family", list(FAMILIES))
def test_optimize_loop_idiom_alone(family, caplog, monkeypatch):
    """Without the module rewrite, the loop idiom rewrites the loop inside HF's wrapper to
    the grouped form and one scatter_combine. GPT-OSS's gate (``_apply_gate``: strided
    column slices) is not provably row-wise: its loop runs as written, and the log says why."""
    from opreg.loops import registry

    monkeypatch.delitem(registry._MODULE_REWRITES, oi.OPTIMIZE_NAME)
    gpt = family == "gpt_oss"
    found = _optimized_matches_eager(family, set() if gpt else {"opreg::scatter_combine"}, caplog)
    assert found and all((f.matched, f.idiom) == (True, "experts") for f in found), found
    assert ("GptOssExperts._apply_gate is not provably row-wise" in caplog.text) == gpt


def test_optimize_leaves_an_unexpressible_gate_to_the_loop_idiom():
    model = tiny_model("mixtral")
    experts = experts_modules(model)[0]
    experts.__class__ = type("OddGateExperts", (type(experts),), {
        "_apply_gate": lambda self, h: h.chunk(2, -1)[0] * torch.tanh(h.chunk(2, -1)[1])})
    model.set_experts_implementation("eager")
    ref = copy.deepcopy(model)
    opreg.optimize(model, compile=False)
    assert [(f.idiom, f.op) for f in experts._opreg_loops] == [("experts", "opreg::scatter_combine")]
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    with torch.no_grad():
        ran = _ran(lambda: model(ids))
        assert_matches(model(ids).logits, ref(ids).logits, torch.float64)
    # the lambda gate is no module: not provably row-wise, so the loop itself ran
    assert "opreg::moe_experts" not in ran


@pytest.mark.parametrize("impl, combine, loop_op", [
    ("grouped_mm", "(x * g)[inv].view-sum", "opreg::scatter_combine"),
    ("batched_mm", "(x * g).view-sum", "opreg::scatter_combine"),
    ("eager", None, "opreg::moe_experts")])
def test_explain_on_a_transformers_model(impl, combine, loop_op, capsys):
    """``explain`` names transformers' own source lines: the combine of the batched and
    grouped paths (rewritten to scatter_combine by the backend) and the eager expert loop
    (what ``opreg.optimize`` makes of it: moe_experts when the model runs the eager
    experts, else the loop idiom's scatter_combine)."""
    from opreg.explain import explain

    model = tiny_model("qwen3_moe")
    model.set_experts_implementation(impl)
    report = explain(model, [torch.randint(0, COMMON["vocab_size"], (2, 7))])
    printed = capsys.readouterr().out
    assert [(f.spelling, os.path.basename(f.file)) for f in report.matches] == \
        ([(combine, "moe.py")] if combine else []), report
    assert not report.near_misses, report
    assert [(f.matched, f.op, os.path.basename(f.file)) for f in report.loops] == \
        [(True, loop_op, "modeling_qwen3_moe.py")], report
    assert f"rewrites it to {loop_op}" in printed
    assert ("one expert at a time; the module runs opreg's experts instead" in printed) == (impl == "eager")
    for f in (*report.matches, *report.loops):
        assert f"{f.file}:{f.line}" in printed
        assert 0 < f.line <= len(open(f.file).read().splitlines())


def test_optimized_model_saved_and_loaded(tmp_path):
    """torch.save of an optimized model works; the loaded one runs as written (pickle keeps a
    method by its name) until opreg.optimize is called on it again, which rewrites it."""
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("eager")
    opreg.optimize(model, compile=False)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        out, ops = loaded(ids).logits, _ran(lambda: loaded(ids))
        assert "opreg::moe_experts" not in ops
        assert_matches(out, want, torch.float64)
        opreg.optimize(loaded, compile=False)
        again, ops = loaded(ids).logits, _ran(lambda: loaded(ids))
    assert "opreg::moe_experts" in ops
    assert_matches(again, want, torch.float64)


def test_optimize_leaves_an_instance_hook_alone():
    """An experts module whose forward is already replaced on the instance (accelerate's
    hooks do that for offloading) is left as it is: the hook still runs."""
    model = tiny_model("mixtral")
    model.set_experts_implementation("eager")
    experts = experts_modules(model)[0]
    seen = []
    inner = experts.forward

    def hook(*args, **kwargs):
        seen.append(1)
        return inner(*args, **kwargs)

    experts.forward = hook
    ref = copy.deepcopy(model)
    opreg.optimize(model, compile=False)
    assert experts.forward is hook
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    with torch.no_grad():
        out = model(ids).logits
    assert seen and "moe_experts" not in str(experts._opreg_loops)
    assert_matches(out, ref(ids).logits, torch.float64)
