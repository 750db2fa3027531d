"""Every experts backend answers the protocol the layer calls (``experts.protocol``), and offers its weights
stacked, read-only (a detached copy: writes do not reach the parameters), in one layout:
``stacked_fc1_weight`` [L, F1, H], ``stacked_fc2_weight`` [L, H, F], slice l equal to expert l's weights,
without adding Parameters or state-dict keys.

The te backend is built here on stand-in GroupedLinear modules holding TE's per-expert ``weight{i}``
Parameters (Transformer Engine needs a GPU); its GEMMs are tested in tests/test_fp8_gpu.py."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
from mok_megatron.experts.protocol import BACKEND_CLASSES, ExpertsBackend, experts_class
from mok_megatron.experts.te import MoKTEGroupedMLP
from mok_megatron.options import ExpertBackend, MoKOptions

L = 4  # local experts (EP 1)


class _GroupedLinear(torch.nn.Module):
    """TE GroupedLinear's parameter layout: ``weight0`` .. ``weight{L-1}``, each ``[out, in]``."""

    def __init__(self, num_gemms, in_features, out_features, **kwargs):
        super().__init__()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features)))


def _build(backend: ExpertBackend, monkeypatch):
    from mok_megatron import compat
    from mok_megatron.experts import te
    from mok_megatron.ops import fp8_grouped_gemm as native
    from tests.cases import make_config

    monkeypatch.setattr(native, "check_native_fp8", lambda device: None)  # CPU: no FP8 GEMMs
    monkeypatch.setattr(compat, "te_grouped_linear_classes", lambda: (_GroupedLinear, _GroupedLinear))
    monkeypatch.setattr(te, "check_expert_backend", lambda *a, **k: None)  # CPU: no Transformer Engine
    cfg = make_config(num_experts=L, hidden=16, ffn=32)
    options = MoKOptions(expert_backend=backend)
    return experts_class(MoKGroupedMLP, options)(L, cfg, options=options)


def _expert_weights(experts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each local expert's fc1 / fc2 weight as its backend's parameters hold them."""
    if isinstance(experts, MoKTEGroupedMLP):
        fc1 = [getattr(experts.linear_fc1, f"weight{i}") for i in range(L)]
        fc2 = [getattr(experts.linear_fc2, f"weight{i}") for i in range(L)]
        return fc1, fc2
    return list(experts.fc1_weight), list(experts.fc2_weight)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("backend", list(ExpertBackend))
def test_every_backend_offers_read_only_stacked_weights(backend, monkeypatch):
    experts = _build(backend, monkeypatch)
    assert type(experts) is BACKEND_CLASSES[backend] and isinstance(experts, ExpertsBackend)
    params_before = [name for name, _ in experts.named_parameters()]
    keys_before = list(experts.state_dict())
    fc1, fc2 = _expert_weights(experts)
    for stacked, per_expert in ((experts.stacked_fc1_weight, fc1), (experts.stacked_fc2_weight, fc2)):
        assert stacked.shape == (L, *per_expert[0].shape) and not stacked.requires_grad
        for i in range(L):
            assert torch.equal(stacked[i], per_expert[i].detach())
        stacked.add_(1)  # a copy: the parameters stay as they are
        assert not any(torch.equal(stacked[i], per_expert[i].detach()) for i in range(L))
    assert experts.stacked_fc1_weight.shape[1:] == (2 * 32, 16)  # SwiGLU: [gate; up] rows
    assert experts.stacked_fc2_weight.shape[1:] == (16, 32)
    for name in ("stacked_fc1_weight", "stacked_fc2_weight"):
        with pytest.raises(AttributeError):
            setattr(experts, name, torch.zeros(1))
    assert [name for name, _ in experts.named_parameters()] == params_before
    assert list(experts.state_dict()) == keys_before
    assert torch.equal(experts.stacked_fc1_weight[1], fc1[1].detach()), "read after the write: unchanged"


@pytest.mark.usefixtures("single_rank")
def test_stacked_weights_follow_the_parameters(monkeypatch):
    """A copy taken now: later parameter updates show in the next read, not in an earlier one."""
    experts = _build(ExpertBackend.TORCH, monkeypatch)
    before = experts.stacked_fc1_weight
    with torch.no_grad():
        experts.fc1_weight.mul_(2)
    assert torch.equal(experts.stacked_fc1_weight, before * 2)
    assert not torch.equal(before, experts.fc1_weight.detach())

