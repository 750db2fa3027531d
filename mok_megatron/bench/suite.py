"""``mok bench layer``'s grid: shapes x routing patterns x implementations, in one process and one run.

For each (shape, routing) case every implementation gets the same weights (MoK / Megatron layouts through
``convert_state_dict``; the peers take the stacked tensors), the same input and therefore the same routing
(``bench_routing``), and no load-balancing loss. Its output and input gradient are checked against the
first implementation before anything is timed; then forward, backward and forward+backward are timed
(``bench_timing``: median, min and max of each phase). A peer that cannot run here is listed under
``skipped`` with the reason. Progress goes to stderr as it happens: one line per case, per implementation
(its forward+backward median and spread, or why it was skipped) and per expert-GEMM floor. Each case
also times the six expert GEMMs alone (``bench_bound``: the floor of a layer on ``torch._grouped_mm``)
and, where ``nvidia-smi`` runs, records the SM clock, power and slowdown reasons while each row was timed
(``gpu_clocks``).

Implementations:
    mok            MoK's MoE layer (the spec's MLP submodule)
    megatron       Megatron-Core MoELayer, local (non-TE) spec: SequentialMLP
    megatron-te    Megatron-Core MoELayer, TE spec: TEGroupedMLP + moe_permute_fusion (needs TE and a GPU)
    torchtitan     torchtitan's MoE (``bench_torchtitan``), when installed; torch.compile'd on CUDA when that works
                   (eager otherwise: the row's note says which and why)
    plain-pytorch  sort-based permute + torch._grouped_mm (``bench_peers``)
    sonic          SonicMoE's layer (``bench.sonic``: QuACK's gather-fused grouped GEMMs), when installed, on a
                   Hopper or Blackwell GPU, bf16, softmax routing

FP8 rows (opt-in, ``--impl mok,mok-torch-fp8,...``; not in the default list): MoK's layer with an FP8 expert
backend (``FP8_IMPLS``: --mok-expert-backend and Megatron's --fp8-recipe; the ``-single`` rows add
--mok-te-single-weight; ``mok-torch-fp8-step`` quantizes its weights every step, as a one-micro-batch training
step does and as TE's rows do, where ``mok-torch-fp8`` reuses them across steps), and Megatron's TEGroupedMLP layer
under the same FP8 context (``MEGATRON_FP8_IMPLS``: ``megatron-te-blockwise``, ``megatron-te-tensorwise``),
checked against the reference with the looser ``FP8_TOLERANCE``; a path this machine cannot run is skipped
with the reason.

Engine rows (opt-in, ``ENGINE_IMPLS``): MoK's layer with another engine, its options as flags in the row's
note: ``mok-tiles`` (``--mok-engine tiles``: the tile kernels on an sm_90 GPU with QuACK, their torch
references on CPU, the note saying which ran; skipped with the layer's own reason where it cannot run).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from mok_megatron.bench.bound import gemm_steps
from mok_megatron.bench.routing import ROUTINGS, expert_load, routed_input, router_weight
from mok_megatron.bench.timing import PHASES, SPREAD, peak_memory_mib, time_phases
from mok_megatron.bench.torchtitan import PeerUnavailable
from mok_megatron.bench.clocks import ClockSampler
from mok_megatron.errors import MoKConfigError

IMPLS = ("mok", "megatron", "megatron-te", "torchtitan", "plain-pytorch", "sonic")
MEGATRON_IMPLS = ("mok", "megatron", "megatron-te")
# adapters written against another project's moving API: a failure there skips the peer, with its reason
BEST_EFFORT = ("torchtitan", "sonic")
# relative error (max |diff| / max |ref|) allowed against the reference implementation
TOLERANCE = {"bf16": 5e-2, "fp32": 1e-4}
# expert GEMM FLOPs per phase, in units of 2 * rows * 3 * H * F (forward: fc1 is 2F wide, fc2 F)
PHASE_FLOP_FACTOR = {"fwd": 1, "bwd": 2, "fwd_bwd": 3, "steady": 3}
# MoK with an FP8 expert backend: name -> (--mok-expert-backend, --fp8-recipe or None, other MoKOptions)
FP8_IMPLS = {
    "mok-torch-fp8": ("torch-fp8", None, {}),
    "mok-torch-fp8-step": ("torch-fp8", None, {}),
    "mok-te-tensorwise": ("te", "tensorwise", {}),
    "mok-te-blockwise": ("te", "blockwise", {}),
    "mok-te-mxfp8": ("te", "mxfp8", {}),
    "mok-te-tensorwise-single": ("te", "tensorwise", {"te_single_weight": True}),
    "mok-te-blockwise-single": ("te", "blockwise", {"te_single_weight": True}),
}
# FP8 rows whose quantized-weight cache is emptied before every step: each step quantizes the weights once,
# as a training step with one micro-batch does after its optimizer step (TE's rows quantize them every
# forward here too); plain ``mok-torch-fp8`` keeps its cache across steps, as micro-batches of one step do
REQUANTIZED_IMPLS = ("mok-torch-fp8-step",)
# MoK's layer on another engine: name -> MoKOptions fields
ENGINE_IMPLS = {"mok-tiles": {"engine": "tiles"}}
# Megatron's own layer (TEGroupedMLP) under the same FP8 context: name -> --fp8-recipe (with
# --moe-router-padding-for-quantization, which Megatron requires of its FP8 grouped GEMM)
MEGATRON_FP8_IMPLS = {"megatron-te-blockwise": "blockwise", "megatron-te-tensorwise": "tensorwise"}
# max |diff| / max |ref| of an FP8 path: e4m3 rounds each operand by up to 2^-4 relative, and the worst
# element of two chained GEMMs can reach a few times that (the Frobenius error is ~0.05: tests/test_fp8_gpu.py)
FP8_TOLERANCE = 0.25


def check_impls(impls: list[str]) -> None:
    known = (*IMPLS, *FP8_IMPLS, *MEGATRON_FP8_IMPLS, *ENGINE_IMPLS)
    bad = [i for i in impls if i not in known]
    if bad:
        raise ValueError(
            f"unknown implementation(s) {bad}: choose from {', '.join(IMPLS)}; opt-in rows: "
            f"{', '.join((*FP8_IMPLS, *MEGATRON_FP8_IMPLS, *ENGINE_IMPLS))}"
        )
    if not any(i in MEGATRON_IMPLS for i in impls):
        raise ValueError(
            f"--impl {','.join(impls)}: include one of {', '.join(MEGATRON_IMPLS)} (weights come from it)"
        )


def _te_reason() -> str | None:
    import torch

    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or TE's own load errors (missing .so, CUDA mismatch)
        return f"Transformer Engine not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "Transformer Engine needs a CUDA GPU"
    return None


def _bench_config(shape: dict, dtype, impl: str, router_fusion: bool = False):
    from mok_megatron.bench.build import layer_config

    cfg = dataclasses.replace(
        layer_config(shape, dtype),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_fusion=router_fusion,
    )
    return dataclasses.replace(cfg, moe_permute_fusion=True) if impl == "megatron-te" else cfg


def _weights(sd: dict):
    from mok_megatron.experts.checkpoint import convert_state_dict

    mok = convert_state_dict(sd, "mok")
    pick = {
        s: [v for k, v in mok.items() if k.endswith(s)] for s in ("router.weight", "fc1_weight", "fc2_weight")
    }
    for s, found in pick.items():
        if len(found) != 1:
            raise RuntimeError(f"reference state dict: {len(found)} tensors named *{s}, expected one")
    return pick["router.weight"][0], pick["fc1_weight"][0], pick["fc2_weight"][0]


def _build(impl: str, shape: dict, dtype, device, ref_sd: dict | None, router_fusion: bool = False):
    """(layer, note) or PeerUnavailable."""
    from mok_megatron.bench.build import build
    from mok_megatron.experts.checkpoint import convert_state_dict

    if impl.startswith("megatron-te") and (reason := _te_reason()):
        raise PeerUnavailable(reason)
    if impl in MEGATRON_FP8_IMPLS:
        return _build_megatron_fp8(impl, shape, dtype, device, ref_sd, router_fusion), ""
    if impl in FP8_IMPLS:
        return _build_fp8(impl, shape, dtype, device, ref_sd, router_fusion), ""
    if impl in ENGINE_IMPLS:
        return _build_engine(impl, shape, dtype, device, ref_sd, router_fusion)
    if impl in MEGATRON_IMPLS:
        layer = build(impl, _bench_config(shape, dtype, impl, router_fusion)).to(device)
        if ref_sd is None:
            router = [p for n, p in layer.named_parameters() if n.endswith("router.weight")]
            with __import__("torch").no_grad():
                router[0].copy_(router_weight(shape["experts"], shape["hidden"]))
        else:
            target = {"mok": "mok", "megatron": "sequential", "megatron-te": "te_grouped"}[impl]
            layer.load_state_dict(convert_state_dict(ref_sd, target), strict=True)
        return layer, ""
    weights = _weights(ref_sd)
    if impl == "plain-pytorch":
        from mok_megatron.bench.peers import PlainMoE

        layer = PlainMoE(*weights, topk=shape["topk"])
        return layer, f"expert GEMMs: {layer.gemm}"
    if impl == "sonic":
        from mok_megatron.bench import sonic

        if reason := sonic.unavailable(shape, dtype, device):
            raise PeerUnavailable(reason)
        return sonic.SonicMoE(*weights, topk=shape["topk"]), "QuACK grouped GEMMs (eager)"
    from mok_megatron.bench.torchtitan import TorchtitanMoE

    import os

    import torch

    layer = TorchtitanMoE(*weights, topk=shape["topk"])
    if device.type != "cuda":
        return layer, "eager (torch.compile is tried on CUDA only)"
    if os.environ.get("MOK_BENCH_TORCHTITAN_COMPILE", "1") == "0":
        return layer, "eager (MOK_BENCH_TORCHTITAN_COMPILE=0)"
    x = torch.randn(shape["tokens"], 1, shape["hidden"], device=device, dtype=dtype)
    return layer, layer.compile_moe(x)  # "torch.compile", or eager with the reason


def _build_fp8(impl: str, shape: dict, dtype, device, ref_sd: dict, router_fusion: bool = False):
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.bench.fp8_layers import InQuantContext, build_mok_layer, fp8_config, unavailable

    backend, recipe, options = FP8_IMPLS[impl]
    if reason := unavailable(backend, recipe):
        raise PeerUnavailable(f"--mok-expert-backend {backend} {recipe or ''}: {reason}")
    cfg = fp8_config(_bench_config(shape, dtype, "mok", router_fusion), recipe)
    try:
        layer = build_mok_layer(backend, cfg, **options).to(device)
    except MoKConfigError as e:  # an option this machine cannot run (e.g. TE's grouped GEMM absent)
        raise PeerUnavailable(str(e)) from None
    layer.load_state_dict(convert_state_dict(ref_sd, "mok"), strict=True)
    return InQuantContext(layer, cfg)


def _build_engine(impl: str, shape: dict, dtype, device, ref_sd: dict, router_fusion: bool = False):
    """(MoK's layer with the options of ``ENGINE_IMPLS[impl]`` and the reference's weights, its table note:
    the options as flags and, for the tiles engine, whether its kernels or their torch references run)."""
    from mok_megatron.bench.build import build
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.options import MoKOptions, flag_name

    fields = ENGINE_IMPLS[impl]
    try:
        layer = build("mok", _bench_config(shape, dtype, "mok", router_fusion), options=MoKOptions(**fields))
    except MoKConfigError as e:  # the engine cannot run this layer here (e.g. no QuACK on the GPU)
        raise PeerUnavailable(str(e)) from None
    layer = layer.to(device)
    layer.load_state_dict(convert_state_dict(ref_sd, "mok"), strict=True)
    note = " ".join(f"{flag_name(name)} {value}" for name, value in fields.items())
    tiles = layer.token_dispatcher.engine.tiles
    if tiles is not None:
        note += ": the tile kernels" if tiles.kernels else ": the tile kernels' torch references"
    return layer, note


def _build_megatron_fp8(impl: str, shape: dict, dtype, device, ref_sd: dict, router_fusion: bool = False):
    from mok_megatron.bench.fp8_layers import InQuantContext, fp8_config, unavailable
    from mok_megatron.bench.build import build
    from mok_megatron.experts.checkpoint import convert_state_dict

    recipe = MEGATRON_FP8_IMPLS[impl]
    if reason := unavailable("te", recipe):
        raise PeerUnavailable(f"Megatron+TE --fp8-recipe {recipe}: {reason}")
    cfg = fp8_config(_bench_config(shape, dtype, "megatron-te", router_fusion), recipe)
    cfg = dataclasses.replace(cfg, moe_router_padding_for_quantization=True)
    layer = build("megatron-te", cfg).to(device)
    layer.load_state_dict(convert_state_dict(ref_sd, "te_grouped"), strict=True)
    return InQuantContext(layer, cfg)


def progress(msg: str) -> None:
    """One line of progress on stderr (stdout keeps the table)."""
    print(msg, file=sys.stderr, flush=True)


def _spread(times: dict) -> str:
    """forward+backward median (min..max) of one ``time_phases`` result, for progress lines."""
    t = times["fwd_bwd"]
    return f"fwd+bwd {t['ms']:.3f} ms ({t['min_ms']:.3f}..{t['max_ms']:.3f})"


def _rel_err(a, ref) -> float:
    return (a.float() - ref).abs().max().item() / (ref.abs().max().item() or 1.0)


def bench_case(
    shape_name: str,
    shape: dict,
    routing: str,
    impls: list[str],
    dtype_name: str,
    iters: int,
    warmup: int,
    router_fusion: bool = False,
    label: str = "",
) -> dict:
    """One (shape, routing) case; ``label`` prefixes its progress lines (``bench_suite`` passes
    '[i/n] shape routing')."""
    import torch

    check_impls(impls)
    label = label or f"{shape_name} {routing}"
    progress(f"{label}: {len(impls)} implementation(s), {iters} timed iterations after {warmup} warm-up")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    t, h, e, k = shape["tokens"], shape["hidden"], shape["experts"], shape["topk"]
    x = routed_input(routing, t, h, e).view(t, 1, h).to(device, dtype)
    dout = (torch.randn(t, 1, h, generator=torch.Generator().manual_seed(2)) * 1e-2).to(device, dtype)
    unit_flops = 2 * t * k * 3 * h * shape["ffn"]
    windows = {}  # impl -> wall-time window of its timing, for the GPU clock summary
    with ClockSampler() as clocks:
        rows, skipped, ref_impl = _bench_impls(
            shape,
            impls,
            dtype_name,
            dtype,
            device,
            x,
            dout,
            unit_flops,
            iters,
            warmup,
            router_fusion,
            windows,
            label,
        )
        steps = gemm_steps(shape, expert_load(routing, t, e, k), dtype, device)
        t0 = time.time()
        bound = time_phases(*steps, lambda: None, iters, warmup)
        windows[None] = (t0, time.time())
        progress(f"{label} expert GEMMs alone: {_spread(bound)}")
        del steps
    for row in rows:
        row["gpu"] = clocks.summary(*windows[row["impl"]])
    bound_gpu = clocks.summary(*windows[None])
    expert_gemms = {f"{p}_{k}": bound[p][k] for p in PHASES for k in SPREAD}
    expert_gemms |= {
        f"{p}_tflops": PHASE_FLOP_FACTOR[p] * unit_flops / (bound[p]["ms"] / 1e3) / 1e12 for p in PHASES
    }
    rows.sort(key=lambda r: impls.index(r["impl"]))
    return {
        "shape": shape_name,
        **shape,
        "routing": routing,
        "expert_rows": expert_load(routing, t, e, k),
        "dtype": dtype_name,
        "iters": iters,
        "warmup": warmup,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "reference": ref_impl,
        "peak_mem": "torch.cuda.max_memory_allocated delta over one fwd+bwd"
        if device.type == "cuda"
        else "n/a on CPU",
        "rows": rows,
        "skipped": skipped,
        "expert_gemms": expert_gemms | {"gpu": bound_gpu},
        "gpu_clocks": "nvidia-smi" if clocks.available else clocks.error,
    }


def step_reset(layer, impl: str):
    """What runs before every timed step of ``impl``: the gradients cleared, and for ``REQUANTIZED_IMPLS``
    the experts' quantized weights dropped (``ops.fp8_grouped_gemm.FP8WeightCache.invalidate``)."""
    caches = []
    if impl in REQUANTIZED_IMPLS:
        from mok_megatron.ops.fp8_grouped_gemm import FP8WeightCache

        # the layer may be wrapped (an FP8 context around it): every module's cache, wherever it sits
        caches = [
            c for m in layer.modules() if isinstance(c := getattr(m, "fp8_weights", None), FP8WeightCache)
        ]
        if not caches:
            raise ValueError(f"{impl}: the layer holds no FP8 weight cache to drop before each step")

    def reset():
        layer.zero_grad(set_to_none=True)
        for cache in caches:
            cache.invalidate()

    return reset


