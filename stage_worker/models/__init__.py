"""Model definitions: they compose parallel layers and nothing else."""
