"""Ops per MoK layer forward+backward, counted on CPU, and the fused-vs-torch layer check.

``python -m tests.layer_launches --json OUT`` (run with ``TRITON_INTERPRET=1`` so that the layer takes the
same Triton paths as on a GPU) builds a tiny bf16 MoK layer (dropless top-2 of 8 experts, SwiGLU, fp32
router), runs one warm-up step, then records one forward+backward:
    aten     every aten op that does work (view/metadata ops left out), with its source: the innermost
             project frame of the forward, or the autograd node of the backward; ops issued by Triton's
             interpreter itself are left out (on a GPU those are one kernel launch)
    triton   Triton kernel launches
and checks the layer's output and gradients against the same layer with its Triton paths switched off
(the torch code Megatron parity is proven on). Writes ``{"aten": [[op, where], ...], "triton": [name, ...],
"max_rel_err": float}``.
"""

from __future__ import annotations

import argparse
import json
import traceback
import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_WORK = {
    "alias",
    "as_strided",
    "chunk",
    "detach",
    "empty",
    "empty_like",
    "empty_strided",
    "expand",
    "is_nonzero",
    "item",
    "_local_scalar_dense",
    "lift_fresh",
    "narrow",
    "new_empty",
    "permute",
    "reshape",
    "select",
    "slice",
    "split",
    "split_with_sizes",
    "squeeze",
    "sym_size",
    "t",
    "transpose",
    "unbind",
    "unsqueeze",
    "_unsafe_view",
    "view",
    "view_as",
}
SHAPE = dict(hidden=64, ffn=32, experts=8, topk=2, tokens=64)


def _where() -> str | None:
    stack = traceback.extract_stack()[:-2]
    if any("/triton/" in f.filename for f in stack):
        return None
    node = torch._C._current_autograd_node()
    if node is not None:
        return "bwd " + node.name()
    frames = [f for f in stack if "mok_megatron" in f.filename or "megatron/core" in f.filename]
    if not frames:
        return "fwd ?"
    f = frames[-1]
    owner = "mok" if "mok_megatron" in f.filename else "megatron"
    return f"fwd {owner} {f.filename.rsplit('/', 1)[-1]}:{f.name}"


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[list[str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in NO_WORK and (where := _where()) is not None:
            self.ops.append([name, where])
        return out


def _count_triton(launches: list[str]):
    """Count kernel launches (interpreted or compiled) by wrapping ``run`` of Triton's kernel classes."""
    from triton.runtime import interpreter, jit

    patched = []
    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        orig = cls.run

        def run(self, *a, _orig=orig, **kw):
            if not kw.get("warmup", False):
                launches.append(getattr(self, "__name__", None) or getattr(self.fn, "__name__", "?"))
            return _orig(self, *a, **kw)

        cls.run = run
        patched.append((cls, orig))
    return patched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import mok_megatron.ops.activation as act_ops
    import mok_megatron.ops.permute as permute_ops
    from mok_megatron.bench.build import layer_config, init_single_process, build

    init_single_process()
    torch.manual_seed(0)
    layer = build("mok", layer_config(SHAPE, torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to(torch.bfloat16)
    dout = torch.randn(x.shape, generator=g).to(torch.bfloat16)

    def step(xi=None):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True) if xi is None else xi
        out, _ = layer(xi)
        out.backward(dout)
        return [out, xi.grad] + [p.grad for p in layer.parameters()]

    fused = step()
    counter, launches = _Count(), []
    patched = _count_triton(launches)
    xi = x.clone().requires_grad_(True)
    try:
        with counter:
            step(xi)
    finally:
        for cls, orig in patched:
            cls.run = orig
    # The same layer on the torch code (what runs on a plain CPU and what the Megatron parity tests hold).
    saved = permute_ops.triton_path, act_ops.triton_path
    permute_ops.triton_path = act_ops.triton_path = lambda t, op: False
    try:
        plain = step()
    finally:
        permute_ops.triton_path, act_ops.triton_path = saved
    errs = [
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()
        for a, b in zip(fused, plain, strict=True)
    ]
    with open(args.json, "w") as f:
        json.dump({"aten": counter.ops, "triton": launches, "max_rel_err": max(errs)}, f, indent=1)
    by_source = Counter(f"{where}: {op}" for op, where in counter.ops)
    print(f"{len(counter.ops)} aten ops + {len(launches)} Triton launches per fwd+bwd; by source:")
    for line, n in sorted(by_source.items()):
        print(f"  {n:3d} x {line}")
    print("  Triton: " + ", ".join(launches))


if __name__ == "__main__":
    main()
