"""GPU kernels, each with a plain-PyTorch fallback that is its test oracle."""
