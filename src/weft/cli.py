"""The `weft` command: one entry point, one subcommand per job.

Without torchrun, a command that needs a world spawns it locally: one process per GPU (NCCL)
when CUDA is available, else `--nproc` CPU processes with gloo. Under torchrun it uses the
world torchrun made (any number of nodes).
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import io
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weft.bench import comm as bench_comm
from weft.bench import layer as bench_layer
from weft.bench import model as bench_model
from weft.bench import tp as bench_tp
from weft.bench import tune as bench_tune
from weft.bench.plot import plot_layer_results
from weft.cliargs import (
    LaunchConfig,
    add_arguments,
    from_namespace,
    non_negative_float,
    non_negative_int,
    on_off,
    positive_int,
)
from weft.jsonfile import write_json
from weft.kernels.rows import KERNELS
from weft.launch import ReportedError, WorkerError, run_distributed
from weft.overlap import run as overlap_run
from weft.train.compare import format_table, summarize
from weft.train.config import (
    BALANCE,
    BALANCE_MODELS,
    CUDA_GRAPHS,
    FREE_ON_RESUME,
    GRAD_REDUCE,
    MASTER_WEIGHTS,
    TP_OVERLAPS,
    TRAIN_A2A_ALGOS,
    TrainConfig,
    config_changes,
    read_run_config,
    read_toml,
    saved_train_config,
)
from weft.train.generate import generate_from_checkpoint
from weft.train.loop import check_run_dir, train
from weft.train.plots import plot_run, read_runs, save_compare_figure


def launch(fn: Callable[..., Any], args: tuple, nproc: int, device: str | None = None) -> Any:
    """Run `fn(*args)` in the current torchrun world, or spawn a local one."""
    if "WORLD_SIZE" in os.environ:
        return fn(*args)
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if use_cuda and nproc != 2:
        print(f"weft: using all {torch.cuda.device_count()} GPUs (--nproc applies to CPU runs; use "
              f"CUDA_VISIBLE_DEVICES or torchrun to choose GPUs)", file=sys.stderr)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("weft: error: --device cuda but no CUDA GPU is visible")
    world = torch.cuda.device_count() if use_cuda else nproc
    try:
        return run_distributed(fn, world, args=args, timeout=None, backend="nccl" if use_cuda else "gloo")[0]
    except WorkerError as e:  # a run that stopped on purpose says why in one line, not a traceback
        if e.report is not None:
            raise SystemExit(f"weft: error: {e.report}") from None
        raise


def _run_config(module_run: Callable, config_cls: type):
    """The handler of a subcommand whose flags are `config_cls`'s fields (and the launch flags):
    build the config, check it (a bad value is a one-line usage error naming its flag), launch."""
    def handler(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
        cfg = from_namespace(config_cls, ns)
        try:
            cfg.validate()
        except ValueError as e:
            parser.error(str(e))
        launch(module_run, (cfg,), ns.nproc, ns.device)
    return handler


def _config_parser(sub, name: str, config_cls: type, module_run: Callable, help: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help, description=config_cls.__doc__)
    add_arguments(parser, config_cls)
    add_arguments(parser, LaunchConfig)
    parser.set_defaults(run=_run_config(module_run, config_cls), parser=parser)
    return parser


_TRAIN_FLAGS = ("preset", "steps", "data", "out", "batch_size", "grad_accum", "lr", "ep_size", "device", "seed",
                "overlap", "on_nonfinite", "sample_tokens", "kernels", "a2a_algo", "ckpt_interval", "keep_last",
                "async_checkpoint", "cuda_graphs", "master_weights", "balance", "balance_model", "balance_n",
                "balance_rounds", "tp", "tp_overlap", "domino_p1", "domino_p2", "grad_reduce")


def _train_config(ns: argparse.Namespace, parser: argparse.ArgumentParser):
    try:
        # The settings this command names: the TOML file's, then the flags given.
        given = read_toml(ns.config) if ns.config else {}
        given |= {name: getattr(ns, name) for name in _TRAIN_FLAGS if getattr(ns, name) is not None}
        cfg = TrainConfig.from_dict(given)
        cfg.resume = cfg.resume or ns.resume
        if cfg.resume:
            cfg = _resumed_config(cfg, given, ns.override)
        if cfg.data is not None and not Path(cfg.data).exists():
            raise FileNotFoundError(f"--data {cfg.data} does not exist")
        cfg.validate()
        _check_world(cfg, ns.nproc)
        check_run_dir(cfg)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))
    return cfg


def _resumed_config(cfg: TrainConfig, given: dict, override: bool) -> TrainConfig:
    """--resume continues the run's saved configuration: the settings this command names (`given`)
    replace the saved ones, and a change to what the model learns (data, lr, seed, model fields,
    ...) is refused unless --override says so (the run's config.json then records it)."""
    saved = read_run_config(cfg.run_dir)
    if saved is None:  # nothing saved yet: this command's settings start the run
        return cfg
    base = saved_train_config(saved)
    resumed = dataclasses.replace(base, **{k: v for k, v in given.items() if k != "resume"}, resume=True)
    guarded = {k: v for k, v in config_changes(base, resumed).items() if k not in FREE_ON_RESUME}
    if guarded and not override:
        listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in guarded.items())
        raise ValueError(f"--resume: this command changes the run's saved configuration ({listed}); "
                         "pass --override to continue with the new values (recorded in config.json)")
    return resumed


