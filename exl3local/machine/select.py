"""The one way to decide where and how a model would run here now: probe the GPUs and choose one
(`find_device`), select the profile for it (--profile > pinned > detected), and check a checkpoint's
fit against both. `up`, `pull`, `list`, `profile` and `doctor` all ask this module, so they cannot
disagree."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from exl3local import env, profiles
from exl3local.errors import BudgetError
from exl3local.model_config import text_config
from exl3local.units import format_gib
from exl3local.machine import budget, hardware, xpu

RUNTIME_SOURCE = "the GPU runtime in the engine's interpreter (torch.accelerator.get_memory_info)"


@dataclass(frozen=True)
class Device:
    gpus: tuple[hardware.GpuInfo, ...]  # every device found, in slot order
    gpu: hardware.GpuInfo  # the one to serve on (or the CPU)
    reason: str
    dmi: str  # the machine model some profiles match on
    # RAM and TTM's page limit of the probed machine (the fixture's, for a fixture tree)
    mem: budget.MemorySnapshot | None = field(default=None, compare=False)
    runtime: xpu.Runtime | None = field(default=None, compare=False)  # None: the engine's runtime was not asked
    cards: tuple[hardware.GpuInfo, ...] = ()  # identical Intel cards one model can span (the chosen one first)

    @property
    def affinity(self) -> list[int] | None:
        """Level Zero indices of the cards to serve on, resolved by PCI id in the engine's runtime; None when
        the runtime was not asked or could not tell."""
        found = [xpu.affinity_index(g, self.gpus, self.runtime) for g in (self.cards or (self.gpu,))]
        return None if any(i is None for i in found) else [i for i in found if i is not None]

    @property
    def device_memory(self) -> budget.DeviceMemory | None:
        """The chosen GPU's memory as the engine's runtime reports it, where it was asked."""
        idx = xpu.affinity_index(self.gpu, self.gpus, self.runtime)
        if idx is None or self.runtime is None:
            return None
        d = next(d for d in self.runtime.devices if d.index == idx)
        if not d.total_bytes:
            return None
        return budget.DeviceMemory(int(d.total_bytes), d.free_bytes, RUNTIME_SOURCE)


@dataclass(frozen=True)
class Selection:
    device: Device
    profile: profiles.Profile
    reason: str  # why this profile, with the overrides applied

    @property
    def gpu(self) -> hardware.GpuInfo:
        return self.device.gpu

    def fit(self, checkpoint: budget.CheckpointLike, mem: budget.MemorySnapshot | None = None,
            profile: profiles.Profile | None = None, transient_bytes: int = 0) -> budget.Budget:
        """The KV budget of `checkpoint` on this device and profile (or the profile as adjusted for this
        model, engine.model_fit); BudgetError when it does not fit. With several identical cards the model
        runs once per card (data parallel) when it fits one, else split over all of them (tensor parallel)."""
        mem = mem or self.device.mem or budget.MemorySnapshot.now()
        prof = profile or self.profile
        n = len(self.device.cards)

        def compute(tp: int, dp: int) -> budget.Budget:
            return budget.compute(self.gpu, mem, checkpoint, prof, transient_bytes=transient_bytes,
                                  device_memory=self.device.device_memory, tensor_parallel=tp, data_parallel=dp)

        try:
            return compute(1, n if n > 1 else 1)
        except BudgetError:
            if n < 2 or not _splits(checkpoint.config, n):
                raise
            return compute(n, 1)


def _splits(config: Mapping, n: int) -> bool:
    """vLLM's tensor parallel splits the attention heads evenly over the cards."""
    heads = text_config(config).get("num_attention_heads")
    return isinstance(heads, int) and heads % n == 0


def _with_runtime(gpu: hardware.GpuInfo, gpus: list[hardware.GpuInfo], runtime: xpu.Runtime) -> hardware.GpuInfo:
    """Fill in what sysfs could not say from the runtime's matching device: VRAM without resizable BAR, and the
    Xe-core count that names a Lunar Lake part."""
    idx = xpu.affinity_index(gpu, gpus, runtime)
    if idx is None:
        return gpu
    d = next(d for d in runtime.devices if d.index == idx)
    changes: dict = {}
    if gpu.memory_bytes is None and not gpu.integrated and d.total_bytes:
        changes.update(memory_bytes=int(d.total_bytes), memory_source=RUNTIME_SOURCE)
    if gpu.device_id == hardware.LNL_ARC and d.xe_cores in hardware.LNL_XE_CORES:
        changes.update(name=hardware.LNL_XE_CORES[d.xe_cores], xe_cores=d.xe_cores)
    return dataclasses.replace(gpu, **changes) if changes else gpu


