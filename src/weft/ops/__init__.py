"""Primitive ops the layers are built from: linear layers and matmuls whose weight gradient can be
deferred to a scheduler (Lancet sec. 4; the scheduler itself is `weft.ops.wgrad.WGradScheduler`)."""
