"""``mok convert SRC DST --to LAYOUT [--key K] [--unsafe-load]``: rewrite the MoE expert weights of a
``torch.save``'d state dict into another layout (``mok_megatron.experts.checkpoint``).

SRC is loaded weights-only (tensors, containers and the few classes Megatron's ``torch.save`` checkpoints
hold). Bad input stops with one line naming the value and the fix, and exit status 1; what can be checked
before the load is (SRC a file, DST's folder there and writable), so a bad DST never costs a whole load.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import warnings
import zipfile

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
# dist_checkpointing (torch_dist / fsdp_dtensor) checkpoints: a folder per iteration holding these
_DIST_MARKERS = (".metadata", "metadata.json", "common.pt")
_TORCH_FILE = "model_optim_rng.pt"


class ConvertError(ValueError):
    """Bad input; the message is one line naming the value and the fix."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok convert",
        description="Rewrite the MoE expert weights of a torch.save'd state dict into another layout "
        "(mok, sequential = Megatron SequentialMLP, te_grouped = Megatron TEGroupedMLP). "
        "dist_checkpointing checkpoints need no conversion.",
    )
    p.add_argument("src", help=f"a torch.save'd file (Megatron --ckpt-format torch: .../{_TORCH_FILE})")
    p.add_argument("dst", help="the file to write")
    p.add_argument("--to", required=True, choices=("mok", "sequential", "te_grouped"))
    p.add_argument("--key", default=None, help="the state dict lives under this key of the file (e.g. model)")
    p.add_argument(
        "--unsafe-load",
        action="store_true",
        help="load SRC with full pickle (weights_only=False): a file from elsewhere can then run arbitrary "
        "code on this machine. Only for files you made yourself that hold objects beyond tensors and "
        "Megatron's checkpoint metadata.",
    )
    return p


def check_src(src: str) -> None:
    if os.path.isdir(src):
        if any(os.path.exists(os.path.join(src, m)) for m in _DIST_MARKERS):
            raise ConvertError(
                f"{src} is a dist_checkpointing (torch_dist) checkpoint folder: it needs no conversion "
                "(MoK's experts save and load Megatron's own sharded tensors); mok convert takes "
                f"torch.save'd files (--ckpt-format torch: iter_*/mp_rank_*/{_TORCH_FILE})."
            )
        inside = sorted(glob.glob(os.path.join(src, "**", _TORCH_FILE), recursive=True))
        hint = f" such as {inside[0]}" if inside else f" (Megatron --ckpt-format torch: .../{_TORCH_FILE})"
        raise ConvertError(f"{src} is a folder; give the torch.save'd file inside it{hint}.")
    if not os.path.exists(src):
        raise ConvertError(f"{src}: no such file; give the path of a torch.save'd checkpoint file.")


