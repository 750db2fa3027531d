"""torchtitan's MoE layer as a ``mok bench layer`` peer, with MoK's weights copied in.

Written against torchtitan's ``torchtitan/models/common/moe.py`` (late 2026: ``MoE.Config`` with
``routed_experts=RoutedExperts.Config(w13=GroupedLinear.Config(...), w2=..., token_dispatcher=
LocalTokenDispatcher.Config(...))`` and ``router=TokenChoiceTopKRouter.Config(gate=RouterGateLinear.Config
(...), score_func=Softmax.Config(), route_norm=True)``). ``route_norm`` on a softmax over all experts gives
the same probabilities as Megatron's softmax over the top-k logits. No load-balancing bias
(``load_balance_coeff=None``) and no aux loss, as for every implementation in the benchmark.

torchtitan 0.3.0 (``torchtitan.models.common.moe`` without ``common.activation``): ``MoE.Config`` with
``routed_experts=RoutedExperts.Config(inner_experts=GroupedExperts.Config(dim, hidden_dim, num_experts),
token_dispatcher=LocalTokenDispatcher.Config(...))`` and ``router=TokenChoiceTopKRouter.Config(gate=Linear.Config
(...), score_func="softmax", route_norm=True)``; weights ``w1_EFD`` / ``w3_EFD`` / ``w2_EDF``; input ``[B, L, D]``.

Older releases (``torchtitan.models.moe``: ``MoE(MoEArgs(...), dim, hidden_dim)`` with ``experts.w1/w2/w3``)
are built through ``MoEArgs`` (softmax, ``route_norm``, ``score_before_experts=False`` so that the score
scales the expert output as in Megatron, no shared expert, no load-balancing bias).

Any step that fails (not installed, a renamed config field, a weight whose shape matches nothing) raises
``PeerUnavailable`` with the reason; the benchmark lists torchtitan as skipped with that reason.
Shape suffix legend: T tokens, H hidden, F expert ffn, E experts, K top-k.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch import nn

MODULES = ("torchtitan.models.common.moe", "torchtitan.models.common.moe.moe", "torchtitan.models.moe")


class PeerUnavailable(RuntimeError):
    """A peer implementation cannot run here; the message says why."""


def _find(name: str, *modules):
    for mod in modules:
        if hasattr(mod, name):
            return getattr(mod, name)
    raise PeerUnavailable(f"torchtitan has no {name} in {', '.join(m.__name__ for m in modules)}")


def _import_moe():
    if importlib.util.find_spec("torchtitan") is None:
        raise PeerUnavailable("torchtitan not installed (pip install torchtitan)")
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise PeerUnavailable("torchtitan MoE not importable (" + "; ".join(errors) + ")")


def _config(moe_mod, hidden: int, ffn: int, experts: int, topk: int):
    linear = importlib.import_module("torchtitan.models.common.linear")
    activation = importlib.import_module("torchtitan.models.common.activation")
    dispatcher = importlib.import_module("torchtitan.models.common.token_dispatcher")
    grouped = _find("GroupedLinear", linear, moe_mod)
    return moe_mod.MoE.Config(
        num_experts=experts,
        load_balance_coeff=None,
        routed_experts=moe_mod.RoutedExperts.Config(
            w13=grouped.Config(in_features=hidden, out_features=ffn, group_size=experts, num_linears=2),
            w2=grouped.Config(in_features=ffn, out_features=hidden, group_size=experts, num_linears=1),
            token_dispatcher=dispatcher.LocalTokenDispatcher.Config(num_experts=experts, top_k=topk),
        ),
        router=moe_mod.TokenChoiceTopKRouter.Config(
            num_experts=experts,
            top_k=topk,
            gate=linear.RouterGateLinear.Config(in_features=hidden, out_features=experts),
            score_func=_find("Softmax", activation).Config(),
            route_norm=True,
        ),
    )


def _config_030(moe_mod, hidden: int, ffn: int, experts: int, topk: int):
    """torchtitan 0.3.0: ``GroupedExperts`` inside ``RoutedExperts``, a string ``score_func``."""
    linear = importlib.import_module("torchtitan.models.common.linear")
    dispatcher = importlib.import_module("torchtitan.models.common.token_dispatcher")
    return moe_mod.MoE.Config(
        num_experts=experts,
        load_balance_coeff=None,
        routed_experts=moe_mod.RoutedExperts.Config(
            inner_experts=moe_mod.GroupedExperts.Config(dim=hidden, hidden_dim=ffn, num_experts=experts),
            token_dispatcher=dispatcher.LocalTokenDispatcher.Config(num_experts=experts, top_k=topk),
        ),
        router=moe_mod.TokenChoiceTopKRouter.Config(
            num_experts=experts,
            top_k=topk,
            gate=linear.Linear.Config(in_features=hidden, out_features=experts),
            score_func="softmax",
            route_norm=True,
        ),
    )


def _is_030(moe_mod) -> bool:
    return hasattr(moe_mod, "GroupedExperts") and "inner_experts" in getattr(
        moe_mod.RoutedExperts.Config, "__dataclass_fields__", {}
    )


def _legacy(moe_mod, hidden: int, ffn: int, experts: int, topk: int):
    args = moe_mod.MoEArgs(
        num_experts=experts,
        num_shared_experts=0,
        score_func="softmax",
        route_norm=True,
        score_before_experts=False,
        top_k=topk,
        load_balance_coeff=None,
    )
    return moe_mod.MoE(args, dim=hidden, hidden_dim=ffn)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    for cand in (src, src.transpose(-2, -1)):
        if cand.numel() == dst.numel() and (cand.shape == dst.shape or cand.dim() != dst.dim()):
            dst.copy_(cand.reshape(dst.shape))
            return
    raise PeerUnavailable(
        f"torchtitan parameter {name} {tuple(dst.shape)} matches no MoK weight {tuple(src.shape)}"
    )


class TorchtitanMoE(nn.Module):
    """``forward(x_T1H)`` returns ``(out_T1H, None)`` like Megatron's layer."""

    def __init__(self, router_EH, fc1_E2FH, fc2_EHF, topk: int):
        super().__init__()
        moe_mod = _import_moe()
        experts, hidden = router_EH.shape
        ffn = fc2_EHF.shape[-1]
        self.legacy = hasattr(moe_mod, "MoEArgs")
        self.takes_3d = self.legacy or _is_030(moe_mod)  # [B, L, D] input rather than [T, D]
        try:
            with torch.device(fc1_E2FH.device):
                if self.legacy:
                    self.moe = _legacy(moe_mod, hidden, ffn, experts, topk)
                elif _is_030(moe_mod):
                    self.moe = _config_030(moe_mod, hidden, ffn, experts, topk).build()
                else:
                    self.moe = _config(moe_mod, hidden, ffn, experts, topk).build()
            self.moe.to(fc1_E2FH.dtype)
        except PeerUnavailable:
            raise
        except Exception as e:  # the config API moves between torchtitan releases: report, don't crash
            raise PeerUnavailable(f"cannot build torchtitan MoE: {type(e).__name__}: {e}") from e
        sources = {"gate": router_EH, "w13": fc1_E2FH, "w2": fc2_EHF}
        fc1_gate, fc1_up = fc1_E2FH.chunk(2, dim=1)
        sources |= {"w1": fc1_gate, "w3": fc1_up}
        with torch.no_grad():
            for name, p in self.moe.named_parameters():
                # "w1" or 0.3.0's shape-suffixed "w1_EFD"
                leaf = [
                    k
                    for k in sources
                    if k in {part.split("_")[0] for part in name.split(".")} | {*name.split(".")}
                ]
                if not leaf:
                    raise PeerUnavailable(
                        f"torchtitan parameter {name} {tuple(p.shape)}: no MoK weight for it"
                    )
                _copy(p, sources[leaf[-1]].to(p.dtype), name)

        self._use(self.moe)  # torch.compile(self.moe) once compile_moe() succeeds

    def _use(self, fn) -> None:
        object.__setattr__(self, "_run", fn)  # a plain attribute, not a second registered submodule

    def compile_moe(self, x_T1H: torch.Tensor) -> str:
        """Compile the MoE with ``torch.compile`` and check one forward+backward on ``x_T1H``'s shape.
        Returns the table note: "torch.compile", or "eager (...)" with the reason compiling failed."""
        compiled = torch.compile(self.moe)
        try:
            self._use(compiled)
            xi = x_T1H.detach().requires_grad_(True)
            self(xi)[0].float().square().mean().backward()
            self.moe.zero_grad(set_to_none=True)
            return "torch.compile"
        except Exception as e:  # inductor/dynamo limits vary by release: time it eager, say why
            self._use(self.moe)
            self.moe.zero_grad(set_to_none=True)
            return f"eager (torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120]})"

    def forward(self, x_T1H: torch.Tensor):
        x = (
            x_T1H.transpose(0, 1) if self.takes_3d else x_T1H.reshape(-1, x_T1H.shape[-1])
        )  # [1, T, H] / [T, H]
        return self._run(x).reshape(x_T1H.shape), None
