"""Model, layout and cluster from an examples/*.sh recipe: run it with DRY_RUN=1 (it prints the
layout line and the launch command, runs nothing) and read Megatron's flags from the command."""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
import subprocess
from pathlib import Path

from mok_megatron.tools.planner.hardware import Cluster, cluster_for_gpu
from mok_megatron.tools.planner.shapes import Attention, Layout, LayoutError, Model, MoEShape


def flags(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    key = None
    for a in argv:
        if a.startswith("--"):
            key = a[2:]
            out[key] = []
        elif key is not None:
            out[key].append(a)
    return out


def _layer_freq(expr: str, layers: int) -> int:
    """Number of MoE layers of --moe-layer-freq: an int N (every N-th layer) or a list expression
    of 0/1 like ([0]*3+[1]*58), evaluated on literals only."""

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.List):
            return [ev(e) for e in n.elts]
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Mult)):
            a, b = ev(n.left), ev(n.right)
            return a + b if isinstance(n.op, ast.Add) else a * b
        raise LayoutError(f"--moe-layer-freq {expr!r}: only ints, lists, + and * are understood")

    v = ev(ast.parse(expr, mode="eval"))
    if isinstance(v, int):
        return sum(1 for i in range(layers) if i % v == 0)
    if len(v) != layers:
        raise LayoutError(f"--moe-layer-freq {expr!r} has {len(v)} entries for {layers} layers")
    return sum(v)


def parse(text: str, name: str) -> tuple[Model, Layout, dict]:
    lines = text.strip().splitlines()
    lay = next((ln for ln in lines if ln.startswith("# layout:")), None)
    cmd = next((ln for ln in lines if "pretrain_gpt" in ln), None)
    if lay is None or cmd is None:
        raise LayoutError(f"{name}: DRY_RUN=1 output lacks the '# layout:' line or the launch command")
    meta = dict(kv.split("=", 1) for kv in lay[len("# layout:") :].split())
    f = flags(shlex.split(cmd))

    def i(k, default=None):
        if k in f:
            return int(f[k][0])
        if default is None:
            raise LayoutError(f"{name}: flag --{k} missing")
        return default

    layers, hidden = i("num-layers"), i("hidden-size")
    heads = i("num-attention-heads")
    mla = "multi-latent-attention" in f
    att = Attention(
        heads,
        i("kv-channels", hidden // heads),
        query_groups=i("num-query-groups", heads) if "group-query-attention" in f else 0,
        mla=mla,
        q_lora=i("q-lora-rank", 0),
        kv_lora=i("kv-lora-rank", 0),
        rope_dim=i("qk-pos-emb-head-dim", 0),
        v_head_dim=i("v-head-dim", 0),
    )
    moe_layers = _layer_freq(f["moe-layer-freq"][0], layers) if "moe-layer-freq" in f else layers
    moe = MoEShape(
        hidden,
        i("moe-ffn-hidden-size"),
        i("num-experts"),
        i("moe-router-topk"),
        i("moe-shared-expert-intermediate-size", 0),
    )
    model = Model(
        Path(name).stem,
        layers,
        moe_layers,
        hidden,
        i("ffn-hidden-size"),
        att,
        moe,
        i("vocab-size"),
        i("seq-length"),
        i("mtp-num-layers", 0),
    )
    pp = i("pipeline-model-parallel-size", 1)
    vpp = i("num-virtual-stages-per-pipeline-rank", 0)
    if not vpp and "pipeline-model-parallel-layout" in f:
        stages = f["pipeline-model-parallel-layout"][0]
        m = re.fullmatch(r"(.*?)\((.*)\|\)\*(\d+)(.*)", stages)
        n = (
            (stages.count("|") - m.group(2).count("|") - 1 + int(m.group(3)) + 1)
            if m
            else stages.count("|") + 1
        )
        vpp = max(1, n // pp)
    recipe = f.get("fp8-recipe", [""])[0]
    precision = "mxfp8" if recipe == "mxfp8" else "fp8" if "fp8-format" in f else "bf16"
    layout = Layout(
        world=i("nnodes") * i("nproc-per-node"),
        tp=i("tensor-model-parallel-size", 1),
        pp=pp,
        vpp=vpp or 1,
        ep=i("expert-model-parallel-size", 1),
        etp=i("expert-tensor-parallel-size", 1),
        cp=i("context-parallel-size", 1),
        micro_batch=i("micro-batch-size", 1),
        global_batch=i("global-batch-size", 1),
        precision=precision,
    )
    layout.check(model)
    return model, layout, meta


def recipe_cluster(meta: dict) -> Cluster:
    """The cluster of a recipe's ``# layout:`` line: its ``gpu=`` (the recipe's GPU=, the value
    ``mok recipe check`` estimates memory against), NVLink domain and GPUs per node."""
    base = cluster_for_gpu(meta.get("gpu", ""))
    domain = int(meta.get("nvlink_domain_gpus", base.nvlink_domain))
    return dataclasses.replace(
        base, nvlink_domain=domain, gpus_per_node=int(meta.get("gpus_per_node", base.gpus_per_node))
    )


def where_recipes_are() -> str:
    """Where the recipe scripts are: examples/ of the source checkout this package runs from, else the
    repository's (a wheel ships the package only)."""
    here = Path(__file__).resolve().parents[3] / "examples"
    names = sorted(s.name for s in here.glob("*.sh")) if here.is_dir() else []
    if names:
        return f"the recipes are in {here}: {', '.join(names)}"
    return (
        "the recipes are the examples/*.sh scripts of the mok-megatron source repository (the installed "
        "package has none): give the path of one there, or plan a model with --model M"
    )


def load(path: str) -> tuple[Model, Layout, Cluster]:
    p = Path(path)
    if not p.is_file():
        raise LayoutError(f"recipe {path}: no such file; {where_recipes_are()}")
    r = subprocess.run(
        ["bash", str(p)],
        env={"DRY_RUN": "1", "PATH": "/usr/bin:/bin", "DEVICE": "gpu"},  # planned on GPUs, whatever runs this
        capture_output=True,
        text=True,
        timeout=60,
    )
    if r.returncode:
        raise LayoutError(f"recipe {path}: DRY_RUN=1 failed: {r.stderr.strip()[-500:]}")
    model, layout, meta = parse(r.stdout, path)
    return model, layout, recipe_cluster(meta)
