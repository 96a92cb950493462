"""Communication primitives: differentiable all-to-all (fixed-size and irregular)."""
from weft.comm.all_to_all import all_to_all, all_to_all_counts

__all__ = ["all_to_all", "all_to_all_counts"]
