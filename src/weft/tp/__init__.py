"""Tensor parallelism for transformer blocks (attention and dense MLPs split, MoE layers fed a
share of the tokens), and Domino's overlap of its all-reduces (Megatron-LM sec. 3; Domino sec.
3.2-3.4, 4.1-4.2: the row split of the input, the column split of the last weight, the hybrid)."""
from weft.tp.block import SCHEDULES, TokenSplit, TPBlock, TPStack, make_schedule, run_blocks
from weft.tp.collectives import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp
from weft.tp.layers import TPMLP, TPAttention
from weft.tp.schedule import Domino, NoComm, Sequential, Stage
from weft.tp.state import dense_tensor, local_tensor, sharded_entries, sharded_parameters

__all__ = ["SCHEDULES", "Domino", "NoComm", "Sequential", "Stage", "TPAttention", "TPBlock", "TPMLP", "TPStack",
           "TokenSplit", "copy_to_tp", "dense_tensor", "gather_from_tp", "local_tensor", "make_schedule",
           "reduce_from_tp", "run_blocks", "sharded_entries", "sharded_parameters", "split_to_tp"]
