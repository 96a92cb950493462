"""Fault injection: one training run killed again and again (the launcher, or one rank, at random
moments, once while a checkpoint is being written) and resumed each time ends exactly where an
uninterrupted run ends: the same loss at every step, bit for bit, each step logged once, the
same final weights, and no process left behind."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_run_processes import _alive, _children, _wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and Linux signals")

STEPS = 60
TOML = """
[train]
preset = "tiny"
steps = {steps}
batch_size = 4
ckpt_interval = 3
eval_interval = 12
eval_batches = 1
log_interval = 1
warmup_steps = 2
sample_tokens = 0
data = "{data}"

[model]
dim = 32
n_layer = 2
n_head = 2
block_size = 32
num_experts = 4
moe_hidden_dim = 64
"""


def _launch(config: Path, out: Path, env: dict, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "weft", "train", "--config", str(config), "--out", str(out), "--nproc", "2",
           "--device", "cpu"] + (["--resume"] if resume else [])
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _last_step(out: Path) -> int:
    return max((r["step"] for r in _rows(out) if "loss" in r), default=0)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    folder = out / "checkpoints" / f"step_{STEPS}"
    state = {}
    for f in sorted(folder.glob("*.pt")):
        if f.name.startswith(("model", "experts")):
            state.update({f"{f.name}:{k}": v for k, v in torch.load(f, weights_only=True).items()
                          if isinstance(v, torch.Tensor)})
    return state


def test_kills_at_random_moments_change_nothing(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(2000)))
    config = tmp_path / "run.toml"
    config.write_text(TOML.format(steps=STEPS, data=corpus))
    env = {**os.environ, "WEFT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}

    reference = _launch(config, tmp_path / "reference", env, resume=False)
    assert reference.wait(timeout=300) == 0, reference.stderr.read()[-3000:]

    rng = random.Random(0)
    out, seen_pids, kills = tmp_path / "faulty", [], []
    for attempt in range(5):
        launcher = _launch(config, out, env, resume=attempt > 0)
        try:
            start = _last_step(out)
            target = start + rng.randint(2, 6)
            while_saving = attempt == 2
            checkpoints = out / "checkpoints"

            def moment() -> bool:
                if launcher.poll() is not None:
                    return True
                if while_saving:  # a checkpoint folder being written; by step, should every save be missed
                    saving = checkpoints.is_dir() and any(p.name.endswith(".tmp") for p in checkpoints.iterdir())
                    return saving or _last_step(out) >= target + 9
                return _last_step(out) >= target

            _wait_for(moment, 240, f"attempt {attempt}'s moment to kill", poll=0.001 if while_saving else 0.05)
            assert launcher.poll() is None, (f"the run ended before attempt {attempt}'s kill (kills so far {kills}, "
                                             f"last step {_last_step(out)}, target {target}): "
                                             f"{launcher.stderr.read()[-1500:]}")
            ranks = [p for p in _children(launcher.pid)
                     if "spawn_main" in (Path("/proc") / str(p) / "cmdline").read_text()]
            seen_pids += [launcher.pid, *ranks]
            victim = launcher.pid if attempt % 2 == 0 or not ranks else rng.choice(ranks)
            saving = checkpoints.is_dir() and any(p.name.endswith(".tmp") for p in checkpoints.iterdir())
            os.kill(victim, signal.SIGKILL)
            kills.append((attempt, "launcher" if victim == launcher.pid else "rank", _last_step(out), saving))
            launcher.wait(timeout=60)
            _wait_for(lambda: not any(_alive(p) for p in ranks), 30, "every rank to exit")
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait(timeout=30)
    final = _launch(config, out, env, resume=True)
    assert final.wait(timeout=300) == 0, final.stderr.read()[-3000:]
    assert not any(_alive(p) for p in seen_pids), "a process of a killed run is still alive"

    ref_rows, rows = _rows(tmp_path / "reference"), _rows(out)
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [s for s, _ in losses] == list(range(1, STEPS + 1)), f"steps logged: {[s for s, _ in losses]}; {kills}"
    assert losses == [(r["step"], r["loss"]) for r in ref_rows if "loss" in r], kills
    assert [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r] == \
        [(r["step"], r["val_loss"]) for r in ref_rows if "val_loss" in r]
    assert {kind for _, kind, _, _ in kills} == {"launcher", "rank"} and len(kills) == 5, kills
    print("kills (attempt, victim, last logged step, while a checkpoint was being written):", kills)
    want, got = _weights(tmp_path / "reference"), _weights(out)
    assert want.keys() == got.keys() and want
    assert all(torch.equal(want[k], got[k]) for k in want)