def _check_world(cfg, nproc: int) -> None:
    """What can be known before spawning: the world and expert-parallel sizes fit the model."""
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
    elif torch.cuda.is_available() and cfg.device != "cpu":
        world = torch.cuda.device_count()
    else:
        world = nproc
    if world % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must divide the number of processes ({world})")
    ep = cfg.ep_size or world
    if world % ep:
        raise ValueError(f"--ep-size {ep} must divide the number of processes ({world})")
    model = cfg.model_config()
    if model.moe_every and model.num_experts % ep:
        raise ValueError(f"the model's {model.num_experts} experts cannot be split over {ep} expert-parallel "
                         f"ranks; choose --nproc/--ep-size dividing {model.num_experts}")


def _train(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    cfg = _train_config(ns, parser)
    launch(train, (cfg,), ns.nproc, cfg.device)


def _generate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        text = generate_from_checkpoint(ns.ckpt, ns.prompt, ns.tokens, ns.temperature, ns.seed, ns.device)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.error(str(e))
    print(text)


def _plot(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        if len(ns.run_dirs) == 1:
            paths = plot_run(ns.run_dirs[0], ns.out)
        else:
            runs = read_runs(ns.run_dirs)
            summaries = [summarize(name, train, val, ns.drops_after) for name, train, val in runs]
            out = Path(ns.out or ".")
            paths = [save_compare_figure(runs, out),
                     write_json(out / "compare.json", {"drops_after": ns.drops_after,
                                                       "runs": [s.to_dict() for s in summaries]})]
            print(format_table(summaries, ns.drops_after))
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    for p in paths:
        print(p)


def _bench_plot(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        print(plot_layer_results(ns.json_file, ns.out))
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train an MoE GPT (default: tiny preset on the embedded corpus)")
    tr.add_argument("--preset", default=None, help="model preset (default tiny); see weft.models.PRESETS")
    tr.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default 400)")
    tr.add_argument("--data", default=None, help="text file, folder of text files, or token .bin "
                    "(default: the Python standard library's source)")
    tr.add_argument("--out", default=None, help="run folder (default runs/<preset>)")
    add_arguments(tr, LaunchConfig)
    tr.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint, with "
                    "the run's saved configuration (flags given replace it; see --override)")
    tr.add_argument("--override", action="store_true", help="with --resume: allow flags that change what the "
                    "model learns (data, lr, seed, model, ...); config.json records the change")
    tr.add_argument("--config", default=None, help="TOML file with [train] and [model] tables")
    tr.add_argument("--batch-size", type=positive_int, default=None, help="sequences per rank per micro-step")
    tr.add_argument("--grad-accum", type=positive_int, default=None)
    tr.add_argument("--lr", type=float, default=None)
    tr.add_argument("--ep-size", type=positive_int, default=None, help="expert-parallel group size")
    tr.add_argument("--seed", type=int, default=None)
    tr.add_argument("--sample-tokens", type=int, default=None, help="length of the text sample at the end")
    tr.add_argument("--on-nonfinite", default=None, choices=["stop", "skip"],
                    help="a NaN/inf loss or gradient: stop the run with an error (default) or skip that step")
    tr.add_argument("--overlap", default=None, choices=["none", "tutel", "lancet"],
                    help="communication overlap: none (default), tutel (tuned pipelining degree per MoE layer), "
                         "lancet (dW scheduling + partitioned forward, planned at start; where the "
                         "step replays as a CUDA graph, dW scheduling + each MoE layer's pipelining degree, "
                         "each kept if its graph replays faster)")
    tr.add_argument("--ckpt-interval", type=non_negative_int, default=None,
                    help="a checkpoint every N steps and at the last one (default 100); 0: no checkpoints at all "
                         "(e.g. benchmark runs of large models, whose checkpoints take minutes to write)")
    tr.add_argument("--keep-last", type=non_negative_int, default=None,
                    help="keep only the newest N checkpoints (default 0: keep all)")
    tr.add_argument("--async-checkpoint", type=on_off, default=None, metavar="{on,off}",
                    help="on (default): checkpoints are written by a background thread while training goes on "
                         "(the state copied to host memory at the step); off: the step waits for them")
    tr.add_argument("--kernels", default=None, choices=list(KERNELS),
                    help="Triton kernels (MoE dispatch/combine, deterministic; rotary) or PyTorch ops only (torch); "
                         "auto (default): Triton on GPUs; comet: as auto, and Comet's fused expert GEMMs that "
                         "communicate tile by tile where the GPUs reach each other's memory")
    tr.add_argument("--a2a-algo", default=None, choices=list(TRAIN_A2A_ALGOS),
                    help="the MoE layers' all-to-all: linear (default: a row per routed slot), dedup (a row per "
                         "token and destination rank, the expert outputs summed there; same losses, fewer bytes), "
                         "dedup-d2 (dedup with each rank's own pairs computed while the others' rows travel in; "
                         "padded capacity), dedup-fixed (dedup; dropless layers in fixed-size exchanges, nothing "
                         "read on the host, so CUDA graphs capture the step), dedup-fixed-own (the same with each "
                         "rank's own pairs kept out of the exchanges, computed while the others' sums return) or "
                         "auto (the fastest, timed as CUDA graphs where the step is graphed; dropless: the eager "
                         "step against dedup-fixed as graphs, unpipelined, in 2 chunks and with the own pairs "
                         "apart, and Comet's kernels as a graph where the GPUs reach each other's memory)")
    tr.add_argument("--balance", default=None, choices=list(BALANCE),
                    help="pro-prophet: dropless MoE layers copy their heaviest experts to every rank each call, "
                         "planned from the earlier calls' loads (same losses); none (default)")
    tr.add_argument("--balance-n", type=positive_int, default=None,
                    help="with --balance pro-prophet, Pro-Prophet's n: each copied expert goes to all ranks but n "
                         "(its owner counted; default 1: every other rank); 1 <= n < ranks")
    tr.add_argument("--balance-rounds", type=positive_int, default=None,
                    help="with --balance pro-prophet, the times the greedy search may take one rank and copy its "
                         "heaviest expert left (default 1: Pro-Prophet's Alg. 1, one copy from each rank)")
    tr.add_argument("--balance-model", default=None, choices=list(BALANCE_MODELS),
                    help="with --balance pro-prophet, the planner's performance model: measured (default: profiled "
                         "on this machine at the start) or nominal (H200-class constants)")
    tr.add_argument("--cuda-graphs", default=None, choices=list(CUDA_GRAPHS),
                    help="GPUs: replay each micro-step's forward and backward as one CUDA graph (no launch cost); "
                         "auto (default): where the shapes are static (padded capacity; dropless on one GPU, in "
                         "fixed-size exchanges or with Comet's kernels; --overlap tutel at the degree whose graph "
                         "is fastest, --overlap lancet with its "
                         "dW schedule only, kept if its graph is faster), "
                         "on: an error where they are not, off: eager")
    tr.add_argument("--master-weights", default=None, choices=list(MASTER_WEIGHTS),
                    help="GPUs: store the blocks' matmul weights in bf16 with float32 masters in the optimizer, "
                         "gradients summed in float32 (the same training, less memory traffic); auto (default): "
                         "wherever that changes no arithmetic (not with --tp, Lancet's partitioned forward or "
                         "--overlap tutel on dropless layers); on: an error where not; off: float32")
    tr.add_argument("--grad-reduce", default=None, choices=list(GRAD_REDUCE),
                    help="the gradients' sum over the data-parallel ranks (the replicated ones over every rank, "
                         "the experts' over their replicas where --ep-size leaves some): overlap (in ~25 MB "
                         "buckets launched during the backward as their gradients finish, as DDP does; with "
                         "--grad-accum in the last micro-batch's backward; with --tp after it), after the "
                         "backward, or auto (default: overlap on GPUs that do not reach each other's memory, "
                         "e.g. several nodes or NCCL_P2P_DISABLE=1, whose experts have replicas, or whose "
                         "buckets are the master weights' float32 accumulators, one micro-batch a step; else after)")
    tr.add_argument("--tp", type=positive_int, default=None,
                    help="tensor parallelism (dense models): split every block over groups of N consecutive ranks "
                         "(Megatron's split; default 1); the other ranks are data parallel")
    tr.add_argument("--tp-overlap", default=None, choices=list(TP_OVERLAPS),
                    help="with --tp: none (default: each all-reduce waited where issued), domino (each "
                         "micro-step's batch cut into --domino-p1 micro-batches whose all-reduces overlap compute), "
                         "domino-copy (the same, its all-reduces copied through the GPUs' peer memory instead of "
                         "NCCL's kernels, which slow the GEMMs beside them; one node with NVLink/P2P) or auto "
                         "(none and Domino's splits timed at the start, the fastest run; cached)")
    tr.add_argument("--domino-p1", type=positive_int, default=None, help="Domino's micro-batches (default 2)")
    tr.add_argument("--domino-p2", type=positive_int, default=None,
                    help="Domino's column slices of each sub-layer's last linear (default 1: none)")
    tr.set_defaults(run=_train, parser=tr)

    _config_parser(sub, "plan", overlap_run.PlanConfig, overlap_run.plan_preset,
                   "profile a preset and print Lancet's overlap plan")

    ge = sub.add_parser("generate", help="sample text from a checkpoint")
    ge.add_argument("--ckpt", required=True, help="a run folder (latest checkpoint) or a checkpoints/step_N folder")
    ge.add_argument("--prompt", default="def ")
    ge.add_argument("--tokens", type=positive_int, default=200)
    ge.add_argument("--temperature", type=non_negative_float, default=0.8,
                    help="sampling temperature, a finite number >= 0 (0: always the likeliest byte)")
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ge.set_defaults(run=_generate, parser=ge)

    pl = sub.add_parser("plot", help="PNG plots of a run (loss, throughput, expert load), or several runs' losses "
                        "overlaid")
    pl.add_argument("run_dirs", nargs="+", metavar="run_dir",
                    help="one run: its figures; several: compare.png, their losses by step and by tokens")
    pl.add_argument("--out", default=None, help="folder for the PNGs (default RUN_DIR/plots; several runs: the "
                    "current directory)")
    pl.add_argument("--drops-after", type=non_negative_int, default=0,
                    help="several runs: the table's dropped-token share counts the logged steps after this one")
    pl.set_defaults(run=_plot, parser=pl)

    _config_parser(sub, "tune", bench_tune.TuneConfig, bench_tune.run,
                   "time the equivalent settings of a layer config and save the fastest")

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _config_parser(bench, "layer", bench_layer.LayerBenchConfig, bench_layer.run,
                   "time forward+backward of one MoE layer")
    _config_parser(bench, "comm", bench_comm.CommBenchConfig, bench_comm.run,
                   "all-to-all and all-reduce bandwidth/latency; fits the comm cost model")
    _config_parser(bench, "model", bench_model.ModelBenchConfig, bench_model.run,
                   "time training iterations of a preset per overlap mode")
    _config_parser(bench, "tp", bench_tp.TPBenchConfig, bench_tp.run,
                   "time forward+backward of tensor-parallel dense blocks: Megatron, Domino, no-comm")

    plo = bench.add_parser("plot", help="stacked bar chart of a `weft bench layer --json` file")
    plo.add_argument("json_file")
    plo.add_argument("--out", default=None, help="PNG path (default: the JSON path with .png)")
    plo.set_defaults(run=_bench_plot, parser=plo)
    return parser


def dump_stacks_on_sigusr1() -> bool:
    """Have SIGUSR1 print every thread's Python stack to stderr and go on (a hung rank then says
    where it waits: `pkill -USR1 -P <torchrun's pid>`). False where the platform has no SIGUSR1
    or stderr is no file (e.g. captured by a test runner)."""
    if not hasattr(signal, "SIGUSR1"):
        return False
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (io.UnsupportedOperation, AttributeError, ValueError):
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    ns = parser.parse_args(argv)
    dump_stacks_on_sigusr1()
    try:
        ns.run(ns, ns.parser)
    except ReportedError as e:  # under torchrun: this process's own run stopped
        message = f"weft: error: {e}"
        stop_failed_rank(message)
        raise SystemExit(message) from None
    except BaseException:
        stop_failed_rank(traceback.format_exc())
        raise
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # nobody tears down while a peer is still inside a collective
        dist.destroy_process_group()


def stop_failed_rank(report: str) -> None:
    """A rank whose run raised, in a process group: print `report` and exit now, leaving the group
    as it is. Tearing it down (`destroy_process_group`) or finalising the interpreter waits for the
    collectives the peers are inside, which this rank will never join: a rank out of GPU memory
    in `bench model --cuda-graphs on` hung there with its error unprinted. torchrun (or weft's own
    launcher) then stops the other ranks. Without a process group: returns, the caller raises."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    print(report.rstrip(), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
