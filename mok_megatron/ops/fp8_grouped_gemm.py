"""Native FP8 expert GEMMs without Transformer Engine: rowwise-scaled ``torch._scaled_grouped_mm``.

Opt-in: ``--mok-expert-backend torch-fp8`` makes the experts (``experts.fp8_mlp.native_expert_mlp``)
call ``fp8_grouped_linear`` where the bf16 path calls ``ops.grouped_gemm.grouped_linear`` (same
``x_MK, w_GNK, offs_G`` contract, weights ``[G, N, K]`` like ``torch.nn.Linear`` per expert, so
checkpoints do not change); the rows must be padded per expert to ``ALIGNMENT`` (``ops.align``), and
``check_native_fp8`` runs once at layer build so a wrong GPU fails before training starts.

The three GEMMs (legend: M rows, K in, N out, G experts; torch wants A row-major, B column-major, e4m3
operands, fp32 scales, bf16 output):

    forward  y[M,N]    = x[M,K]    @ w_g[N,K]^T   scale_a [M] (row of x, over K)   scale_b [G,N] (over K)
    dgrad    dx[M,K]   = dy[M,N]   @ w_g[N,K]     scale_a [M] (row of dy, over N)  scale_b [G,K] (over N)
    wgrad    dw_g[N,K] = dy_g^T[N,M_g] @ x_g[M_g,K]  scale_a [G*N], scale_b [G*K]: one per (column, expert),
                                                   over that expert's rows (``quantize.quantize_segments``)

All scales are computed on the device (no host sync). Activations and gradients are e4m3 with
per-row amax scaling (no e5m2: current scaling per row leaves no overflow risk, which is what e5m2's
range buys delayed scaling).

Accumulation: the forward GEMM runs with ``use_fast_accum=True`` (Hopper's FP8 tensor cores accumulate in
reduced precision, promoted to fp32 only between k-tiles; TE and DeepSeek-V3 do this for fprop, where the
error it adds is small next to e4m3's 2^-4 rounding); dgrad too when its contraction (the weight's N) is at
most ``DGRAD_FAST_ACCUM_MAX_N`` (the error grows with the contraction length), else ``use_fast_accum=False``
(full fp32 accumulation), as wgrad always. Why not exact everywhere: on the H200 (torch 2.11, measured)
exact accumulation runs the Qwen3-30B-A3B expert GEMMs (128 experts x ~1024
rows, contraction 768-2048) at 286-370 TFLOP/s against 711-1179 with fast accumulation and 560-718 in bf16,
while on the DeepSeek-V3 slice (8 x 4096 rows, contraction 2048-7168) it costs only 16-19 %.

Weight gradient: FP8 (per-expert column scales) when the experts average at least ``WGRAD_FP8_MIN_ROWS``
rows (static: padded rows / experts), else bf16 ``torch._grouped_mm`` on the unquantized operands: the FP8
2d x 2d kernel ran the Qwen3 shapes (~1024 rows per expert) at 245-338 TFLOP/s against 649-668 in bf16,
and the DeepSeek slice (4096 rows) at 1004-1019 against 693-701. The bf16 path also skips the two
per-(expert, column) quantization passes.

Quantization kernels (``kernels.fp8_quant``): on CUDA one-pass Triton kernels (rowwise for x, dy and the
forward weight; per-(expert, column) with a transposing write for the wgrad operands and the dgrad weight),
bitwise equal to their pure-torch references (``kernels.fp8_quant_reference``), which run everywhere else
(CPU tests).

Padding: the experts' MLP (``experts.fp8_mlp.native_expert_mlp``) calls ``fp8_grouped_linear_padded``
for fc1 (the R real rows quantized straight into the padded FP8 layout) and ``fp8_grouped_linear_gather``
for fc2 (returns the real rows; its backward quantizes their gradient straight into the padded layout), so
neither x nor the output gradient is copied into a zero-filled bf16 padded buffer. Both are bitwise the
pad / ``fp8_grouped_linear`` / unpad composition.

Quantized weights are cached per weight version in an ``FP8WeightCache`` that the experts module owns
(``experts.fp8_mlp.MoKFP8GroupedMLP.fp8_weights``; every GEMM here takes it as ``cache``, None: quantize
on every call): both orientations, (q, scale), keyed on ``(data_ptr, _version, shape, stride, dtype)`` plus
the cache's optimizer-step epoch, in a weak dictionary keyed by the weight tensor (an entry dies with its
weight). So a forward and every later forward/dgrad with the same weights (gradient-accumulation
micro-batches, activation recompute) quantize each weight once. Invalidated by (a) any in-place change
through the weight or a view of it (``_version``: torch optimizers, ``copy_`` in ``load_state_dict``),
(b) any ``torch.optim.Optimizer.step`` (torch's optimizer post-step hook, registered by each cache and
removed when the cache dies, bumps its epoch: Megatron's optimizers write the model weights through
``param.data`` or the DDP param buffer, which ``_version`` does not see), (c) ``FP8WeightCache.invalidate()``
for anything else that rewrites weights behind autograd's back. While a CUDA graph is being captured the
cache is bypassed (the graph must quantize on every replay). Memory: 1 byte per weight element per
orientation, i.e. about one bf16 copy of the experts' weights.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from mok_megatron.errors import MoKConfigError
from mok_megatron.ops.grouped_gemm import _wgrad as _bf16_wgrad
from mok_megatron.kernels.fp8_quant import (
    quantize_rowwise,
    quantize_rowwise_partials,
    quantize_rowwise_scatter,
    quantize_segments_t,
    quantize_segments_t_scatter,
    quantize_weight_t,
)

# Every expert's row count must be a multiple of this (16-byte aligned fp8 rows for the wgrad's
# contraction over tokens); pad with ``ops.align.pad_plan(counts, ALIGNMENT, ...)``.
ALIGNMENT = 16
MIN_CAPABILITY = (9, 0)
OUT_DTYPE = torch.bfloat16
DGRAD_FAST_ACCUM_MAX_N = 2048  # dgrad contraction length up to which fast accumulation is used
WGRAD_FP8_MIN_ROWS = 2048  # average rows per expert from which the weight gradient runs in FP8


def _dgrad_fast(w_GNK: torch.Tensor) -> bool:
    return w_GNK.shape[1] <= DGRAD_FAST_ACCUM_MAX_N


def _wgrad_fp8(num_rows: int, w_GNK: torch.Tensor) -> bool:
    return num_rows >= WGRAD_FP8_MIN_ROWS * w_GNK.shape[0]


def _wgrad_bf16(dy_MN: torch.Tensor, x_MK: torch.Tensor, offs_G: torch.Tensor, w_GNK: torch.Tensor):
    """bf16 weight gradient ``dw[g] = dy_g^T x_g`` (rows grouped by ``offs_G``, unquantized operands)."""
    return _bf16_wgrad(dy_MN.to(w_GNK.dtype), x_MK.to(w_GNK.dtype), offs_G)


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot run FP8 on ``device`` (None: it can)."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"needs torch._scaled_grouped_mm, which torch {torch.__version__} lacks (torch >= 2.8)"
    if device.type != "cuda":
        return f"needs an FP8-capable GPU (sm_90+, Hopper or newer); this device is {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (
            "needs an FP8-capable GPU (sm_90+, Hopper or newer; torch's FP8 grouped GEMM has no sm_89 kernel); "
            f"this device is {torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})"
        )
    return None


def check_native_fp8(device: torch.device | str) -> None:
    """Raise MoKConfigError unless ``torch._scaled_grouped_mm`` can run FP8 on ``device``."""
    reason = unavailable_reason(device)
    if reason is not None:
        raise MoKConfigError(
            f"--mok-expert-backend torch-fp8 {reason}. Use the default bf16 expert backend, or a TE FP8 recipe "
            "(--fp8-recipe) where `mok env` lists one as available."
        )


def _check_shapes(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> None:
    if x_MK.dim() != 2 or w_GNK.dim() != 3 or x_MK.shape[1] != w_GNK.shape[2]:
        raise ValueError(
            f"fp8_grouped_linear: x {tuple(x_MK.shape)} and w {tuple(w_GNK.shape)} do not fit; "
            "expected x [M, K] and w [G, N, K]"
        )
    _, n, k = w_GNK.shape
    if n % 16 or k % 16:
        raise ValueError(
            f"fp8_grouped_linear: N={n}, K={k}; FP8 rows need 16-byte strides, so both must be multiples of 16"
        )
    if offs_G.shape != (w_GNK.shape[0],) or offs_G.dtype != torch.int32:
        raise ValueError(
            f"fp8_grouped_linear: offs {tuple(offs_G.shape)} {offs_G.dtype}; expected ({w_GNK.shape[0]},) int32 "
            f"inclusive row offsets, each expert padded to a multiple of {ALIGNMENT} (ops.align)"
        )


# ---- quantized weights, cached per weight version ---------------------------------------------------------


def _quantize_weight(w_GNK: torch.Tensor, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    if orientation == "fwd":  # q [G, N, K], one scale per (g, n) over K
        return quantize_rowwise(w_GNK)
    if orientation == "dgrad":  # q [G, K, N], one scale per (g, k) over N
        return quantize_weight_t(w_GNK)
    raise ValueError(f"quantized_weight: orientation={orientation!r}, expected 'fwd' or 'dgrad'")


def _experts_of(w_GNK: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``(base, lo)`` when ``w_GNK`` is ``base[lo:lo + G]`` (a group of a stacked weight's experts, or the
    whole of it: ``experts.groups``, the late-wgrad stand-ins), else None."""
    base = w_GNK._base
    if base is None or base.dim() != w_GNK.dim() or base.shape[1:] != w_GNK.shape[1:]:
        return None
    if base.stride() != w_GNK.stride() or not base.is_contiguous():
        return None
    lo, rem = divmod(w_GNK.storage_offset() - base.storage_offset(), base.stride(0))
    if rem or lo < 0 or lo + w_GNK.shape[0] > base.shape[0]:
        return None
    return base, lo


