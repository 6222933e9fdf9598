"""specaudit's fix ``cpu-sampler`` of vLLM 0.32.0's CPU rejection sampler, imported by
`sitecustomize` in every process of a server started with it (`specaudit.vllm.fixes`). Upstream
text and reproducer: docs/upstream/vllm-cpu-expand-kernel.md.

1. ``vllm.utils.cpu_triton_utils._expand_kernel_impl`` (the CPU stand-in for the Triton
   ``expand_kernel``) hands the C++ kernel int64 *copies* of its output and input and never
   copies back, so ``expand_batch_to_tokens`` returns uninitialised memory for every tensor that
   is not int64: the per-draft-token temperature and top-p (float32) and top-k (int32) that
   ``apply_sampling_constraints`` applies to the target's logits at each drafted position.
   Fixed: the expansion done in torch, in the output's own dtype.
2. ``apply_top_k_only`` takes ``k.max()`` of an empty tensor on a step that verifies no draft
   tokens. Fixed: no rows, nothing to mask.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def _fix_expand(module: ModuleType) -> None:
    import torch

    def expand_kernel_impl(
        output: torch.Tensor,
        input_val: torch.Tensor,
        cu_num_tokens: torch.Tensor,
        replace_from: Any,
        replace_to: Any,
        MAX_NUM_TOKENS: Any = None,  # noqa: N803 (the kernel's own argument name)
    ) -> None:
        cu = cu_num_tokens.to(torch.int64)
        counts = torch.diff(cu, prepend=cu.new_zeros(1))
        to = torch.as_tensor(replace_to, dtype=input_val.dtype, device=input_val.device)
        values = torch.where(input_val == replace_from, to, input_val)
        output.copy_(torch.repeat_interleave(values, counts).to(output.dtype))

    setattr(module, "_expand_kernel_impl", expand_kernel_impl)  # noqa: B010


def _fix_top_k(module: ModuleType) -> None:
    import torch

    top_k_only = getattr(module, "apply_top_k_only")  # noqa: B009 (a module mypy cannot see)

    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if k.numel() == 0:
            return logits
        out: torch.Tensor = top_k_only(logits, k)
        return out

    setattr(module, "apply_top_k_only", apply_top_k_only)  # noqa: B010


# applied right after vLLM imports each module, in whichever process does: importing vLLM here,
# at interpreter start, would slow every process down (and the first request with it)
FIXES: dict[str, Callable[[ModuleType], None]] = {
    "vllm.utils.cpu_triton_utils": _fix_expand,
    "vllm.v1.sample.ops.topk_topp_sampler": _fix_top_k,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules of `FIXES` as Python would, and fixes each once it has run."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        fix = FIXES.get(name)
        if fix is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            fix(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterImport())
