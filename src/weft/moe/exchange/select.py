"""Which exchange runs a call: the one place that maps a setting (Tutel's d, all-to-all algorithm,
r) to a strategy, and the settings a tuned ("auto") call may choose from (Tutel 3.3)."""
from __future__ import annotations

import dataclasses

from weft.moe.config import DEDUP_ALGOS, MoECall, parallel_choices
from weft.moe.exchange.all_to_all import AllToAll
from weft.moe.exchange.base import Exchange, ExchangeContext
from weft.moe.exchange.comet import Comet
from weft.moe.exchange.data_parallel import DataParallelExperts
from weft.moe.exchange.pipelined import Pipelined
from weft.moe.exchange.replicated import ReplicatedExperts, Transfer
from weft.moe.exchange.sliced import SlicedExperts
from weft.tune.dictionary import DEGREES, Setting


def select(ctx: ExchangeContext, setting: Setting, dropless: bool, transfer: Transfer | None = None) -> Exchange:
    """The strategy that runs `setting`: r = 0 data-parallel experts; fewer experts than ranks the
    sliced experts; d > 1 (while communicating) the pipelined exchange; a `transfer` copying
    experts in a plain dropless call (Pro-Prophet) the replicated experts; a comet setting with
    peer buffers (the ranks map each other's memory) Comet's fused kernels; else one all-to-all."""
    placement = ctx.placement
    if setting.parallel == 0 and (placement.ep_size > 1 or not dropless):
        return DataParallelExperts(ctx)
    if placement.expert_shards > 1:
        return SlicedExperts(ctx, setting.parallel, setting.overlap_degree, setting.a2a_algo)
    pipelined = setting.overlap_degree > 1 and ctx.communicate and not (dropless and placement.ep_size == 1)
    if pipelined:
        return Pipelined(ctx, setting.overlap_degree, setting.a2a_algo)
    if transfer is not None and transfer.copied and dropless and ctx.communicate and placement.ep_size > 1:
        return ReplicatedExperts(ctx, transfer)
    if setting.comet and ctx.peers is not None and ctx.scheduler is None:
        return Comet(ctx, ctx.peers)
    return AllToAll(ctx, setting.a2a_algo)


def plain_algo(setting: Setting) -> Setting:
    """`setting` for an exchange of dispatched rows: the deduplicating all-to-all's setting runs
    the linear one there (a call that cannot deduplicate: one rank, or not communicating, where
    nothing crosses a rank)."""
    return dataclasses.replace(setting, a2a_algo="linear") if setting.a2a_algo in DEDUP_ALGOS else setting


def untuned_setting(call: MoECall) -> Setting:
    """The setting of a call the tuning dictionary does not decide: "auto" parts at their plain
    values (d = 1, linear), r = 1 unless the call fixed it; `kernels="comet"` makes its plain
    setting Comet's."""
    return _comet_if_asked(call, Setting(1 if call.overlap_degree == "auto" else call.overlap_degree,
                                         "linear" if call.a2a_algo == "auto" else call.a2a_algo,
                                         1 if call.parallel_r is None else call.parallel_r))


def _comet_if_asked(call: MoECall, setting: Setting) -> Setting:
    """`kernels="comet"`: the plain setting (d = 1, linear, r = 1) runs Comet's kernels."""
    plain = (setting.overlap_degree, setting.a2a_algo, setting.parallel) == (1, "linear", 1)
    return Setting(1, "linear", 1, comet=True) if call.kernels == "comet" and plain else setting


def offers_comet(call: MoECall, on_gpu: bool, ep_size: int, expert_shards: int) -> bool:
    """Whether a tuned `kernels="auto"` call times Comet's exchange beside the all-to-all settings
    (the caller checks that the ranks map each other's memory): "auto" means the Triton kernels,
    which is on GPUs; an exchange among several ranks; whole experts per rank. Comet's setting runs
    the same function (outputs, gradients, drops), so the tuner keeps it only where it is faster."""
    return call.kernels == "auto" and on_gpu and call.communicate and ep_size > 1 and expert_shards == 1


def dedup_sends_fewer(call: MoECall, ep_size: int) -> bool:
    """Whether the deduplicating all-to-all can move fewer rows than the linear one. A token must be
    able to pick several experts of one rank (top_k > 1). A padded call with cf > 0 sends El * C
    (about top_k * cf * T / W) rows per destination where dedup sends min(T, El * C): fewer only
    if top_k * cf > W. A no-drop call (cf <= 0) sizes C from the heaviest expert, and a dropless
    one sends exact counts, so both may send fewer."""
    cf = call.capacity_factor
    return call.top_k > 1 and (cf is None or cf <= 0 or call.top_k * cf > ep_size)


