"""Skew soak instruments: count tokens through every MoE layer and watch peak memory per step.

Forcing the skew uses Megatron's own knob: ``moe_router_force_biased = -1e4`` adds one fixed random
per-expert bias (same on all ranks, one per layer) of standard deviation 1e4 to the router logits, so
with top-1 routing every token of every rank goes to the same expert, i.e. to one EP rank.

``TokenCounter`` hooks each MoE layer:
    routed    token-expert assignments the router made on this rank (routing_map.sum())
    received  assignments that reached this rank's experts (sum of tokens_per_expert), per local expert
    out_rows  rows of the layer output that are non-zero (a dropped token comes back as a zero row)
    in_rows   rows of the layer input
Dropless dispatch loses nothing iff, summed over ranks, received == routed, and out_rows == in_rows.

``MemoryProbe`` records the peak memory of each step: resident set size (psutil) on CPU,
``torch.cuda.max_memory_allocated`` (reset every step) on GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FORCE_BIAS_STD = -1e4  # negative: one bias per layer, drawn once and reused (Megatron's convention)


class TokenCounter:
    def __init__(self, moe_layers: list):
        self.layers = moe_layers
        n_local = [layer.num_local_experts for layer in moe_layers]
        self.routed = [0] * len(moe_layers)
        self.received = [torch.zeros(n, dtype=torch.long) for n in n_local]
        self.in_rows = [0] * len(moe_layers)
        self.out_rows = [0] * len(moe_layers)
        for i, layer in enumerate(moe_layers):
            layer.router.register_forward_hook(self._on_router(i))
            layer.experts.register_forward_pre_hook(self._on_experts(i))
            layer.register_forward_hook(self._on_layer(i))

    def _on_router(self, i):
        def hook(module, args, out):
            _, routing_map = out
            self.routed[i] += int(routing_map.sum())

        return hook

    def _on_experts(self, i):
        def hook(module, args):
            tokens_per_expert = args[1]
            self.received[i] += torch.as_tensor(tokens_per_expert).detach().to("cpu", torch.long)

        return hook

    def _on_layer(self, i):
        def hook(module, args, out):
            x = args[0]
            y = out[0] if isinstance(out, tuple) else out
            self.in_rows[i] += x.shape[0] * x.shape[1]
            self.out_rows[i] += int((y.detach().reshape(-1, y.shape[-1]) != 0).any(-1).sum())

        return hook

    def totals(self, group=None) -> dict:
        """Counts summed over the ranks of ``group`` (collective). ``per_expert`` is the global
        histogram of received assignments, per layer (EP ranks hold consecutive experts)."""
        scalars = torch.tensor([self.routed, self.in_rows, self.out_rows], dtype=torch.long)
        dist.all_reduce(scalars, group=group)
        per_expert = []
        for rec in self.received:
            pieces = [torch.zeros_like(rec) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, rec, group=group)
            per_expert.append(torch.cat(pieces).tolist())
        return {
            "routed": scalars[0].tolist(),
            "in_rows": scalars[1].tolist(),
            "out_rows": scalars[2].tolist(),
            "per_expert": per_expert,
        }


class MemoryProbe:
    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.peaks: list[int] = []
        if not self.cuda:
            import psutil

            self._proc = psutil.Process()

    def start_step(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def end_step(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks.append(int(torch.cuda.max_memory_allocated()))
        else:
            self.peaks.append(int(self._proc.memory_info().rss))

    def summary(self, warmup: int) -> dict:
        """Peak after warm-up vs. the first post-warm-up window: ``growth`` is how much the second half
        of the measured steps exceeds the first half (a leak grows it; flat memory keeps it ~0)."""
        measured = self.peaks[warmup:]
        half = max(1, len(measured) // 2)
        first, second = measured[:half], measured[half:] or measured[:half]
        return {
            "kind": "cuda_max_allocated" if self.cuda else "rss",
            "warmup_steps": warmup,
            "at_warmup": measured[0],
            "peak_first_half": max(first),
            "peak_second_half": max(second),
            "growth": max(second) - max(first),
            "peak": max(measured),
            "per_step": self.peaks,
        }
