"""The exl3local error tree. Only the CLI's top level turns these into exit codes."""

from __future__ import annotations


class Exl3Error(Exception):
    """Base error: str() is the message, `.hint` says what to do next."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConfigError(Exl3Error):
    """A profile, env variable or flag is wrong; the message names key and file."""

    exit_code = 2


class CheckpointError(Exl3Error):
    """A checkpoint is not what it must be; raised before any weight is loaded."""

    exit_code = 3

    def __init__(self, file: str, tensor: str | None, expected: str, found: str, hint: str = "") -> None:
        where = f"{file}: {tensor}" if tensor else file
        super().__init__(f"{where}: expected {expected}, found {found}", hint)
        self.file = file
        self.tensor = tensor
        self.expected = expected
        self.found = found


class HardwareError(Exl3Error):
    """No or unsupported GPU, udev unavailable."""

    exit_code = 4


class BudgetError(Exl3Error):
    """The KV budget does not fit the memory headroom; the message shows the arithmetic."""

    exit_code = 5


class NoKernelError(Exl3Error):
    """No kernel can serve a layer; the message lists every candidate's refusal."""

    exit_code = 6

    def __init__(self, spec: object, reasons: list[str]) -> None:
        lines = "\n".join(f"  - {r}" for r in reasons)
        super().__init__(f"no EXL3 kernel for {spec}:\n{lines}")
        self.spec = spec
        self.reasons = reasons


class EngineError(Exl3Error):
    """The vLLM engine failed; carries its state, exit status and stderr tail."""

    exit_code = 7

    def __init__(self, state: str, exit_status: int | None, tail: str, hint: str = "") -> None:
        super().__init__(f"engine {state} (exit status {exit_status}):\n{tail}", hint)
        self.state = state
        self.exit_status = exit_status
        self.tail = tail


class EngineGaveUp(EngineError):
    """Too many fast failures: the engine is FAILED, the daemon stays up and reports it."""


class DaemonUnavailable(Exl3Error):
    """The daemon's API is not reachable (raised from httpx.ConnectError)."""

    exit_code = 8


class DaemonTooSlow(DaemonUnavailable):
    """Connected, but the daemon did not answer in time."""