def offers_dedup(call: MoECall, token_choice: bool, ep_size: int, expert_shards: int, balanced: bool) -> bool:
    """Whether a tuned call times `a2a_algo="dedup"` (each token sent to a rank once,
    `weft.moe.dedup`) beside the linear all-to-all: `a2a_algo="auto"`, a token-choice gate, several
    ranks, whole experts per rank, no Comet kernels asked for, no Pro-Prophet copies, and fewer rows
    to send (`dedup_sends_fewer`; otherwise it only adds its records and row expansion). It
    computes the same function, so the tuner keeps it only where it measured it faster."""
    return (call.a2a_algo == "auto" and token_choice and call.communicate and ep_size > 1 and expert_shards == 1
            and call.kernels != "comet" and not balanced and call.parallel_r in (None, 1)
            and dedup_sends_fewer(call, ep_size))


def candidates(call: MoECall, parallel: str, ep_size: int, expert_shards: int, num_nodes: int,
               comet: bool = False, dedup: bool = False) -> list[Setting]:
    """The settings a call may run: every degree if `overlap_degree="auto"` (dropless: only with
    E >= W, the sliced dropless exchange has no pipelined form), both all-to-all algorithms if
    `a2a_algo="auto"` and the group spans several nodes (padded modes only), and for
    `parallel="adaptive"` layers whose call did not fix r, r = 0 and every divisor r of W / E (just
    r = 1 when E >= W), each r with every degree and algorithm. The tuner does not time all of
    them: it ternary-searches r over the divisors. A one-rank dropless call has nothing to tune.
    `comet` (see `offers_comet`): Comet's exchange as one more candidate beside the plain setting;
    with `kernels="comet"` the plain setting is Comet's. `dedup` (see `offers_dedup`): the
    deduplicating all-to-all after the linear one of the same degree: d = 1, and (padded) d = 2,
    its own pairs computed while the others' rows travel in."""
    found = [_comet_if_asked(call, s) for s in _exchange_candidates(call, parallel, ep_size, expert_shards, num_nodes)]
    if comet and Setting(1, "linear") in found:
        found.insert(found.index(Setting(1, "linear")) + 1, Setting(1, "linear", 1, comet=True))
    if dedup and Setting(1, "linear") in found:
        found.insert(found.index(Setting(1, "linear")) + 1 + comet, Setting(1, "dedup"))
    if dedup and Setting(2, "linear") in found and not call.dropless:
        found.insert(found.index(Setting(2, "linear")) + 1, Setting(2, "dedup"))
    return found


def _exchange_candidates(call: MoECall, parallel: str, ep_size: int, expert_shards: int,
                         num_nodes: int) -> list[Setting]:
    padded = not call.dropless
    free_r = parallel == "adaptive" and call.parallel_r is None
    if call.parallel_r == 0:
        return [Setting(1, "linear", 0)]
    if not padded and ep_size == 1:  # no exchange: every setting is the same local compute
        return [Setting(1, "linear")]
    if call.overlap_degree == "auto":
        degrees = DEGREES if padded or expert_shards == 1 else (1,)
    else:
        degrees = (call.overlap_degree,)
    several_nodes = padded and num_nodes > 1
    algos = (["linear", "2dh"] if several_nodes else ["linear"]) if call.a2a_algo == "auto" else [call.a2a_algo]
    if expert_shards > 1:  # fewer experts than ranks: every r, each with every d and algorithm
        rs = [r for r in parallel_choices(expert_shards) if r > 0] if free_r else [call.parallel_r]
        found = [Setting(d, a, r) for r in rs for a in algos for d in degrees]
        return found + ([Setting(1, "linear", 0)] if free_r else [])
    # Each pipelined chunk can be exchanged either way, so every degree pairs with every algorithm.
    found = [Setting(d, a) for a in algos for d in degrees]
    if free_r and ep_size > 1:
        found.append(Setting(1, "linear", 0))
    return found


def is_tuned(call: MoECall, parallel: str, ep_size: int) -> bool:
    """Whether the tuning dictionary decides this call's setting (something is "auto" and there is
    an exchange to choose for)."""
    free_r = parallel == "adaptive" and call.parallel_r is None and ep_size > 1
    return call.communicate and ("auto" in (call.overlap_degree, call.a2a_algo) or free_r)


def tuning_key(shape: str, call: MoECall, parallel: str, comet: bool = False, dedup: bool = False) -> str:
    """Everything but the capacity that changes which setting is fastest, or which are candidates:
    the layer's `shape` (experts, k, sizes, activation, W, dtype), the call's fixed parts, and
    whether Comet's exchange is among them (`comet`, or `kernels="comet"`) and the deduplicating
    all-to-all (`dedup`)."""
    key = shape + ("-comet" if comet or call.kernels == "comet" else "") + ("-dedup" if dedup else "")
    # Layers (or calls) with other candidate sets must not share a choice: a fixed degree or
    # algorithm must not run another one, and only "adaptive" layers may run r = 0.
    if call.overlap_degree != "auto":
        key += f"-d{call.overlap_degree}"
    if call.a2a_algo != "auto":
        key += f"-{call.a2a_algo}"
    if parallel == "adaptive":
        key += "-adaptive"
    if call.dropless:  # capacity_factor can change per call: keep padded and dropless apart
        key += "-dropless"
    if call.parallel_r is not None:  # a call that fixed r must not run (or search) another r
        key += f"-r{call.parallel_r}"
    return key