def find_device(sysfs_root: Path | None = None, python: str | None = None) -> Device:
    """The GPUs and the one to serve on. `sysfs_root` defaults to EXL3LOCAL_SYSFS, the tree the daemon probes.
    With `python` (the engine's interpreter) and an Intel GPU present, the GPU runtime there is asked too."""
    root = Path(sysfs_root or env.SYSFS.get())
    mem = budget.MemorySnapshot.read(root)
    gpus = hardware.probe(root, mem_total_bytes=mem.total_bytes)
    runtime = None
    if python and any(g.vendor == "intel" and g.supported for g in gpus):
        runtime = xpu.query(python)
        gpus = [_with_runtime(g, gpus, runtime) for g in gpus]
    gpu, reason = hardware.choose(gpus, mem.total_bytes)
    cards: tuple[hardware.GpuInfo, ...] = ()
    if gpu.vendor == "intel" and not gpu.integrated:
        twins = [g for g in gpus if g.supported and g.vendor == "intel" and g.device_id == gpu.device_id
                 and g.driver in ("xe", "i915") and not g.integrated]
        if len(twins) > 1:
            cards = (gpu, *(g for g in twins if g != gpu))
            reason += f"; {len(cards)} identical cards ({', '.join(g.slot or '?' for g in cards)})"
    return Device(tuple(gpus), gpu, reason, hardware.dmi_product(root), mem, runtime, cards)


def model_room(gpu: hardware.GpuInfo, mem: budget.MemorySnapshot, profile: profiles.Profile,
               device_memory: budget.DeviceMemory | None = None) -> int | None:
    """Bytes left for weights and KV on this machine under this profile (None: unknown): the budget's room
    minus the engine's overhead, and on an iGPU no more than TTM's page limit allows GPU buffers."""
    try:
        room = budget.room(gpu, mem, profile, device_memory) - int(profile.memory["engine_overhead_bytes"])
    except BudgetError:
        return None
    if gpu.integrated and mem.gpu_pages_limit_bytes is not None:
        room = min(room, mem.gpu_pages_limit_bytes)
    return room


def model_choices(profile: profiles.Profile) -> list[dict]:
    """The profile's default model first, then its [[model.by_memory]] alternatives."""
    m = profile.model
    first = {k: m[k] for k in ("repo", "revision", "served_name", "weight_bytes") if k in m}
    return [first, *(dict(c) for c in m.get("by_memory", ()))]


def by_memory(profile: profiles.Profile, device: Device) -> tuple[profiles.Profile, str | None]:
    """The profile with the first of its models whose weights and the proven KV pin fit this machine as its
    default, and why; unchanged when it names no alternatives or its default fits."""
    if not profile.model.get("by_memory") or "weight_bytes" not in profile.model:
        return profile, None
    mem = device.mem or budget.MemorySnapshot.now()
    room = model_room(device.gpu, mem, profile, device.device_memory)
    if room is None:
        return profile, None
    kv = int(profile.memory.get("kv_start_bytes") or budget.MIN_KV_BYTES)
    choices = model_choices(profile)
    fits = next((c for c in choices if int(c["weight_bytes"]) + kv <= room), None)
    if fits is choices[0]:
        return profile, None
    names = ", ".join(f"{c['repo']}:{c.get('revision', 'main')} ({format_gib(int(c['weight_bytes']))})" for c in choices)
    if fits is None:
        return profile, (f"none of this profile's models fits {format_gib(room)} for weights and KV here: {names}")
    swapped = profiles.with_overrides(profile, {
        "model.repo": json.dumps(fits["repo"]), "model.revision": json.dumps(fits.get("revision", "main")),
        "model.served_name": json.dumps(fits.get("served_name") or fits["repo"].rsplit("/", 1)[-1].lower()),
        "model.weight_bytes": str(int(fits["weight_bytes"])),
    }, source=profile.source)
    return swapped, (f"default model by memory: {fits['repo']}:{fits.get('revision', 'main')}, the first of {names} "
                     f"whose weights + a {format_gib(kv)} KV fit the {format_gib(room)} left here")


def select(profile_id: str | None = None, overrides: Mapping[str, str] | None = None,
           sysfs_root: Path | None = None, *, device: Device | None = None) -> Selection:
    """The device and profile `up` would use now (`device`: one already found)."""
    device = device or find_device(sysfs_root)
    profile, reason = profiles.select(profile_id, overrides or {}, device.gpu, device.dmi)
    if not any(k.startswith("model.") for k in (overrides or {})):
        profile, why = by_memory(profile, device)
        if why:
            reason += f"; {why}"
    return Selection(device, profile, reason)