class FP8WeightCache:
    """Quantized weights of one owner (an experts module), per weight version (module docstring): a weak
    dictionary keyed by the weight tensor, and an epoch that every optimizer step bumps through torch's
    optimizer post-step hook, registered here and removed when the cache is collected."""

    def __init__(self):
        self._weights = WeakIdKeyDictionary()  # weight -> (key, {orientation: (q, scale)})
        self._epoch = 0
        ref = weakref.ref(self)  # the hook must not keep the cache alive

        def after_step(*_):
            cache = ref()
            if cache is not None:
                cache.invalidate()

        weakref.finalize(self, register_optimizer_step_post_hook(after_step).remove)

    def __len__(self) -> int:
        return len(self._weights)

    def invalidate(self) -> None:
        """Drop every cached quantized weight (after rewriting weights outside autograd and optimizers)."""
        self._epoch += 1

    def _key(self, w: torch.Tensor) -> tuple:
        return (w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype, w.device, self._epoch)

    def get(self, w_GNK: torch.Tensor, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantized_weight(w_GNK, orientation)`` from this cache, quantizing on a miss."""
        group = _experts_of(w_GNK)
        if group is not None:
            base, lo = group
            q, scale = self.get(base, orientation)
            return q[lo : lo + w_GNK.shape[0]], scale[lo : lo + w_GNK.shape[0]]
        key = self._key(w_GNK)
        cached = self._weights.get(w_GNK)
        if cached is None or cached[0] != key:
            cached = (key, {})
            self._weights[w_GNK] = cached
        by_orientation = cached[1]
        if orientation not in by_orientation:
            by_orientation[orientation] = _quantize_weight(w_GNK, orientation)
        return by_orientation[orientation]


def quantized_weight(
    w_GNK: torch.Tensor, orientation: str, cache: FP8WeightCache | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of ``w_GNK`` for the forward (``"fwd"``: q [G, N, K], scale [G, N]) or the dgrad
    (``"dgrad"``: q [G, K, N], scale [G, K]), row-major; from ``cache`` (module docstring), or quantized now
    without one or while a CUDA graph is captured. In the cache a view of some of a stacked weight's experts
    gets its slice of the stacked weight's entry (the scales are per expert, so the slice is bitwise its own
    quantization): the views made anew every layer call share one quantization per weight version."""
    if cache is None or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return _quantize_weight(w_GNK, orientation)
    return cache.get(w_GNK, orientation)


# ---- GEMM operands -------------------------------------------------------------------------------------------


def fwd_operands(x_MK, w_GNK, weight=None, x_quantized=None):
    """(A, B, scale_a, scale_b) of the forward GEMM, in the layouts ``torch._scaled_grouped_mm`` takes.
    ``weight``: ``quantized_weight(w_GNK, "fwd")`` when the caller has it (else quantized here);
    ``x_quantized``: ``quantize_rowwise(x_MK)`` when the caller has it."""
    xq_MK, xs_M = x_quantized if x_quantized is not None else quantize_rowwise(x_MK)
    wq_GNK, ws_GN = weight if weight is not None else quantize_rowwise(w_GNK)  # one scale per n, over K
    # B [G, K, N] column-major: the transpose of the row-major [G, N, K] (a view)
    return xq_MK, wq_GNK.transpose(-2, -1), xs_M, ws_GN


def dgrad_operands(dy_MN, w_GNK, weight=None, dy_quantized=None):
    dyq_MN, dys_M = dy_quantized if dy_quantized is not None else quantize_rowwise(dy_MN)
    wq_GKN, ws_GK = weight if weight is not None else quantize_weight_t(w_GNK)  # one scale per k, over N
    # B [G, N, K] column-major: the transpose of the row-major [G, K, N]
    return dyq_MN, wq_GKN.transpose(-2, -1), dys_M, ws_GK


def wgrad_operands(dy_MN, x_MK, offs_G, x_quantized=None, dy_partials=None, x_partials=None):
    """``x_quantized``: (xq_KM, xs_GK) as ``quantize_segments_t(x_MK, offs_G)`` gives, when the caller
    built them another way (the padded fc1: ``quantize_segments_t_scatter``); ``*_partials``: the block
    amaxes ``quantize_rowwise_partials`` kept when it quantized that operand rowwise (no amax pass)."""
    dyq_NM, dys_GN = quantize_segments_t(dy_MN, offs_G, partials=dy_partials)  # A [N, M] row-major
    if x_quantized is None:
        x_quantized = quantize_segments_t(x_MK, offs_G, partials=x_partials)
    xq_KM, xs_GK = x_quantized
    return dyq_NM, xq_KM.t(), dys_GN.reshape(-1), xs_GK.reshape(-1)  # B [M, K] column-major = x^T row-major


def _gemm(a, b, scale_a, scale_b, offs_G, fast_accum: bool):
    return torch._scaled_grouped_mm(
        a, b, scale_a, scale_b, offs=offs_G, out_dtype=OUT_DTYPE, use_fast_accum=fast_accum
    )


def _rowwise(x_MK: torch.Tensor, partials: bool):
    """``((q, scale), block amaxes or None)``: with ``partials`` (the operand's FP8 weight gradient will
    follow) one pass also keeps what that gradient's per-(expert, column) scales need."""
    if partials:
        q, s, p = quantize_rowwise_partials(x_MK)
        return (q, s), p
    return quantize_rowwise(x_MK), None


class _FP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G, cache):
        x_quantized, x_partials = _rowwise(x_MK, w_GNK.requires_grad and _wgrad_fp8(x_MK.shape[0], w_GNK))
        ctx.save_for_backward(x_MK, w_GNK, offs_G, x_partials)
        ctx.cache = cache
        operands = fwd_operands(x_MK, w_GNK, quantized_weight(w_GNK, "fwd", cache), x_quantized)
        return _gemm(*operands, offs_G, fast_accum=True).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GNK, offs_G, x_partials = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx_MK = dw_GNK = dy_partials = None
        wgrad_fp8 = ctx.needs_input_grad[1] and _wgrad_fp8(x_MK.shape[0], w_GNK)
        if ctx.needs_input_grad[0]:
            dy_quantized, dy_partials = _rowwise(dy_MN, wgrad_fp8)
            operands = dgrad_operands(dy_MN, w_GNK, quantized_weight(w_GNK, "dgrad", ctx.cache), dy_quantized)
            dx_MK = _gemm(*operands, offs_G, fast_accum=_dgrad_fast(w_GNK)).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            if wgrad_fp8:
                operands = wgrad_operands(dy_MN, x_MK, offs_G, dy_partials=dy_partials, x_partials=x_partials)
                dw_GNK = _gemm(*operands, offs_G, fast_accum=False).to(w_GNK.dtype)
            else:
                dw_GNK = _wgrad_bf16(dy_MN, x_MK, offs_G, w_GNK)
        return dx_MK, dw_GNK, None, None


