"""Communication primitives: differentiable all-to-all (fixed-size, irregular, 2DH) and all-gather
(also split into start and wait)."""
from weft.comm.all_to_all import all_gather, all_to_all, all_to_all_counts
from weft.comm.async_gather import start_all_gather, wait_all_gather
from weft.comm.two_dim import all_to_all_2dh

__all__ = ["all_gather", "all_to_all", "all_to_all_2dh", "all_to_all_counts", "start_all_gather",
           "wait_all_gather"]
