"""The `weft` command: one entry point, one subcommand per job.

Without torchrun, a command that needs a world spawns it locally: one process per GPU (NCCL)
when CUDA is available, else `--nproc` CPU processes with gloo. Under torchrun it uses the
world torchrun made (any number of nodes).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _capacity_list(text: str) -> tuple[float | None, ...]:
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(None if item in ("none", "dropless") else float(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"capacity factors are numbers or 'dropless', got {item!r}") from None
    return tuple(out)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
    from weft.launch import run_distributed

    world = torch.cuda.device_count() if use_cuda else nproc
    return run_distributed(fn, world, args=args, timeout=None, backend="nccl" if use_cuda else "gloo")[0]


def _bench_layer(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.bench import layer

    if ns.config not in layer.CONFIGS:
        parser.error(f"unknown --config {ns.config!r}; choose from {', '.join(layer.CONFIGS)}")
    modes = tuple(m.strip() for m in ns.modes.split(",") if m.strip())
    known = list(layer.MODES) + list(layer.PEER_MODES)
    if not modes or any(m not in known for m in modes):
        parser.error(f"--modes {ns.modes!r}: choose from {', '.join(known)}")
    if ns.baseline not in modes:
        parser.error(f"--baseline {ns.baseline!r} must be one of the --modes")
    args = (ns.config, ns.tokens_per_rank, ns.capacity, ns.activation, DTYPES[ns.dtype], ns.steps, ns.warmup,
            ns.json, modes, ns.baseline, ns.optimizer, ns.trace, 5, ns.num_experts, ns.top_k)
    launch(layer.run, args, ns.nproc, ns.device)


def _train_config(ns: argparse.Namespace, parser: argparse.ArgumentParser):
    from weft.train.config import TrainConfig, load_toml

    try:
        cfg = load_toml(ns.config) if ns.config else TrainConfig()
        for name in ("preset", "steps", "data", "out", "batch_size", "grad_accum", "lr", "ep_size", "device", "seed",
                     "overlap"):
            value = getattr(ns, name)
            if value is not None:
                setattr(cfg, name, value)
        cfg.resume = cfg.resume or ns.resume
        if ns.sample_tokens is not None:
            cfg.sample_tokens = ns.sample_tokens
        if cfg.data is not None and not Path(cfg.data).exists():
            raise FileNotFoundError(f"--data {cfg.data} does not exist")
        cfg.validate()
        _check_world(cfg, ns.nproc)
        from weft.train.loop import check_run_dir

        check_run_dir(cfg)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))
    return cfg


def _check_world(cfg, nproc: int) -> None:
    """What can be known before spawning: the world and expert-parallel sizes fit the model."""
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
    elif torch.cuda.is_available() and cfg.device != "cpu":
        world = torch.cuda.device_count()
    else:
        world = nproc
    ep = cfg.ep_size or world
    if world % ep:
        raise ValueError(f"--ep-size {ep} must divide the number of processes ({world})")
    model = cfg.model_config()
    if model.moe_every and model.num_experts % ep:
        raise ValueError(f"the model's {model.num_experts} experts cannot be split over {ep} expert-parallel "
                         f"ranks; choose --nproc/--ep-size dividing {model.num_experts}")


def _train(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.train.loop import train

    cfg = _train_config(ns, parser)
    launch(train, (cfg,), ns.nproc, cfg.device)


def _plan(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.models import PRESETS
    from weft.overlap.run import plan_preset

    if ns.preset not in PRESETS:
        parser.error(f"unknown --preset {ns.preset!r}; choose from {', '.join(PRESETS)}")
    args = (ns.preset, ns.batch_size, ns.gate, ns.capacity, ns.max_partitions, ns.max_range, ns.comm_model, ns.json)
    launch(plan_preset, args, ns.nproc, ns.device)


def _bench_model(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.bench import model
    from weft.models import PRESETS

    if ns.preset not in PRESETS:
        parser.error(f"unknown --preset {ns.preset!r}; choose from {', '.join(PRESETS)}")
    modes = tuple(m.strip() for m in ns.modes.split(",") if m.strip())
    if not modes or any(m not in model.MODES for m in modes):
        parser.error(f"--modes {ns.modes!r}: choose from {', '.join(model.MODES)}")
    args = (ns.preset, ns.batch_size, ns.gate, ns.capacity, modes, ns.steps, ns.warmup, ns.json, ns.max_partitions)
    launch(model.run, args, ns.nproc, ns.device)


def _capacity_or_preset(text: str):
    if text == "preset":
        return text
    if text in ("none", "dropless"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity factor is a number or 'dropless', got {text!r}") from None


def _add_model_arguments(parser: argparse.ArgumentParser, batch_size: int) -> None:
    parser.add_argument("--preset", default="gpt2-s-moe", help="model preset (see weft.models.PRESETS)")
    parser.add_argument("--batch-size", type=_positive_int, default=batch_size, help="sequences per rank")
    parser.add_argument("--gate", default=None, choices=["topk", "bpr", "cosine", "expert_choice", "random"],
                        help="override the preset's gate")
    parser.add_argument("--capacity", type=_capacity_or_preset, default="preset",
                        help="override the preset's capacity factor ('dropless' for None)")
    parser.add_argument("--max-partitions", type=_positive_int, default=8, help="Lancet's K")


def _generate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.train.generate import generate_from_checkpoint

    try:
        text = generate_from_checkpoint(ns.ckpt, ns.prompt, ns.tokens, ns.temperature, ns.seed, ns.device)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.error(str(e))
    print(text)


def _plot(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.train.plots import plot_run

    try:
        paths = plot_run(ns.run_dir, ns.out)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    for p in paths:
        print(p)


def _sizes(text: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for item in text.split(","):
        item = item.strip().lower().removesuffix("ib").removesuffix("b")
        try:
            out.append(int(float(item[:-1]) * units[item[-1]]) if item and item[-1] in units else int(item))
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"sizes are bytes like 1024, 64K or 256M, got {item!r}") from None
    return out


def _bench_comm(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.bench import comm

    collectives = tuple(c.strip() for c in ns.collectives.split(",") if c.strip())
    if not collectives or any(c not in comm.COLLECTIVES for c in collectives):
        parser.error(f"--collectives {ns.collectives!r}: choose from {', '.join(comm.COLLECTIVES)}")
    args = (ns.sizes, collectives, ns.steps, ns.warmup, ns.json, ns.model, None)
    launch(comm.run, args, ns.nproc, ns.device)


def _bench_plot(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.bench.plot import plot_layer_results

    try:
        print(plot_layer_results(ns.json_file, ns.out))
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))


def _tune(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from weft.bench.layer import CONFIGS
    from weft.tune.run import run

    if ns.config not in CONFIGS:
        parser.error(f"unknown --config {ns.config!r}; choose from {', '.join(CONFIGS)}")
    if ns.capacity is None or ns.capacity <= 0:
        parser.error("--capacity must be a positive capacity factor (tuning applies to the padded modes)")
    args = (ns.config, ns.tokens_per_rank, ns.capacity, ns.activation, DTYPES[ns.dtype], ns.out, ns.trials, ns.a2a)
    launch(run, args, ns.nproc, ns.device)


def _add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a command runs when it is not under torchrun (see `launch`)."""
    parser.add_argument("--nproc", type=_positive_int, default=2, help="CPU processes when not under torchrun")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)


