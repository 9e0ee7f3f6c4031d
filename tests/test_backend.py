"""The "opreg" torch.compile backend: registration (by name and via the entry point),
options, Inductor end to end (default kernels, profiler, training, dynamic shapes,
in-place into graph inputs), the cache key, user patterns, and explain."""
from __future__ import annotations

import importlib.metadata
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _fresh as fresh
import pytest
import torch
import torch.nn as nn

import opreg
import opreg.backend as backend
from opreg.backend import GraphPattern, RecordingBackend, opreg_backend, stats
from opreg.explain import explain, main as explain_main
from opreg.models import cat_linear as cat_model
from opreg.patterns import cat_linear as cl_pattern

T, N, H = 5, 11, 8


@pytest.fixture(autouse=True)
def _reset() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def gated_index_add(out: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    out.index_add_(0, idx, x * g[:, None])
    return out


def sc_args(t: int = T, n: int = N) -> list[torch.Tensor]:
    return [torch.randn(t, H), torch.randint(0, t, (n,)), torch.randn(n, H), torch.rand(n)]


# ------------------------------------------------------------------------ registration

def test_backend_by_name() -> None:
    assert "opreg" in torch._dynamo.list_backends()
    with opreg.use("reference"):
        f = torch.compile(lambda x, w: torch.cat([x, x], -1) @ w.T, backend="opreg",
                          options={"inner": "eager"})
        x, w = torch.randn(3, 4), torch.randn(5, 8)
        torch.testing.assert_close(f(x, w), torch.cat([x, x], -1) @ w.T)


def test_entry_point_registration_does_not_duplicate(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the entry point known, Dynamo's lookup_backend loads this module and then
    registers the loaded function itself: importing must not have registered it already."""
    from torch._dynamo.backends import registry

    class EntryPoint:
        def load(self) -> Any:
            backend._register_backend()        # what importing opreg.backend runs
            return opreg_backend

    monkeypatch.delitem(registry._COMPILER_FNS, "opreg")
    monkeypatch.setitem(registry._BACKENDS, "opreg", EntryPoint())
    assert registry.lookup_backend("opreg") is opreg_backend


ENTRY_POINT = "opreg = opreg.backend:opreg_backend"   # [project.entry-points.torch_dynamo_backends]


def test_entry_point_subprocess(tmp_path: Path) -> None:
    """backend="opreg" with no opreg import, through the entry point. If the installed
    package doesn't declare it yet, a stand-in dist-info on PYTHONPATH does."""
    import os

    env = dict(os.environ)
    stand_in = "opreg" not in importlib.metadata.entry_points(group="torch_dynamo_backends").names
    if stand_in:
        info = tmp_path / "opreg_entry_point-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: opreg-entry-point\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[torch_dynamo_backends]\n{ENTRY_POINT}\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    code = textwrap.dedent("""
        import sys, torch
        assert "opreg.backend" not in sys.modules
        f = torch.compile(lambda x: x * 2, backend="opreg", options={"inner": "eager"})
        print(f(torch.ones(2)).tolist(), "opreg.backend" in sys.modules)
    """)
    if stand_in:  # on PYTHONPATH: only a new interpreter reads it
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    else:  # forked from a process that has imported torch, not opreg (~3.5 s less of CPU)
        r = fresh.run(["-c", code], timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[2.0, 2.0] True"


# ----------------------------------------------------------------------------- options

def test_options_patterns_and_inner() -> None:
    with opreg.use("reference"):
        args = sc_args()
        expected = gated_index_add(*[a.clone() for a in args])
        for options, rewrites in (({"inner": "eager"}, 1), ({"inner": "aot_eager"}, 1),
                                  ({"inner": "eager", "patterns": []}, 0),
                                  ({"inner": "eager", "patterns": ["cat_linear"]}, 0)):
            torch._dynamo.reset()
            before = stats["rewrites"]
            f = torch.compile(gated_index_add, backend="opreg", options=options)
            torch.testing.assert_close(f(*[a.clone() for a in args]), expected)
            assert stats["rewrites"] - before == rewrites, options


@pytest.mark.parametrize("options,match", [({"inner": "nope"}, "inner must be one of"),
                                           ({"inner": "eager", "max_autotune": True}, "Inductor options"),
                                           ({"inner": "eager", "patterns": ["nope"]}, "unknown pattern")])
def test_bad_options(options: dict[str, Any], match: str) -> None:
    f = torch.compile(lambda x: x + 1, backend="opreg", options=options)
    with pytest.raises(Exception, match=match):
        f(torch.ones(2))


def test_inductor_config_patches() -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    patches = backend.inductor_config_patches("max-autotune-no-cudagraphs", {"freezing": False})
    assert patches["freezing"] is False and patches["max_autotune"] is True
    key_pass = patches["post_grad_custom_pre_pass"]
    assert isinstance(key_pass, CustomGraphPass)
    assert key_pass.uuid() == backend.patterns_uuid()


def test_cache_key_follows_pattern_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Editing a pattern's source changes the uuid Inductor's caches key on."""
    src = tmp_path / "my_pattern_mod.py"
    body = textwrap.dedent("""
        from opreg.backend import GraphPattern
        class MyPattern(GraphPattern):
            name = "my_pattern"
            def apply(self, gm, ctx):
                return 0  # VERSION
    """)
    src.write_text(body.replace("VERSION", "v1"))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("my_pattern_mod")
    p = mod.MyPattern()
    pats = backend.registered_patterns() + [p]
    u1, k1 = p.uuid(), backend.patterns_uuid(pats)
    src.write_text(body.replace("VERSION", "v2"))
    assert p.uuid() != u1 and backend.patterns_uuid(pats) != k1
    assert backend.patterns_uuid(backend.registered_patterns()) != k1


def test_existing_post_grad_pass_is_chained() -> None:
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Theirs(CustomGraphPass):
        calls = 0

        def __call__(self, graph: torch.fx.Graph) -> None:
            Theirs.calls += 1

        def uuid(self) -> Any:
            return "theirs-v1"

    with config.patch(post_grad_custom_pre_pass=Theirs()):
        p = backend.inductor_config_patches()["post_grad_custom_pre_pass"]
    p(torch.fx.Graph())
    assert Theirs.calls == 1 and p.uuid() == (backend.patterns_uuid(), "theirs-v1")


# ------------------------------------------------------------- Inductor, end to end

def test_cat_model_inductor_default_kernels() -> None:
    """The acceptance check: torch.compile(CatModel(), backend="opreg") == eager and runs
    opreg::cat_linear_stacked (default binding; the parts are x[i]) - visible in the
    profiler."""
    m = cat_model.Model()
    (x,) = cat_model.get_inputs(generator=torch.Generator().manual_seed(0))
    before = cl_pattern.PATTERN.total
    c = torch.compile(m, backend="opreg")
    torch.testing.assert_close(c(x), m(x))
    with torch.profiler.profile() as prof:
        got = c(x)
    torch.testing.assert_close(got, m(x))
    assert "opreg::cat_linear_stacked" in {e.name for e in prof.events()}
    assert cl_pattern.PATTERN.total == before + 1


def test_inductor_training_matches_eager() -> None:
    m = cat_model.Model()
    (x0,) = cat_model.get_inputs()
    c = torch.compile(m, backend="opreg")
    grads = []
    for f in (m, c):
        m.zero_grad()
        x = x0.clone().requires_grad_()
        loss = f(x).tanh().sum()
        loss.backward()
        grads.append((loss.detach(), x.grad, m.proj.weight.grad.clone(), m.proj.bias.grad.clone()))
    torch.testing.assert_close(grads[1], grads[0])


def test_inductor_inplace_into_graph_input_dynamic() -> None:
    """index_add_ into a graph input under Inductor, sizes marked dynamic: the input is
    mutated as in eager, one graph serves every size."""
    before = stats["graphs"]
    f = torch.compile(gated_index_add, backend="opreg")
    for t, n in ((5, 11), (9, 30), (3, 7)):
        args = sc_args(t, n)
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        eager_args = [a.clone() for a in args]
        expected = gated_index_add(*eager_args)
        got = f(*args)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(args[0], eager_args[0])   # the input itself was updated
    assert stats["graphs"] - before == 1


# ---------------------------------------------------------------------- user patterns

def _scaled_tanh_reference(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.tanh(x) * s


def test_register_pattern_from_outside() -> None:
    """A user op (opreg.register_op) and its pattern (reference computation -> op)."""
    if "test_scaled_tanh" not in opreg.registry.ops():
        opreg.register_op("test_scaled_tanh", "(Tensor x, float s) -> Tensor")(_scaled_tanh_reference)

    def search(x):
        return torch.tanh(x) * 2.0

    def replacement(x):
        return torch.ops.opreg.test_scaled_tanh(x, 2.0)

    p = backend.register_pattern(search, replacement, name="scaled_tanh", op="test_scaled_tanh",
                                 check=lambda v: v["x"].dtype == torch.float32)
    try:
        with pytest.raises(ValueError, match="already registered"):
            backend.register_pattern(search, replacement, name="scaled_tanh")

        def model(x):
            return torch.tanh(x + 1) * 2.0 + 1

        for dtype, rewritten in ((torch.float32, 1), (torch.float64, 0)):
            torch._dynamo.reset()
            rec = RecordingBackend()
            x = torch.randn(4, 3, dtype=dtype)
            torch.testing.assert_close(torch.compile(model, backend=rec)(x), model(x))
            assert rec.after[0]["opreg::test_scaled_tanh"] == rewritten
            assert rec.after[0]["tanh"] == 1 - rewritten
        assert p.matches["scaled_tanh"] == 1
        assert backend.patterns_uuid() != backend.patterns_uuid(backend.registered_patterns()[:2])
    finally:
        backend.unregister_pattern("scaled_tanh")
    assert all(q.name != "scaled_tanh" for q in backend.registered_patterns())


def test_register_graph_pattern_subclass() -> None:
    class CountCats(GraphPattern):
        name = "count_cats"

        def apply(self, gm: torch.fx.GraphModule, ctx: Any) -> int:
            self.matches["cat"] += sum(1 for n in gm.graph.nodes if n.target is torch.cat)
            return 0

    p = backend.register_pattern(CountCats())
    try:
        torch.compile(lambda a: torch.cat([a, a]), backend=RecordingBackend())(torch.ones(2))
        assert p.matches["cat"] == 1
    finally:
        backend.unregister_pattern("count_cats")


# ----------------------------------------------------------------------------- explain

class NearMisses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * H, 3)
        self.proj0 = nn.Linear(H, 3)

    def forward(self, out, idx, x, g, parts):
        out.index_add_(0, idx, x * g[:, None])                      # matched
        o2 = torch.zeros_like(out)
        o2[idx] += x                                                # index_put_ w/o accumulate
        y = self.proj(torch.cat([parts[0], parts[1]], dim=-1))      # matched
        z = self.proj0(torch.cat([parts[0], parts[1]], dim=0))      # cat on dim 0
        c = torch.cat([parts[0], parts[1]], -1)
        w = self.proj(c) + c.sum()                                  # cat used elsewhere
        return out, o2, y, z, w


def test_explain_reports_matches_and_near_misses(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*sc_args(), torch.randn(2, 4, H)]
    report = explain(NearMisses(), args)
    printed = capsys.readouterr().out
    assert sorted(f.pattern for f in report.matches) == ["cat_linear", "scatter_combine"]
    reasons = {f.reason.split(":")[0] for f in report.near_misses}
    assert any("without accumulate" in r for r in reasons), reasons
    assert any("cat on dim 0" in r for r in reasons), reasons
    assert any("used elsewhere" in r for r in reasons), reasons
    this_file = Path(__file__).name
    for f in report.matches + report.near_misses:
        assert f.file.endswith(this_file) and f.line > 0, f
    assert f"{this_file}:" in printed and "opreg::scatter_combine" in printed


def test_explain_points_loops_to_optimize(capsys: pytest.CaptureFixture[str]) -> None:
    from opreg.models import moe_combine_loop as moe

    report = explain(moe.Model(), moe.get_inputs())
    assert report.graphs == 0 and report.graph_breaks
    assert [f.matched for f in report.loops] == [True]
    assert "opreg.optimize" in capsys.readouterr().out


def test_explain_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert explain_main(["opreg.models.cat_linear:Model"]) == 0
    out = capsys.readouterr().out
    # The op actually emitted: the parts are x[i] slices, so the stacked form.
    assert re.search(r"cat_linear\.py:\d+: linear -> opreg::cat_linear_stacked", out), out
    assert explain_main(["opreg.models.no_such_module"]) == 2


def test_cache_key_hashes_the_framework_and_the_op_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit of any file a pattern depends on (the framework's, the pattern's own, its
    op spec) changes the key Inductor's caches use, so none can serve a stale entry."""
    from opreg.compile import cache_key
    from opreg.patterns import cat_linear, scatter_combine

    here = Path(cache_key.__file__).resolve().parent
    files = [here / f"{m}.py" for m in cache_key.FRAMEWORK]
    for p in (scatter_combine.PATTERN, cat_linear.PATTERN):
        used = cache_key.pattern_files(p.sources())
        assert any(f.endswith(f"opreg/ops/{p.op}.py") for f in used), used
        files += [Path(f) for f in used]
        files.append(Path(inspect.getsourcefile(type(p))))
    real = Path.read_bytes
    before = backend.patterns_uuid()
    for f in files:
        monkeypatch.setattr(Path, "read_bytes",
                            lambda self, f=f: real(self) + (b"#edit" if self.resolve() == f.resolve() else b""))
        assert backend.patterns_uuid() != before, f"an edit of {f} leaves the cache key unchanged"
        monkeypatch.setattr(Path, "read_bytes", real)
    assert backend.patterns_uuid() == before


def test_cache_key_covers_what_the_op_specs_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transitively: ``opreg/ops/_common.py`` (the dtype sets and checks every op spec's
    ``unsupported()`` uses) is no pattern's import, yet an edit of it changes the key."""
    from opreg.compile import cache_key
    from opreg.ops import _common
    from opreg.patterns import cat_linear, scatter_combine

    common = Path(_common.__file__).resolve()
    for p in (scatter_combine.PATTERN, cat_linear.PATTERN):
        assert str(common) in cache_key.pattern_files(p.sources())
    real = Path.read_bytes
    before = backend.patterns_uuid()
    monkeypatch.setattr(Path, "read_bytes",
                        lambda self: real(self) + (b"\n# edit" if self.resolve() == common else b""))
    assert backend.patterns_uuid() != before, "an edit of opreg/ops/_common.py leaves the key unchanged"
    monkeypatch.setattr(Path, "read_bytes", real)
    assert backend.patterns_uuid() == before
