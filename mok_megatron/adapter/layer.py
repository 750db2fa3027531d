"""``MoKMoELayer``: Megatron's ``MoELayer`` with MoK's dispatcher.

Everything else is Megatron's own: the router (top-k, score functions, expert bias, group-limited
routing, aux / seq-aux / global-aux / z losses, capacity dropping), shared experts, latent projections,
recompute of the whole layer, and the six-phase split that Megatron's schedules drive. The experts come
from the spec (``MoKGroupedMLP`` in MoK's specs; Megatron's experts work too).

Megatron-Core 0.19 builds its dispatcher with a hard-coded if/elif, so the layer is built as an
``alltoall`` layer and the dispatcher is then replaced (MoK matches alltoall semantics exactly).
"""

from __future__ import annotations

import copy

import torch

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.utils import get_pg_size

from mok_megatron.config import MoKConfig, MoKConfigError
from mok_megatron.adapter.cuda_graphs import check_cuda_graphs
from mok_megatron.adapter.dispatcher import MoKTokenDispatcher
from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
from mok_megatron.engine.plan import aligned_plan_applies
from mok_megatron.engine.select import select_transport
from mok_megatron.options import MoKOptions, default_options


class MoKMoELayer(MoELayer):
    def __init__(
        self,
        config,
        submodules=None,
        layer_number: int | None = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: str | None = None,
        options: MoKOptions | None = None,
    ):
        pg = pg_collection if pg_collection is not None else get_default_pg_collection()
        # Validate everything before Megatron builds anything (and before any collective).
        mok_config = MoKConfig.from_megatron(
            config, ep_size=get_pg_size(pg.ep), etp_size=get_pg_size(pg.expt_tp)
        )
        if config.transformer_impl == "inference_optimized":
            raise MoKConfigError(
                "transformer_impl='inference_optimized' uses Megatron's inference dispatchers; the MoK "
                "layer is for training. Use Megatron's inference MoE spec for inference."
            )
        kind = config.moe_token_dispatcher_type
        if kind not in ("alltoall", "mok"):
            raise MoKConfigError(
                f"moe_token_dispatcher_type={kind!r}: the MoK layer replaces Megatron's alltoall "
                "dispatcher; set --moe-token-dispatcher-type alltoall (or mok with our Megatron-LM "
                f"patch), or use Megatron's own layer spec for {kind!r}."
            )
        if kind == "mok":  # Megatron-Core only knows how to build the types it hard-codes
            config = copy.copy(config)
            config.moe_token_dispatcher_type = "alltoall"
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg,
            is_mtp_layer=is_mtp_layer,
            name=name,
        )
        self.mok_config = mok_config
        self.mok_options = options if options is not None else default_options()
        self.token_dispatcher = MoKTokenDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg,
            mok_config=mok_config,
            options=self.mok_options,
            transport=select_transport(mok_config, self.mok_options, pg.ep),
        )
        mok_experts = isinstance(self.experts, MoKGroupedMLP)
        align = self.experts.input_alignment() if mok_experts else 1
        pipelined = self.token_dispatcher.pipelined
        host_counts = mok_experts and self.experts.reads_counts_on_host()
        if not pipelined and aligned_plan_applies(mok_config):
            # EP = 1: the routing kernels' plan (no sort), at the experts' alignment (1: plain rows).
            self.token_dispatcher.aligned_plan = True
            self.token_dispatcher.exact_aligned_rows = host_counts
        if align > 1 and (self.token_dispatcher.aligned_plan or (pipelined and not host_counts)):
            # The permute writes the experts' padded layout itself (no pad / unpad copies); in the
            # pipeline only for experts that take device counts.
            self.token_dispatcher.row_alignment = align
            self.experts.aligned_input = align
        if pipelined and mok_experts and not host_counts:
            # MoK's experts take device counts: every pipeline expert call on the routing kernels' plan.
            self.token_dispatcher.routing_kernel_calls = True
        if self.token_dispatcher.aligned_plan and align > 1 and mok_experts and self.experts.fuses_permute():
            # EP = 1 native FP8 experts: permute and combine fused into their FP8 operands.
            self.token_dispatcher.fused_experts = True
        if self.mok_options.sync_free and self.token_dispatcher.pipelined:
            if not isinstance(self.experts, MoKGroupedMLP):
                raise MoKConfigError(
                    f"--mok-sync-free needs MoK's experts (MoKGroupedMLP); {type(self.experts).__name__} "
                    "reads token counts on the host. Use a MoK spec, or drop --mok-sync-free."
                )
        check_cuda_graphs(
            self.config,
            mok_config,
            self.mok_options,
            pipelined=self.token_dispatcher.pipelined,
            mok_experts=isinstance(self.experts, MoKGroupedMLP),
        )
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)

    def routed_experts_compute(self, hidden_states, probs):
        if self.token_dispatcher.fused_experts:
            return self.token_dispatcher.run_fused(
                hidden_states, probs, self.experts.token_rows_forward
            ), None
        if not self.token_dispatcher.pipelined:
            return super().routed_experts_compute(hidden_states, probs)
        experts = self.experts
        device_counts = isinstance(experts, MoKGroupedMLP)
        # MoK's bf16 experts: weight gradients late, hiding the last dispatch-backward (experts.late_wgrad)
        late = experts.late_wgrad() if device_counts and self.mok_options.late_wgrad else None

        def expert_fn(x_MH, tpe_dev, tpe_host, probs_M):
            # Megatron's own experts read the counts on the host (tolist): give them host counts.
            tpe = tpe_dev if device_counts or tpe_host is None else torch.tensor(tpe_host)
            y, bias = experts(x_MH, tpe, probs_M) if late is None else experts(x_MH, tpe, probs_M, late=late)
            if bias is not None:
                raise MoKConfigError("the pipelined MoK layer needs experts without an output bias")
            return y

        # Native FP8 experts fuse each call's permute / combine into their FP8 operands (experts.fp8_mlp).
        token_rows = experts.token_rows_forward if device_counts and experts.fuses_permute() else None
        opener = late.open if late is not None else None
        return self.token_dispatcher.run_pipeline(hidden_states, probs, expert_fn, token_rows, opener), None