def _add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_positive_int, default=20,
                        help="timed steps (bench layer: rounds, the modes interleaved); median reported")
    parser.add_argument("--warmup", type=_positive_int, default=5, help="untimed steps first")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train an MoE GPT (default: tiny preset on the embedded corpus)")
    tr.add_argument("--preset", default=None, help="model preset (default tiny); see weft.models.PRESETS")
    tr.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default 400)")
    tr.add_argument("--data", default=None, help="text file, folder of text files, or token .bin "
                    "(default: the Python standard library's source)")
    tr.add_argument("--out", default=None, help="run folder (default runs/<preset>)")
    _add_launch_arguments(tr)
    tr.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    tr.add_argument("--config", default=None, help="TOML file with [train] and [model] tables")
    tr.add_argument("--batch-size", type=_positive_int, default=None, help="sequences per rank per micro-step")
    tr.add_argument("--grad-accum", type=_positive_int, default=None)
    tr.add_argument("--lr", type=float, default=None)
    tr.add_argument("--ep-size", type=_positive_int, default=None, help="expert-parallel group size")
    tr.add_argument("--seed", type=int, default=None)
    tr.add_argument("--sample-tokens", type=int, default=None, help="length of the text sample at the end")
    tr.add_argument("--overlap", default=None, choices=["none", "tutel", "lancet"],
                    help="communication overlap: none (default), tutel (tuned pipelining degree per MoE layer), "
                         "lancet (dW scheduling + partitioned forward, planned at start)")
    tr.set_defaults(run=_train, parser=tr)

    pn = sub.add_parser("plan", help="profile a preset and print Lancet's overlap plan")
    _add_model_arguments(pn, batch_size=8)
    pn.add_argument("--max-range", type=_positive_int, default=None, help="most sub-layers one pipeline spans")
    pn.add_argument("--comm-model", default=None, help="cost model JSON from `weft bench comm` (default: measure)")
    pn.add_argument("--json", default=None, help="write the plan here")
    _add_launch_arguments(pn)
    pn.set_defaults(run=_plan, parser=pn)

    ge = sub.add_parser("generate", help="sample text from a checkpoint")
    ge.add_argument("--ckpt", required=True, help="a run folder (latest checkpoint) or a checkpoints/step_N folder")
    ge.add_argument("--prompt", default="def ")
    ge.add_argument("--tokens", type=_positive_int, default=200)
    ge.add_argument("--temperature", type=float, default=0.8)
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ge.set_defaults(run=_generate, parser=ge)

    pl = sub.add_parser("plot", help="PNG plots of a run: loss, throughput, expert load")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None, help="folder for the PNGs (default RUN_DIR/plots)")
    pl.set_defaults(run=_plot, parser=pl)

    tu = sub.add_parser("tune", help="time the equivalent settings of a layer config and save the fastest")
    tu.add_argument("--config", default="tiny", help="mixtral, qwen2, phi35, deepseek or tiny")
    tu.add_argument("--tokens-per-rank", type=_positive_int, default=None)
    tu.add_argument("--capacity", type=float, default=1.0, help="capacity factor (> 0)")
    tu.add_argument("--activation", default="relu", choices=["relu", "gelu", "silu", "swiglu"])
    tu.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    tu.add_argument("--trials", type=_positive_int, default=3)
    tu.add_argument("--a2a", default="auto", choices=["auto", "linear", "2dh"], help="all-to-all algorithms to try")
    tu.add_argument("--out", default="tuning.json", help="tuning dictionary file (created or extended)")
    _add_launch_arguments(tu)
    tu.set_defaults(run=_tune, parser=tu)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    lay = bench.add_parser("layer", help="time forward+backward of one MoE layer")
    lay.add_argument("--config", default="tiny", help="mixtral, qwen2, phi35, deepseek or tiny")
    lay.add_argument("--tokens-per-rank", type=_positive_int, default=None,
                     help="tokens per rank (default 4096; deepseek 1024, tiny 256)")
    lay.add_argument("--num-experts", type=_positive_int, default=None,
                     help="override the config's expert count (fewer than ranks: experts sharded, modes rN)")
    lay.add_argument("--top-k", type=_positive_int, default=None, help="override the config's top-k")
    lay.add_argument("--modes", default="plain,no-comm",
                     help="comma-separated: plain, no-comm, d2, d4, d8 (Tutel pipelining), 2dh (two-level "
                          "all-to-all), r0 (data-parallel experts), r1/r2/r4/r8 (Tutel's r with fewer experts than "
                          "ranks), auto (tuning dictionary), torchtitan, megatron (default plain,no-comm)")
    lay.add_argument("--baseline", default="plain", help="mode the ratios are relative to")
    lay.add_argument("--capacity", type=_capacity_list, default=(1.0, None),
                     help="comma-separated capacity factors, 'dropless' for None (default 1.0,dropless)")
    lay.add_argument("--activation", default="relu", choices=["relu", "gelu", "silu", "swiglu"])
    lay.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    lay.add_argument("--optimizer", default="none", choices=["none", "sgd", "adamw"],
                     help="also time an optimizer step (Tutel's reference numbers include SGD)")
    _add_timing_arguments(lay)
    lay.add_argument("--json", default=None, help="write the results to this JSON file")
    lay.add_argument("--trace", default=None, help="folder for Chrome traces of each mode (GPU)")
    _add_launch_arguments(lay)
    lay.set_defaults(run=_bench_layer, parser=lay)

    com = bench.add_parser("comm", help="all-to-all and all-reduce bandwidth/latency; fits the comm cost model")
    com.add_argument("--sizes", type=_sizes, default=None,
                     help="bytes per rank, comma-separated (default 1K..256M in powers of 4; CPU up to 16M)")
    com.add_argument("--collectives", default="all_to_all,all_reduce")
    _add_timing_arguments(com)
    com.add_argument("--json", default=None,
                     help="write the measurements here (and the fitted model as <stem>.model.json beside it)")
    com.add_argument("--model", default=None, help="where to write the fitted piecewise-linear cost model")
    _add_launch_arguments(com)
    com.set_defaults(run=_bench_comm, parser=com)

    mod = bench.add_parser("model", help="time training iterations of a preset per overlap mode")
    _add_model_arguments(mod, batch_size=8)
    mod.add_argument("--modes", default="none,tutel,lancet-bw,lancet-fw,lancet",
                     help="comma-separated: none, tutel, lancet-bw, lancet-fw, lancet, and with the dW "
                          "scheduler on even without all-to-alls dw-in-place (its default) or defer-dw "
                          "(every dW deferred to the end of backward); a mode listed twice is timed twice "
                          "(its spread is the noise floor)")
    # The modes are timed interleaved: a round runs one iteration of every mode.
    mod.add_argument("--steps", type=_positive_int, default=20, help="timed rounds (median, min, iqr reported)")
    mod.add_argument("--warmup", type=_positive_int, default=5, help="untimed rounds first")
    mod.add_argument("--json", default=None, help="write the results to this JSON file")
    _add_launch_arguments(mod)
    mod.set_defaults(run=_bench_model, parser=mod)

    plo = bench.add_parser("plot", help="stacked bar chart of a `weft bench layer --json` file")
    plo.add_argument("json_file")
    plo.add_argument("--out", default=None, help="PNG path (default: the JSON path with .png)")
    plo.set_defaults(run=_bench_plot, parser=plo)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    ns = parser.parse_args(argv)
    import torch.distributed as dist

    try:
        ns.run(ns, ns.parser)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # nobody tears down while a peer is still inside a collective
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
