"""End-to-end training on CPU gloo ranks: the loss falls, resume is exact, checkpoints load into
one process for sampling, and the CLI rejects bad arguments with clear messages."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from weft.cli import _train_config, build_parser, launch, main
from weft.distributed import MoEGroups
from weft.models import GPT, GPTConfig
from weft.testing import run_distributed
from weft.train.checkpoint import latest_checkpoint, verify_checkpoint
from weft.train.config import TrainConfig, load_toml
from weft.train.generate import generate_from_checkpoint
from weft.train.loop import sample, train
from weft.train.plots import plot_run

SMALL_MODEL = {"dim": 32, "n_layer": 2, "n_head": 2, "block_size": 32, "num_experts": 4,
               "moe_hidden_dim": 64, "top_k": 2}


def write_corpus(folder: Path) -> Path:
    """A small corpus of Python-like lines, as a text file in `folder`."""
    lines = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(3000)]
    path = folder / "code.txt"
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def config(corpus: Path, out: Path, **kw) -> TrainConfig:
    values = dict(data=str(corpus), out=str(out), model=dict(SMALL_MODEL), steps=30, batch_size=8,
                  warmup_steps=5, eval_interval=10, eval_batches=2, ckpt_interval=10, log_interval=10,
                  sample_tokens=0, lr=3e-3)
    values.update(kw)
    return TrainConfig(**values)


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """Per step, the training metric `key` (default the loss)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if "loss" in r}


def run(cfg: TrainConfig, world: int, cache: Path) -> dict:
    return run_distributed(train, world, args=(cfg,), timeout=300, env={"WEFT_CACHE": str(cache)})[0]


def test_loss_falls_and_run_folder_is_complete(corpus, tmp_path):
    out = tmp_path / "run"
    summary = run(config(corpus, out, steps=60, sample_tokens=20), 2, tmp_path / "cache")
    loss = losses(out)
    assert sorted(loss) == list(range(1, 61))
    assert sum(loss[s] for s in range(51, 61)) / 10 < sum(loss[s] for s in range(1, 6)) / 5 - 1.0
    assert summary["val_loss"] < loss[1] - 1.0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_row = next(r for r in rows if "loss" in r)
    for key in ("ce_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "dropped_share",
                "expert_load", "imbalance"):
        assert key in step_row
    assert len(step_row["expert_load"]) == 1 and len(step_row["expert_load"][0]) == 4
    assert sum(step_row["expert_load"][0]) == 2 * 8 * 32 * 2  # ranks * batch * seq * top_k
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_10", "step_20", "step_30", "step_40", "step_50", "step_60"]
    assert summary["sample"].startswith("def ") and len(summary["sample"]) > 4
    assert {p.name for p in plot_run(out)} == {"loss.png", "throughput.png", "expert_load.png"}


# Models whose function does not depend on how a batch is shared out over ranks: dense, and an MoE
# routed by argmax, dropless, without aux loss (a mean over each rank's tokens).
WORLD_INVARIANT = {"dense": {**SMALL_MODEL, "moe_every": 0},
                   "moe": {**SMALL_MODEL, "capacity_factor": None, "aux_loss_coef": 0.0}}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", list(WORLD_INVARIANT))
def test_data_parallel_ranks_train_like_one_rank_with_their_global_batch(corpus, tmp_path, world, model):
    """W ranks of batch 8 / W read the windows of one rank of batch 8 (the sampler splits one global
    batch) and reduce their gradients to that rank's: the same losses, gradient norms and
    validation losses step by step (expert parallelism included)."""
    runs = {}
    for ranks in (1, world):
        out = tmp_path / f"w{ranks}"
        run(config(corpus, out, model=dict(WORLD_INVARIANT[model]), steps=10, batch_size=8 // ranks,
                   eval_interval=5, log_interval=1), ranks, tmp_path / "cache")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
        runs[ranks] = (losses(out), losses(out, "grad_norm"), val)
    one, split = runs[1], runs[world]
    assert sorted(split[0]) == list(range(1, 11)) and sorted(split[2]) == [5, 10]
    assert [split[0][s] for s in range(1, 11)] == pytest.approx([one[0][s] for s in range(1, 11)], abs=2e-4)
    assert [split[1][s] for s in range(1, 11)] == pytest.approx([one[1][s] for s in range(1, 11)], rel=1e-3)
    assert [split[2][s] for s in (5, 10)] == pytest.approx([one[2][s] for s in (5, 10)], abs=2e-4)


def test_resume_is_exact(corpus, tmp_path):
    cache = tmp_path / "cache"
    run(config(corpus, tmp_path / "full"), 2, cache)
    run(config(corpus, tmp_path / "split", steps=20, lr_decay_steps=30), 2, cache)
    run(config(corpus, tmp_path / "split", steps=30, resume=True), 2, cache)
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert [full[s] for s in range(21, 31)] == [split[s] for s in range(21, 31)]


def test_checkpoint_of_two_ranks_samples_in_one_process(corpus, tmp_path):
    out = tmp_path / "run"
    run(config(corpus, out, steps=10), 2, tmp_path / "cache")
    a = generate_from_checkpoint(out, "def ", 30, seed=1)
    b = generate_from_checkpoint(out / "checkpoints" / "step_10", "def ", 30, seed=1)
    assert a == b and a.startswith("def ") and len(a) >= 4


