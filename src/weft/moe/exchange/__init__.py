"""How routed rows reach their experts: small strategies behind one interface (`Exchange`).

| strategy | when | paper |
|---|---|---|
| `AllToAll` | plain expert parallelism: padded all-to-all (linear or 2DH) or dropless all-to-allv | Tutel 2, app. A |
| `Pipelined` | d > 1: chunks whose all-to-alls overlap the experts | Tutel 3.2 |
| `DataParallelExperts` | r = 0: weights gathered to the rows | Tutel 3.1 |
| `SlicedExperts` | fewer experts than ranks, r > 0 slices | Tutel 3.1, fig. 7 |
| `ReplicatedExperts` | dropless with `balance="pro-prophet"`: heavy experts copied to chosen ranks | Pro-Prophet IV-A |
| `Comet` | `kernels="comet"`, or a tuned "auto" call on GPUs that chose it: fused expert GEMMs | Comet 3 |

`select` picks one per call from a `Setting`; see docs/architecture.md for adding one.
"""
from weft.moe.exchange.all_to_all import AllToAll
from weft.moe.exchange.base import (
    Exchange,
    ExchangeContext,
    ExpertPlacement,
    Grouped,
    GroupedOnDevice,
    Layout,
    Padded,
    Staging,
    gather_counts,
    gather_counts_on_device,
)
from weft.moe.exchange.comet import Comet
from weft.moe.exchange.data_parallel import DataParallelExperts
from weft.moe.exchange.pipelined import Pipelined
from weft.moe.exchange.replicated import ReplicatedExperts, Transfer
from weft.moe.exchange.select import candidates, offers_comet, offers_dedup, select, tuning_key, untuned_setting
from weft.moe.exchange.sliced import SlicedExperts

__all__ = ["AllToAll", "Comet", "DataParallelExperts", "Exchange", "ExchangeContext", "ExpertPlacement", "Grouped",
           "GroupedOnDevice", "Layout", "Padded", "Pipelined", "ReplicatedExperts", "SlicedExperts", "Staging",
           "Transfer", "candidates", "gather_counts", "gather_counts_on_device", "offers_comet", "offers_dedup",
           "select", "tuning_key", "untuned_setting"]
