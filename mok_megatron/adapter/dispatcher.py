"""``MoKTokenDispatcher``: Megatron's ``MoETokenDispatcher`` phases on top of ``mok_megatron.engine``.

Megatron calls the six phases with tensors only, so the adapter keeps exactly one piece of state:
the frozen ``DispatchPlan`` of the call in flight, set by ``dispatch_preprocess`` and dropped by
``combine_postprocess``. Everything backward needs is captured by the autograd graph, so Megatron's
schedules may interleave the backward of one micro-batch with the forward of the next.

Pipelined mode (the overlap engine, ``mok_megatron.engine.pipeline``): when expert parallelism is
on and the routing is dropless without expert-TP, ``dispatch_preprocess`` builds a ``PipelinePlan``,
``token_dispatch`` / ``token_combine`` pass tensors through, and ``MoKMoELayer.routed_experts_compute``
runs dispatch -> experts -> combine as one minibatch pipeline (``run_pipeline`` here).

With ``moe_shared_expert_overlap`` the dispatcher drives ``SharedExpertMLP``'s overlap hooks in the
same order as Megatron's alltoall dispatcher (pre_forward_comm -> fc1 -> fc2 -> post_forward_comm ->
get_output), and adds the shared output in ``combine_postprocess``: it is never dropped. Pipelined, fc1
runs beside the dispatches and fc2 beside the last combines (the pipeline's ``after_combines``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from mok_megatron.adapter import profiling
from mok_megatron.config import MoKConfig
from mok_megatron.engine import plain as F
from mok_megatron.transport.comm import all_to_all_v
from mok_megatron.engine.pipeline import PipelineRuntime, PipelineStats
from mok_megatron.engine.pipeline import run_pipeline as _run_pipeline
from mok_megatron.engine.pipeline_plan import PipelinePlan
from mok_megatron.engine.plan import DispatchPlan, EPGroups, RowLayout, build_aligned_plan, build_plan
from mok_megatron.engine.select import EngineChoice
from mok_megatron.options import MoKOptions


@dataclass(frozen=True)
class PipelineCall:
    """What the pipelined routed-experts phase needs: the plan and the routing it was built from."""

    plan: PipelinePlan
    routing_map_TE: torch.Tensor


class MoKTokenDispatcher(MoETokenDispatcher):
    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices,
        config,
        pg_collection,
        mok_config: MoKConfig,
        options: MoKOptions,
        engine: EngineChoice,
    ):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.mok_config = mok_config
        self.groups = EPGroups.from_pg_collection(pg_collection)
        self.options = options
        self.engine = engine
        self._plan: DispatchPlan | PipelineCall | None = None
        self.runtime = PipelineRuntime()  # the pipeline's stream, caches and counters (this layer's)
        self._tile_streams: dict = {}  # the tiles engine's streams (``engine.tiles.TileStreams``), per device index
        self.profile: profiling.PhaseProfile | None = None  # set inside profiling.record(model)

    @property
    def stats(self) -> PipelineStats:
        """This layer's pipeline counters (calls, sync-free overflows redone)."""
        return self.runtime.stats

    @property
    def transport(self):
        return self.engine.transport

    @property
    def pipelined(self) -> bool:
        return self.engine.pipelined

    @property
    def folded_phase(self) -> str | None:
        """The one phase dispatch, experts and combine run in (``pipeline`` / ``experts``), or None."""
        return self.engine.folded_phase

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
        # Pipelined: dispatch, experts and combine are one overlapped phase, timed as "pipeline"
        # (fused experts: one phase "experts").
        closes = self.folded_phase or "dispatch"
        prof = self.profile
        hidden_states = profiling.backward_mark(prof, hidden_states, id(self), closes=closes, opens=None)
        with profiling.phase(self.profile, "dispatch", dev):
            hidden_shape = hidden_states.shape
            if self.pipelined:
                self._plan = PipelineCall(self._pipeline_plan(hidden_shape, routing_map), routing_map)
            elif self.engine.rows.routing_kernels:
                self._plan = build_aligned_plan(
                    hidden_shape,
                    routing_map,
                    probs,
                    self.mok_config,
                    self.groups,
                    self.engine.row_alignment,
                    exact_rows=self.engine.rows is RowLayout.ALIGNED_EXACT,
                )
            else:
                self._plan = build_plan(hidden_shape, routing_map, probs, self.mok_config, self.groups)
            if self.shared_experts is not None:
                self.shared_experts.pre_forward_comm(hidden_states)
            if self.folded_phase:
                return hidden_states.reshape(-1, hidden_shape[-1]), probs
            return F.dispatch_preprocess(hidden_states.reshape(-1, hidden_shape[-1]), probs, self._plan)

    def _pipeline_plan(self, hidden_shape, routing_map, sync_free=None):
        cfg = self.mok_config
        policy = self.engine.pipeline.minibatches
        L, ep_group = cfg.num_local_experts, self.groups.ep
        return policy.plan(hidden_shape, routing_map, L, cfg.topk, ep_group, sync_free, self.runtime.labels)

    def run_pipeline(
        self,
        hidden_states: torch.Tensor,
        probs: torch.Tensor,
        expert_fn,
        token_rows_fn=None,
        before_experts=None,
    ) -> torch.Tensor:
        """Pipelined dispatch -> experts -> combine of the call in flight: ``[T, H]``. ``token_rows_fn``:
        experts that fuse the per-call permute / combine into their operands (``RowLayout.FUSED``).
        ``before_experts``: see ``engine.pipeline.run_pipeline`` (``LateWgrad.open``)."""
        call = self.plan
        config = self.engine.pipeline
        hooks = dict(
            token_rows_fn=token_rows_fn,
            before_experts=before_experts,
            after_combines=self._shared_fc2_once(),
            runtime=self.runtime,
        )
        with profiling.phase(self.profile, "pipeline", hidden_states.device):
            rm = call.routing_map_TE
            out = _run_pipeline(hidden_states, probs, rm, call.plan, config, expert_fn, **hooks)
            self.stats.calls += 1
            plan = call.plan
            if plan.sync_free and config.minibatches.capacity_multiplier < 1.0 and bool(plan.overflow):
                # A destination got more tokens than its fixed buffers hold: nothing is dropped, the
                # whole exchange is redone with exact sizes (one host read, counted).
                self.stats.overflow_redos += 1
                exact = self._pipeline_plan(plan.hidden_shape, call.routing_map_TE, sync_free=False)
                out = _run_pipeline(hidden_states, probs, rm, exact, config, expert_fn, **hooks)
        return out

    def _shared_fc2_once(self):
        """The shared expert's fc2 (+ its TP reduction) for the pipeline's ``after_combines``: on the
        shared expert's side stream, after it waits for the compute stream, so it runs while the last
        combines fly instead of after them (``token_combine`` then has nothing left to launch). Once
        per layer call, an overflow redo included. None without an overlapped shared expert."""
        shared = self.shared_experts
        if shared is None:
            return None
        done: list[bool] = []

        def fc2() -> None:
            if not done:
                done.append(True)
                shared.wait_current_stream()
                shared.linear_fc2_forward(None)
                shared.post_forward_comm()

        return fc2

    def run_fused(self, hidden_states: torch.Tensor, probs: torch.Tensor, experts_fn) -> torch.Tensor:
        """The fused experts on the call in flight: ``experts_fn(x_TH, probs_TK, meta, counts_L) -> [T, H]``."""
        plan = self.plan
        with profiling.phase(self.profile, "experts", hidden_states.device):
            probs_TK = probs.gather(1, plan.ids_TK)
            return experts_fn(hidden_states, probs_TK, plan.meta, plan.tokens_per_expert_L)

    def run_tiles(self, hidden_states: torch.Tensor, probs: torch.Tensor, experts) -> torch.Tensor:
        """The tiles engine on the call in flight (``engine.tiles``): ``[T, H]``. At EP = 1 the routing
        kernels' plan places the tokens' rows (or, with a transport exposing its peers' buffers, the rank's
        own rows, the rest pulled from the transport's sources); otherwise the plain engine's dispatch and
        combine move them and each received row is its own token."""
        from mok_megatron.engine.tiles import TileStreams, row_routes, tile_experts

        plan = self.plan
        weights = (experts.fc1_weight, experts.fc2_weight)
        owners = experts.main_grad_owners()
        streams = None
        if self.engine.tiles.kernels:  # the pull's, the weight gradients' and the return trip's streams
            dev = hidden_states.device
            streams = self._tile_streams.get(dev.index)
            if streams is None or streams.holds(torch.cuda.current_stream(dev)):
                # none yet, or a set taken while another stream was current holds the one this call runs on
                streams = self._tile_streams[dev.index] = TileStreams.on(dev)
        tiles, source = self.engine.tiles, self.engine.pull
        with profiling.phase(self.profile, "experts", hidden_states.device):
            if plan.meta is not None:
                meta = plan.meta
                probs_TK = probs.gather(1, plan.ids_TK)
                counts = plan.tokens_per_expert_L
                return tile_experts(
                    hidden_states, probs_TK, meta, counts, *weights, tiles, owners, streams, source
                )
            x_RH, counts, probs_R = F.dispatch(hidden_states, probs, plan)
            meta = row_routes(counts)
            y_RH = tile_experts(
                x_RH, probs_R[:, None], meta, counts, *weights, tiles, owners, streams, source
            )
            return F.combine_postprocess(F.token_combine(F.combine_preprocess(y_RH, plan), plan), plan).view(
                -1, hidden_states.shape[-1]
            )

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        with profiling.phase(self.profile, "dispatch", hidden_states.device):
            if self.shared_experts is not None:
                self.shared_experts.wait_current_stream()
            plan = self.plan
            if self.folded_phase:
                if self.shared_experts is not None:
                    self.shared_experts.linear_fc1_forward_and_act(hidden_states)
                return hidden_states, probs
            x = all_to_all_v(hidden_states, plan.recv_splits, plan.send_splits, plan.groups.ep)
            if self.shared_experts is not None:
                self.shared_experts.linear_fc1_forward_and_act(x)
            p = all_to_all_v(probs, plan.recv_splits, plan.send_splits, plan.groups.ep)
            return x, p

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        dev = hidden_states.device
        with profiling.phase(self.profile, "dispatch", dev):
            x, tokens_per_expert, p = F.dispatch_postprocess(hidden_states, probs, self.plan)
        x = profiling.backward_mark(self.profile, x, id(self), closes="experts", opens="dispatch")
        profiling.open_span(self.profile, id(self), "experts", dev)
        return x, tokens_per_expert, p

    # ---- combine -----------------------------------------------------------------------------

    def combine_preprocess(self, hidden_states: torch.Tensor):
        if self.folded_phase:
            raise RuntimeError(
                f"combine_preprocess: this MoK layer combines inside its {self.folded_phase} phase "
                "(run_pipeline / run_fused)"
            )
        dev = hidden_states.device
        profiling.close_span(self.profile, id(self), "experts", dev)
        prof = self.profile
        hidden_states = profiling.backward_mark(
            prof, hidden_states, id(self), closes="combine", opens="experts"
        )
        with profiling.phase(self.profile, "combine", dev):
            return F.combine_preprocess(hidden_states, self.plan)

    def token_combine(self, hidden_states: torch.Tensor):
        with profiling.phase(self.profile, "combine", hidden_states.device):
            shared = None if self.pipelined else self.shared_experts  # pipelined: fc2 ran beside the combines
            if shared is not None:
                shared.wait_current_stream()
            if self.folded_phase:
                y = hidden_states
            else:
                y = F.token_combine(hidden_states, self.plan)
            if shared is not None:
                shared.linear_fc2_forward(y)
                shared.post_forward_comm()
            return y

    def combine_postprocess(self, hidden_states: torch.Tensor):
        with profiling.phase(self.profile, "combine", hidden_states.device):
            plan = self.plan
            if self.pipelined:
                out = hidden_states.view(plan.plan.hidden_shape)
            elif self.engine.rows is RowLayout.FUSED or self.engine.tiles is not None:
                out = hidden_states.view(plan.hidden_shape)
            else:
                out = F.combine_postprocess(hidden_states, plan)
            self._plan = None
        opens = self.folded_phase or "combine"
        out = profiling.backward_mark(self.profile, out, id(self), closes=None, opens=opens)
        if self.shared_experts is not None:
            out = out + self.shared_experts.get_output()
        return out
