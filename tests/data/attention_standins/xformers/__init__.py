"""Stand-in for xformers (the real kernels need CUDA)."""