@pytest.mark.parametrize("gate, dropless", [("topk", True), ("expert_choice", False)])
def test_sample_runs_token_choice_dropless_for_the_call_only(gate, dropless):
    """Sampling passes capacity_factor=None per call (token choice only) and writes no layer setting."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL_MODEL, moe_every=1, gate=gate, capacity_factor=1.0))
    before = [moe.capacity_factor for moe in model.moe_layers()]
    text = sample(model, "def ", 5, torch.device("cpu"), MoEGroups(None, None, None, 1, 1))
    assert text.startswith("def ")
    assert [moe.capacity_factor for moe in model.moe_layers()] == before
    assert all((moe.stats.capacity is None) == dropless for moe in model.moe_layers())
    model(torch.zeros(1, 8, dtype=torch.long))
    assert all(moe.stats.capacity is not None for moe in model.moe_layers())


def test_toml_config_maps_onto_the_dataclasses(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\npreset = "tiny"\nsteps = 7\n\n[model]\ncapacity_factor = "dropless"\ndim = 64\n')
    cfg = load_toml(path)
    assert cfg.steps == 7 and cfg.model_config().capacity_factor is None and cfg.model_config().dim == 64
    path.write_text("[train]\nstepz = 7\n")
    with pytest.raises(ValueError, match="unknown train config keys.*stepz"):
        load_toml(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--steps", "0"], "must be a positive integer"),
        (["train", "--preset", "huge"], "unknown preset 'huge'"),
        (["train", "--data", "/no/such/corpus"], "/no/such/corpus does not exist"),
        (["train", "--config", "/no/such.toml"], "config file /no/such.toml does not exist"),
        (["train", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["generate", "--ckpt", "/no/such/run"], "checkpoint path /no/such/run does not exist"),
        (["generate", "--ckpt", "/no/such/run", "--temperature", "-1"], "--temperature: must be a finite number >= 0"),
        (["generate", "--ckpt", "/no/such/run", "--temperature", "nan"], "--temperature: must be a finite number >= 0"),
        (["plot", "/no/such/run"], "/no/such/run"),
        (["bench", "layer", "--config", "gpt5"], "unknown --config 'gpt5'"),
        (["bench", "layer", "--modes", "plain,fastest"], "--modes 'plain,fastest': choose from"),
        (["bench", "comm", "--sizes", "12Q"], "sizes are bytes like 1024, 64K or 256M"),
        (["tune", "--config", "gpt5"], "unknown --config 'gpt5'"),
        (["tune", "--capacity", "0"], "--capacity must be a positive capacity factor"),
        (["train", "--nproc", "3"], "experts cannot be split over 3 expert-parallel ranks"),
        (["train", "--device", "cpu", "--cuda-graphs", "on"], "cuda_graphs 'on' needs GPUs"),
        # the device left to choose on a machine with no GPU: refused before anything is built
        pytest.param(["train", "--overlap", "lancet", "--cuda-graphs", "on"], "cuda_graphs 'on' needs GPUs",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
        (["train", "--cuda-graphs", "always"], "invalid choice: 'always'"),
        (["train", "--async-checkpoint", "maybe"], "--async-checkpoint: must be on or off, got 'maybe'"),
        (["train", "--preset", "tiny-dense", "--nproc", "2", "--tp", "3", "--device", "cpu"],
         "--tp 3 must divide the number of processes (2)"),
        (["train", "--preset", "tiny-dense", "--tp-overlap", "domino"], "set --tp > 1"),
        (["bench", "layer", "--modes", "plain,balance+graph", "--capacity", "1"],
         "--modes balance+graph: +graph applies"),
    ],
)
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code not in (0, None)
    assert message in capsys.readouterr().err


def test_cli_refuses_to_overwrite_a_run(corpus, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit):
        main(["train", "--data", str(corpus), "--out", str(tmp_path / "run")])
    assert "already holds a run; pass --resume" in capsys.readouterr().err


def poisoned_train(cfg: TrainConfig, bad_step: int, late: bool = False) -> dict:
    """`train` whose loss is NaN at `bad_step` only (a diverged step), on every rank; `late`: each
    step's metrics read after the next step's micro-batches, as on GPUs."""
    from weft.train import loop

    real_step = loop._train_step
    loop.reads_late = lambda device: late

    def train_step(model, optimizer, batches, step, *args, **kwargs):
        if step != bad_step:
            return real_step(model, optimizer, batches, step, *args, **kwargs)
        real_forward = model.forward

        def forward(*a, **k):
            logits, loss = real_forward(*a, **k)
            return logits, loss * float("nan")
        model.forward = forward
        try:
            return real_step(model, optimizer, batches, step, *args, **kwargs)
        finally:
            del model.forward

    loop._train_step = train_step
    return loop.train(cfg)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.parametrize("late", [False, True])
def test_a_diverged_step_stops_the_run_before_the_optimizer_step(corpus, tmp_path, monkeypatch, capsys, late):
    out = tmp_path / "run"
    cfg = config(corpus, out, steps=6, ckpt_interval=2, eval_interval=100)
    monkeypatch.setenv("WEFT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as stop:
        launch(poisoned_train, (cfg, 3, late), nproc=2, device="cpu")
    assert str(stop.value).startswith("weft: error: step 3: the gradient norm is nan")
    assert "\n" not in str(stop.value)  # one line, not a worker's traceback
    assert [r["step"] for r in _rows(out)] == [1, 2]  # nothing logged for the bad step
    assert latest_checkpoint(out).name == "step_2"  # the last good state stays the latest


@pytest.mark.parametrize("late", [False, True])
def test_on_nonfinite_skip_skips_the_step_and_trains_on(corpus, tmp_path, late):
    out = tmp_path / "run"
    cfg = config(corpus, out, steps=5, ckpt_interval=5, eval_interval=100, on_nonfinite="skip")
    run_distributed(poisoned_train, 2, args=(cfg, 3, late), timeout=300, env={"WEFT_CACHE": str(tmp_path / "cache")})
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["skipped"] for r in rows] == [False, False, True, False, False]
    assert all(math.isfinite(r["loss"]) for r in rows if not r["skipped"])


def traced_train(cfg: TrainConfig, late: bool) -> list[tuple[str, int]]:
    """`train` recording, in order, each step's launch and each read of a step's metrics, with the
    reads late (as on GPUs) or not (the CPU's default)."""
    from weft.train import loop

    events, real_step, real_read = [], loop._train_step, loop._read_step
    loop.reads_late = lambda device: late

    def train_step(model, optimizer, batches, step, *args, **kwargs):
        events.append(("launch", step))
        return real_step(model, optimizer, batches, step, *args, **kwargs)

    def read_step(pending, *args, **kwargs):
        events.append(("read", pending.step))
        return real_read(pending, *args, **kwargs)

    loop._train_step, loop._read_step = train_step, read_step
    loop.train(cfg)
    return events


def test_the_host_reads_each_step_while_the_next_one_runs(corpus, tmp_path):
    """On GPUs a step's metrics (the host's first wait for the device since the step was launched)
    are read after the next step's micro-batches are launched, except where an evaluation or a
    checkpoint needs the step first; every step is read once and logged in order, with the losses
    of a run that reads each step at once (the CPU's way: its ops have finished when they return)."""
    runs = {}
    for late in (True, False):
        out = tmp_path / f"late-{late}"
        cfg = config(corpus, out, steps=7, ckpt_interval=3, eval_interval=100)
        events = run_distributed(traced_train, 1, args=(cfg, late), timeout=300,
                                 env={"WEFT_CACHE": str(tmp_path / "c")})[0]
        runs[late] = _rows(out)
        assert [r["step"] for r in runs[late]] == list(range(1, 8))
        assert events == ([("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2), ("read", 3),
                           ("launch", 4), ("launch", 5), ("read", 4), ("launch", 6), ("read", 5), ("read", 6),
                           ("launch", 7), ("read", 7)] if late else
                          [(what, s) for s in range(1, 8) for what in ("launch", "read")])
    assert [r["loss"] for r in runs[True]] == [r["loss"] for r in runs[False]]


def biased_poisoned_train(cfg: TrainConfig, bad_step: int, late: bool) -> list[bool]:
    """`poisoned_train` returning, per step, whether the step moved the layers' selection bias."""
    from weft.train import loop

    moved, real_step = [], loop._train_step

    def train_step(model, *args, **kwargs):
        before = [moe.expert_bias.clone() for moe in model.moe_layers()]
        result = real_step(model, *args, **kwargs)
        moved.append(any(not torch.equal(b, moe.expert_bias) for b, moe in zip(before, model.moe_layers())))
        return result

    loop._train_step = train_step
    poisoned_train(cfg, bad_step, late)
    return moved


@pytest.mark.parametrize("late", [False, True])
def test_a_skipped_step_leaves_the_expert_bias_where_it_was(corpus, tmp_path, late):
    """--on-nonfinite skip with a selection bias: the bias follows every step's loads but the
    skipped one's (decided on the device, like the optimizer's skip)."""
    cfg = config(corpus, tmp_path / "run", steps=5, ckpt_interval=5, eval_interval=100, on_nonfinite="skip",
                 model={**SMALL_MODEL, "expert_bias_rate": 0.01})
    moved = run_distributed(biased_poisoned_train, 2, args=(cfg, 3, late), timeout=300,
                            env={"WEFT_CACHE": str(tmp_path / "cache")})[0]
    assert moved == [True, True, False, True, True]
    assert [r["skipped"] for r in _rows(tmp_path / "run")] == [False, False, True, False, False]


@pytest.mark.parametrize("field, value", [("lr", float("inf")), ("lr", float("nan")), ("grad_clip", float("inf"))])
def test_non_finite_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"train.{field} must be finite"):
        TrainConfig(**{field: value}).validate()


def _cli_config(argv: list[str]) -> TrainConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    return _train_config(ns, ns.parser)


def test_resume_continues_the_saved_configuration(corpus, tmp_path, capsys):
    """--resume takes the run's saved settings, not the defaults; a change to what the model learns
    is refused unless --override, which config.json then records."""
    out = tmp_path / "run"
    run(config(corpus, out, steps=4, batch_size=4, lr=1e-3, seed=7, ckpt_interval=2), 2, tmp_path / "cache")
    resumed = _cli_config(["train", "--out", str(out), "--resume", "--steps", "6"])
    assert (resumed.lr, resumed.batch_size, resumed.seed, resumed.data, resumed.steps) == (1e-3, 4, 7, str(corpus), 6)
    assert resumed.model_config().dim == SMALL_MODEL["dim"]
    with pytest.raises(SystemExit):
        _cli_config(["train", "--out", str(out), "--resume", "--lr", "0.01", "--seed", "8"])
    err = capsys.readouterr().err
    assert "changes the run's saved configuration (lr 0.001 -> 0.01, seed 7 -> 8)" in err and "--override" in err
    changed = _cli_config(["train", "--out", str(out), "--resume", "--lr", "0.01", "--override"])
    assert changed.lr == 0.01 and changed.batch_size == 4
    run(changed, 2, tmp_path / "cache")
    doc = json.loads((out / "config.json").read_text())
    assert doc["train"]["lr"] == 0.01
    assert doc["history"] == [{"resumed_at_step": 4, "changed": {"lr": [0.001, 0.01]}}]


def test_a_fresh_run_never_writes_over_a_foreign_config_or_a_file(corpus, tmp_path, capsys):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "config.json").write_text('{"some": "other tool"}')
    with pytest.raises(SystemExit):
        _cli_config(["train", "--out", str(out), "--data", str(corpus)])
    assert "config.json is not a weft run configuration" in capsys.readouterr().err
    assert (out / "config.json").read_text() == '{"some": "other tool"}'
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit):
        _cli_config(["train", "--out", str(tmp_path / "afile"), "--data", str(corpus)])
    assert "is a file, not a folder" in capsys.readouterr().err


