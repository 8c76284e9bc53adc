"""EXL3 on the CPU: a C++ library (exl3_cpu.cpp, one build per ISA tier) called through ctypes.

ops.CpuLinear is one bound projection; build.py compiles the library (scripts/setup, or on first use).
"""
