"""Forced routing for ``mok bench layer``: every implementation sees the same top-k choices.

The router of each layer is a bias-free linear map ``logits_TE = x_TH @ W_EH.T``. The benchmark sets
``W_EH = [I_E | 0]`` (an identity on the first E input features) and writes the wanted logits into those
first E features of the input, so every router, whatever its precision, computes exactly the same
logits: products with 1 and 0 are exact in bf16 and fp32. The logits of one token are a permutation of
E distinct values ``k / 16`` (k = -E/2 .. E/2 - 1), all exact in bf16, so there are no ties for top-k
to break differently. The rest of the input is N(0, 1), which the experts see as usual.

Shape suffix legend: T tokens, H hidden, E experts, K top-k.

Patterns (the order of a token's experts is drawn with a seeded generator, then turned into logits):
    uniform   every expert equally likely: a random permutation per token
    zipf      expert e drawn with probability ~ 1 / (e + 1) ** 1.2, without replacement (Gumbel top-k)
    one-hot   every token's first choice is expert 0; the remaining choices uniform
"""

from __future__ import annotations

ROUTINGS = ("uniform", "zipf", "one-hot")
ZIPF_EXPONENT = 1.2


def expert_order(routing: str, tokens: int, experts: int, seed: int = 0):
    """``order_TE``: each token's experts, most preferred first (int64)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    gumbel_TE = -torch.log(-torch.log(torch.rand(tokens, experts, generator=g, dtype=torch.float64)))
    if routing == "uniform":
        keys_TE = gumbel_TE
    elif routing == "zipf":
        ranks_E = torch.arange(1, experts + 1, dtype=torch.float64)
        keys_TE = gumbel_TE - ZIPF_EXPONENT * torch.log(ranks_E)
    elif routing == "one-hot":
        keys_TE = gumbel_TE.clone()
        keys_TE[:, 0] = float("inf")
    else:
        raise ValueError(f"routing {routing!r}: choose one of {', '.join(ROUTINGS)}")
    return torch.argsort(keys_TE, dim=1, descending=True)


def forced_logits(routing: str, tokens: int, experts: int, seed: int = 0):
    """``logits_TE`` (fp32): distinct multiples of 1/16, largest for each token's preferred expert."""
    import torch

    order_TE = expert_order(routing, tokens, experts, seed)
    values_E = (torch.arange(experts - 1, -1, -1, dtype=torch.float32) - experts // 2) / 16
    logits_TE = torch.empty(tokens, experts)
    logits_TE.scatter_(1, order_TE, values_E.expand(tokens, experts))
    return logits_TE


def routed_input(routing: str, tokens: int, hidden: int, experts: int, seed: int = 0):
    """``x_TH`` (fp32, CPU): N(0, 1) features whose first E columns are the forced logits."""
    import torch

    if experts > hidden:
        raise ValueError(
            f"forced routing writes the logits into the input's first {experts} features, "
            f"but hidden={hidden} < experts={experts}: use a shape with hidden >= experts"
        )
    x_TH = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    x_TH[:, :experts] = forced_logits(routing, tokens, experts, seed)
    return x_TH


def router_weight(experts: int, hidden: int):
    """``W_EH`` = [I_E | 0]: the router that reads the forced logits back out of the input."""
    import torch

    w_EH = torch.zeros(experts, hidden)
    w_EH[:, :experts] = torch.eye(experts)
    return w_EH


def expert_load(routing: str, tokens: int, experts: int, topk: int, seed: int = 0):
    """Rows each expert receives (list of E ints): what the pattern does to the grouped GEMMs."""
    import torch

    chosen_TK = expert_order(routing, tokens, experts, seed)[:, :topk]
    return torch.bincount(chosen_TK.reshape(-1), minlength=experts).tolist()
