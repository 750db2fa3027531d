"""FLOP and byte arithmetic (per token unless named otherwise). Forward+backward = 3 x forward.

A GEMM of (m x k) @ (k x n) is 2 m k n FLOP. A SwiGLU expert of width F on hidden H is one H -> 2F
GEMM and one F -> H GEMM: 6 F H FLOP per token forward, 18 F H forward+backward.
"""

from __future__ import annotations

from mok_megatron.tools.planner.shapes import Attention, Model, MoEShape

FWD_BWD = 3


def expert_flops(tokens: int, moe: MoEShape) -> float:
    """Routed-expert GEMM FLOP of ``tokens`` tokens, forward + backward (what the layer benchmarks count)."""
    return FWD_BWD * 6.0 * tokens * moe.topk * moe.ffn * moe.hidden


def attention_flops_per_token(att: Attention, hidden: int, seq: int) -> float:
    """Forward FLOP per token of one attention block (projections + causal core)."""
    h, d = att.heads, att.head_dim
    if att.mla:
        qk = d + att.rope_dim
        v = att.v_head_dim or d
        q = 2 * hidden * att.q_lora + 2 * att.q_lora * h * qk if att.q_lora else 2 * hidden * h * qk
        kv = 2 * hidden * (att.kv_lora + att.rope_dim) + 2 * att.kv_lora * h * (d + v)
        proj = q + kv + 2 * h * v * hidden
        core = 2 * seq * h * (qk + v) / 2  # QK^T and PV, causal: half the pairs
    else:
        g = att.query_groups or h
        proj = 2 * hidden * h * d + 2 * 2 * hidden * g * d + 2 * h * d * hidden
        core = 2 * seq * h * 2 * d / 2
    return proj + core


def moe_layer_flops_per_token(moe: MoEShape) -> float:
    """Forward FLOP per token of one MoE block: router, routed experts, shared expert."""
    return (
        2 * moe.hidden * moe.experts
        + 6.0 * moe.topk * moe.ffn * moe.hidden
        + 6.0 * moe.shared_ffn * moe.hidden
    )


def model_flops_per_token(m: Model) -> float:
    """Training FLOP per token (forward + backward), Megatron-style: no recompute counted."""
    att = attention_flops_per_token(m.attention, m.hidden, m.seq)
    dense = 6.0 * m.dense_ffn * m.hidden
    moe = moe_layer_flops_per_token(m.moe)
    body = m.layers * att + (m.layers - m.moe_layers) * dense + m.moe_layers * moe
    mtp = m.mtp_layers * (att + moe + 2 * 2 * m.hidden * m.hidden + 2 * m.hidden * m.vocab)
    return FWD_BWD * (body + mtp + 2 * m.hidden * m.vocab)


def p_visit(moe: MoEShape, ep: int) -> float:
    """Probability that a token has at least one of its top-k experts on a given *other* EP rank
    (uniform routing, k distinct experts out of E, E / EP experts per rank)."""
    if ep <= 1:
        return 0.0
    local = moe.experts // ep
    miss = 1.0
    for i in range(moe.topk):
        miss *= max(moe.experts - local - i, 0) / (moe.experts - i)
    return 1.0 - miss


def mok_remote_ranks(moe: MoEShape, ep: int) -> float:
    """Expected other EP ranks one token is sent to by MoK's deduplicated dispatch."""
    return (ep - 1) * p_visit(moe, ep)


def megatron_remote_copies(moe: MoEShape, ep: int) -> float:
    """Expected remote copies per token in Megatron's alltoall dispatcher: one per (token, expert) pair."""
    return moe.topk * (ep - 1) / ep


# dispatch + combine forward, and their gradients backward: four all-to-alls of the hidden state
TRANSFERS_PER_LAYER = 4


def a2a_bytes(
    tokens: int, hidden: int, copies: float, elem_bytes: float = 2.0, extra_row_bytes: float = 0.0
) -> float:
    """Bytes one rank sends in one MoE layer forward + backward."""
    return TRANSFERS_PER_LAYER * tokens * copies * (hidden * elem_bytes + extra_row_bytes)


def mok_bytes(tokens: int, moe: MoEShape, ep: int) -> float:
    """MoK's deduplicated traffic: one bf16 row per (token, remote rank) plus the fp32 weights of that
    rank's local experts (4 bytes x E/EP per row, as the engine's byte counter shows)."""
    return a2a_bytes(tokens, moe.hidden, mok_remote_ranks(moe, ep), extra_row_bytes=4.0 * (moe.experts // ep))


def megatron_bytes(tokens: int, moe: MoEShape, ep: int) -> float:
    """Megatron's alltoall dispatcher: one bf16 row per (token, expert) pair on another rank."""
    return a2a_bytes(tokens, moe.hidden, megatron_remote_copies(moe, ep))


def token_traffic_bytes(tokens: int, moe: MoEShape) -> float:
    """HBM traffic proxy of the non-GEMM work (permute, activation, combine, their gradients): bf16
    rows of width H + 2F per (token, expert) pair. Only its proportions matter; the calibration fits the
    time per byte."""
    return 2.0 * tokens * moe.topk * (moe.hidden + 2 * moe.ffn)
