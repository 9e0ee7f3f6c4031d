"""Child of tests/test_moe_inline.py: trace the fused MoE path under ``torch.compile`` on the
CPU, with ``moe_experts_train.INLINE_KERNELS`` on, and print the kernels each graph holds.

Dynamo handles Triton launches only where torch sees a GPU with Triton, and AOT autograd
reads each kernel's writes from its Triton IR, built for the current target. So, before
anything imports torch's compile stack: torch is told that Triton and host tensor
descriptors are there, Triton's active driver is one that names an sm90 target (no launch
ever reaches it: the backend below records the graphs and runs nothing of them), and the
fused path, its implementation binding and the kernels' TMA choice are as on an sm90 GPU.
Prints one line, ``GRAPHS <json>``: for the training step's forward and backward graphs (on
the CPU's choices, then on the H200's: "(grouped_mm)") and the no-grad forward's, the
kernels' names in graph order and the other ops' names; and where the op's eager forward
would run Gluon kernels ("(gluon)"), the no-grad forward's (the op, one node) and the
training step's (its kernels; with ``GLUON_TRAINING_OPS`` the two custom ops).
"""
from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Callable

import torch
import torch.utils._triton as torch_triton

torch_triton.has_triton = lambda: True
torch_triton.has_triton_package = lambda: True
torch_triton._device_supports_tensor_descriptor = lambda: True

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class _Sm90:
    """A driver that only names its target (what Triton IR generation asks)."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


triton.runtime.driver.set_active(_Sm90())

from opreg.backends.triton import moe_experts as F  # noqa: E402
from opreg.backends.triton import moe_experts_backward as B  # noqa: E402
from opreg.backends.triton import moe_experts_train as T  # noqa: E402
from opreg.backends.triton import tune  # noqa: E402

F._has_tma = lambda device_index: True  # the kernels' TMA choice as on an sm90 GPU
F.why_not_fused = lambda *args: None  # CPU tensors, no interpreter: the fused path as on CUDA
T._bound = lambda device_type: "triton"  # the implementation CUDA binds
T.INLINE_KERNELS = True

GRAPHS: dict[str, dict[str, list[str]]] = {}


def _record(name: str) -> Callable[..., Any]:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        kernels, other = [], set()
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            if "triton_kernel_wrapper" in str(n.target):
                kernels.append(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__)
            elif "getitem" not in str(n.target):
                other.add(str(n.target))
        GRAPHS[name] = {"kernels": kernels, "other": sorted(other)}

        def not_run(*args: Any) -> Any:
            raise SystemExit(f"{name} graph recorded, not run")
        return not_run
    return compiler


def main() -> None:
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd

    e, h, i, k, t = 8, 256, 128, 2, 512  # 1024 pairs: the three-kernel routing
    args = list(tune.inputs(e, h, i, k, t, torch.bfloat16, "cpu"))
    for j in (0, 2, 3, 5):  # hidden_states, top_k_weights, gate_up_proj, down_proj
        args[j].requires_grad_()
    def training_step(tag: str) -> None:
        torch._dynamo.reset()
        step = torch.compile(lambda *a: T.train(*a).float().sum(), fullgraph=True,
                             backend=aot_autograd(fw_compiler=_record("forward" + tag),
                                                  bw_compiler=_record("backward" + tag)))
        # the backward compiled with the forward (torch without the option: at the first
        # backward, which never comes here: the forward graph is not run)
        eager_bw = (functorch_config.patch(force_non_lazy_backward_lowering=True)
                    if hasattr(functorch_config, "force_non_lazy_backward_lowering") else contextlib.nullcontext())
        with eager_bw:
            try:
                step(*args)
            except SystemExit:
                pass

    training_step("")
    # the H200's choices (sm90, bf16): GEMM1 on the sorted rows kept for dW1, the weight
    # gradients and GEMM1's dgrad on torch._grouped_mm
    wgrad, dgrad1 = B.grouped_mm_wgrad_default, B.grouped_mm_dgrad1_default
    B.grouped_mm_wgrad_default = lambda *a: True
    B.grouped_mm_dgrad1_default = lambda *a: True
    training_step(" (grouped_mm)")
    B.grouped_mm_wgrad_default, B.grouped_mm_dgrad1_default = wgrad, dgrad1

    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]

    def no_grad_forward(tag: str) -> None:
        def forward(*a: Any) -> torch.Tensor:  # as the transformers integration's: inline, else the op
            out = T.inline_forward(*a)
            return torch.ops.opreg.moe_experts(*a) if out is None else out

        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True,
                                 backend=aot_autograd(fw_compiler=_record("no-grad forward" + tag)))
        with torch.no_grad():
            try:
                compiled(*plain)
            except SystemExit:
                pass

    no_grad_forward("")
    # where the op's eager forward runs the Gluon GEMMs (sm90, bf16, enough rows per expert:
    # moe_experts_train._eager_gluon), which Dynamo does not trace: the op, one node
    T._eager_gluon = lambda *a: True
    no_grad_forward(" (gluon)")
    T.GLUON_TRAINING_OPS = False
    training_step(" (gluon, inline)")  # GLUON_TRAINING_OPS off: the kernels
    T.GLUON_TRAINING_OPS = True
    training_step(" (gluon)")  # the two custom ops, one node each
    print("GRAPHS " + json.dumps(GRAPHS))


if __name__ == "__main__":
    main()
    sys.exit(0)