def test_resume_with_a_toml_file_changes_only_what_the_file_names(corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    saved = config(corpus, out, lr=1e-3, seed=7)
    (out / "config.json").write_text(json.dumps({"train": saved.to_dict(), "model": saved.model_config().to_dict()}))
    toml = tmp_path / "more.toml"
    toml.write_text("[train]\nsteps = 90\n")
    resumed = _cli_config(["train", "--out", str(out), "--resume", "--config", str(toml)])
    assert (resumed.steps, resumed.lr, resumed.seed, resumed.batch_size) == (90, 1e-3, 7, saved.batch_size)


def test_a_resume_logs_each_step_once(corpus, tmp_path):
    """The interrupted run logged steps past its last checkpoint; the resumed run trains them again
    and its rows replace theirs (validation rows too)."""
    import shutil
    cache, out = tmp_path / "cache", tmp_path / "run"
    run(config(corpus, out, steps=25, lr_decay_steps=30), 2, cache)
    shutil.rmtree(out / "checkpoints" / "step_25")  # as if killed before its final save
    run(config(corpus, out, steps=30, resume=True), 2, cache)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "loss" in r]
    val_steps = [r["step"] for r in rows if "val_loss" in r]
    assert train_steps == list(range(1, 31))
    assert val_steps == sorted(set(val_steps)) and val_steps[-1] == 30


