"""Training checkpoints: a folder per step written under a temporary name and renamed into place
(`state.json` last: its presence marks a complete checkpoint), the newest few kept; `--resume`
continues from the latest exactly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..atomic import plain_mode, write_json
from ..errors import SpecdecError
from ..models.drafter import Eagle3Drafter


from .drafter_init import FROZEN


def latest_checkpoint(out: Path) -> Path | None:
    ck = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    ck = [c for c in ck if (c / "state.json").exists()]
    return ck[-1] if ck else None


def save_checkpoint(out: Path, step: int, model: Eagle3Drafter, opt, sched, state: dict, keep: int) -> Path:
    from safetensors.torch import save_file

    final = out / "checkpoints" / f"step-{step}"
    tmp = out / "checkpoints" / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Not the frozen embedding: it is the target's (113 MB of a SmolLM2 checkpoint's 180 MB in
    # fp32, 2.1 GB for a Llama-3-8B target's vocab), and a resume copies it from the target again.
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != FROZEN}
    save_file(weights, str(tmp / "drafter.safetensors"))
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "optimizer.pt")
    write_json(tmp / "drafter_config.json", model.cfg.to_dict())
    write_json(tmp / "state.json", state)  # last: its presence marks a complete checkpoint
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        f.chmod(plain_mode())  # safetensors writes 0600
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    old = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]
    for o in old:
        shutil.rmtree(o, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: Eagle3Drafter, opt, sched) -> dict:
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(str(path / "drafter.safetensors")), strict=False)
    if unexpected or set(missing) - {FROZEN}:
        raise SpecdecError(f"checkpoint {path} does not match the drafter: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}; start again without --resume or pick the right --out")
    # Our own file, still read without unpickling arbitrary objects.
    st = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    return json.loads((path / "state.json").read_text())
