"""The registry: selection order, scopes, plug-ins, new ops, build fallback, the cache."""
from __future__ import annotations

import itertools
import os
import stat
import warnings

import pytest
import torch

import opreg
from opreg import _build, registry

import _fresh as fresh
from _util import assert_matches

SC = torch.ops.opreg.scatter_combine.default
_names = itertools.count()


def sc_inputs(t: int = 16):
    idx = torch.arange(t).repeat_interleave(2)[torch.randperm(2 * t)]
    return torch.randn(2 * t, 8), idx, torch.rand(2 * t), t


def kernel_line(op: str, key: str) -> str:
    """The dispatcher's computed entry for ``op`` at ``key`` (file of the kernel)."""
    table = torch._C._dispatch_dump_table(f"opreg::{op}")
    return next((ln for ln in table.splitlines() if ln.startswith(key + ":")), "")


def have_compiler() -> bool:
    return registry.lookup("scatter_combine").impls["cpu"].unavailable("cpu") is None


def test_default_binding_is_cpp_with_no_python_on_the_call_path():
    if not have_compiler():
        pytest.skip("no C++ compiler")
    SC(*sc_inputs())
    assert opreg.bound("scatter_combine", "cpu") == "cpu"
    assert opreg.autograd_kind("scatter_combine") == "cpp"
    # The kernels the dispatcher runs for CPU tensors come from our C++ sources, and
    # nothing of ours sits at BackendSelect (no scope is open).
    assert "backends/cpu/scatter_combine.cpp" in kernel_line("scatter_combine", "CPU")
    assert "backends/autograd/" in kernel_line("scatter_combine", "AutogradCPU")
    assert "registry.py" not in kernel_line("scatter_combine", "BackendSelect")


def test_use_scope_rebinds_and_restores():
    args = sc_inputs()
    SC(*args)
    before = opreg.bound("scatter_combine", "cpu")
    with opreg.use("reference"):
        assert opreg.bound("scatter_combine", "cpu") == "reference"
        inside = SC(*args)
    assert opreg.bound("scatter_combine", "cpu") == before
    # After the scope, the router is covered again: the default path has no Python.
    assert "fallthrough" in kernel_line("scatter_combine", "BackendSelect")
    assert_matches(inside, opreg.ops.scatter_combine.reference(*[
        a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]),
        torch.float32)


def test_use_rejects_unknown_names():
    with pytest.raises(KeyError, match="nope"):
        with opreg.use(scatter_combine="nope"):
            pass
    with pytest.raises(KeyError, match="no op named"):
        with opreg.use(not_an_op="reference"):
            pass


@pytest.fixture
def third_party():
    """A plug-in implementation registered from outside the package, as a user would."""
    calls = []

    @opreg.register_impl("scatter_combine", "test_plugin", devices=("cpu",))
    def plugin(expert_hidden, token_idx, gates, num_tokens):
        calls.append(expert_hidden.shape)
        return opreg.ops.scatter_combine.reference(expert_hidden, token_idx, gates, num_tokens)

    yield plugin, calls
    opreg.unregister_impl("scatter_combine", "test_plugin")


def test_third_party_impl_selected_when_asked(third_party):
    plugin, calls = third_party
    args = sc_inputs()
    SC(*args)
    assert calls == []  # lower priority than the built-ins: not used unless asked
    assert opreg.get("scatter_combine", impl="test_plugin") is plugin
    with opreg.use(scatter_combine="test_plugin"):
        out = opreg.get("scatter_combine")(*args)
        assert len(calls) == 1
        assert opreg.bound("scatter_combine", "cpu") == "test_plugin"
    SC(*args)
    assert len(calls) == 1
    torch.testing.assert_close(out, SC(*args))
    rows = [r for r in opreg.implementations("scatter_combine") if r["impl"] == "test_plugin"]
    assert rows and rows[0]["available"]


def test_explicit_choice_beats_scope(third_party):
    _, calls = third_party
    with opreg.use(scatter_combine="test_plugin"):
        opreg.get("scatter_combine", impl="reference")(*sc_inputs())
    assert calls == []