def check_dst(dst: str) -> None:
    if os.path.isdir(dst):
        raise ConvertError(f"{dst} is a folder; give the path of the file to write ({dst}/converted.pt).")
    folder = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(folder):
        raise ConvertError(f"{dst}: folder {folder} does not exist; create it (mkdir -p {folder}) first.")
    if not os.access(folder, os.W_OK):
        raise ConvertError(f"{dst}: folder {folder} is not writable; choose another folder.")


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _format_problem(src: str) -> str | None:
    """Why SRC cannot be a ``torch.save`` file, judged from its bytes; None if it may be one."""
    if zipfile.is_zipfile(src):
        return None
    with open(src, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK\x03\x04"):
        return (
            f"{src} is a cut-off zip archive (no end record: a save or copy that stopped early?); copy it "
            "again or use another checkpoint."
        )
    if head[:1] != b"\x80":  # torch.save's legacy format is a pickle: protocol 2+ starts with 0x80
        what = "an empty file" if not head else "neither a zip archive nor a pickle"
        return f"{src} is not a torch.save'd file ({what}); give a checkpoint file ({_TORCH_FILE})."
    return None


def _safe_globals(megatron: bool) -> list:
    """The classes besides tensors and containers that Megatron's and mok-pretrain-gpt's ``torch.save``
    checkpoints hold: argparse's ``Namespace`` and the enums among the saved arguments (``megatron``:
    Megatron's too, whose import takes seconds, so only for a file that holds them)."""
    import enum

    from mok_megatron import options

    safe: list = [argparse.Namespace]
    safe += [v for v in vars(options).values() if isinstance(v, type) and issubclass(v, enum.Enum)]
    if megatron:
        import logging

        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # its CUDA_HOME note
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from megatron.core.enums import ModelType
                from megatron.core.transformer.enums import AttnBackend, AttnMaskType

            safe += [ModelType, AttnBackend, AttnMaskType]
        except ImportError:
            pass
    return safe


def _pickled_classes(src: str) -> list[str]:
    """The classes a ``torch.save`` file's pickle names, read with ``pickletools`` (which runs nothing): the
    weights-only unpickler stops at the first opcode it does not know (pickle protocol 4's FRAME), before
    the class it would refuse."""
    import pickletools

    with zipfile.ZipFile(src) as z:
        data = next((n for n in z.namelist() if n.endswith("/data.pkl")), None)
        if data is None:
            return []
        raw = z.read(data)
    names, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(raw):
            if op.name == "GLOBAL":
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            if isinstance(arg, str):
                strings.append(arg)
    except ValueError:  # a damaged pickle: what was read so far
        pass
    return list(dict.fromkeys(names))


def _refused(src: str, e: Exception) -> list[str]:
    """The classes of a weights-only refusal beyond torch's, the containers' and ``_safe_globals``'."""
    named = _GLOBAL.search(str(e))
    names = [named.group(1)] if named else _pickled_classes(src)
    ours = {f"{c.__module__}.{c.__qualname__}" for c in _safe_globals(megatron=False)}
    known = ("torch.", "collections.", "builtins.", "_codecs.")
    return [n for n in names if n not in ours and not n.startswith(known)]


def load(src: str, unsafe: bool):
    """``torch.load`` weights-only (``unsafe``: full pickle); a file it cannot load is a ``ConvertError``."""
    problem = _format_problem(src)
    if problem:
        raise ConvertError(problem)
    with warnings.catch_warnings():  # torch's note on pickle protocols above 2: the error line says it all
        warnings.simplefilter("ignore")
        return _load(src, unsafe)


def _load(src: str, unsafe: bool):
    import pickle

    import torch

    try:
        if unsafe:
            return torch.load(src, map_location="cpu", weights_only=False)
        try:
            with torch.serialization.safe_globals(_safe_globals(megatron=False)):
                return torch.load(src, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            refused = _refused(src, e)
            if not refused or not all(n.startswith("megatron.") for n in refused):
                raise
        with torch.serialization.safe_globals(_safe_globals(megatron=True)):
            return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if unsafe or "Weights only load failed" not in str(e):
            why = f"{src} cannot be loaded ({_first_line(e)}); is it a torch.save'd file?"
            raise ConvertError(why) from None
        refused = [n for n in _refused(src, e) if not n.startswith("megatron.core.")]
        if refused:
            why = f"holds a {refused[0]} object, which a weights-only load refuses (unpickling runs code)"
        else:
            why = "is a pickle a weights-only load cannot read (saved with a pickle protocol above 2?)"
        raise ConvertError(
            f"{src} {why}. If you made this file yourself and trust it, add --unsafe-load."
        ) from None
    except (RuntimeError, OSError, EOFError, KeyError, ValueError) as e:
        raise ConvertError(
            f"{src} cannot be loaded ({_first_line(e)}): a damaged or cut-off file? Copy it again or use "
            "another checkpoint."
        ) from None


def state_dict(obj, src: str, key: str | None) -> tuple[dict, int]:
    """(the state dict holding the experts, its number of MoE layers)."""
    from mok_megatron.experts.checkpoint import expert_prefixes

    if key is not None:
        if not isinstance(obj, dict):
            raise ConvertError(f"--key {key}: {src} holds a {type(obj).__name__}, not a dict; drop --key.")
        if key not in obj:
            keys = ", ".join(map(str, list(obj)[:12])) or "none"
            raise ConvertError(f"--key {key}: {src} has no such key; its keys: {keys}.")
        obj = obj[key]
    if not isinstance(obj, dict):
        where = f"under --key {key}" if key else "at the top level"
        raise ConvertError(f"{src} holds a {type(obj).__name__} {where}, not a state dict.")
    n = len(expert_prefixes(obj))
    if n:
        return obj, n
    holders = [k for k, v in obj.items() if isinstance(v, dict) and expert_prefixes(v)]
    if key is None and holders:
        raise ConvertError(
            f"no MoE expert weights at the top level of {src}; they are under key {holders[0]!r}: add "
            f"--key {holders[0]}."
        )
    where = f" under --key {key}" if key else ""
    raise ConvertError(
        f"no MoE expert weights found in {src}{where} (no SequentialMLP, TEGroupedMLP or MoK expert keys); "
        "a dense model has none to convert."
    )


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        check_src(ns.src)
        check_dst(ns.dst)
        obj = load(ns.src, ns.unsafe_load)
        sd, n = state_dict(obj, ns.src, ns.key)
    except ConvertError as e:
        print(f"mok convert: error: {e}", file=sys.stderr)
        return 1
    import torch

    from mok_megatron.experts.checkpoint import convert_state_dict

    converted = convert_state_dict(sd, ns.to)
    if ns.key:
        obj = dict(obj)
        obj[ns.key] = converted
    else:
        obj = converted
    try:
        torch.save(obj, ns.dst)
    except (OSError, RuntimeError) as e:
        print(f"mok convert: error: {ns.dst} cannot be written ({_first_line(e)}).", file=sys.stderr)
        return 1
    print(f"mok convert: {n} MoE layer(s) -> {ns.to}, written to {ns.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
