"""Model shapes and parallel layouts, validated when built (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field


class LayoutError(ValueError):
    """A model or layout that cannot run; the message names the value, the constraint and the fix."""


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    ffn: int  # per routed expert
    experts: int
    topk: int
    shared_ffn: int = 0  # total intermediate size of the shared expert(s); 0 = none

    def __post_init__(self):
        for f in ("hidden", "ffn", "experts", "topk"):
            if getattr(self, f) < 1:
                raise LayoutError(f"MoE {f}={getattr(self, f)}: must be >= 1")


@dataclass(frozen=True)
class Attention:
    heads: int
    head_dim: int  # qk head dim (no rope part) / kv_channels
    query_groups: int = 0  # GQA groups; 0 = MHA (= heads)
    mla: bool = False
    q_lora: int = 0  # MLA only; 0 = no query compression
    kv_lora: int = 0
    rope_dim: int = 0  # MLA decoupled rope head dim
    v_head_dim: int = 0  # MLA; 0 = head_dim


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    moe_layers: int
    hidden: int
    dense_ffn: int  # FFN of the dense (non-MoE) layers
    attention: Attention
    moe: MoEShape
    vocab: int
    seq: int
    mtp_layers: int = 0

    def __post_init__(self):
        if not 0 <= self.moe_layers <= self.layers:
            raise LayoutError(
                f"{self.name}: moe_layers={self.moe_layers} must be in [0, layers={self.layers}]"
            )
        if self.moe.hidden != self.hidden:
            raise LayoutError(f"{self.name}: MoE hidden {self.moe.hidden} != model hidden {self.hidden}")
        if self.moe.topk > self.moe.experts:
            raise LayoutError(
                f"{self.name}: topk={self.moe.topk} > experts={self.moe.experts}; pick topk <= experts"
            )


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    precision: str = "bf16"  # GEMM precision: bf16, fp8, mxfp8
    dp: int = field(init=False)

    def __post_init__(self):
        for f in ("world", "tp", "pp", "vpp", "ep", "etp", "cp", "micro_batch", "global_batch"):
            if getattr(self, f) < 1:
                raise LayoutError(f"layout {f}={getattr(self, f)}: must be >= 1")
        if self.precision not in ("bf16", "fp8", "mxfp8"):
            raise LayoutError(f"precision {self.precision!r}: must be bf16, fp8 or mxfp8")
        mp = self.tp * self.pp * self.cp
        if self.world % mp:
            raise LayoutError(
                f"world {self.world} is not divisible by TP x PP x CP = {mp}; change the GPU count or the layout"
            )
        object.__setattr__(self, "dp", self.world // mp)
        per_stage = self.world // self.pp
        if per_stage % (self.ep * self.etp):
            raise LayoutError(
                f"EP x ETP = {self.ep * self.etp} does not divide the {per_stage} GPUs of a pipeline stage "
                "(world / PP); pick EP x ETP that divides it"
            )
        if self.global_batch % (self.micro_batch * self.dp):
            raise LayoutError(
                f"global batch {self.global_batch} is not a multiple of micro-batch x DP = "
                f"{self.micro_batch} x {self.dp}; round the global batch"
            )

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def check(self, model: Model) -> None:
        """Constraints that involve the model."""
        if model.moe.experts % self.ep:
            raise LayoutError(
                f"{model.name}: {model.moe.experts} experts do not split over EP={self.ep}; pick EP dividing it"
            )
        if model.attention.heads % self.tp:
            raise LayoutError(f"{model.name}: {model.attention.heads} heads do not split over TP={self.tp}")
        if self.pp * self.vpp > model.layers + model.mtp_layers + 2:
            raise LayoutError(
                f"{model.name}: PP x VPP = {self.pp * self.vpp} stages for {model.layers} layers; use fewer stages"
            )
        if model.seq % (self.cp * self.tp):
            raise LayoutError(
                f"{model.name}: sequence {model.seq} does not split over CP x TP = {self.cp * self.tp}"
            )

    def moe_tokens(self, model: Model) -> int:
        """Tokens entering one rank's MoE layer per micro-batch (sequence parallel splits them over TP)."""
        return self.micro_batch * model.seq // (self.cp * self.tp)


_MLA = Attention(heads=128, head_dim=128, mla=True, q_lora=1536, kv_lora=512, rope_dim=64, v_head_dim=128)
MODELS = {
    "deepseek-v3": Model(
        "deepseek-v3",
        61,
        58,
        7168,
        18432,
        _MLA,
        MoEShape(7168, 2048, 256, 8, 2048),
        129280,
        4096,
        mtp_layers=1,
    ),
    "kimi-k2": Model(
        "kimi-k2",
        61,
        60,
        7168,
        18432,
        Attention(64, 128, mla=True, q_lora=1536, kv_lora=512, rope_dim=64, v_head_dim=128),
        MoEShape(7168, 2048, 384, 8, 2048),
        163840,
        4096,
    ),
    "qwen3-235b-a22b": Model(
        "qwen3-235b-a22b",
        94,
        94,
        4096,
        12288,
        Attention(64, 128, 4),
        MoEShape(4096, 1536, 128, 8),
        151936,
        4096,
    ),
    "qwen3-30b-a3b": Model(
        "qwen3-30b-a3b", 48, 48, 2048, 6144, Attention(32, 128, 4), MoEShape(2048, 768, 128, 8), 151936, 4096
    ),
}


def model(name: str) -> Model:
    if name not in MODELS:
        raise LayoutError(f"model {name!r}: unknown; choose one of {', '.join(MODELS)} or pass --recipe")
    return MODELS[name]


# Each model's own layout: the one its examples/<model>_gb300.sh recipe runs (tests hold them equal),
# used by ``mok plan --model M`` for every flag not given.
LAYOUTS = {
    "deepseek-v3": dict(
        cluster="gb300-nvl72", nodes=128, nvlink_domain=64, tp=1, pp=8, vpp=4, ep=64, cp=1,
        micro_batch=1, global_batch=4096, precision="mxfp8",
    ),
    "kimi-k2": dict(
        cluster="gb300-nvl72", nodes=128, nvlink_domain=64, tp=1, pp=8, vpp=4, ep=64, cp=1,
        micro_batch=1, global_batch=4096, precision="mxfp8",
    ),
    "qwen3-235b-a22b": dict(
        cluster="gb300-nvl72", nodes=128, nvlink_domain=32, tp=2, pp=8, vpp=2, ep=32, cp=1,
        micro_batch=1, global_batch=2048, precision="mxfp8",
    ),
    "qwen3-30b-a3b": dict(
        cluster="gb300-nvl72", nodes=128, nvlink_domain=32, tp=1, pp=1, vpp=1, ep=32, cp=1,
        micro_batch=2, global_batch=2048, precision="mxfp8",
    ),
}  # fmt: skip