@pytest.mark.parametrize("command", [["train", "--config"], ["plan", "--comm-model"]])
def test_a_binary_file_given_as_a_config_is_a_one_line_error(command, tmp_path, capsys):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)))
    with pytest.raises(SystemExit) as exit_info:
        main([*command, str(junk)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(junk) in err.splitlines()[-1] and "Traceback" not in err


def test_keep_last_keeps_the_newest_checkpoints_and_resume_still_works(corpus, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    run(config(corpus, out, steps=30, ckpt_interval=5, keep_last=2), 2, cache)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_25", "step_30"]
    run(config(corpus, out, steps=35, resume=True, keep_last=2), 2, cache)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_30", "step_35"]


def test_checkpoints_written_in_the_background_are_those_written_in_the_step(corpus, tmp_path):
    """`weft train` with its checkpoints written in the background (the default) and in the step
    (`async_checkpoint = false`), 2 ranks, a checkpoint every 10 steps and the newest two kept:
    the same losses, the same checkpoints kept, and each one's model and optimizer files byte for
    byte the same (sizes and sha256 in the manifests) and its RNG files the same torch states
    (Python's `random` state is each process's own from its start: no two runs share it)."""
    cache = tmp_path / "cache"
    for name, background in (("background", True), ("in_step", False)):
        run(config(corpus, tmp_path / name, keep_last=2, async_checkpoint=background), 2, cache)
    assert losses(tmp_path / "background") == losses(tmp_path / "in_step")
    kept = sorted(p.name for p in (tmp_path / "background" / "checkpoints").iterdir())
    assert kept == sorted(p.name for p in (tmp_path / "in_step" / "checkpoints").iterdir()) == ["step_20", "step_30"]
    for step in kept:
        background, in_step = (verify_checkpoint(tmp_path / name / "checkpoints" / step)
                               for name in ("background", "in_step"))
        assert background["files"].keys() == in_step["files"].keys()
        assert background["step"] == int(step.removeprefix("step_"))
        for name in background["files"]:
            if name.startswith("rng_rank"):
                rng = [torch.load(tmp_path / run / "checkpoints" / step / name, weights_only=False)
                       for run in ("background", "in_step")]
                assert torch.equal(rng[0]["torch"], rng[1]["torch"])
            else:
                assert background["files"][name] == in_step["files"][name], name


def test_a_metrics_line_cut_by_a_kill_is_dropped_on_the_next_start(tmp_path):
    from weft.train.metrics import MetricsLog
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # killed mid-write
    log = MetricsLog(path, resume_from=1)
    log.write({"step": 2, "loss": 1.5})
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def test_data_errors_inside_the_ranks_are_one_line(tmp_path, capsys):
    folder = tmp_path / "binary"
    folder.mkdir()
    (folder / "a.dat").write_bytes(b"\x00\x01\x02")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--data", str(folder), "--steps", "2", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == f"weft: error: data: no text found in folder {folder} (1 files): 1 file(s) not " \
        "UTF-8 text (or binary, with NUL bytes), 0 empty"
    assert "Traceback" not in capsys.readouterr().err


def test_a_dense_model_trains_resumes_exactly_samples_and_plots(corpus, tmp_path):
    """moe_every = 0: no MoE layer anywhere (the metrics code used to reshape 0 expert counts)."""
    dense = {**SMALL_MODEL, "moe_every": 0}
    cache = tmp_path / "cache"
    summary = run(config(corpus, tmp_path / "full", steps=40, model=dense, sample_tokens=20), 2, cache)
    full = losses(tmp_path / "full")
    assert sum(full[s] for s in range(31, 41)) / 10 < sum(full[s] for s in range(1, 6)) / 5 - 1.0
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    step_row = next(r for r in rows if "loss" in r)
    assert step_row["expert_load"] == [] and step_row["imbalance"] == [] and step_row["aux_loss"] == 0.0
    assert summary["sample"].startswith("def ")
    run(config(corpus, tmp_path / "split", steps=20, model=dense, lr_decay_steps=40), 2, cache)
    run(config(corpus, tmp_path / "split", steps=40, model=dense, resume=True), 2, cache)
    split = losses(tmp_path / "split")
    assert [full[s] for s in range(21, 41)] == [split[s] for s in range(21, 41)]
    text = generate_from_checkpoint(tmp_path / "full", "def ", 10, 0.8, 0, "cpu")
    assert text.startswith("def ") and len(text) > 4
    assert {p.name for p in plot_run(tmp_path / "full")} == {"loss.png", "throughput.png"}


def test_a_run_that_repeats_its_data_is_warned_with_the_sizes():
    from weft.train.loop import data_repeat_warning
    assert data_repeat_warning(10_000_000, 16_384, 600) is None  # 9.8M tokens of 10M: once
    warning = data_repeat_warning(10_000_000, 16_384, 1200)
    assert warning.startswith("1200 steps read 19.7M tokens from a training split of 10.0M tokens: it is read "
                              "1.97 times over")


@pytest.mark.parametrize("model, overlap, reason", [
    ({}, "none", "CUDA graphs need a GPU"),
    ({"capacity_factor": None}, "none", "MoE layer 0 runs capacity_factor=None (dropless)"),
    ({"capacity_factor": None, "a2a_algo": "dedup-fixed"}, "none", None),  # dropless, nothing read on the host
    ({"capacity_factor": 0}, "none", "MoE layer 0 runs capacity_factor=0 (no-drop)"),
    ({}, "lancet", None),  # its dW schedule captured (no partitioned forward range set on the model)
    ({}, "tutel", None),  # its degree timed as CUDA graphs, then captured
])
def test_cuda_graphs_say_why_a_step_cannot_be_graphed(model, overlap, reason):
    from weft.train.step import graph_blocker, set_layers

    algo = model.pop("a2a_algo", "linear")
    gpt = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 2, **model}))
    set_layers(gpt, "a2a_algo", algo)
    device = torch.device("cpu" if reason and reason.startswith("CUDA") else "cuda")  # the checks before the device's
    hint = (" (--a2a-algo dedup-fixed reads none, nor does --kernels comet where the GPUs reach each other's "
            "memory)") if "dropless" in (reason or "") else ""
    assert graph_blocker(gpt, device, overlap) == (reason if reason is None or reason.startswith(("CUDA", "--")) else
                                                   reason + ": its sizes are read on the host every step" + hint)


