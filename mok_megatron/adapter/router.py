"""``MoKTopKRouter``: Megatron's ``TopKRouter`` with two of its GPU costs removed.

* ``gating``: with ``moe_router_dtype='fp32'`` and bf16/fp16 parameters the logits come from a bf16 GEMM
  that accumulates and writes fp32, and the backward splits the fp32 gradient into two bf16 halves
  (``mok_megatron.ops.router_gemm``) instead of fp32 CUDA-core GEMMs on fp32 copies of the input.
  Every other router dtype (none, i.e. the parameters' dtype, or fp64) keeps Megatron's gating: the
  logits are Megatron's own, bit for bit.
* ``routing``: the top-k *selection* (for routing and for the aux-loss map) is one Triton pass per row
  (``mok_megatron.kernels.topk``) instead of ``torch.topk``; Megatron's own
  ``topk_routing_with_score_function`` then computes the probabilities at those indices
  (``precomputed_indices``), so values and gradients are Megatron's. The selection runs on exactly the
  tensor Megatron selects on (logits, softmax / sigmoid / sqrt-softplus scores, plus expert bias).

Routing parity with Megatron (``tests/kernel_cases.py``, ``router/*``): where a token's scores have no tie
at the K-th place, MoK routes it to exactly the experts ``torch.topk`` picks. At such a tie MoK takes the
lower expert index; ``torch.topk``'s order there is unspecified and device-dependent, so the two may
route that token differently (and build a different aux-loss map). With ``moe_router_dtype='fp32'``
(recommended) ties need equal fp32 logits and were not seen on random inputs at 64 experts / top-8; the
fp32 logits differ from Megatron's only in summation order (each within 5e-7 of the exact sum, against
gaps of >= 2.9e-5 between the 8th and 9th logit there). With bf16 parameters and no ``moe_router_dtype``
both routers select on the same bf16-rounded logits, and 2-5% of tokens tie at the 8th place (64 experts,
top-8): those are the tokens that can route differently (measurements: ``mok_megatron.kernels.topk``).

Everything else is Megatron's, untouched: z-loss, token dropping, aux / seq-aux / global-aux losses,
expert-bias updates, the state dict. Group-limited routing, sinkhorn, quantile balancing, router replay,
``--moe-router-fusion`` (TE's fused kernels) and CPU tensors (outside Triton's interpreter) keep
Megatron's ``routing``; fp64 / bf16 router dtypes and fp32 parameters keep Megatron's ``gating``. The MoK
specs use this router wherever Megatron's spec had ``TopKRouter``; a spec with a custom router keeps it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    topk_routing_with_score_function,
)
from megatron.core.transformer.moe.router import TopKRouter

from mok_megatron.ops.fast import triton_path
from mok_megatron.ops.router_gemm import router_logits

_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")


def _positive_scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "sigmoid":
        return torch.sigmoid(logits_TE.float())
    return F.softplus(logits_TE.float()).sqrt()


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

    def _fast_routing(self, logits: torch.Tensor) -> bool:
        cfg = self.config
        return (
            triton_path(logits, "topk_indices")
            and self.score_function in _SCORES
            and not any(t in ("sinkhorn", "quantile_balancing") for t in _as_list(self.routing_type))
            and not cfg.moe_router_fusion
            and getattr(self, "router_replay", None) is None
            and not cfg.moe_router_group_topk
            and not cfg.moe_router_num_groups
        )

    def _selection_scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The tensor Megatron's ``topk_routing_with_score_function`` takes its top-k of."""
        if self.score_function == "softmax":
            if self.config.moe_router_pre_softmax:
                return torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
            return logits_TE
        scores = _positive_scores(logits_TE, self.score_function)
        return scores if self.expert_bias is None else scores + self.expert_bias.float()

    def _aux_scores(self, logits_TE: torch.Tensor, padding_mask):
        """Megatron's ``compute_routing_scores_for_aux_loss`` with the top-k on the Triton kernel."""
        from mok_megatron.kernels.topk import topk_indices

        if self.score_function == "softmax":
            scores = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        else:
            scores = _positive_scores(logits_TE, self.score_function)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        idx = topk_indices(scores.detach(), self.topk)
        routing_map = torch.zeros_like(logits_TE, dtype=torch.bool).scatter_(1, idx, True)
        if padding_mask is not None:
            valid = (~padding_mask).unsqueeze(-1)
            routing_map, scores = routing_map * valid, scores * valid
        return routing_map, scores

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if not self._fast_routing(logits):
            return super().routing(logits, padding_mask=padding_mask)
        from mok_megatron.kernels.topk import topk_indices

        cfg = self.config
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, cfg.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        idx_TK = topk_indices(self._selection_scores(logits).detach(), self.topk)
        probs, routing_map = topk_routing_with_score_function(
            logits,
            self.topk,
            use_pre_softmax=cfg.moe_router_pre_softmax,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=self.score_function,
            expert_bias=self.expert_bias,
            precomputed_indices=idx_TK,
        )
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs,
                routing_map,
                router_topk=self.topk,
                capacity_factor=cfg.moe_expert_capacity_factor,
                drop_policy=cfg.moe_token_drop_policy,
                pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
            )
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, aux_scores = self._aux_scores(logits, padding_mask)
            masked = padding_mask is not None
            probs = self._apply_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
            probs = self._apply_seq_aux_loss(
                probs, aux_scores, aux_map, seq_length, bsz, with_padding_mask=masked
            )
            probs = self._apply_global_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]
