"""EXL3 math: the bit-exact PyTorch reference decoder and the Triton kernels."""
