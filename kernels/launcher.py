"""Bound launches' plumbing (kernels/bound.py uses it): launching a compiled Triton kernel without Triton's
argument binding, and the per-stream scratch every bound projection shares.

Launching (DirectLaunch): the first call per argument signature (dtypes, pointer alignment, the ints the
kernel specialises on) goes through Triton's JIT, which compiles and returns the compiled kernel; later
calls hand its launcher the argument list directly, pointers as ints. Ints that change per call are marked
do_not_specialize in the kernels. Under TRITON_INTERPRET=1 (or with Triton's launch hooks set, e.g. by a
profiler) every call goes through Triton's own launch path.

Scratch: the input transform's output u, the split-K partials and the per-block counters live in one
workspace per (device, stream), shared by every bound projection on that stream (calls on one stream run
in order). Counters start at zero and each launch's last program resets its own. A workspace that is
outgrown is kept allocated, not freed: a CUDA graph captured earlier may still point at it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import triton

from exl3local.kernels import selftest


def launch_mode(kernel, device: torch.device) -> tuple[bool, Callable[[], int]]:
    """How bound launches of `kernel` run on `device`: (plain, stream). plain: through Triton's own launch, under the
    interpreter (TRITON_INTERPRET=1, or CPU tensors) or where the #20 self-check refuses the direct launch (a
    Triton/backend it was not tested with, or a failed bound_direct check: kernels/selftest.py). stream: the getter
    of the stream to launch on (0 under the interpreter)."""
    interpret = not isinstance(kernel, triton.runtime.JITFunction) or device.type == "cpu"
    plain = interpret or selftest.direct_launch_refusal(device) is not None
    if interpret:
        return plain, lambda: 0
    get = triton.runtime.driver.active.get_current_stream
    index = device.index if device.index is not None else torch.cuda.current_device()
    return plain, lambda: get(index)


class Workspace:
    """u (fp16), split-K partials (fp32) and block counters (int32, zeroed) for one (device, stream)."""

    _live: dict[tuple[torch.device, int], Workspace] = {}
    _retired: list[Workspace] = []  # outgrown, kept allocated for graphs captured against them

    def __init__(self, device: torch.device, inputs: int, partials: int, counters: int) -> None:
        self.inputs = torch.empty(max(inputs, 1), dtype=torch.float16, device=device)
        self.partials = torch.empty(max(partials, 1), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(counters, 1), dtype=torch.int32, device=device)
        self.inputs_ptr, self.partials_ptr = self.inputs.data_ptr(), self.partials.data_ptr()
        self.counters_ptr = self.counters.data_ptr()
        self.sizes = (self.inputs.numel(), self.partials.numel(), self.counters.numel())

    def holds(self, inputs: int, partials: int, counters: int) -> bool:
        return self.sizes[0] >= inputs and self.sizes[1] >= partials and self.sizes[2] >= counters

    @classmethod
    def get(cls, device: torch.device, stream: int, inputs: int, partials: int, counters: int) -> Workspace:
        ws = cls._live.get((device, stream))
        if ws is not None and ws.holds(inputs, partials, counters):
            return ws
        if ws is not None:
            cls._retired.append(ws)
            inputs = max(inputs, ws.inputs.numel())
            partials = max(partials, ws.partials.numel())
            counters = max(counters, ws.counters.numel())
        ws = cls._live[(device, stream)] = Workspace(device, inputs, partials, counters)
        return ws


def hooked(hook) -> bool:
    """Whether a Triton launch hook is set: None or an empty HookChain (Triton >= 3.6) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectLaunch:
    """One Triton kernel launched with its compiled launcher once compiled (see the module doc)."""

    def __init__(self, fn, varying: tuple[str, ...], interpret: bool, **options) -> None:
        self.fn = fn
        self.names = tuple(inspect.signature(fn.fn).parameters)
        self.varying = varying
        self.slots = [self.names.index(name) for name in varying]
        self.options = options
        self.compiled: dict[tuple, tuple] = {}
        # Triton's launch hooks (profilers) run only through its own path; a Triton without `knobs` always takes
        # it (nothing is ever put in `compiled`), and so does the interpreter.
        self.hooks = None if interpret else getattr(getattr(triton, "knobs", None), "runtime", None)

    def __call__(self, grid: tuple[int, int, int], stream: int, key: tuple, fixed: dict, tensors: tuple,
                 values: tuple) -> None:
        """Launch with `fixed` (the same for every call with this key) and the per-call arguments named by
        `varying`: as tensors and ints (`tensors`, for Triton's path) and as addresses and ints (`values`)."""
        entry = self.compiled.get(key)
        hooks = self.hooks
        if entry is None or hooked(hooks.launch_enter_hook) or hooked(hooks.launch_exit_hook):
            args = dict(fixed, **dict(zip(self.varying, tensors)))
            kernel = self.fn[grid](**args, **self.options)
            if hooks is not None and hasattr(kernel, "packed_metadata") and \
                    len(getattr(kernel.src, "signature", ())) == len(self.names):
                template = [args[name] for name in self.names]
                template = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in template]
                self.compiled[key] = (kernel, template)
            return
        kernel, template = entry
        args = template.copy()
        for slot, value in zip(self.slots, values):
            args[slot] = value
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