def test_high_priority_plugin_becomes_default():
    calls = []

    @opreg.register_impl("scatter_combine", "test_fast", devices=("cpu",), priority=1000,
                         dtypes=[torch.float32])
    def fast(*args):
        calls.append(1)
        return opreg.ops.scatter_combine.reference(*args)

    try:
        SC(*sc_inputs())
        assert calls == [1]
        h, i, g, t = sc_inputs()
        SC(h.double(), i, g.double(), t)  # not one of its dtypes: the reference runs
        assert calls == [1]
    finally:
        opreg.unregister_impl("scatter_combine", "test_fast")
    SC(*sc_inputs())
    assert calls == [1] and opreg.bound("scatter_combine", "cpu") != "test_fast"


def test_duplicate_names_raise():
    with pytest.raises(ValueError, match="already has an implementation"):
        opreg.register_impl("scatter_combine", "reference")(lambda *a: None)
    with pytest.raises(ValueError, match="already registered"):
        opreg.register_op("scatter_combine", "(Tensor x) -> Tensor")(lambda x: x)
    with pytest.raises(KeyError, match="no op named"):
        opreg.get("no_such_op")


def test_register_new_op_with_autograd():
    name = f"test_scaled_add_{next(_names)}"

    @opreg.register_op(name, "(Tensor x, Tensor y, float alpha) -> Tensor")
    def scaled_add(x, y, alpha):
        return x + alpha * y

    op = getattr(torch.ops.opreg, name).default
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(op(x, y, 0.5), x + 0.5 * y)
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, 0.5), (x, y))
    assert opreg.autograd_kind(name) == "python"
    torch.library.opcheck(op, (x, y, 0.5))
    assert opreg.get(name, impl="reference") is scaled_add


def test_an_implementation_that_trains_itself():
    """``register_impl(..., train=)``: a call with gradients that binds the implementation
    runs its ``train`` (its own backward); None from it, a ``use()`` scope binding another,
    or no gradient: the reference's gradients / the plain kernel, as before."""
    name = f"test_cube_{next(_names)}"

    @opreg.register_op(name, "(Tensor x) -> Tensor")
    def cube(x):
        return x * x * x

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x ** 3

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 3 * x * x

    trained = []

    def train(x):
        if x.dtype != torch.float64:
            return None  # this one trains float64 only
        trained.append(1)
        return Cube.apply(x)

    @opreg.register_impl(name, "mine", devices=("cpu",), priority=200, train=train)
    def mine(x):
        return x ** 3

    op = getattr(torch.ops.opreg, name).default
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = op(x)
    assert trained == [1] and type(y.grad_fn).__name__ == "CubeBackward"
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, 3 * x.detach() ** 2)
    assert torch.autograd.gradcheck(op, (x,))  # through train, both ways
    n = len(trained)
    (g32,) = torch.autograd.grad(op(x.float()).sum(), x)  # train says no: the reference's
    torch.testing.assert_close(g32.float(), 3 * x.detach().float() ** 2)  # float32 arithmetic
    with opreg.use(**{name: "reference"}):
        op(x)
    with torch.no_grad():
        op(x)
    assert len(trained) == n, "train ran where it should not"


