"""Hot-path kernels: Triton on GPU, each with a torch reference that is also the CPU path."""
