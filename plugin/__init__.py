"""vLLM integration: the `exl3` quantization method."""


def register() -> None:
    """Entry point `vllm.general_plugins` → exl3. Idempotent and cheap (runs in every vLLM process).

    Importing the config module registers `exl3` with vLLM (the decorator on Exl3Config); Python's
    module cache makes a second call a no-op, so the name is never appended twice to the platform's
    list of supported methods.
    """
    import exl3local.plugin.config  # noqa: F401

    # -- kernel self-test hook (issue 20 item 5): the dispatch self-tests each kernel before a layer gets it
    # (kernels/selftest.py); its verdicts go to this process's kernel-path counters, where status, doctor and
    # the dashboard read which path is off and why. Setting the publisher again replaces it (idempotent).
    from exl3local.kernels import selftest

    selftest.set_publisher(publish_selftest)

    # -- the CPU kernel's heap trim (issue 22): it needs the end of each model forward, and vLLM's ForwardContext
    # lives exactly as long as one (kernels/cpu/heap.py).
    from exl3local.kernels.cpu import heap

    heap.set_forward_scope(current_forward)


def publish_selftest(results: list, refused: dict[str, str]) -> None:
    """Self-test results and the paths they took out of service → this process's trace flags."""
    from exl3local.plugin import trace

    trace.set_flag("selftest", [r.to_json() for r in results])
    if refused:
        latched = dict(trace.counters().snapshot()["flags"].get("latched_off") or {})
        trace.set_flag("latched_off", {**latched, **refused})
    trace.counters().flush()  # now: a load that fails later still leaves the verdicts readable


def current_forward():
    """vLLM's context of the model forward running now, or None outside one."""
    from vllm import forward_context

    return forward_context.get_forward_context() if forward_context.is_forward_context_available() else None