def test_failing_build_falls_back_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("OPREG_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "kernels"
    src.mkdir()
    (src / "broken.cpp").write_text("this is not C++;\n")
    name = f"test_double_{next(_names)}"

    @opreg.register_op(name, "(Tensor x) -> Tensor")
    def double(x):
        return x * 2

    registry.add_impl(name, registry.Impl(
        "broken", name, ("cpu",), priority=500,
        extension=_build.Extension(f"opreg_test_broken_{name}", str(src))))
    op = getattr(torch.ops.opreg, name).default
    x = torch.randn(4)
    with pytest.warns(RuntimeWarning, match="failed to build"):
        torch.testing.assert_close(op(x), x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(op(x), x * 2)  # no second warning
    row = next(r for r in opreg.implementations(name) if r["impl"] == "broken")
    assert not row["available"] and "failed to build" in row["why_not"]
    assert opreg.bound(name, "cpu") == "reference"
    with pytest.raises(RuntimeError, match="unavailable"):
        opreg.get(name, impl="broken")


def test_cache_dir_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("OPREG_CACHE_DIR", str(tmp_path / "c"))
    d = _build.build_dir(_build.CPU)
    for p in (d, d.parent, tmp_path / "c"):
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("OPREG_CACHE_DIR", str(shared))
    _build.build_dir(_build.CPU)
    assert stat.S_IMODE(shared.stat().st_mode) & 0o022 == 0
    if os.getuid() == 0:
        os.chown(shared, 65534, 65534)
        with pytest.raises(_build.BuildError, match="owned by uid"):
            _build.build_dir(_build.CPU)


def test_stale_lock_does_not_hang():
    """A build killed half-way leaves cpp_extension's lock file behind; the next
    build must not wait on it forever."""
    if not have_compiler():
        pytest.skip("no C++ compiler")
    SC(*sc_inputs())  # make sure the library is built
    (_build.build_dir(_build.CPU) / "lock").write_text("")
    code = "import opreg._build as b; b.build(b.CPU); print('ok')"
    out = fresh.run(["-c", code], timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_cuda_home_follows_wrapper_script(tmp_path, monkeypatch):
    real = tmp_path / "toolkit" / "bin"
    real.mkdir(parents=True)
    (real / "nvcc").write_text("#!/bin/sh\necho real\n")
    wrapper = tmp_path / "wrap" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {real / "nvcc"} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    assert _build.cuda_home() == str((tmp_path / "toolkit").resolve())


def test_ops_work_under_compile_and_export():
    args = sc_inputs()
    parts = [torch.randn(3, 4), torch.randn(3, 5)]
    w, b = torch.randn(6, 9), torch.randn(6)

    def f(h, i, g, ps, w, b):
        return torch.ops.opreg.scatter_combine(h, i, g, 16) @ w[:, :8].t(), \
            torch.ops.opreg.cat_linear(ps, w, b)

    eager = f(*args[:3], parts, w, b)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(*args[:3], parts, w, b)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)

    class M(torch.nn.Module):
        def forward(self, h, i, g, p0, p1, w):
            return torch.ops.opreg.scatter_combine(h, i, g, 16), torch.ops.opreg.cat_linear([p0, p1], w, None)

    ep = torch.export.export(M(), (*args[:3], *parts, w))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"opreg.scatter_combine.default", "opreg.cat_linear.default"} <= targets
    for e, c in zip(M()(*args[:3], *parts, w), ep.module()(*args[:3], *parts, w)):
        torch.testing.assert_close(c, e)


def test_without_a_working_compiler_everything_still_works(tmp_path):
    """No usable C++ compiler: at most one warning per library, naming the compiler, then the
    reference with Python autograd (the reference's own gradients) for both built-in ops.
    (The kernels' library is found unusable by the probe, without a build: `opreg list` says
    why; the autograd library's build is tried and warns.)"""
    code = """
import warnings, torch, opreg
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as w:
    h = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    g = torch.rand(6, dtype=torch.float64, requires_grad=True)
    i = torch.tensor([0, 2, 1, 0, 2, 2])
    assert torch.autograd.gradcheck(lambda h, g: torch.ops.opreg.scatter_combine(h, i, g, 3), (h, g))
    ps = [torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    wt = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: torch.ops.opreg.cat_linear([a, b], c, None), (*ps, wt))
msgs = [str(x.message) for x in w if "failed to build" in str(x.message)]
# At least one warning, none twice for a library, each naming the compiler.
named = [n for m in msgs for n in ("opreg_cpu", "opreg_autograd") if n + " failed" in m]
assert msgs and len(named) == len(set(named)) == len(msgs), msgs
assert all("/bin/false" in m for m in msgs), msgs
with torch.no_grad():  # (under grad, the Python autograd runs the reference itself)
    torch.ops.opreg.scatter_combine(h, i, g, 3)
assert opreg.bound("scatter_combine", "cpu") == "reference"
assert opreg.autograd_kind("scatter_combine") == opreg.autograd_kind("cat_linear") == "python"
print("ok")
"""
    env = {**os.environ, "CXX": "/bin/false", "OPREG_CACHE_DIR": str(tmp_path)}
    out = fresh.run(["-c", code], timeout=300, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr[-3000:]
