"""vLLM integration: the `exl3` quantization method."""


def register() -> None:
    """Entry point `vllm.general_plugins` → exl3. Idempotent and cheap (runs in every vLLM process)."""
