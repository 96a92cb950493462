"""`weft tune`: build the tuning dictionary of a layer config ahead of training (Tutel 3.3)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from weft.bench.layer import CONFIGS
from weft.cliargs import ACTIVATION_CHOICES, DTYPES, arg, positive_int
from weft.distributed import init_distributed
from weft.moe import MoE
from weft.tune.dictionary import TuningDictionary


@dataclass
class TuneConfig:
    """`weft tune`: time the equivalent settings of a layer config and save the fastest."""

    config: str = arg("tiny", "layer config: mixtral, qwen2, phi35, deepseek or tiny")
    tokens_per_rank: int | None = arg(None, "tokens per rank (default: the config's)", parse=positive_int)
    capacity: float = arg(1.0, "capacity factor (> 0)", parse=float)
    activation: str = arg("relu", "expert activation", choices=ACTIVATION_CHOICES)
    dtype: str = arg("bf16", "parameter and input dtype (fp32 on the CPU)", choices=tuple(DTYPES))
    trials: int = arg(3, "timed calls of each candidate", parse=positive_int)
    a2a: str = arg("auto", "all-to-all algorithms to try", choices=("auto", "linear", "2dh"))
    out: str = arg("tuning.json", "tuning dictionary file (created or extended)")

    def validate(self) -> None:
        if self.config not in CONFIGS:
            raise ValueError(f"unknown --config {self.config!r}; choose from {', '.join(CONFIGS)}")
        if self.capacity is None or not self.capacity > 0 or self.capacity == float("inf"):  # nan and inf too
            raise ValueError("--capacity must be a positive capacity factor (tuning applies to the padded modes)")


def run(tune: TuneConfig) -> str:
    """Time every candidate setting of one layer for its capacity bucket; persist the choice."""
    tune.validate()
    config, trials, path = tune.config, tune.trials, tune.out
    tokens_per_rank, capacity_factor, activation = tune.tokens_per_rank, tune.capacity, tune.activation
    dtype = DTYPES[tune.dtype]
    ctx = init_distributed()
    cfg = CONFIGS[config]
    if ctx.device.type == "cpu":
        dtype = torch.float32
    tokens = tokens_per_rank or cfg.tokens_per_rank
    tuning = TuningDictionary(path, trials=trials)
    torch.manual_seed(0)
    moe = MoE(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, capacity_factor=capacity_factor,
              activation=activation, overlap_degree="auto", a2a_algo=tune.a2a, tuning=tuning,
              device=ctx.device, dtype=dtype)
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    x = torch.randn(tokens, cfg.dim, device=ctx.device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn_like(x)
    candidates = moe.candidates()
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
