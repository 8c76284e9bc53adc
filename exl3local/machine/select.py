"""The one way to decide where and how a model would run here now: probe the GPUs and choose one
(`find_device`), select the profile for it (--profile > pinned > detected), and check a checkpoint's
fit against both. `up`, `pull`, `list`, `profile` and `doctor` all ask this module, so they cannot
disagree."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from exl3local import env, profiles
from exl3local.machine import budget, hardware


@dataclass(frozen=True)
class Device:
    gpus: tuple[hardware.GpuInfo, ...]  # every device found, in slot order
    gpu: hardware.GpuInfo  # the one to serve on (or the CPU)
    reason: str
    dmi: str  # the machine model some profiles match on


@dataclass(frozen=True)
class Selection:
    device: Device
    profile: profiles.Profile
    reason: str  # why this profile, with the overrides applied

    @property
    def gpu(self) -> hardware.GpuInfo:
        return self.device.gpu

    def fit(self, checkpoint: budget.CheckpointLike, mem: budget.MemorySnapshot | None = None,
            profile: profiles.Profile | None = None) -> budget.Budget:
        """The KV budget of `checkpoint` on this device and profile (or the profile as adjusted for this
        model, engine.model_fit); BudgetError when it does not fit."""
        return budget.compute(self.gpu, mem or budget.MemorySnapshot.now(), checkpoint, profile or self.profile)


def find_device(sysfs_root: Path | None = None) -> Device:
    """The GPUs and the one to serve on. `sysfs_root` defaults to EXL3LOCAL_SYSFS, the tree the daemon probes."""
    root = Path(sysfs_root or env.SYSFS.get())
    gpus = hardware.probe(root)
    gpu, reason = hardware.choose(gpus)
    return Device(tuple(gpus), gpu, reason, hardware.dmi_product(root))


def select(profile_id: str | None = None, overrides: Mapping[str, str] | None = None,
           sysfs_root: Path | None = None, *, device: Device | None = None) -> Selection:
    """The device and profile `up` would use now (`device`: one already found)."""
    device = device or find_device(sysfs_root)
    profile, reason = profiles.select(profile_id, overrides or {}, device.gpu, device.dmi)
    return Selection(device, profile, reason)
