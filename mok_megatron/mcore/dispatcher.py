"""``MoKTokenDispatcher``: Megatron's ``MoETokenDispatcher`` phases on top of ``mok_megatron.functional``.

Megatron calls the six phases with tensors only, so the adapter keeps exactly one piece of state:
the frozen ``DispatchPlan`` of the call in flight, set by ``dispatch_preprocess`` and dropped by
``combine_postprocess``. Everything backward needs is captured by the autograd graph, so Megatron's
schedules may interleave the backward of one micro-batch with the forward of the next.

With ``moe_shared_expert_overlap`` the dispatcher drives ``SharedExpertMLP``'s overlap hooks in the
same order as Megatron's alltoall dispatcher (pre_forward_comm -> fc1 -> fc2 -> post_forward_comm ->
get_output), and adds the shared output in ``combine_postprocess``: it is never dropped.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from mok_megatron import profiling
from mok_megatron.config import MoKConfig
from mok_megatron.functional import dispatch as F
from mok_megatron.functional.comm import all_to_all_v
from mok_megatron.functional.plan import DispatchPlan, EPGroups, build_plan


class MoKTokenDispatcher(MoETokenDispatcher):
    def __init__(
        self, num_local_experts: int, local_expert_indices, config, pg_collection, mok_config: MoKConfig
    ):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.mok_config = mok_config
        self.groups = EPGroups.from_pg_collection(pg_collection)
        self._plan: DispatchPlan | None = None

    @property
    def plan(self) -> DispatchPlan:
        if self._plan is None:
            raise RuntimeError(
                "MoKTokenDispatcher: no dispatch in flight; dispatch_preprocess must run before the "
                "later phases."
            )
        return self._plan

    # ---- dispatch ----------------------------------------------------------------------------

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        if routing_map.dtype != torch.bool or routing_map.dim() != 2 or probs.dim() != 2:
            raise ValueError(
                f"dispatch_preprocess: expected routing_map [tokens, experts] bool and probs [tokens, "
                f"experts], got {routing_map.dtype} {tuple(routing_map.shape)} and {tuple(probs.shape)}"
            )
        dev = hidden_states.device
        hidden_states = profiling.backward_mark(hidden_states, id(self), closes="dispatch", opens=None)
        with profiling.phase("dispatch", dev):
            hidden_shape = hidden_states.shape
            self._plan = build_plan(hidden_shape, routing_map, probs, self.mok_config, self.groups)
            if self.shared_experts is not None:
                self.shared_experts.pre_forward_comm(hidden_states)
            return F.dispatch_preprocess(hidden_states.reshape(-1, hidden_shape[-1]), probs, self._plan)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        with profiling.phase("dispatch", hidden_states.device):
            if self.shared_experts is not None:
                self.shared_experts.wait_current_stream()
            plan = self.plan
            x = all_to_all_v(hidden_states, plan.recv_splits, plan.send_splits, plan.groups.ep)
            if self.shared_experts is not None:
                self.shared_experts.linear_fc1_forward_and_act(x)
            p = all_to_all_v(probs, plan.recv_splits, plan.send_splits, plan.groups.ep)
            return x, p

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        dev = hidden_states.device
        with profiling.phase("dispatch", dev):
            x, tokens_per_expert, p = F.dispatch_postprocess(hidden_states, probs, self.plan)
        x = profiling.backward_mark(x, id(self), closes="experts", opens="dispatch")
        profiling.open_span(id(self), "experts", dev)
        return x, tokens_per_expert, p

    # ---- combine -----------------------------------------------------------------------------

    def combine_preprocess(self, hidden_states: torch.Tensor):
        dev = hidden_states.device
        profiling.close_span(id(self), "experts", dev)
        hidden_states = profiling.backward_mark(hidden_states, id(self), closes="combine", opens="experts")
        with profiling.phase("combine", dev):
            return F.combine_preprocess(hidden_states, self.plan)

    def token_combine(self, hidden_states: torch.Tensor):
        with profiling.phase("combine", hidden_states.device):
            if self.shared_experts is not None:
                self.shared_experts.wait_current_stream()
            y = F.token_combine(hidden_states, self.plan)
            if self.shared_experts is not None:
                self.shared_experts.linear_fc2_forward(y)
                self.shared_experts.post_forward_comm()
            return y

    def combine_postprocess(self, hidden_states: torch.Tensor):
        with profiling.phase("combine", hidden_states.device):
            out = F.combine_postprocess(hidden_states, self.plan)
            self._plan = None
        out = profiling.backward_mark(out, id(self), closes=None, opens="combine")
        if self.shared_experts is not None:
            out = out + self.shared_experts.get_output()
        return out
