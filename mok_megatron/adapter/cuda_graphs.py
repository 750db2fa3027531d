"""Which of Megatron's CUDA-graph scopes a MoK layer can be captured in (checked at build).

A CUDA graph replays device work only: a region that reads the device from the host (``.cpu()``,
``.tolist()``, ``int(tensor)``) cannot be captured. Per scope (``--cuda-graph-modules``):

    attn, moe_router  Megatron's own modules: MoK changes nothing there; always allowed.
    moe_preprocess    ``MoKTokenDispatcher.dispatch_preprocess`` builds the dispatch plan. The exact
                      plan reads the token counts on the host (one read per call), so capture needs a
                      host-free plan: the overlap pipeline with ``--mok-sync-free``, or the plain engine
                      with drop-and-pad (``--moe-pad-expert-input-to-capacity``: static sizes).
    moe / whole layer (empty module list, or ``--cuda-graph-impl full_iteration``): everything above
                      plus dispatch, experts and combine: the same host-free plan, MoK's experts (which
                      take device counts) and, in sync-free mode, ``--mok-capacity-multiplier 1.0`` (a
                      smaller buffer is checked for overflow on the host).
"""

from __future__ import annotations

from mok_megatron.config import MoKConfig

from mok_megatron.errors import MoKConfigError
from mok_megatron.options import MoKOptions


def _scopes(config) -> list[str]:
    return [getattr(m, "name", str(m)) for m in (getattr(config, "cuda_graph_modules", None) or [])]


def captured_regions(config) -> tuple[bool, bool]:
    """(preprocess captured, whole MoE layer captured) under this Megatron config."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "none":
        return False, False
    scopes = _scopes(config)
    whole = impl == "full_iteration" or not scopes or "moe" in scopes
    return whole or "moe_preprocess" in scopes, whole


def check_cuda_graphs(
    config, cfg: MoKConfig, options: MoKOptions, pipelined: bool, mok_experts: bool
) -> None:
    """Raise ``MoKConfigError`` naming the flags when a captured region of this layer reads the host."""
    preprocess, whole = captured_regions(config)
    if not preprocess:
        return
    impl = config.cuda_graph_impl
    scope = (
        f"--cuda-graph-impl {impl}"
        if impl == "full_iteration"
        else f"--cuda-graph-impl {impl} --cuda-graph-modules {' '.join(_scopes(config)) or '(whole layer)'}"
    )
    host_free_plan = (pipelined and options.sync_free) or (not pipelined and cfg.pad_to_capacity)
    if not host_free_plan:
        engine = "the overlap pipeline" if pipelined else "the plain engine"
        raise MoKConfigError(
            f"{scope} captures MoK's dispatch preprocess, but on {engine} without "
            f"{'--mok-sync-free' if pipelined else '--moe-pad-expert-input-to-capacity'} it reads the "
            "token counts on the host (not capturable). Add --mok-sync-free (overlap pipeline, dropless, "
            "EP>1), or use drop-and-pad (--moe-expert-capacity-factor with "
            "--moe-pad-expert-input-to-capacity), or capture only attn moe_router."
        )
    if whole and not mok_experts:
        raise MoKConfigError(
            f"{scope} captures the whole MoE layer, but its experts are not MoKGroupedMLP and read token "
            "counts on the host. Use a MoK layer spec, or capture only attn moe_router moe_preprocess."
        )
    if whole and pipelined and options.capacity_multiplier < 1.0:
        raise MoKConfigError(
            f"{scope} captures the whole MoE layer, but --mok-capacity-multiplier="
            f"{options.capacity_multiplier} checks for buffer overflow on the host after each exchange. "
            "Use --mok-capacity-multiplier 1.0 (never overflows) or capture only attn moe_router "
            "moe_preprocess."
        )