class _FP8GroupedLinearPadded(torch.autograd.Function):
    """The same GEMMs with A = the per-expert padded layout of ``x_RK``'s R real rows, quantized straight
    into it (``kernels.fp8_quant.*_scatter``): no bf16 padded buffer, no pad/unpad copies of x or dx
    beyond the one gather of dx's real rows. Bitwise the unpadded-input path after ``ops.align.pad_rows``."""

    @staticmethod
    def forward(ctx, x_RK, w_GNK, dest_R, offs_real_G, offs_G, num_rows: int, cache):
        ctx.save_for_backward(x_RK, w_GNK, dest_R, offs_real_G, offs_G)
        ctx.num_rows, ctx.cache = num_rows, cache
        xq_PK, xs_P = quantize_rowwise_scatter(x_RK, dest_R, num_rows)
        wq_GNK, ws_GN = quantized_weight(w_GNK, "fwd", cache)
        y_PN = _gemm(xq_PK, wq_GNK.transpose(-2, -1), xs_P, ws_GN, offs_G, fast_accum=True)
        return y_PN.to(x_RK.dtype)

    @staticmethod
    def backward(ctx, dy_PN):
        x_RK, w_GNK, dest_R, offs_real_G, offs_G = ctx.saved_tensors
        dy_PN = dy_PN.contiguous()
        dx_RK = dw_GNK = None
        if ctx.needs_input_grad[0]:
            operands = dgrad_operands(dy_PN, w_GNK, quantized_weight(w_GNK, "dgrad", ctx.cache))
            dx_PK = _gemm(*operands, offs_G, fast_accum=_dgrad_fast(w_GNK))
            dx_RK = dx_PK.index_select(0, dest_R).to(x_RK.dtype)
        if ctx.needs_input_grad[1]:
            if _wgrad_fp8(ctx.num_rows, w_GNK):
                x_quantized = quantize_segments_t_scatter(x_RK, offs_real_G, offs_G, ctx.num_rows)
                operands = wgrad_operands(dy_PN, None, offs_G, x_quantized)
                dw_GNK = _gemm(*operands, offs_G, fast_accum=False).to(w_GNK.dtype)
            else:  # the real rows of dy against x's real rows
                dw_GNK = _wgrad_bf16(dy_PN.index_select(0, dest_R), x_RK, offs_real_G, w_GNK)
        return dx_RK, dw_GNK, None, None, None, None, None