def _comet_blocker_worker() -> list:
    from weft.train.step import graph_blocker, lancet_partitions_forward, set_layers

    gpt = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 2, "capacity_factor": None}))
    cuda = torch.device("cuda")  # the checks before the device's (the layers' peers: shared files here)
    plain = graph_blocker(gpt, cuda, "none")
    set_layers(gpt, "kernels", "comet")
    balanced = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 2, "capacity_factor": None}), kernels="torch",
                   balance="pro-prophet")
    off_comet = graph_blocker(balanced, cuda, "none")
    set_layers(balanced, "kernels", "comet")
    return [plain, graph_blocker(gpt, cuda, "none"), graph_blocker(gpt, cuda, "lancet"), off_comet,
            graph_blocker(balanced, cuda, "none"),
            [lancet_partitions_forward(balanced, cuda, mode) for mode in ("auto", "on")]]


def test_dropless_comet_steps_can_be_graphed():
    """Dropless layers read their counts on the host, except with Comet's kernels where the ranks
    reach each other's memory (2 gloo ranks: shared files): their steps can be captured, unless
    Lancet's scheduler takes the exchange (it runs the all-to-allv); Pro-Prophet's copies too,
    in replica slots on that path only, and then with --cuda-graphs on only (auto keeps the
    balanced step eager, so Lancet plans its partitioned forward there)."""
    plain, comet, lancet, off_comet, balanced, partitions = run_distributed(_comet_blocker_worker, 2,
                                                                            timeout=120)[0]
    assert plain.startswith("MoE layer 0 runs capacity_factor=None (dropless)"), plain
    assert comet is None
    assert lancet == plain
    assert off_comet.startswith("--balance pro-prophet plans each call's copies on the host"), off_comet
    assert balanced is None
    assert partitions == [True, False]


def test_lancets_partitioned_forward_keeps_the_step_eager():
    from weft.overlap.forward import Range
    from weft.overlap.passes import apply
    from weft.train.step import graph_blocker

    gpt = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 2}))
    apply(gpt, [Range(0, 1, 2, 1)], None)
    assert graph_blocker(gpt, torch.device("cuda"), "lancet") == (
        "--overlap lancet's partitioned forward ranges read their all-to-allv sizes on the host")
    apply(gpt, [], None)
    assert graph_blocker(gpt, torch.device("cuda"), "lancet") is None


def test_an_eager_micro_step_returns_the_logged_values(corpus):
    """The values `weft train` logs come out of the micro-step (so a CUDA graph's replay reports its own)."""
    from weft.train.step import build_micro_step

    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 1}))
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    steps = build_micro_step(gpt, 2, "auto", (x, y), log=pytest.fail)  # CPU: eager, nothing said
    assert not steps.graphed and not steps.owns_grads
    losses, counts = steps.run(x, y)
    _, loss = gpt(x, y)
    assert torch.allclose(losses[:3], torch.stack([loss, gpt.last_ce_loss, gpt.last_aux_loss]).detach())
    moes = gpt.moe_layers()
    assert float(losses[3]) == sum(float(m.stats.dropped) for m in moes)
    assert torch.equal(counts, torch.stack([m.stats.expert_counts.float() for m in moes]))
    grads = [p.grad.clone() for p in gpt.parameters()]
    gpt.zero_grad()
    (loss / 2).backward()  # the micro-step divided its loss by grad_accum
    assert all(torch.allclose(a, p.grad) for a, p in zip(grads, gpt.parameters()))


def eager_timer(gpt: GPT, setting: str | tuple[str, ...], fastest, seen: list, losses: list):
    """A stand-in for `weft.graphs.time_graphed` in `choose_fastest`: it runs each candidate's
    micro-step once eagerly (a replay runs the captured step), noting the values the MoE layers ran
    with (`seen`: of `setting`, or a tuple of several settings) and the loss (`losses`), and reports
    `fastest` as the fastest."""
    def values(moe):
        return getattr(moe, setting) if isinstance(setting, str) else tuple(getattr(moe, s) for s in setting)

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen)

    def timer(step_of, candidates):
        times = []
        for value in candidates:
            gpt.zero_grad(set_to_none=True)
            losses.append(float(step_of(value)(x, y)[0][0]))
            seen.append({values(moe) for moe in gpt.moe_layers()})
            times.append(0.5 if value == fastest else 1.0)
        return times

    return timer


def test_tutel_in_a_graphed_step_runs_the_degree_whose_step_is_fastest():
    """`--overlap tutel` with CUDA graphs: every candidate degree's micro-step is timed (here by a
    timer that runs it eagerly, as `time_graphed` replays its capture), each with every MoE layer
    at that degree and computing the same losses; the fastest degree is set on every layer."""
    from weft.graphs import live_gradient_accumulators
    from weft.train.step import GRAPH_TUNED, choose_fastest, eager_micro_step, with_layers_at
    from weft.tune.dictionary import DEGREES

    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 1}))
    seen, losses = [], []
    timer = eager_timer(gpt, "overlap_degree", 4, seen, losses)
    assert GRAPH_TUNED["overlap_degree"] == DEGREES
    step_of = with_layers_at(gpt, eager_micro_step(gpt, 1), "overlap_degree")
    degree, seconds = choose_fastest(gpt, step_of, timer, "overlap_degree", DEGREES)
    assert degree == 4 and seconds == [0.5 if d == 4 else 1.0 for d in DEGREES]
    assert seen == [{d} for d in DEGREES]
    assert losses == pytest.approx([losses[0]] * len(DEGREES), abs=1e-6)  # chunking changes nothing
    assert [moe.overlap_degree for moe in gpt.moe_layers()] == [4] * len(gpt.moe_layers())
    assert live_gradient_accumulators(list(gpt.parameters())) == []  # no autograd graph of a candidate kept


def test_the_expert_bias_trains_changes_routing_and_resumes_exactly(corpus, tmp_path):
    """model.expert_bias_rate > 0: every MoE layer's selection bias moves with the step's global
    loads, changes the routing (the losses leave those of a run without it after step 1, where
    the bias is still 0), is saved in the checkpoint, and a resumed run has the uninterrupted
    run's losses (which a bias lost on resume would change)."""
    model = {**SMALL_MODEL, "expert_bias_rate": 0.01}
    cache = tmp_path / "cache"
    run(config(corpus, tmp_path / "plain", steps=20), 2, cache)
    run(config(corpus, tmp_path / "full", steps=20, model=model), 2, cache)
    run(config(corpus, tmp_path / "split", steps=10, model=model, lr_decay_steps=20), 2, cache)
    run(config(corpus, tmp_path / "split", steps=20, model=model, resume=True), 2, cache)
    plain, full, split = losses(tmp_path / "plain"), losses(tmp_path / "full"), losses(tmp_path / "split")
    assert full[1] == plain[1] and any(full[s] != plain[s] for s in range(2, 21))
    assert [full[s] for s in range(11, 21)] == [split[s] for s in range(11, 21)]
    saved = {k: v for part in sorted((tmp_path / "full" / "checkpoints" / "step_20").glob("model_part*.pt"))
             for k, v in torch.load(part, weights_only=True).items()}
    biases = [v for k, v in saved.items() if k.endswith("expert_bias")]
    assert len(biases) == 1 and biases[0].shape == (4,) and biases[0].abs().sum() > 0


