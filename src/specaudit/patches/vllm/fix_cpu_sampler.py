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

from typing import Any


def _install() -> None:
    import torch
    from vllm.utils import cpu_triton_utils  # type: ignore[import-not-found]
    from vllm.v1.sample.ops import topk_topp_sampler  # type: ignore[import-not-found]

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

    top_k_only = topk_topp_sampler.apply_top_k_only

    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if k.numel() == 0:
            return logits
        out: torch.Tensor = top_k_only(logits, k)
        return out

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    topk_topp_sampler.apply_top_k_only = apply_top_k_only


_install()