class _FP8GroupedLinearGather(torch.autograd.Function):
    """The same GEMMs on the padded layout, returning only the R real rows (``y_PN[dest_R]``); the
    backward quantizes the real rows' gradient straight into the padded layout (no bf16 zero-filled
    padded gradient). Bitwise the padded-output path followed by ``ops.align.unpad_rows``."""

    @staticmethod
    def forward(ctx, x_PK, w_GNK, dest_R, offs_real_G, offs_G, cache):
        ctx.save_for_backward(x_PK, w_GNK, dest_R, offs_real_G, offs_G)
        ctx.cache = cache
        operands = fwd_operands(x_PK, w_GNK, quantized_weight(w_GNK, "fwd", cache))
        return _gemm(*operands, offs_G, fast_accum=True).index_select(0, dest_R).to(x_PK.dtype)

    @staticmethod
    def backward(ctx, dy_RN):
        x_PK, w_GNK, dest_R, offs_real_G, offs_G = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()
        num_rows = x_PK.shape[0]
        dx_PK = dw_GNK = None
        if ctx.needs_input_grad[0]:
            dyq_PN, dys_P = quantize_rowwise_scatter(dy_RN, dest_R, num_rows)
            wq_GKN, ws_GK = quantized_weight(w_GNK, "dgrad", ctx.cache)
            fast = _dgrad_fast(w_GNK)
            dx_PK = _gemm(dyq_PN, wq_GKN.transpose(-2, -1), dys_P, ws_GK, offs_G, fast_accum=fast)
            dx_PK = dx_PK.to(x_PK.dtype)
        if ctx.needs_input_grad[1]:
            if _wgrad_fp8(num_rows, w_GNK):
                dyq_NP, dys_GN = quantize_segments_t_scatter(dy_RN, offs_real_G, offs_G, num_rows)
                xq_KP, xs_GK = quantize_segments_t(x_PK, offs_G)
                operands = (dyq_NP, xq_KP.t(), dys_GN.reshape(-1), xs_GK.reshape(-1))
                dw_GNK = _gemm(*operands, offs_G, fast_accum=False).to(w_GNK.dtype)
            else:  # x's real rows against the real rows of dy
                dw_GNK = _wgrad_bf16(dy_RN, x_PK.index_select(0, dest_R), offs_real_G, w_GNK)
        return dx_PK, dw_GNK, None, None, None, None