def test_pro_prophet_balancing_trains_with_the_plain_losses(corpus, tmp_path):
    """--balance pro-prophet on a dropless model: the same losses as without (float rounding: the
    copies' gradients are summed in another order), experts copied on the way (metrics), and the
    checkpoint resumes in a run without balancing with the same losses."""
    dropless = {**SMALL_MODEL, "capacity_factor": "dropless", "moe_every": 1}
    cache = tmp_path / "cache"
    run(config(corpus, tmp_path / "plain", steps=12, model=dropless, ckpt_interval=6), 2, cache)
    # the paper's model on nominal constants: the model measured on these CPU processes (with each
    # copy's overhead) rightly keeps such tiny experts home, and the copies are what is tested here
    run(config(corpus, tmp_path / "balanced", steps=12, model=dropless, ckpt_interval=6, balance="pro-prophet",
               balance_model="nominal"), 2, cache)
    # and the default: the model measured here before the first step, copy overhead included
    run(config(corpus, tmp_path / "measured", steps=12, model=dropless, balance="pro-prophet"), 2, cache)
    plain, balanced = losses(tmp_path / "plain"), losses(tmp_path / "balanced")
    assert sorted(balanced) == list(range(1, 13))
    for other in (balanced, losses(tmp_path / "measured")):
        assert all(abs(plain[s] - other[s]) <= 1e-4 * abs(plain[s]) for s in plain), (plain, other)
    rows = [json.loads(line) for line in (tmp_path / "balanced" / "metrics.jsonl").read_text().splitlines()]
    copied = [r["copied_experts"] for r in rows if "loss" in r]
    assert all(len(layers) == 2 for layers in copied)  # one list per MoE layer
    assert any(experts for layers in copied for experts in layers), "no expert was copied in 12 steps"
    # each layer's plan: the busiest rank over the mean, plain and with the copies (lower where it copies)
    planned = [(experts, load) for r in rows if "loss" in r
               for experts, load in zip(r["copied_experts"], r["planned_rank_load"])]
    assert all(load is None or 1.0 <= load[1] <= load[0] for _, load in planned), planned
    assert all(load[1] < load[0] for experts, load in planned if experts), planned
    # a balanced run's checkpoint is a plain one: it resumes without balancing
    resumed = config(corpus, tmp_path / "balanced", steps=12, model=dropless, resume=True, balance="none")
    rows_before = losses(tmp_path / "balanced")
    shutil.rmtree(tmp_path / "balanced" / "checkpoints" / "step_12")
    run(resumed, 2, cache)
    after = losses(tmp_path / "balanced")
    assert all(abs(after[s] - rows_before[s]) <= 1e-4 * abs(rows_before[s]) for s in range(7, 13))


def test_pro_prophet_on_comets_path_trains_with_the_plain_losses(corpus, tmp_path):
    """--balance pro-prophet --kernels comet --balance-rounds 2: the copies go into replica slots
    on Comet's dropless path (peer memory: shared files between the CPU processes) and the run
    logs the plain run's losses (float rounding), with experts copied on the way."""
    dropless = {**SMALL_MODEL, "capacity_factor": "dropless", "moe_every": 1}
    cache = tmp_path / "cache"
    run(config(corpus, tmp_path / "plain", steps=8, model=dropless), 2, cache)
    run(config(corpus, tmp_path / "slots", steps=8, model=dropless, kernels="comet", balance="pro-prophet",
               balance_model="nominal", balance_rounds=2), 2, cache)
    plain, balanced = losses(tmp_path / "plain"), losses(tmp_path / "slots")
    assert sorted(balanced) == list(range(1, 9))
    assert all(abs(plain[s] - balanced[s]) <= 1e-4 * abs(plain[s]) for s in plain), (plain, balanced)
    rows = [json.loads(line) for line in (tmp_path / "slots" / "metrics.jsonl").read_text().splitlines()]
    assert any(experts for r in rows if "loss" in r for experts in r["copied_experts"]), "no expert was copied"


def _follow_loads_worker(steps: int) -> list[str]:
    """A balanced model's micro-step as `weft train` graphs it (`follow_loads`), on the CPU: after
    an eager first step every step is taken for a replay of a capture (`_capturing` true), the
    layers at `graph_placement="updated"`, the placement planned after each step for the next.
    The losses and every gradient equal the unbalanced model's, step by step, while experts are
    copied."""
    import torch.distributed as dist

    import weft.moe.layer as layer_module
    from test_balance_equivalence import copies_pay
    from weft.train.step import eager_micro_step, follow_loads

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig.from_dict({**SMALL_MODEL, "capacity_factor": None, "moe_every": 1})
    runs, copied = [], []
    for balance in (None, "pro-prophet"):
        torch.manual_seed(0)
        gpt = GPT(cfg, kernels="comet", balance=balance)
        with torch.no_grad():
            gpt.tok_emb.weight[:, 0] += 3.0  # every token leans on dimension 0 ...
        for moe in gpt.moe_layers():
            with torch.no_grad():
                moe.router.weight[1, 0] += 5.0  # ... which sends it to expert 1 (rank 0's): a hot rank
            if balance:
                moe.graph_placement, moe.balancer.model = "updated", copies_pay(world)
        optimizer = torch.optim.SGD(gpt.parameters(), lr=0.1)
        eager = eager_micro_step(gpt, 1)
        graphed = follow_loads(eager, gpt)
        trace = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            tokens = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=gen)
            losses, _ = (eager if step == 0 else graphed)(tokens[:, :-1], tokens[:, 1:])
            trace.append((float(losses[0]), [p.grad.clone() for p in gpt.parameters()]))
            optimizer.step()
            optimizer.zero_grad()
            if balance:
                copied.append([moe._replica_slots.expert_WR.tolist() for moe in gpt.moe_layers()])
                layer_module._capturing = lambda x: True  # from the second step on: a capture's replays
        runs.append(trace)
    failures = []
    for step, ((plain_loss, plain_grads), (loss, grads)) in enumerate(zip(*runs)):
        if abs(plain_loss - loss) > 1e-5 * abs(plain_loss):
            failures.append(f"rank {rank} step {step}: loss {loss} against {plain_loss}")
        failures += [f"rank {rank} step {step}: gradient {i} differs"
                     for i, (a, b) in enumerate(zip(plain_grads, grads))
                     if float((a - b).norm()) > 1e-4 * float(b.norm()) + 1e-12]
    if not any(e >= 0 for layers in copied for rows in layers for row in rows for e in row):
        failures.append(f"rank {rank}: no expert was copied: {copied}")
    return failures


