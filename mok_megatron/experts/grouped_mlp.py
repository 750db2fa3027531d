"""``MoKGroupedMLP``: Megatron's experts interface on stacked weights and grouped GEMMs.

Legend: L local experts, F1 fc1 rows on this rank (2F with a GLU), F FFN width on this rank, H hidden.

Parameters (one tensor per projection, so the grouped GEMM reads them in place):
    fc1_weight  [L, F1, H]   slice l == expert l's ``linear_fc1.weight`` in Megatron's SequentialMLP
    fc2_weight  [L, H, F]    slice l == expert l's ``linear_fc2.weight``

``sharded_state_dict`` emits exactly the ShardedTensors of ``SequentialMLP`` / ``TEGroupedMLP`` (same
keys, global shapes and offsets, including the SwiGLU split), so ``dist_checkpointing`` checkpoints
move between the three layouts. ``load_state_dict`` also accepts plain (non-distributed) state dicts
in either Megatron layout (see ``mok_megatron.experts.checkpoint``).

Expert backend (``MoKOptions.expert_backend``, ``--mok-expert-backend``; checks in ``experts.backend``;
the class of each backend: ``experts.protocol.experts_class``):
    torch      this class: the bf16 grouped GEMMs of ``experts.torch_mlp``
    torch-fp8  ``experts.fp8_mlp.MoKFP8GroupedMLP``, a subclass: the same parameters, GEMMs in native
               rowwise FP8
    te         ``experts.te.MoKTEGroupedMLP``, a subclass: Transformer Engine GroupedLinear parameters and
               GEMMs, exactly TEGroupedMLP's layout

Every backend offers its weights stacked, read-only, for conversion and inspection
(``stacked_fc1_weight`` [L, F1, H], ``stacked_fc2_weight`` [L, H, F]; ``experts.protocol``).

Gradient accumulation fusion (``config.gradient_accumulation_fusion``, read once at construction): with
the torch backend, weights that have ``main_grad`` (Megatron's DDP) and an accumulating GEMM for their
device (QuACK on Hopper, or the CPU reference: ``experts.main_grad.has_accumulating_gemm``), the
weight-gradient GEMMs add straight into ``main_grad`` and backward returns Megatron's dummy gradients (``experts.main_grad``), in
autograd's backward, ``backward_dw`` (delayed wgrad) and the late-wgrad gate alike. torch-fp8 returns
ordinary gradients (DDP's hook adds them; ``grad_added_to_main_grad`` stays False); TE honours the flag
itself.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size

from mok_megatron.config import MoKConfig

from mok_megatron.errors import MoKConfigError
from mok_megatron.experts.backend import check_expert_backend, expert_alignment
from mok_megatron.experts.groups import ExpertGroups
from mok_megatron.experts.main_grad import main_grad_owner
from mok_megatron.experts.torch_mlp import WgradQueue, expert_mlp
from mok_megatron.experts_contract import ExpertsContract
from mok_megatron.options import ExpertBackend, MoKOptions


def _init_device(config) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def read_only(weights: list[torch.Tensor]) -> torch.Tensor:
    """The experts' weights stacked along a new first axis, detached and copied (TE's FP8 parameters
    dequantized): conversion and inspection read it, and nothing written to it reaches the parameters."""
    with torch.no_grad():
        return torch.stack([w.detach().dequantize() for w in weights], 0)


class MoKGroupedMLP(MegatronModule):
    """Routed experts, the ``torch`` backend:
    ``forward(x, tokens_per_expert, permuted_probs) -> (out, None)``.

    ``options``: the layer's (``MoKMoELayer`` passes them; the expert backend among them).
    ``aligned_input`` > 1: the dispatcher delivers every expert's rows padded to this multiple
    (``engine.plan.build_aligned_plan`` or the pipeline's expert calls); 1: the experts pad for themselves
    where their GEMMs must."""

    backend = ExpertBackend.TORCH  # the --mok-expert-backend this class runs

    @classmethod
    def contract(cls, config, mok_config: MoKConfig, options: MoKOptions) -> ExpertsContract:
        """What these experts take (``engine.select``): device counts, no row alignment."""
        return ExpertsContract(mok=True, alignment=expert_alignment(ExpertBackend.TORCH, config))

    def __init__(
        self,
        num_local_experts: int,
        config,
        pg_collection=None,
        name: str | None = None,
        mok_config: MoKConfig | None = None,
        options: MoKOptions | None = None,
        aligned_input: int = 1,
    ):
        super().__init__(config=config)
        cfg = self._setup(num_local_experts, config, pg_collection, mok_config, options, aligned_input)
        self.expert_backend = self.options.expert_backend
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        if self.expert_backend is not self.backend:
            raise MoKConfigError(
                f"{type(self).__name__} with expert_backend='{self.expert_backend.value}': each backend has "
                "its own class; build experts_class(MoKGroupedMLP, options) (experts.protocol), or let "
                "MoKMoELayer do it."
            )
        if self.expert_backend is not ExpertBackend.TORCH:
            from mok_megatron.compat import have_te

            gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            check_expert_backend(
                self.expert_backend,
                config,
                gpu,
                have_te=have_te(),
                sync_free=self.options.sync_free,
                recompute_activation=cfg.recompute_activation,
                delay_wgrad=cfg.delay_wgrad,
            )
        fc1_rows = cfg.activation.fc1_multiplier() * cfg.local_ffn_size
        device = _init_device(config)
        dtype = config.params_dtype
        self.fc1_weight = torch.nn.Parameter(
            torch.empty(num_local_experts, fc1_rows, cfg.hidden_size, device=device, dtype=dtype)
        )
        self.fc2_weight = torch.nn.Parameter(
            torch.empty(num_local_experts, cfg.hidden_size, cfg.local_ffn_size, device=device, dtype=dtype)
        )
        if config.perform_initialization:
            self.reset_parameters()
        for param, tp_dim in ((self.fc1_weight, 1), (self.fc2_weight, 2)):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=tp_dim, stride=1)
            param.allreduce = False  # reduced over the expert-data-parallel group, not all DP ranks
        # Megatron's delayed-wgrad contract: backward leaves the weight gradients in this queue,
        # backward_dw() computes them, then fires the hooks DDP registered for these parameters
        # (DDP registers them here instead of on autograd when skip_backward_post_hook is set).
        self.wgrad_queue = WgradQueue() if cfg.delay_wgrad else None
        self._wgrad_hooks = []
        if cfg.delay_wgrad:
            for param in (self.fc1_weight, self.fc2_weight):
                param.skip_backward_post_hook = True

    def _setup(
        self, num_local_experts, config, pg_collection, mok_config, options, aligned_input
    ) -> MoKConfig:
        """What every MoK experts class keeps: process groups, the checked config, options, row layout."""
        pg = pg_collection if pg_collection is not None else get_default_pg_collection()
        self.ep_group, self.tp_group, self.dp_group = pg.ep, pg.expt_tp, pg.expt_dp
        self.mok_config = mok_config or MoKConfig.from_megatron(
            config, ep_size=get_pg_size(self.ep_group), etp_size=get_pg_size(self.tp_group)
        )
        cfg = self.mok_config
        if num_local_experts != cfg.num_local_experts:
            raise MoKConfigError(
                f"{type(self).__name__} got num_local_experts={num_local_experts}, but num_moe_experts="
                f"{cfg.num_experts} over EP={cfg.ep_size} gives {cfg.num_local_experts}."
            )
        self.num_local_experts = num_local_experts
        self.options = options if options is not None else MoKOptions()
        self.aligned_input = aligned_input
        return cfg

    def reset_parameters(self) -> None:
        """Initialise each expert like Megatron does, under the expert-parallel RNG stream."""
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker,
            get_expert_parallel_rng_tracker_name,
        )

        tracker = get_cuda_rng_tracker()
        use_fork = tracker.is_initialized() and get_expert_parallel_rng_tracker_name() in tracker.get_states()
        ctx = (
            tracker.fork(get_expert_parallel_rng_tracker_name())
            if use_fork
            else torch.random.fork_rng(devices=[])
        )
        with ctx, torch.no_grad():
            for e in range(self.num_local_experts):
                self.config.init_method(self.fc1_weight[e])
                self.config.output_layer_init_method(self.fc2_weight[e])

    def late_wgrad(self):
        """A ``experts.late_wgrad.LateWgrad`` gate for one pipelined layer call, or None where the weight
        gradients are computed as usual: Megatron's ``delay_wgrad_compute`` (its queue defers them
        further) or no gradient wanted. The FP8 and TE backends (other GEMMs) return None always.
        (``--mok-late-wgrad`` is the layer's to check: ``MoKMoELayer.routed_experts_compute``.)"""
        from mok_megatron.experts.late_wgrad import LateWgrad

        weights = (self.fc1_weight, self.fc2_weight)
        if (
            self.wgrad_queue is not None
            or not torch.is_grad_enabled()
            or not all(w.requires_grad for w in weights)
        ):
            return None
        return LateWgrad(weights)

    def expert_groups(self, bounds: tuple[int, ...]) -> ExpertGroups:
        """This layer call's weights cut into groups of local experts (a pipeline split by experts): one
        autograd node for all groups (``experts.groups``). The torch and torch-fp8 backends."""
        fusion = self.gradient_accumulation_fusion and self.expert_backend is ExpertBackend.TORCH
        owners = (main_grad_owner(self.fc1_weight, fusion), main_grad_owner(self.fc2_weight, fusion))
        return ExpertGroups((self.fc1_weight, self.fc2_weight), bounds, owners)

    def main_grad_owners(self) -> tuple:
        """(fc1's, fc2's) ``main_grad`` owner for this forward, or None each (``experts.main_grad``): whose
        weight gradients a caller computing them itself (the tiles engine) adds into ``main_grad``."""
        fusion = self.gradient_accumulation_fusion and self.expert_backend is ExpertBackend.TORCH
        return (main_grad_owner(self.fc1_weight, fusion), main_grad_owner(self.fc2_weight, fusion))

    @property
    def stacked_fc1_weight(self) -> torch.Tensor:
        """fc1's weights ``[L, F1, H]``, read-only (``read_only``); slice l is expert l's
        ``linear_fc1.weight``."""
        return read_only(list(self.fc1_weight))

    @property
    def stacked_fc2_weight(self) -> torch.Tensor:
        """fc2's weights ``[L, H, F]``, read-only (``read_only``); slice l is expert l's
        ``linear_fc2.weight``."""
        return read_only(list(self.fc2_weight))

    def _call_weights(self, late, group):
        """``(w1, w2, queue, owners, rng)`` of one call: the parameters and the module's queue, a late-wgrad
        gate's stand-ins and queue, or a group's views of the weights, its local experts and its owners."""
        w1, w2, queue = self.fc1_weight, self.fc2_weight, self.wgrad_queue
        owners, rng = None, None
        if late is not None:
            if late.weights is None or late.params[0] is not self.fc1_weight:
                raise RuntimeError("MoKGroupedMLP.forward: late= must be this module's LateWgrad, opened")
            (w1, w2), queue = late.weights, late.queue
        if group is not None:
            groups, c = group
            if late is not None or queue is not None:
                raise MoKConfigError(
                    "MoKGroupedMLP: expert groups (--mok-minibatch-split experts) with delayed or late "
                    "weight gradients: drop --mok-late-wgrad or Megatron's --delay-wgrad-compute, or split "
                    "by tokens."
                )
            (w1, w2), rng, owners = groups.weights(c), groups.experts(c), groups.owners
        return w1, w2, queue, owners, rng

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, late=None, group=None):
        """Megatron's experts call. ``late`` (an open ``LateWgrad`` of this module, pipeline only): the
        GEMMs use its stand-in weights and queue their weight gradients in it. ``group`` (``(groups,
        c)``, ``groups`` from ``expert_groups``): the rows and counts are those of group c's local
        experts, which its views of the weights compute."""
        cfg = self.mok_config
        w1, w2, queue, owners, rng = self._call_weights(late, group)
        fusion = self.gradient_accumulation_fusion
        out = expert_mlp(
            permuted_local_hidden_states,
            permuted_probs,
            tokens_per_expert,
            w1,
            w2,
            cfg.activation,
            apply_probs_on_input=cfg.apply_probs_on_input,
            recompute_activation=cfg.recompute_activation,
            wgrad_queue=queue,
            main_grad_owners=owners
            or (main_grad_owner(self.fc1_weight, fusion), main_grad_owner(self.fc2_weight, fusion)),
            main_grad_range=rng,
        )
        return out, None

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """Megatron DDP (with ``delay_wgrad_compute``) registers its gradient-ready hook here."""
        self._wgrad_hooks.append(hook)

    def backward_dw(self) -> None:
        """Compute the weight gradients deferred by backward (``delay_wgrad_compute``) and accumulate
        them into ``param.grad`` (into ``main_grad``, with Megatron's dummy as ``param.grad``, under
        gradient accumulation fusion); then run DDP's hooks. A no-op without delayed wgrad or with nothing
        queued."""
        if self.wgrad_queue is None or not len(self.wgrad_queue):
            return
        self.wgrad_queue.run()
        for hook in self._wgrad_hooks:
            hook()

    # ---- checkpoints -------------------------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        from mok_megatron.experts.checkpoint import to_mok_layout

        to_mok_layout(state_dict, prefix, self.num_local_experts)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """ShardedTensors identical to SequentialMLP's (and TEGroupedMLP's), one per expert."""
        singleton = bool((metadata or {}).get("singleton_local_shards", False))
        gated = self.mok_config.activation.gated
        return {
            f"{prefix}fc1_weight": self._expert_factory(
                self.fc1_weight, prefix, "linear_fc1.weight", 0, sharded_offsets, singleton, gated
            ),
            f"{prefix}fc2_weight": self._expert_factory(
                self.fc2_weight, prefix, "linear_fc2.weight", 1, sharded_offsets, singleton, False
            ),
        }

    def _expert_factory(self, param, prefix, leaf, tp_axis, sharded_offsets, singleton, swiglu):
        num_global = get_pg_size(self.ep_group) * self.num_local_experts
        first = get_pg_rank(self.ep_group) * self.num_local_experts
        tp_rank, tp_size = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        replica_id = (0, 0, get_pg_rank(self.dp_group))

        def key_and_offsets(i: int, name: str, pre: str):
            """Megatron's SequentialMLP key and prepended offsets of local expert ``i``'s ``name``."""
            g = first + i
            if singleton:
                return f"{pre}experts.{g}.{name}", tuple(sharded_offsets)
            return f"{pre}experts.{name}", (*sharded_offsets, (len(sharded_offsets), g, num_global))

        def expert_tensor(i: int, t_i: torch.Tensor, rid, pre: str = prefix) -> tuple[ShardedTensor, tuple]:
            key, offsets = key_and_offsets(i, leaf, pre)
            sh = ShardedTensor.from_rank_offsets(
                key,
                t_i,
                *offsets,
                (tp_axis + len(offsets), tp_rank, tp_size),
                replica_id=rid,
                prepend_axis_num=len(offsets),
            )
            return sh, offsets

        def extra_state(i: int, pre: str):
            # Megatron's linears also save an `_extra_state` object per expert (None for local
            # linears); writing it too keeps MoK checkpoints loadable by SequentialMLP/TEGroupedMLP.
            key, offsets = key_and_offsets(i, leaf.replace(".weight", "._extra_state"), pre)
            return make_sharded_object_for_checkpoint(
                None, key, offsets, replica_id=(0, tp_rank, replica_id[2])
            )

        def build(key, data, rid, flattened_range):
            if flattened_range is not None:
                raise ValueError("MoKGroupedMLP checkpoints do not support flattened (DP-sharded) ranges")
            # Derive the prefix from `key`, not from the closure: Megatron renames factory keys after
            # building them (TransformerBlock drops `layers.{i}.` for its layer axis; optimizer state
            # gets `optimizer.state.exp_avg.` in front).
            pre = key[: -len(leaf)]
            out = []
            for i in range(data.shape[0]):
                sh, offsets = expert_tensor(i, data[i], rid, pre)
                if swiglu:  # split [gate; up] exactly as Megatron's MLP does
                    f = apply_swiglu_sharded_factory(sh, offsets, singleton)
                    out.append([*f.build_fn(f.key, data[i], rid, None), extra_state(i, pre)])
                else:
                    out.append([sh, extra_state(i, pre)])
            return out

        def merge(loaded):
            if swiglu:
                sh, offsets = expert_tensor(0, param.data[0], replica_id)
                merge_one = apply_swiglu_sharded_factory(sh, offsets, singleton).merge_fn
            else:
                merge_one = lambda parts: parts[0]  # noqa: E731
            return torch.stack([merge_one(sub[:-1]) for sub in loaded], 0)  # sub[-1]: extra state

        return ShardedTensorFactory(f"{prefix}{leaf}", param, build, merge, replica_id)