def fp8_grouped_linear_gather(
    x_PK: torch.Tensor,
    w_GNK: torch.Tensor,
    dest_R: torch.Tensor,
    offs_real_G: torch.Tensor,
    offs_G: torch.Tensor,
    cache: FP8WeightCache | None = None,
) -> torch.Tensor:
    """``ops.align.unpad_rows(fp8_grouped_linear(x_PK, w_GNK, offs_G), plan)`` whose backward builds no
    bf16 padded gradient. Inputs as ``fp8_grouped_linear_padded`` with x [P, K] on the padded layout;
    output y [R, N], the real rows."""
    check_native_fp8(x_PK.device)
    _check_shapes(x_PK, w_GNK, offs_G)
    if dest_R.dim() != 1 or offs_real_G.shape != offs_G.shape:
        raise ValueError(
            f"fp8_grouped_linear_gather: dest {tuple(dest_R.shape)} and offs_real {tuple(offs_real_G.shape)} "
            f"do not fit offs {tuple(offs_G.shape)}; pass a PadPlan's dest_R, offsets_E"
        )
    return _FP8GroupedLinearGather.apply(x_PK.contiguous(), w_GNK, dest_R, offs_real_G, offs_G, cache)


def fp8_grouped_linear_padded(
    x_RK: torch.Tensor,
    w_GNK: torch.Tensor,
    dest_R: torch.Tensor,
    offs_real_G: torch.Tensor,
    offs_G: torch.Tensor,
    num_rows: int,
    cache: FP8WeightCache | None = None,
) -> torch.Tensor:
    """``fp8_grouped_linear(ops.align.pad_rows(x_RK, plan), w_GNK, offs_G)`` without the padded bf16 copy.

    Inputs: x [R, K] expert-major real rows; dest int64 [R] (``PadPlan.dest_R``); offs_real int32 [G]
    (``PadPlan.offsets_E``); offs int32 [G] the GEMM's padded ends (``native_offsets(plan)``), num_rows P.
    Output: y [P, N] on the padded layout (padding rows: zero inputs). Gradient for x [R, K] and w."""
    check_native_fp8(x_RK.device)
    _check_shapes(x_RK, w_GNK, offs_G)
    if dest_R.shape != (x_RK.shape[0],) or offs_real_G.shape != offs_G.shape:
        raise ValueError(
            f"fp8_grouped_linear_padded: dest {tuple(dest_R.shape)} and offs_real {tuple(offs_real_G.shape)} "
            f"do not fit x {tuple(x_RK.shape)} and offs {tuple(offs_G.shape)}; pass a PadPlan's dest_R, offsets_E"
        )
    x_RK = x_RK.contiguous()
    return _FP8GroupedLinearPadded.apply(x_RK, w_GNK, dest_R, offs_real_G, offs_G, num_rows, cache)


def fp8_grouped_linear(
    x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, cache: FP8WeightCache | None = None
) -> torch.Tensor:
    """``y_MN[rows of g] = x_MK[rows of g] @ w_GNK[g].T`` in FP8 (rowwise scales) with autograd; the
    quantized weights from ``cache`` (None: quantized on every call).

    Inputs as ``ops.grouped_gemm.grouped_linear``; each expert's rows padded to ``ALIGNMENT`` (zero
    padding rows: they add nothing to dW). Rows past ``offs_G[-1]`` (spare rows of a static-size padded
    buffer) get unspecified outputs and must not be read; their gradient rows are unspecified too.
    Raises MoKConfigError on a device without FP8 grouped GEMMs (CPU, pre-Hopper)."""
    check_native_fp8(x_MK.device)
    _check_shapes(x_MK, w_GNK, offs_G)
    return _FP8GroupedLinear.apply(x_MK.contiguous(), w_GNK, offs_G, cache)