def _bench_impls(
    shape, impls, dtype_name, dtype, device, x, dout, unit_flops, iters, warmup, router_fusion, windows, label
):
    """(rows, skipped, reference impl): every implementation checked against the first, then timed."""
    import torch

    rows, skipped, ref, ref_sd, ref_impl = [], [], None, None, None
    order = sorted(impls, key=lambda i: i not in MEGATRON_IMPLS)  # weights come from a Megatron-type layer
    for impl in order:
        torch.manual_seed(0)
        try:
            layer, note = _build(impl, shape, dtype, device, ref_sd, router_fusion)
        except PeerUnavailable as err:
            skipped.append({"impl": impl, "reason": str(err)})
            progress(f"{label} {impl}: skipped ({err})")
            continue
        if ref_sd is None:
            ref_sd = {
                n: v.detach().clone() if torch.is_tensor(v) else v for n, v in layer.state_dict().items()
            }

        def forward(layer=layer):
            xi = x.detach().requires_grad_(True)
            return layer(xi)[0], xi

        def backward(res):
            res[0].backward(dout)

        reset = step_reset(layer, impl)

        try:
            out, xi = forward()
            backward((out, xi))
        except Exception as e:
            if impl not in BEST_EFFORT:
                raise
            skipped.append({"impl": impl, "reason": f"first fwd+bwd failed: {type(e).__name__}: {e}"})
            progress(f"{label} {impl}: skipped ({skipped[-1]['reason']})")
            continue
        if ref is None:
            ref, ref_impl, err = (out.detach().float(), xi.grad.float()), impl, (0.0, 0.0)
        else:
            err = (_rel_err(out.detach(), ref[0]), _rel_err(xi.grad, ref[1]))
            if max(err) > (
                FP8_TOLERANCE if impl in FP8_IMPLS or impl in MEGATRON_FP8_IMPLS else TOLERANCE[dtype_name]
            ):
                msg = f"{impl} disagrees with {ref_impl}: relative error out {err[0]:.3e}, dx {err[1]:.3e}"
                if impl in BEST_EFFORT:
                    skipped.append({"impl": impl, "reason": msg})
                    progress(f"{label} {impl}: skipped ({msg})")
                    continue
                raise RuntimeError(msg)
        del out, xi
        t0 = time.time()
        times = time_phases(forward, backward, reset, iters, warmup)
        windows[impl] = (t0, time.time())
        row = {"impl": impl, "note": note, "rel_err_out": err[0], "rel_err_dx": err[1]}
        for p in PHASES:
            row |= {f"{p}_{k}": times[p][k] for k in SPREAD}
            row[f"{p}_tflops"] = PHASE_FLOP_FACTOR[p] * unit_flops / (times[p]["ms"] / 1e3) / 1e12
        row |= {
            "ms": row["fwd_bwd_ms"],
            "min_ms": row["fwd_bwd_min_ms"],
            "max_ms": row["fwd_bwd_max_ms"],
            "expert_tflops": row["fwd_bwd_tflops"],
        }
        row["peak_mem_mib"] = peak_memory_mib(forward, backward, reset)
        rows.append(row)
        progress(f"{label} {impl}: {_spread(times)}, rel err out {err[0]:.1e} dx {err[1]:.1e}")
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, skipped, ref_impl


def bench_suite(
    shapes: dict,
    routings: list[str],
    impls: list[str],
    dtype_name: str = "bf16",
    iters: int = 20,
    warmup: int = 3,
    router_fusion: bool = False,
) -> list[dict]:
    """One case per (shape, routing), all in this process."""
    from mok_megatron.bench.build import init_single_process

    check_impls(impls)
    bad = [r for r in routings if r not in ROUTINGS]
    if bad:
        raise ValueError(f"unknown routing(s) {bad}: choose from {', '.join(ROUTINGS)}")
    init_single_process()
    grid = [(name, s, r) for name, s in shapes.items() for r in routings]
    return [
        bench_case(
            name, s, r, impls, dtype_name, iters, warmup, router_fusion, f"[{i}/{len(grid)}] {name} {r}"
        )
        for i, (name, s, r) in enumerate(grid, 1)
    ]
