"""``MoKTopKRouter``: Megatron's ``TopKRouter`` with the fp32 gating GEMM on bf16 tensor cores.

Only ``gating`` changes (see ``mok_megatron.ops.router_gemm``): with ``moe_router_dtype='fp32'`` and
bf16/fp16 parameters the logits come from a bf16 GEMM that accumulates and writes fp32, and the backward
splits the fp32 gradient into two bf16 halves. Routing, score functions, expert bias, aux / seq-aux /
global-aux / z losses, token dropping and the state dict are Megatron's, untouched. Everything else
(fp64 or bf16 router dtype, fp32 parameters, input jitter on its own path) falls back to Megatron's
``router_gating_linear``. The MoK specs use this router wherever Megatron's spec had ``TopKRouter``; a
spec with a custom router keeps it.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

from mok_megatron.ops.router_gemm import router_logits


class MoKTopKRouter(TopKRouter):
    def gating(self, input: torch.Tensor):
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype
        )
        if input.is_cuda and self.weight.is_cuda:
            logits = router_logits(input, self.weight, self.bias, router_dtype)
            if logits is not None:
                return logits
        return super().gating(input)
