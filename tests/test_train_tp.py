"""`weft train --tp`: a dense GPT with its blocks split over tensor-parallel groups (weft.tp)
trains with the losses of the unsplit model on one rank (Megatron's schedule and Domino's), its
checkpoints hold the dense tensors (they resume into another TP size with the same losses and
sample in one process), and settings it cannot run are one-line errors."""
from __future__ import annotations

import json

import pytest

from test_train import config as train_config
from test_train import corpus, losses, run  # noqa: F401  (corpus is a fixture)
from weft.train.config import TrainConfig
from weft.train.generate import generate_from_checkpoint

DENSE = {"dim": 32, "n_layer": 2, "n_head": 4, "block_size": 32, "moe_every": 0}


def config(corpus_path, out, **kw) -> TrainConfig:
    return train_config(corpus_path, out, model=dict(DENSE), **kw)


def grad_norms(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


@pytest.fixture(scope="module")
def one_rank(corpus, tmp_path_factory):  # noqa: F811
    """The reference: the same model, data and steps on one rank (tp 1)."""
    out = tmp_path_factory.mktemp("tp1") / "run"
    run(config(corpus, out, steps=12), 1, out.parent / "cache")
    return {**losses(out), "grad_norms": grad_norms(out)}


@pytest.mark.parametrize("world, overlap, p2", [(2, "none", 1), (2, "domino", 1), (2, "domino", 2), (4, "domino", 1),
                                               (2, "domino-copy", 1), (4, "domino-copy", 2)])
def test_tensor_parallel_training_has_the_losses_of_one_rank(corpus, one_rank, tmp_path, world, overlap, p2):  # noqa: F811
    out = tmp_path / "run"
    run(config(corpus, out, steps=12, tp=world, tp_overlap=overlap, domino_p2=p2), world, tmp_path / "cache")
    split = losses(out)
    assert sorted(split) == list(range(1, 13))
    assert [split[s] for s in range(1, 13)] == pytest.approx([one_rank[s] for s in range(1, 13)], abs=2e-4)
    # the global gradient norm counts each slice once (it is what clipping scales by)
    assert grad_norms(out) == pytest.approx(one_rank["grad_norms"], rel=1e-3)


def test_a_checkpoint_moves_between_tp_sizes(corpus, one_rank, tmp_path):  # noqa: F811
    """Saved by 2 TP ranks, resumed by one (and by 2 from a one-rank checkpoint): the same losses
    as the run that never stopped; the dense checkpoint samples in one process."""
    cache = tmp_path / "cache"
    run(config(corpus, tmp_path / "a", steps=6, lr_decay_steps=12, tp=2, tp_overlap="domino"), 2, cache)
    run(config(corpus, tmp_path / "a", steps=12, resume=True), 1, cache)
    run(config(corpus, tmp_path / "b", steps=6, lr_decay_steps=12), 1, cache)
    run(config(corpus, tmp_path / "b", steps=12, resume=True, tp=2), 2, cache)
    for name in ("a", "b"):
        resumed = losses(tmp_path / name)
        assert [resumed[s] for s in range(7, 13)] == pytest.approx([one_rank[s] for s in range(7, 13)], abs=2e-4)
    text = generate_from_checkpoint(tmp_path / "b", "def ", 8, 0.8, 0, "cpu")
    assert text.startswith("def ") and len(text) > 4


def test_tensor_and_data_parallel_together_train(corpus, tmp_path):  # noqa: F811
    """4 ranks as 2 data-parallel groups of 2 TP ranks: the loss falls, and the run ends with a
    sample (one sequence: evaluation and sampling run Megatron's schedule)."""
    out = tmp_path / "run"
    summary = run(config(corpus, out, steps=30, tp=2, tp_overlap="domino", sample_tokens=10), 4, tmp_path / "cache")
    assert summary["sample"].startswith("def ") and len(summary["sample"]) > 4
    loss = losses(out)
    assert sum(loss[s] for s in range(26, 31)) / 5 < sum(loss[s] for s in range(1, 6)) / 5 - 0.5


# An MoE model whose function does not depend on how its tokens are shared out: dropless, no aux or
# z loss (those are means over each rank's share), argmax routing.
MOE = {**DENSE, "moe_every": 2, "num_experts": 4, "capacity_factor": None, "aux_loss_coef": 0.0,
       "routing_temperature": 0.0}


@pytest.fixture(scope="module")
def one_rank_moe(corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("tp1moe") / "run"
    run(train_config(corpus, out, model=dict(MOE), steps=12), 1, out.parent / "cache")
    return losses(out)


@pytest.mark.parametrize("world, overlap, balance", [(2, "domino", "none"), (4, "none", "none"),
                                                     (2, "domino", "pro-prophet"), (2, "domino-copy", "none")])
def test_tensor_parallel_moe_training_has_the_losses_of_one_rank(corpus, one_rank_moe, tmp_path, world,  # noqa: F811
                                                                 overlap, balance):
    """`weft train --tp N` on an MoE model: attention and dense MLP split, experts over the world,
    each TP rank routing its share of the tokens: the losses of the unsplit model on one rank; with
    `--balance pro-prophet` too (the copies change where experts run, not what they compute)."""
    out = tmp_path / "run"
    summary = run(train_config(corpus, out, model=dict(MOE), steps=12, tp=world, tp_overlap=overlap,
                               sample_tokens=5, balance=balance), world, tmp_path / "cache")
    split = losses(out)
    assert [split[s] for s in range(1, 13)] == pytest.approx([one_rank_moe[s] for s in range(1, 13)], abs=2e-4)
    assert summary["sample"].startswith("def ")  # one sequence of odd lengths: every rank routes it all
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loads = [r["expert_load"] for r in rows if "expert_load" in r]
    tokens = 8 * 32 * 2  # batch x block x top-k: every rank's share counted once
    assert all(sum(layer) == tokens for step in loads for layer in step), loads[:2]
    copies = [r["copied_experts"] for r in rows if "copied_experts" in r]
    assert (len(copies) == 12) == (balance == "pro-prophet"), copies


def test_a_tensor_parallel_moe_checkpoint_resumes_on_one_rank(corpus, one_rank_moe, tmp_path):  # noqa: F811
    cache = tmp_path / "cache"
    run(train_config(corpus, tmp_path / "a", model=dict(MOE), steps=6, lr_decay_steps=12, tp=2), 2, cache)
    run(train_config(corpus, tmp_path / "a", model=dict(MOE), steps=12, resume=True), 1, cache)
    resumed = losses(tmp_path / "a")
    assert [resumed[s] for s in range(7, 13)] == pytest.approx([one_rank_moe[s] for s in range(7, 13)], abs=2e-4)


@pytest.mark.parametrize("kw, message", [
    (dict(tp=4, model={"moe_every": 2, "block_size": 15}, batch_size=2), "do not divide evenly"),
    (dict(tp=1, tp_overlap="domino"), "set --tp > 1"),
    (dict(tp=2, tp_overlap="fast"), "train.tp_overlap must be one of none, domino, domino-copy, auto"),
    (dict(tp=0), "train.tp must be a positive integer"),
    (dict(tp=2, overlap="lancet"), "use --tp-overlap domino"),
    (dict(tp=2, tp_overlap="domino", domino_p1=32, batch_size=8), "exceeds the batch size 8"),
    (dict(tp=2, tp_overlap="domino", domino_p2=64), "exceeds the model width 32"),
    (dict(tp=2, domino_p2=0), "train.domino_p2 must be a positive integer"),
])
def test_settings_tensor_parallelism_cannot_run_are_refused(kw, message):
    model = {**DENSE, **kw.pop("model", {})}
    with pytest.raises(ValueError, match=message):
        TrainConfig(model=model, **kw).validate()


def test_domino_copy_is_refused_where_the_ranks_cannot_reach_each_other(corpus, tmp_path):  # noqa: F811
    """--tp-overlap domino-copy on ranks that span nodes (fewer local ranks than the group): one
    line naming why and what to run instead, before any step."""
    from weft.launch import WorkerError
    from weft.testing import run_distributed
    from weft.train.loop import train

    cfg = config(corpus, tmp_path / "run", steps=2, tp=2, tp_overlap="domino-copy")
    with pytest.raises(WorkerError) as failure:
        run_distributed(train, 2, args=(cfg,), timeout=120,
                        env={"WEFT_CACHE": str(tmp_path / "cache"), "LOCAL_WORLD_SIZE": "1"})
    assert failure.value.report == ("--tp-overlap domino-copy copies through the peers' memory, which these ranks "
                                    "cannot reach (the group's 2 ranks span several nodes (1 per node)); use "
                                    "--tp-overlap domino")
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or "loss" not in metrics.read_text()
