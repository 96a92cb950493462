"""`weft generate`: sample text from a checkpoint in a single process (experts are resharded)."""
from __future__ import annotations

from pathlib import Path

import torch

from weft.distributed import MoEGroups
from weft.models import GPT, GPTConfig
from weft.train.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint
from weft.train.loop import sample


def resolve_checkpoint(path: str | Path) -> Path:
    """A `checkpoints/step_N` folder, or the latest complete one of a run folder."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if (path / "manifest.json").exists():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"no complete checkpoint in {path} (expected {path}/checkpoints/step_N/manifest.json)")
    return latest


def generate_from_checkpoint(path: str | Path, prompt: str, tokens: int, temperature: float = 0.8,
                             seed: int = 0, device: str | None = None) -> str:
    ckpt = resolve_checkpoint(path)
    extra = verify_checkpoint(ckpt).get("extra") or {}
    if "model" not in extra:
        raise ValueError(f"checkpoint {ckpt} has no model configuration (extra['model']); "
                         "it was not written by `weft train`")
    model_cfg = GPTConfig.from_dict(extra["model"])
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = GPT(model_cfg, group=None).to(dev)
    single = MoEGroups(None, None, None, 1, 1)
    load_checkpoint(ckpt, model, None, single)
    return sample(model, prompt, tokens, dev, single, temperature=temperature, seed=seed)
