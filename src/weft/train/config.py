"""Training configuration: one dataclass, loadable from TOML, overridable from the CLI.

A TOML file has a `[train]` table with TrainConfig fields and an optional `[model]` table
with GPTConfig fields that override the preset (`capacity_factor = "dropless"` means None).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weft.jsonfile import read_json
from weft.kernels.rows import KERNELS
from weft.models import GPTConfig, get_preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


TP_OVERLAPS = ("none", "domino", "domino-copy", "auto")
CUDA_GRAPHS = ("auto", "on", "off")
MASTER_WEIGHTS = ("auto", "on", "off")
GRAD_REDUCE = ("auto", "overlap", "after")
BALANCE = ("none", "pro-prophet")
BALANCE_MODELS = ("measured", "nominal")
TRAIN_A2A_ALGOS = ("linear", "dedup", "dedup-d2", "dedup-fixed", "dedup-fixed-own", "auto")


# The peak learning rate weft's runs were tuned at (byte-level data, batches of 16 sequences or
# fewer, 40 warm-up steps: the presets up to 1024 wide), and the width above which it falls.
BASE_LR = 3e-3
BASE_LR_WIDTH = 1024


def default_lr(dim: int) -> float:
    """The peak learning rate of a run that sets none: `BASE_LR` up to `BASE_LR_WIDTH` wide, then
    falling with the width squared. Adam's first steps move every weight by about the learning
    rate, so a matrix's outputs move by about lr x its fan-in (muP, Yang et al. 2022, scales
    Adam's hidden learning rates by 1 / width); the measurements behind the rule are in
    docs/benchmarks.md, "The learning rate of wide models"."""
    return BASE_LR * min(1.0, (BASE_LR_WIDTH / dim) ** 2)


@dataclass
class TrainConfig:
    """Everything a training run needs besides the model shape (which comes from `preset`)."""

    preset: str = "tiny"
    model: dict[str, Any] = field(default_factory=dict)  # GPTConfig overrides
    data: str | None = None  # None: the Python standard library's source (embedded corpus)
    out: str | None = None  # run folder; default runs/<preset>
    steps: int = 400
    batch_size: int = 16  # sequences per rank per micro-step
    grad_accum: int = 1
    lr: float | None = None  # peak learning rate; None: `default_lr` of the model's width
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    lr_decay_steps: int | None = None  # cosine horizon; None = steps (set it to stop a run early)
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_batches: int = 8
    ckpt_interval: int = 100  # a checkpoint every N steps and at the last one; 0: none (benchmark runs)
    log_interval: int = 20
    val_fraction: float = 0.01
    seed: int = 1337
    ep_size: int | None = None  # expert-parallel size; None = all ranks
    device: str | None = None  # cpu or cuda; None = cuda when available
    resume: bool = False
    overlap: str = "none"  # none, tutel (tuned pipelining degree) or lancet (weft.overlap.optimize)
    sample_tokens: int = 200
    sample_prompt: str = "def "
    kernels: str = "auto"  # weft.MoE's kernels: "auto", "torch", "triton" or "comet" (fused expert GEMMs)
    # the MoE layers' all-to-all: "linear" (a row per routed slot), "dedup" (a row per token and
    # destination rank, its outputs summed there: weft.moe.dedup; same losses, fewer bytes),
    # "dedup-d2" (dedup with each rank's own pairs computed while the others' rows travel in;
    # padded capacity), "dedup-fixed" (dedup; dropless layers in fixed-size exchanges, nothing read
    # on the host, so the step graphs), "dedup-fixed-own" (the same with each rank's own pairs kept
    # out of the exchanges, computed while the others' sums return) or "auto" (the fastest, timed as
    # CUDA graphs where the step is graphed, else linear or dedup by each layer's tuning dictionary;
    # dropless with graphs allowed: that eager step against dedup-fixed as graphs at degrees 1 and 2,
    # dedup-fixed-own and, where the GPUs reach each other's memory, Comet's kernels,
    # weft.train.step.choose_fixed_size)
    a2a_algo: str = "linear"
    # "pro-prophet": dropless MoE layers copy their heaviest experts each call (weft.MoE's balance)
    balance: str = "none"
    # Pro-Prophet's performance model: "measured" (the model profiled on this machine at the start,
    # weft.overlap.fit_balance_models) or "nominal" (H200-class constants, no profiling)
    balance_model: str = "measured"
    # Pro-Prophet's n: the ranks (owner included) that get no copy of a copied expert (1: copy to all)
    balance_n: int = 1
    # the times Pro-Prophet's greedy search may take one rank (1: the paper's Alg. 1, one copy from each rank)
    balance_rounds: int = 1
    keep_last: int = 0  # keep the newest N complete checkpoints, delete older ones (0: keep all)
    # checkpoints written by a background thread while training goes on (weft.train.checkpoint.CheckpointWriter:
    # the state copied to host memory at the step, the files written, checksummed and published after); false:
    # the step waits for its checkpoint on disk
    async_checkpoint: bool = True
    fused_optimizer: bool = True  # GPUs: torch's fused AdamW (False: its multi-tensor one)
    # GPUs: the blocks' matmul weights stored in bf16 with float32 masters in the optimizer
    # (weft.train.optim), their gradients summed in float32 where anything sums them: "auto" (no
    # overlap engine, TP or expert replication), "on" (an error where not), "off": float32
    master_weights: str = "auto"
    on_nonfinite: str = "stop"  # a NaN/inf gradient norm or loss: "stop" the run (exit 1) or "skip" the step
    # the gradients' sum over the data-parallel ranks (replicated ones over every rank, expert ones
    # over their replicas where ep_size leaves some): "overlap" (in buckets during the backward,
    # as DDP does: weft.moe.grads.OverlappedReduce; with several micro-batches per step in the
    # last one's backward; with tensor parallelism after it), "after" the backward, or "auto":
    # overlap on GPUs that do not reach each other's memory (several nodes, or P2P off: a slow
    # link, where it measured 1.06-1.18x the tokens/s), whose experts have replicas (1.42x with
    # NVLink) or whose buckets are the master weights' accumulators (one micro-batch a step: 1.00-
    # 1.01x with NVLink, less memory), else after (NVLink, the replicated gradients alone, several
    # micro-batches or float32 weights: 1-4% slower; weft.train.loop.reduced_after)
    grad_reduce: str = "auto"
    # GPUs: each micro-step's forward and backward replayed as one CUDA graph (weft.graphs) where
    # its shapes are static: "auto" where possible, "on" (an error where not), "off"
    cuda_graphs: str = "auto"
    # tensor parallelism: the blocks split over groups of `tp` consecutive ranks (weft.tp; MoE
    # layers keep their experts over the whole world, each TP rank routing 1/tp of the tokens);
    # `tp_overlap` "domino" overlaps its all-reduces by cutting each micro-step's batch
    # into `domino_p1` micro-batches and each sub-layer's last linear into `domino_p2` column
    # slices (Domino), "none" waits for them (Megatron), "auto" times those and Domino's other
    # splits at the start and runs the fastest (weft.tp.search; the choice is cached)
    tp: int = 1
    tp_overlap: str = "none"
    domino_p1: int = 2
    domino_p2: int = 1

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else (self.betas,)

    @property
    def run_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / self.preset

    def model_config(self) -> GPTConfig:
        """The preset with the `model` overrides applied (validated)."""
        base = get_preset(self.preset).to_dict()
        overrides = {k: (None if v == "dropless" else v) for k, v in self.model.items()}
        return GPTConfig.from_dict({**base, **overrides})

    @property
    def peak_lr(self) -> float:
        """`lr`, or where it is unset `default_lr` of the model's width."""
        return self.lr if self.lr is not None else default_lr(self.model_config().dim)

    @property
    def runs_on_cpu(self) -> bool:
        """Whether the run trains on CPUs: device "cpu", or left to choose on a machine with no GPU."""
        return self.device == "cpu" or (self.device is None and not torch.cuda.is_available())

    def validate(self) -> None:
        numbers = ("min_lr_ratio", "weight_decay", "grad_clip", "val_fraction")
        for name in numbers:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"train.{name} must be a number, got {value!r}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas must be two numbers in [0, 1), got {self.betas!r}")
        positive = ("steps", "batch_size", "grad_accum", "eval_interval", "eval_batches",
                    "log_interval")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"train.{name} must be a positive integer, got {value!r}")
        if self.overlap not in ("none", "tutel", "lancet"):
            raise ValueError(f"train.overlap must be 'none', 'tutel' or 'lancet', got {self.overlap!r}")
        for name in numbers:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"train.{name} must be finite, got {getattr(self, name)}")
        if self.lr is not None and (isinstance(self.lr, bool) or not isinstance(self.lr, (int, float))
                                    or not math.isfinite(self.lr) or not self.lr > 0):
            raise ValueError(f"train.lr must be finite and positive (or unset: the default for the model's "
                             f"width), got {self.lr!r}")
        for name, zero in (("ckpt_interval", "0: no checkpoints"), ("keep_last", "0 keeps all")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"train.{name} must be an integer >= 0 ({zero}), got {value!r}")
        if not isinstance(self.async_checkpoint, bool):
            raise ValueError(f"train.async_checkpoint must be true or false, got {self.async_checkpoint!r}")
        if not isinstance(self.fused_optimizer, bool):
            raise ValueError(f"train.fused_optimizer must be true or false, got {self.fused_optimizer!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"train.kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.a2a_algo not in TRAIN_A2A_ALGOS:
            raise ValueError(f"train.a2a_algo must be one of {', '.join(TRAIN_A2A_ALGOS)}, got {self.a2a_algo!r}")
        if self.a2a_algo != "linear":
            for name, value, plain in (("overlap", self.overlap, "none"), ("balance", self.balance, "none")):
                if value != plain:
                    raise ValueError(f"train.a2a_algo {self.a2a_algo!r} runs one exchange each way; it does not "
                                     f"combine with {name} {value!r} (use {name} {plain!r} or a2a_algo 'linear')")
            if self.kernels == "comet":
                raise ValueError(f"train.a2a_algo {self.a2a_algo!r} and kernels 'comet' are two exchanges; choose one")
        if self.balance not in BALANCE:
            raise ValueError(f"train.balance must be 'none' or 'pro-prophet', got {self.balance!r}")
        if isinstance(self.balance_n, bool) or not isinstance(self.balance_n, int) or self.balance_n < 1:
            raise ValueError(f"train.balance_n must be a positive integer, got {self.balance_n!r}")
        if isinstance(self.balance_rounds, bool) or not isinstance(self.balance_rounds, int) or self.balance_rounds < 1:
            raise ValueError(f"train.balance_rounds must be a positive integer, got {self.balance_rounds!r}")
        if self.balance_model not in BALANCE_MODELS:
            raise ValueError(f"train.balance_model must be 'measured' or 'nominal', got {self.balance_model!r}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"train.cuda_graphs must be 'auto', 'on' or 'off', got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.runs_on_cpu:
            raise ValueError("train.cuda_graphs 'on' needs GPUs (device is cpu); use 'auto' or 'off'")
        if self.master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"train.master_weights must be 'auto', 'on' or 'off', got {self.master_weights!r}")
        if self.master_weights == "on" and self.device == "cpu":  # (with no device given: refused at the start)
            raise ValueError("train.master_weights 'on' needs GPUs (device is cpu: it trains in float32); use 'auto' "
                             "or 'off'")
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"train.grad_reduce must be 'auto', 'overlap' or 'after', got {self.grad_reduce!r}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"train.on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError("train.warmup_steps and train.grad_clip must be >= 0")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"train.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.ep_size is not None and self.ep_size < 1:
            raise ValueError(f"train.ep_size must be positive, got {self.ep_size}")
        model = self.model_config()  # raises for unknown presets and bad model fields
        self._validate_tp(model)
        if self.balance != "none" and model.moe_every and model.capacity_factor is not None:
            raise ValueError(f"train.balance {self.balance!r} balances dropless MoE layers; the model's "
                             f"capacity_factor is {model.capacity_factor} (set capacity_factor = \"dropless\" in "
                             "the [model] table)")
        if self.a2a_algo == "dedup-d2" and model.moe_every and model.capacity_factor is None:
            raise ValueError("train.a2a_algo 'dedup-d2' needs a padded capacity mode; the model's MoE layers are "
                             "dropless (use a2a_algo 'dedup')")

    def _validate_tp(self, model: GPTConfig) -> None:
        for name in ("tp", "domino_p1", "domino_p2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"train.{name} must be a positive integer, got {value!r}")
        if self.tp_overlap not in TP_OVERLAPS:
            raise ValueError(f"train.tp_overlap must be one of {', '.join(TP_OVERLAPS)}, got {self.tp_overlap!r}")
        if self.tp == 1:
            if self.tp_overlap != "none":
                raise ValueError(f"train.tp_overlap {self.tp_overlap!r} overlaps tensor parallelism; set --tp > 1")
            return
        if model.moe_every and (self.batch_size * model.block_size) % self.tp:
            raise ValueError(f"--tp {self.tp}: each rank of a TP group routes 1/{self.tp} of the tokens; "
                             f"{self.batch_size} x {model.block_size} tokens per micro-step do not divide evenly")
        if self.overlap != "none":
            raise ValueError(f"--tp {self.tp}: --overlap {self.overlap} does not run with tensor parallelism; use "
                             "--tp-overlap domino")
        if self.tp_overlap.startswith("domino") and self.domino_p2 > model.dim:
            raise ValueError(f"train.domino_p2 {self.domino_p2} exceeds the model width {model.dim}: Domino cuts each "
                             "sub-layer's output features into that many slices")
        if self.tp_overlap.startswith("domino") and self.domino_p1 > self.batch_size:
            raise ValueError(f"train.domino_p1 {self.domino_p1} exceeds the batch size {self.batch_size}: Domino "
                             "cuts each micro-step's batch into that many micro-batches")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown train config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**values)


def load_toml(path: str | Path) -> TrainConfig:
    """A TrainConfig from a TOML file with `[train]` and `[model]` tables."""
    return TrainConfig.from_dict(read_toml(path))


def read_toml(path: str | Path) -> dict[str, Any]:
    """The train settings a TOML file names (`[train]`, with `[model]` as its "model" entry)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not UTF-8 text (TOML with [train] and [model] tables)") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    unknown = sorted(set(doc) - {"train", "model"})
    if unknown:
        raise ValueError(f"config file {path}: unknown tables {unknown}; use [train] and [model]")
    values = dict(doc.get("train", {}))
    model = {**values.get("model", {}), **doc.get("model", {})}
    return values | ({"model": model} if model else {})


# Settings a resumed run may change without --override: they do not change what the model
# learns (how long, how often to log/evaluate/save, where it runs, how communication is hidden).
FREE_ON_RESUME = frozenset({"steps", "resume", "device", "log_interval", "eval_interval", "ckpt_interval",
                            "sample_tokens", "sample_prompt", "overlap", "on_nonfinite", "out",
                            "kernels", "a2a_algo", "fused_optimizer", "master_weights", "keep_last", "async_checkpoint",
                            "cuda_graphs",
                            "balance", "balance_model", "balance_n", "balance_rounds", "tp", "tp_overlap",
                            "domino_p1", "domino_p2", "grad_reduce"})


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The configuration a run folder's `config.json` holds ({"train": ..., "model": ..., maybe
    "history": [...]}), None if there is none; ValueError if the file is not a weft run's."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return None
    try:
        doc = read_json(path, f"{path} does not exist")
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a weft run configuration ({e}); choose another --out") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("train"), dict) or not isinstance(doc.get("model"), dict):
        raise ValueError(f"{path} is not a weft run configuration (no train and model tables); choose another --out")
    return doc


def saved_train_config(doc: dict[str, Any]) -> TrainConfig:
    """The TrainConfig of a run folder's configuration (`read_run_config`)."""
    return TrainConfig.from_dict(doc["train"])


def config_changes(saved: TrainConfig, new: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """{setting: (saved, new)} for every setting that differs, model fields as `model.NAME`
    (compared on the resolved model configuration, so a preset and its fields compare alike)."""
    changes: dict[str, tuple[Any, Any]] = {}
    before, after = saved.to_dict(), new.to_dict()
    for name in before:
        if name != "model" and before[name] != after[name]:
            changes[name] = (before[name], after[name])
    model_before, model_after = saved.model_config().to_dict(), new.model_config().to_dict()
    for name in model_before:
        if model_before[name] != model_after[name]:
            changes[f"model.{name}"] = (model_before[name], model_after[name])
    return changes