def test_a_balanced_step_that_follows_the_loads_has_the_plain_losses():
    flat = [f for failures in run_distributed(_follow_loads_worker, 2, args=(6,), timeout=300) for f in failures]
    assert not flat, "\n".join(flat[:15])


def test_a_balanced_checkpoint_resumes_on_another_world_size_with_the_same_losses(corpus, tmp_path):
    """Pro-Prophet's copies live for one call, so a balanced run's checkpoint is a plain one: saved
    by 2 ranks (batch 4 each) that copied experts, it resumes on 4 ranks (batch 2 each: the same
    global batches), balanced and not, and each continues with the uninterrupted 2-rank run's
    losses (the dropless model without aux loss computes the same function however the batch is
    shared out; to float rounding)."""
    model = {**WORLD_INVARIANT["moe"], "moe_every": 1}
    cache = tmp_path / "cache"
    run(config(corpus, tmp_path / "full", steps=12, model=model, batch_size=4, ckpt_interval=6,
               balance="pro-prophet", balance_model="nominal"), 2, cache)
    full = losses(tmp_path / "full")
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert any(experts for r in rows if "loss" in r for experts in r["copied_experts"]), "no expert was copied"
    for balance in ("pro-prophet", "none"):
        out = tmp_path / f"resumed-{balance}"
        shutil.copytree(tmp_path / "full", out)
        shutil.rmtree(out / "checkpoints" / "step_12")
        (out / "metrics.jsonl").write_text("".join(
            line + "\n" for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("step", 0) <= 6))
        run(config(corpus, out, steps=12, model=model, batch_size=2, ckpt_interval=6, resume=True,
                   balance=balance, balance_model="nominal"), 4, cache)
        resumed = losses(out)
        assert [resumed[s] for s in range(7, 13)] == pytest.approx([full[s] for s in range(7, 13)], abs=2e-4), balance


def test_balance_needs_a_dropless_model():
    with pytest.raises(ValueError, match="balances dropless MoE layers; this model's capacity_factor is 1.25"):
        GPT(GPTConfig.from_dict({**SMALL_MODEL, "moe_every": 1}), balance="pro-prophet")


def test_weft_train_refuses_balance_on_a_padded_model(capsys):
    from weft.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--preset", "tiny", "--balance", "pro-prophet", "--steps", "2"])
    assert "train.balance 'pro-prophet' balances dropless MoE layers" in capsys.readouterr().err


@pytest.mark.parametrize("capacity", [1.25, None])
def test_comet_kernels_train_with_the_plain_losses(corpus, tmp_path, capacity):
    """--kernels comet (padded capacity, and dropless with the counts left on the device: Comet's
    exchange over shared-memory files between the two gloo ranks, its kernels' PyTorch references)
    trains with the losses of --kernels auto."""
    cache = tmp_path / "cache"
    model = {**SMALL_MODEL, "capacity_factor": capacity}
    run(config(corpus, tmp_path / "auto", steps=8, log_interval=1, model=model), 2, cache)
    run(config(corpus, tmp_path / "comet", steps=8, log_interval=1, kernels="comet", model=model), 2, cache)
    auto, comet = losses(tmp_path / "auto"), losses(tmp_path / "comet")
    assert sorted(comet) == list(range(1, 9))
    assert all(abs(auto[s] - comet[s]) <= 1e-5 * abs(auto[s]) for s in auto), (auto, comet)


