"""exl3local: serve EXL3-quantized LLMs locally through vLLM (Intel Arc first)."""

__version__ = "0.1.0"
