"""What this machine is (GPUs, memory) and what fits on it."""
