"""vLLM integration: the `exl3` quantization method."""


def register() -> None:
    """Entry point `vllm.general_plugins` → exl3. Idempotent and cheap (runs in every vLLM process).

    Importing the config module registers `exl3` with vLLM (the decorator on Exl3Config); Python's
    module cache makes a second call a no-op, so the name is never appended twice to the platform's
    list of supported methods.
    """
    import exl3local.plugin.config  # noqa: F401
