"""`weft tune`: build the tuning dictionary of a layer config ahead of training (Tutel 3.3)."""
from __future__ import annotations

import torch

from weft.bench.layer import CONFIGS
from weft.distributed import init_distributed
from weft.moe import MoE
from weft.tune.dictionary import TuningDictionary, candidates_for


def run(config: str, tokens_per_rank: int | None, capacity_factor: float, activation: str, dtype: torch.dtype,
        path: str, trials: int = 3, a2a_algo: str = "auto") -> str:
    """Time every candidate setting of one layer for its capacity bucket; persist the choice."""
    ctx = init_distributed()
    cfg = CONFIGS[config]
    if ctx.device.type == "cpu":
        dtype = torch.float32
    tokens = tokens_per_rank or cfg.tokens_per_rank
    tuning = TuningDictionary(path, trials=trials)
    torch.manual_seed(0)
    moe = MoE(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, capacity_factor=capacity_factor,
              activation=activation, overlap_degree="auto", a2a_algo=a2a_algo, tuning=tuning,
              device=ctx.device, dtype=dtype)
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    x = torch.randn(tokens, cfg.dim, device=ctx.device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn_like(x)
    candidates = candidates_for(moe)
    calls = len(candidates) * trials + 1
    if ctx.rank == 0:
        print(f"weft tune: {config}, {ctx.world_size} ranks, candidates {[c.name for c in candidates]}, "
              f"{trials} trials each", flush=True)
    for _ in range(calls):
        moe(x).backward(grad)
        moe.zero_grad(set_to_none=True)
        x.grad = None
    summary = tuning.summary()
    if ctx.rank == 0:
        print(summary + f"\nwrote {path}", flush=True)
    return summary
