"""``MoKTEGroupedMLP``: MoK's experts with Transformer Engine GEMMs (``--mok-expert-backend te``).

Legend: L local experts, R rows (expert-major), F1 fc1 rows (2F with a GLU), F FFN width, H hidden.

The GEMMs are Megatron's own TE wrappers, built exactly as ``TEGroupedMLP`` builds them
(``TEColumnParallelGroupedLinear`` for fc1, ``TERowParallelGroupedLinear`` for fc2, same constructor
arguments), so parameters, ``state_dict`` keys (``linear_fc1.weight{i}``, ``linear_fc1._extra_state``),
TE's FP8 metadata, delayed weight gradients (TE's ``delay_wgrad_compute``) and the distributed-checkpoint
``sharded_state_dict`` (``TEGroupedMLP``'s method, the same keys as ``SequentialMLP``) are Megatron's. FP8
comes from the context Megatron's ``TransformerBlock`` enters around every layer
(``fp8_utils.get_fp8_context``: delayed, tensorwise, blockwise, mxfp8; ``fp4_utils`` for nvfp4); without
``--fp8-format`` TE runs bf16.

What MoK changes (``te_expert_mlp``): per-expert padding to the recipe's alignment
is one device scatter of the rows by ``ops.align``'s plan (Megatron's ``Fp8Padding`` splits and
concatenates per expert on the host's counts), the activation is MoK's (``ops.activation``), and plain
(non-distributed) state dicts in MoK's stacked layout load too (``to_te_layout``).

TE's native grouped GEMM (``GroupedLinear(use_grouped_tensor=True)``, which Megatron's wrappers take from
``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=1``; one cuBLASLt grouped GEMM per projection, cuBLASLt 13.4+
on Hopper) is refused at build (``check_not_native_grouped``): it wants the splits on the device and, for
FP8 blocks, every expert's rows padded to 128 (a device-side assertion otherwise), and with device splits
its bf16 results did not match the per-expert GEMMs on an H200 (TE 2.20.2, cuBLASLt 13.10: NaN
outputs). Megatron 0.19's own ``TEGroupedMLP`` passes host lists, which that path rejects too.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from mok_megatron.config import MoKConfig

from mok_megatron.errors import MoKConfigError
from mok_megatron.experts.backend import check_expert_backend, expert_alignment
from mok_megatron.experts.common import padded_expert_mlp, scale_input
from mok_megatron.experts.grouped_mlp import MoKGroupedMLP, read_only
from mok_megatron.experts_contract import ExpertsContract
from mok_megatron.ops.activation import apply_activation
from mok_megatron.options import ExpertBackend, MoKOptions


def padded_counts_host(counts_L: torch.Tensor, alignment: int) -> list[int]:
    """Per-expert padded row counts on the host (TE's ``m_splits``): one device-to-host read."""
    from mok_megatron.compat import te_m_splits

    counts_L = counts_L.long()
    return te_m_splits((counts_L + alignment - 1) // alignment * alignment)


def check_not_native_grouped(linear) -> None:
    """Raise ``MoKConfigError`` where ``linear`` (a TE GroupedLinear) would take TE's native grouped GEMM."""
    if getattr(linear, "use_grouped_tensor", False):
        raise MoKConfigError(
            "--mok-expert-backend te: Transformer Engine's native grouped GEMM is on "
            "(NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=1), which this backend does not run: it needs device "
            "splits, rows padded to 128 per expert for FP8 blocks, and its bf16 results did not match the "
            "per-expert GEMMs. Unset NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM, or use --mok-expert-backend "
            "torch-fp8 / torch (one grouped GEMM per projection already)."
        )


def te_expert_mlp(
    x_RH, probs_R, counts_L, linear_fc1, linear_fc2, act, alignment, *, apply_probs_on_input=False
):
    """The MLP through TE GroupedLinear modules (``module(x, m_splits) -> (y, bias)``, Megatron's
    wrapper contract). Runs under whatever FP8 context the caller entered (Megatron's block does)."""
    m_splits = padded_counts_host(counts_L, alignment)

    def fc1(x_PH, plan):
        return linear_fc1(x_PH, m_splits)[0]

    def fc2(a_PF, plan):
        return linear_fc2(a_PF, m_splits)[0]

    if alignment == 1:  # nothing to pad (TE bf16): skip the scatter / gather
        if apply_probs_on_input:
            x_RH, probs_R = scale_input(x_RH, probs_R)
        return fc2(apply_activation(fc1(x_RH, None), act, probs_R), None)
    return padded_expert_mlp(
        x_RH,
        probs_R,
        counts_L,
        fc1,
        fc2,
        act,
        alignment,
        apply_probs_on_input=apply_probs_on_input,
        num_rows=sum(m_splits),
    )


def to_te_layout(sd: dict, prefix: str, num_local_experts: int) -> None:
    """In place: rewrite expert weights under ``prefix`` (MoK stacked or SequentialMLP layout) into TE
    GroupedLinear's (``linear_fc{1,2}.weight{i}``, one ``_extra_state`` per linear). TE-layout dicts are
    left as they are."""
    from mok_megatron.experts.checkpoint import detect_layout, from_mok_layout, to_mok_layout

    layout = detect_layout(sd, prefix)
    if layout in (None, "te_grouped"):
        return
    to_mok_layout(sd, prefix, num_local_experts)
    from_mok_layout(sd, prefix, "te_grouped")


class MoKTEGroupedMLP(MoKGroupedMLP):
    """Routed experts on TE GroupedLinear: ``forward(x, tokens_per_expert, permuted_probs) -> (out, None)``.

    ``MoKMoELayer`` builds it in place of ``MoKGroupedMLP`` when the options ask for ``expert_backend='te'``
    (``experts.protocol.experts_class``). TE keeps one Parameter per expert (``linear_fc1.weight{i}``);
    ``stacked_fc1_weight`` / ``stacked_fc2_weight`` stack them read-only as the other backends do."""

    backend = ExpertBackend.TE

    @classmethod
    def contract(cls, config, mok_config: MoKConfig, options) -> ExpertsContract:
        """TE's GroupedLinear reads the per-expert counts on the host (``m_splits``) and wants the FP8
        recipe's row alignment."""
        return ExpertsContract(
            mok=True, alignment=expert_alignment(ExpertBackend.TE, config), host_counts=True
        )

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
        from mok_megatron.compat import have_te, te_grouped_linear_classes

        MegatronModule.__init__(self, config=config)
        options = options if options is not None else MoKOptions(expert_backend=ExpertBackend.TE)
        cfg = self._setup(num_local_experts, config, pg_collection, mok_config, options, aligned_input)
        pg = pg_collection if pg_collection is not None else get_default_pg_collection()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        check_expert_backend(
            ExpertBackend.TE,
            config,
            device,
            have_te=have_te(),
            sync_free=self.options.sync_free,
            recompute_activation=cfg.recompute_activation,
        )
        self.expert_backend = ExpertBackend.TE
        self.expert_alignment = expert_alignment(ExpertBackend.TE, config)
        self.input_size = config.hidden_size
        fc1_cls, fc2_cls = te_grouped_linear_classes()
        # Exactly TEGroupedMLP.__init__'s calls (megatron/core/transformer/moe/experts.py, 0.19).
        self.linear_fc1 = fc1_cls(
            num_local_experts,
            self.input_size if config.moe_latent_size is None else config.moe_latent_size,
            cfg.activation.fc1_multiplier() * config.moe_ffn_hidden_size,
            config=config,
            init_method=config.init_method,
            bias=False,
            skip_bias_add=False,
            is_expert=True,
            tp_comm_buffer_name="fc1",
            pg_collection=pg,
            name=(name + ".linear_fc1") if name is not None else None,
        )
        self.linear_fc2 = fc2_cls(
            num_local_experts,
            config.moe_ffn_hidden_size,
            config.hidden_size if config.moe_latent_size is None else config.moe_latent_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            skip_bias_add=True,
            is_expert=True,
            tp_comm_buffer_name="fc2",
            pg_collection=pg,
            name=(name + ".linear_fc2") if name is not None else None,
        )
        check_not_native_grouped(self.linear_fc1)
        self.wgrad_queue = None  # TE defers weight gradients itself (delay_wgrad_compute)
        self._wgrad_hooks = []

    def reset_parameters(self) -> None:  # TE initialises its weights (config.init_method)
        return None

    @property
    def stacked_fc1_weight(self) -> torch.Tensor:
        """fc1's weights ``[L, F1, H]`` (``linear_fc1.weight{l}`` at slice l), read-only (``read_only``)."""
        return read_only([getattr(self.linear_fc1, f"weight{i}") for i in range(self.num_local_experts)])

    @property
    def stacked_fc2_weight(self) -> torch.Tensor:
        """fc2's weights ``[L, H, F]`` (``linear_fc2.weight{l}`` at slice l), read-only (``read_only``)."""
        return read_only([getattr(self.linear_fc2, f"weight{i}") for i in range(self.num_local_experts)])

    def late_wgrad(self):
        return None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):

        cfg = self.mok_config
        # Rows the dispatcher already padded (aligned plan) go straight to TE's GEMMs.
        alignment = 1 if self.aligned_input >= self.expert_alignment else self.expert_alignment
        out = te_expert_mlp(
            permuted_local_hidden_states,
            permuted_probs,
            tokens_per_expert,
            self.linear_fc1,
            self.linear_fc2,
            cfg.activation,
            alignment,
            apply_probs_on_input=cfg.apply_probs_on_input,
        )
        return out, None

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """Nothing here: Megatron's DDP visits every module holding the parameter, so it registers the
        hook on the TE linears themselves (which fire it in their backward_dw), as for TEGroupedMLP
        (which has no such method). Registering here as well would reduce the gradient twice."""
        return None

    def backward_dw(self) -> None:
        """TE's deferred weight gradients (``delay_wgrad_compute``), fc2 then fc1 as ``TEGroupedMLP``."""
        self.linear_fc2.backward_dw()
        self.linear_fc1.backward_dw()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        to_te_layout(state_dict, prefix, self.num_local_experts)
        MegatronModule._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """``TEGroupedMLP``'s own mapping (its keys are ``SequentialMLP``'s, so MoK's too)."""
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        return TEGroupedMLP.sharded_state_dict(self, prefix, sharded_offsets, metadata)