def test_the_gradients_reduced_during_the_backward_train_with_the_same_losses(corpus, tmp_path):
    """--grad-reduce overlap (the replicated gradients summed over the ranks in buckets launched
    during the backward, and with --ep-size 1 the expert gradients over their replicas too)
    trains with the losses and gradient norms of --grad-reduce after, bitwise on 2 ranks, also
    with --grad-accum 2 (the last micro-batch's backward sends the step's sums); the default,
    auto, reduces after the backward on the CPU (it overlaps on GPUs only); one rank sums
    nothing."""
    cache = tmp_path / "cache"
    for ep_size, accum, experts in ((None, 1, "nowhere"), (1, 1, "during the backward"), (None, 2, "nowhere"),
                                    (1, 2, "during the backward")):
        for mode, where in (("overlap", "during the backward"), ("after", "after it")):
            summary = run(config(corpus, tmp_path / f"{mode}{ep_size}{accum}", steps=6 // accum, log_interval=1,
                                 grad_reduce=mode, ep_size=ep_size, grad_accum=accum, batch_size=8 // accum), 2, cache)
            assert summary["replicated_gradients_reduced"] == where
            assert summary["expert_gradients_reduced"] == (experts if mode == "overlap" or ep_size is None else where)
        overlap, after = tmp_path / f"overlap{ep_size}{accum}", tmp_path / f"after{ep_size}{accum}"
        assert sorted(losses(overlap)) == list(range(1, 6 // accum + 1))
        assert losses(overlap) == losses(after) and losses(overlap, "grad_norm") == losses(after, "grad_norm")
    summary = run(config(corpus, tmp_path / "auto", steps=2), 2, cache)  # auto: after, on the CPU
    assert summary["replicated_gradients_reduced"] == "after it"
    summary = run(config(corpus, tmp_path / "one", steps=2, grad_reduce="overlap"), 1, cache)
    assert summary["replicated_gradients_reduced"] == "nowhere" and summary["expert_gradients_reduced"] == "nowhere"


def test_a_balanced_model_sums_its_expert_gradients_after_the_backward(corpus, tmp_path):
    """Pro-Prophet adds its copied experts' gradients into the owners' at the end of the backward,
    after their buckets would have been sent: with the experts replicated (4 ranks, --ep-size 2)
    --grad-reduce overlap sums a balanced model's expert gradients after the backward (the
    replicated ones during it) and trains with the losses of --grad-reduce after (to float32
    rounding: 4 ranks sum in the buckets' order), through the steps that copy experts."""
    model = {**WORLD_INVARIANT["moe"], "moe_every": 1}
    cache = tmp_path / "cache"
    for mode in ("overlap", "after"):
        summary = run(config(corpus, tmp_path / mode, steps=5, model=model, batch_size=4, log_interval=1,
                             balance="pro-prophet", balance_model="nominal", ep_size=2, grad_reduce=mode), 4, cache)
        assert summary["expert_gradients_reduced"] == "after it", summary
    rows = [json.loads(line) for line in (tmp_path / "overlap" / "metrics.jsonl").read_text().splitlines()]
    assert any(experts for r in rows if "loss" in r for experts in r["copied_experts"]), "no expert was copied"
    overlap, after = losses(tmp_path / "overlap"), losses(tmp_path / "after")
    assert sorted(overlap) == list(range(1, 6))
    assert overlap == pytest.approx(after, rel=1e-6, abs=0), (overlap, after)


def test_the_gradient_reduction_overlaps_the_backward_where_it_pays():
    """`--grad-reduce auto` overlaps only on GPUs, where they do not reach each other's memory (a
    slow link: several nodes, P2P off), where the experts have replicas (`--ep-size` below the
    world: their sum too) or where the buckets' slots are the master weights' accumulators (one
    micro-batch a step); `overlap` wherever it can, with several micro-batches per step too; both
    reduce after the backward with tensor parallelism."""
    from weft.train.loop import reduced_after

    cuda, cpu, slow = torch.device("cuda"), torch.device("cpu"), "NCCL_P2P_DISABLE=1: the GPUs do not reach ..."
    auto, overlap = TrainConfig(grad_reduce="auto"), TrainConfig(grad_reduce="overlap")
    assert reduced_after(auto, 1, cuda, slow) is None and reduced_after(overlap, 1, cuda, None) is None
    assert "reach each other's memory" in reduced_after(auto, 1, cuda, None)
    assert reduced_after(auto, 1, cuda, None, expert_replicas=2) is None  # the experts' sum too: overlapped
    assert reduced_after(auto, 1, cuda, None, adopted=True) is None  # the buckets are the accumulators
    assert "CPU" in reduced_after(auto, 1, cpu, None, adopted=True)
    assert "CPU" in reduced_after(auto, 1, cpu, None) and reduced_after(overlap, 1, cpu, None) is None
    assert "CPU" in reduced_after(auto, 1, cpu, None, expert_replicas=2)
    for cfg in (auto, overlap):
        assert "--tp" in reduced_after(cfg, 2, cuda, slow)
        assert reduced_after(TrainConfig(grad_reduce=cfg.grad_reduce, grad_accum=2), 1, cuda, slow) is None
    with pytest.raises(ValueError, match="grad_reduce must be 'auto', 'overlap' or 'after'"):
        TrainConfig(grad_reduce="during").validate()


def test_the_buckets_adopt_the_accumulators_except_under_lancet_with_several_micro_batches():
    """`adopts_accumulators`: with staged weights, one micro-batch or several (not under Lancet,
    whose dW scheduler may send a bucket again); never without staged weights."""
    from weft.train.loop import adopts_accumulators
    from weft.train.optim import MasterPlan, MasterWeights

    staged = MasterWeights(MasterPlan([], [torch.nn.Parameter(torch.ones(3))]), dtype=torch.float32)
    none = MasterWeights(MasterPlan([], []))
    for overlap in ("none", "tutel", "lancet"):
        for accum in (1, 2):
            cfg = TrainConfig(overlap=overlap, grad_accum=accum)
            assert adopts_accumulators(cfg, staged) == (accum == 1 or overlap != "lancet"), (overlap, accum)
            assert not adopts_accumulators(cfg, none) and not adopts_accumulators(cfg, None)


def test_an_unset_learning_rate_falls_with_the_width_past_1024():
    """`default_lr`: 3e-3 up to 1024 wide (the presets weft's runs were tuned at), then with the
    width squared (the wide presets' loss jumped to 10-23 at step 2 with 3e-3); a set lr stays."""
    from weft.train.config import default_lr
    from weft.train.loop import lr_at

    assert default_lr(128) == default_lr(768) == default_lr(1024) == 3e-3
    assert default_lr(2048) == pytest.approx(7.5e-4) and default_lr(4096) == pytest.approx(1.875e-4)
    assert TrainConfig(preset="gpt2-s-moe").peak_lr == 3e-3
    assert TrainConfig(preset="phi35-moe-2l").peak_lr == pytest.approx(1.875e-4)
    assert TrainConfig(preset="tiny", model={"dim": 2048}).peak_lr == pytest.approx(7.5e-4)  # the overrides' width
    wide = TrainConfig(preset="qwen2-moe-2l", warmup_steps=10, steps=20)
    assert lr_at(10, wide) == pytest.approx(7.5e-4) and lr_at(5, wide) == pytest.approx(3.75e-4)
    assert TrainConfig(preset="qwen2-moe-2l", lr=1e-2).peak_lr == 1e-2


@pytest.mark.parametrize("value", [0.0, -1e-3, "fast", True])
def test_a_learning_rate_must_be_a_positive_number(value):
    with pytest.raises(ValueError, match="train.lr must be finite and positive"):
        TrainConfig(lr=value).validate()


def test_a_run_with_ckpt_interval_0_writes_no_checkpoint(corpus, tmp_path):
    """`--ckpt-interval 0` (benchmark runs): no checkpoint, not even the last step's; the metrics
    are all there. A negative interval is refused by name."""
    out = tmp_path / "run"
    run(config(corpus, out, steps=12, ckpt_interval=0), 2, tmp_path / "cache")
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert sorted(losses(out)) == list(range(1, 13))
    with pytest.raises(ValueError, match="ckpt_interval must be an integer >= 0"):
        config(corpus, out, ckpt_interval=-1).validate()
