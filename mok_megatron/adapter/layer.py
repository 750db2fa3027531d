"""``MoKMoELayer``: Megatron's ``MoELayer`` with MoK's dispatcher.

Everything else is Megatron's own: the router (top-k, score functions, expert bias, group-limited
routing, aux / seq-aux / global-aux / z losses, capacity dropping), shared experts, latent projections,
recompute of the whole layer, and the six-phase split that Megatron's schedules drive. The experts come
from the spec (``MoKGroupedMLP`` in MoK's specs; Megatron's experts work too).

Construction decides everything once, before Megatron builds a submodule: the ``MoKConfig`` (Megatron's
config checked against what MoK runs), the experts' class for the options' backend, and the engine
(``engine.select.select_engine``: plain or pipeline, the transport, the experts' row layout). A
transport object given at construction (``transport=``, ``transport.base.Transport``: benchmarks and tests
give the one-GPU loopback) replaces the one the options would pick; under ``--mok-engine tiles`` it must
expose its peers' buffers to the pull (``transport.base.PullSource``), and the experts' rows are pulled from
it. The
experts get the layer's options and row layout through their builder; the dispatcher gets the engine
at construction. Megatron-Core 0.19 builds its dispatcher with a hard-coded if/elif, so the layer is
built as an ``alltoall`` layer and the dispatcher is then replaced (MoK matches alltoall semantics
exactly).
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.utils import get_pg_size

from mok_megatron.adapter.cuda_graphs import check_cuda_graphs
from mok_megatron.adapter.dispatcher import MoKTokenDispatcher
from mok_megatron.config import MoKConfig
from mok_megatron.errors import MoKConfigError
from mok_megatron.engine.plan import RowLayout
from mok_megatron.engine.select import select_engine
from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
from mok_megatron.experts.protocol import experts_class
from mok_megatron.experts_contract import MEGATRON_EXPERTS, ExpertsContract
from mok_megatron.options import MoKOptions


def _experts_class(builder) -> type | None:
    """The MoK experts class a spec's experts builder builds (a class or a partial of one), else None."""
    cls = builder.func if isinstance(builder, partial) else builder
    return cls if isinstance(cls, type) and issubclass(cls, MoKGroupedMLP) else None


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
        transport=None,
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
        options = options if options is not None else MoKOptions()
        if submodules is None:
            raise MoKConfigError(
                "MoKMoELayer needs submodules (MoESubmodules with experts); build it from a MoK spec "
                "(mok_megatron.spec.get_gpt_layer_with_mok_spec or mokify)."
            )
        cls = _experts_class(submodules.experts)
        if cls is not None:
            cls = experts_class(cls, options)
            contract = cls.contract(config, mok_config, options)
        else:
            contract = MEGATRON_EXPERTS
        engine = select_engine(mok_config, options, pg.ep, contract, transport)
        check_cuda_graphs(config, mok_config, options, pipelined=engine.pipelined, mok_experts=contract.mok)
        if cls is not None:
            builder = submodules.experts
            keywords = builder.keywords if isinstance(builder, partial) else {}
            submodules = dataclasses.replace(
                submodules,
                experts=partial(
                    cls,
                    **{
                        **keywords,
                        "mok_config": mok_config,
                        "options": options,
                        "aligned_input": engine.row_alignment,
                    },
                ),
            )
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg,
            is_mtp_layer=is_mtp_layer,
            name=name,
        )
        self.mok_config = mok_config
        self.mok_options = options
        self.experts_contract: ExpertsContract = contract
        self.token_dispatcher = MoKTokenDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg,
            mok_config=mok_config,
            options=options,
            engine=engine,
        )
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)

    def routed_experts_compute(self, hidden_states, probs):
        engine = self.token_dispatcher.engine
        if engine.tiles is not None:
            return self.token_dispatcher.run_tiles(hidden_states, probs, self.experts), None
        if not engine.pipelined and engine.rows is RowLayout.FUSED:
            return self.token_dispatcher.run_fused(
                hidden_states, probs, self.experts.token_rows_forward
            ), None
        if not engine.pipelined:
            return super().routed_experts_compute(hidden_states, probs)
        experts, contract = self.experts, self.experts_contract
        # MoK's bf16 experts: weight gradients late, hiding the last dispatch-backward (experts.late_wgrad)
        late = experts.late_wgrad() if contract.mok and self.mok_options.late_wgrad else None

        groups = {}  # split by experts: this call's weight views, one autograd node for every group

        def expert_fn(x_MH, tpe_dev, tpe_host, probs_M, group=None):
            # Megatron's own experts read the counts on the host (tolist): give them host counts.
            tpe = tpe_dev if contract.mok or tpe_host is None else torch.tensor(tpe_host)
            if group is not None:
                if group.bounds not in groups:
                    groups[group.bounds] = experts.expert_groups(group.bounds)
                y, bias = experts(x_MH, tpe, probs_M, group=(groups[group.bounds], group.index))
            elif late is None:
                y, bias = experts(x_MH, tpe, probs_M)
            else:
                y, bias = experts(x_MH, tpe, probs_M, late=late)
            if bias is not None:
                raise MoKConfigError("the pipelined MoK layer needs experts without an output bias")
            return y

        # Native FP8 experts fuse each call's permute / combine into their FP8 operands (experts.fp8_mlp).
        token_rows = experts.token_rows_forward if contract.mok and contract.fuses_permute else None
        opener = late.open if late is not None else None
        return self.token_dispatcher.run_pipeline(hidden_states, probs, expert_fn, token_rows, opener), None
