"""The typed configs of `weft bench layer|model|comm`, `weft plan` and `weft tune`: their flags are
their fields (and the launch flags), command lines parse into the expected config objects, and bad
values are one-line usage errors naming the flag."""
from __future__ import annotations

import dataclasses

import pytest

from weft.bench.comm import CommBenchConfig
from weft.bench.layer import LayerBenchConfig
from weft.bench.model import ModelBenchConfig
from weft.bench.tp import TPBenchConfig
from weft.bench.tune import TuneConfig
from weft.cli import build_parser
from weft.cliargs import LaunchConfig, from_namespace
from weft.overlap.run import PlanConfig

COMMANDS = {
    ("bench", "layer"): LayerBenchConfig,
    ("bench", "model"): ModelBenchConfig,
    ("bench", "comm"): CommBenchConfig,
    ("bench", "tp"): TPBenchConfig,
    ("plan",): PlanConfig,
    ("tune",): TuneConfig,
}


def _subparser(path: tuple[str, ...]):
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p))
def test_flags_are_the_config_fields(path):
    parser = _subparser(path)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(COMMANDS[path])} | {f.name for f in dataclasses.fields(LaunchConfig)}
    assert flags == fields
    defaults = parser.parse_args([])
    assert from_namespace(COMMANDS[path], defaults) == COMMANDS[path]()  # the flags' defaults are the fields'


def _parse(argv: list[str]):
    ns = build_parser().parse_args(argv)
    return ns


def test_a_bench_layer_command_line_becomes_its_config():
    ns = _parse(["bench", "layer", "--config", "qwen2", "--modes", "plain, d2,auto", "--capacity", "1.25,dropless",
                 "--tokens-per-rank", "512", "--profile-steps", "0", "--nproc", "4"])
    cfg = from_namespace(LayerBenchConfig, ns)
    assert cfg == LayerBenchConfig(config="qwen2", modes=("plain", "d2", "auto"), capacity=(1.25, None),
                                   tokens_per_rank=512, profile_steps=0)
    assert ns.nproc == 4


def test_model_plan_comm_and_tune_command_lines():
    model = from_namespace(ModelBenchConfig, _parse(["bench", "model", "--preset", "tiny", "--capacity", "dropless",
                                                     "--gate", "bpr", "--modes", "none,lancet,none"]))
    assert (model.preset, model.capacity, model.gate, model.modes) == ("tiny", None, "bpr", ("none", "lancet", "none"))
    assert model.model_config().capacity_factor is None and model.model_config().gate == "bpr"
    plan = from_namespace(PlanConfig, _parse(["plan", "--preset", "gpt2-l-moe", "--max-range", "3"]))
    assert (plan.preset, plan.capacity, plan.max_range) == ("gpt2-l-moe", "preset", 3)
    comm = from_namespace(CommBenchConfig, _parse(["bench", "comm", "--sizes", "1K,2M", "--warmup", "0"]))
    assert (comm.sizes, comm.warmup, comm.collectives) == ([1024, 2 << 20], 0, ("all_to_all", "all_reduce"))
    tune = from_namespace(TuneConfig, _parse(["tune", "--config", "mixtral", "--a2a", "linear", "--trials", "2"]))
    assert (tune.config, tune.a2a, tune.trials, tune.capacity) == ("mixtral", "linear", 2, 1.0)


@pytest.mark.parametrize("argv, message", [
    (["bench", "layer", "--modes", "plain,fastest"], "--modes 'plain,fastest': choose from"),
    (["bench", "layer", "--modes", "d2", "--baseline", "plain"], "--baseline 'plain' must be one of the --modes"),
    (["bench", "layer", "--config", "gpt5"], "unknown --config 'gpt5'"),
    (["bench", "model", "--preset", "nope"], "unknown --preset 'nope'"),
    (["bench", "model", "--modes", "none,fast"], "--modes 'none,fast'"),
    (["bench", "comm", "--collectives", "broadcast"], "unknown collective(s) ['broadcast']"),
    (["tune", "--capacity", "0"], "--capacity must be a positive capacity factor"),
    (["tune", "--capacity", "nan"], "--capacity must be a positive capacity factor"),
    (["bench", "comm", "--sizes", "-5"], "--sizes must be positive byte counts"),
    (["plan", "--preset", "nope"], "unknown --preset 'nope'"),
    (["bench", "layer", "--steps", "0"], "must be a positive integer"),
    (["bench", "layer", "--capacity", "lots"], "capacity factors are numbers or 'dropless'"),
    (["bench", "comm", "--sizes", "12Q"], "sizes are bytes like 1024"),
    (["bench", "tp", "--config", "gpt9"], "unknown --config 'gpt9'"),
    (["bench", "tp", "--modes", "none,fastest"], "--modes 'none,fastest': choose from"),
    (["bench", "tp", "--p1", "16", "--batch-size", "8"], "--p1 16 exceeds --batch-size 8"),
])
def test_bad_values_are_usage_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ns = build_parser().parse_args(argv)
        ns.run(ns, ns.parser)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
