"""Kernel choice for EXL3 layers: what a layer needs (KernelSpec), who can serve it (CANDIDATES), which
one does (choose_kernel), and which path a call took (KernelPath, for the plugin's trace counters).

The choice runs once per layer (`prepare`), never per call; `linear()` is the convenience wrapper that
prepares and applies in one go (tests, benches, one-off use).

    spec = KernelSpec(size_k, size_n, bits, codebook, torch.float16, has_bias=False)
    kernel = prepare(spec, device)            # raises NoKernelError listing every refusal
    path = kernel.path_for(rows)              # KernelPath for the trace, no side effects
    y = kernel.apply(x, trellis, suh, svh, bias)

Layers that run many times bind their tensors once (kernels/bound.py): `BoundLinear(parts, in_features,
bias)` is a callable x -> y that launches one fused kernel per part for decode batches; `bind_moe` does
the same for one MoE projection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from exl3local import env
from exl3local.errors import NoKernelError
from exl3local.kernel_paths import KernelPath
from exl3local.kernels import reference
from exl3local.kernels.codebook import CODEBOOKS
from exl3local.kernels.hadamard import HADAMARD_BLOCK

BACKENDS = ("triton", "triton_dense", "cpu", "reference")
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KernelSpec:
    """What a layer needs from a kernel: shapes and types only (the checkpoint's tensors decide them)."""

    size_k: int
    size_n: int
    bits: float
    codebook: str
    act_dtype: torch.dtype = torch.float16
    has_bias: bool = False

    def __str__(self) -> str:
        dtype = str(self.act_dtype).removeprefix("torch.")
        bias = "+bias" if self.has_bias else ""
        return f"EXL3 {self.size_k}x{self.size_n} bits={self.bits} {self.codebook} {dtype}{bias}"


@dataclass(frozen=True)
class DeviceInfo:
    """Where a kernel will run: the torch device type, and whether Triton runs in its CPU interpreter."""

    backend: str  # "cuda" | "xpu" | "cpu"
    triton_interpret: bool = False

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceInfo:
        dev = torch.device(device)
        return cls(dev.type, env.TRITON_INTERPRET.get_bool())


def spec_refusal(spec: KernelSpec) -> str | None:
    """Why no EXL3 kernel at all could serve this spec (the format itself forbids it), or None."""
    try:
        reference.check_bits(spec.bits, spec.codebook)
    except ValueError as exc:
        return str(exc)
    if spec.size_k % HADAMARD_BLOCK or spec.size_n % HADAMARD_BLOCK:
        return f"dims must be multiples of {HADAMARD_BLOCK}, got k={spec.size_k}, n={spec.size_n}"
    if spec.act_dtype not in ACT_DTYPES:
        return f"activations must be one of {ACT_DTYPES}, got {spec.act_dtype}"
    return None


class Exl3Kernel(ABC):
    """One backend's EXL3 linear. Subclasses say why they refuse a spec, and serve it once accepted."""

    backend: str  # one of BACKENDS: what `linear(..., backend=...)` forces

    def __init__(self, spec: KernelSpec, device: DeviceInfo) -> None:
        self.spec = spec
        self.device = device

    @classmethod
    @abstractmethod
    def refuse(cls, spec: KernelSpec, device: DeviceInfo) -> str | None:
        """None when this kernel can serve `spec` on `device`, else the reason it cannot."""

    @abstractmethod
    def path_for(self, rows: int) -> KernelPath:
        """The path `apply` takes for `rows` activation rows (pure: the plugin counts it)."""

    @abstractmethod
    def apply(
        self,
        x: torch.Tensor,
        trellis: torch.Tensor,
        suh: torch.Tensor,
        svh: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y = x @ W (+ bias), shape (*x.shape[:-1], size_n), dtype of x."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


class TorchReferenceKernel(Exl3Kernel):
    """kernels/reference.py: bit-exact and portable, decodes the whole weight per call (slow)."""

    backend = "reference"

    @classmethod
    def refuse(cls, spec: KernelSpec, device: DeviceInfo) -> str | None:
        return spec_refusal(spec)

    def path_for(self, rows: int) -> KernelPath:
        return KernelPath.REFERENCE

    def apply(self, x, trellis, suh, svh, bias=None):
        return reference.linear(x, trellis, suh, svh, self.spec.bits, self.spec.codebook, bias)


# Row-count crossover of TritonLinearKernel, measured on the H200 by bench/kernels.py (docs/PERF.md);
# unmeasured on Arc, where the same constant is a first guess.
GEMV_MAX_ROWS = 16  # one 16-row dot tile: triton_fused, one launch per projection
# From 17 rows the dense W_r once per call + vendor matmul (triton_gemm) serves by default: row tiles decoded on
# chip (gemv with a 32/64-row tile at 4 warps) lost to it at every M >= 32 measured (5120x17408: 274 vs 209 µs at
# M=32, 492 vs 207 at 64, 841 vs 208 at 128; docs/perf/h200-v3-bench.log). The tiled path (fused_launch.py: 64-row
# tiles at 8 warps, split-K for occupancy) serves up to EXL3LOCAL_TILED_MAX_ROWS rows when set; off, because its whole
# steps lost or tied at M = 32, 64, 128 on both models (27B M = 64: 72.0 vs 59.8 ms graph; docs/PERF.md).


class TritonLinearKernel(Exl3Kernel):
    """Triton: the fused one-launch GEMV (Ŵ decoded in registers) for few rows, dense reconstruct + vendor
    matmul for more (triton_fused.py / triton_gemm.py)."""

    backend = "triton"

    def __init__(self, spec: KernelSpec, device: DeviceInfo) -> None:
        super().__init__(spec, device)
        # apply()'s tensors bound once per distinct set (a layer passes the same views every call); the
        # launch holds the tensors, so a cached address cannot be reused by another tensor.
        self.bound: dict[tuple, object] = {}
        from exl3local.kernels.fused_launch import tiled_max_rows

        self.max_rows = tiled_max_rows()  # the bound launches' last row count (GEMV_MAX_ROWS: tiled path off)

    @classmethod
    def refuse(cls, spec: KernelSpec, device: DeviceInfo) -> str | None:
        why = spec_refusal(spec)
        if why is not None:
            return why
        if device.backend == "cpu" and not device.triton_interpret:
            return "Triton on CPU tensors runs only in its interpreter (TRITON_INTERPRET=1)"
        if device.backend not in ("cuda", "xpu", "cpu"):
            return f"no Triton backend for device type {device.backend!r}"
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"triton is not importable: {exc}"
        return None

    def path_for(self, rows: int) -> KernelPath:
        return KernelPath.GEMV if rows <= self.max_rows else KernelPath.RECONSTRUCT_GEMM

    def apply(self, x, trellis, suh, svh, bias=None):
        from exl3local.kernels import triton_gemm

        spec = self.spec
        if x.shape[-1] != spec.size_k:
            raise ValueError(f"x has {x.shape[-1]} input features, the layer expects {spec.size_k}")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, spec.size_k)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        path = self.path_for(x2d.shape[0])
        if x2d.shape[0] == 0:
            y = x2d.new_empty(0, spec.size_n)
        elif path is KernelPath.GEMV:
            y = torch.empty(x2d.shape[0], spec.size_n, dtype=x.dtype, device=x.device)
            self.launch_for(trellis, suh, svh, bias).launch(x2d, y, x2d.shape[0])
        else:
            y = triton_gemm.reconstruct_gemm(x2d, trellis, suh, svh, spec.bits, spec.codebook, bias)
        return y.reshape(*lead, spec.size_n)

    def launch_for(self, trellis, suh, svh, bias):
        """The fused launch bound to these tensors (made on first use)."""
        from exl3local.kernels.fused_launch import FusedLaunch

        key = tuple((t.data_ptr(), t.shape, t.dtype) if t is not None else None for t in (trellis, suh, svh, bias))
        launch = self.bound.get(key)
        if launch is None:
            launch = self.bound[key] = FusedLaunch(trellis, suh, svh, self.spec.bits, self.spec.codebook, bias)
        return launch


class TritonReconstructKernel(Exl3Kernel):
    """Triton's dense reconstruct + vendor matmul (triton_gemm) at every row count: the next candidate after
    TritonLinearKernel where its GEMV launches fail the load-time self-test (kernels/selftest.py) but the decode
    and reconstruct kernels pass: W is rebuilt per call, far faster than the reference on a GPU. Not bound as
    fused launches (its backend is not "triton"), and the grouped MoE kernel stays off with it."""

    backend = "triton_dense"

    @classmethod
    def refuse(cls, spec: KernelSpec, device: DeviceInfo) -> str | None:
        return TritonLinearKernel.refuse(spec, device)

    def path_for(self, rows: int) -> KernelPath:
        return KernelPath.RECONSTRUCT_GEMM

    def apply(self, x, trellis, suh, svh, bias=None):
        from exl3local.kernels import triton_gemm

        spec = self.spec
        x2d = x.reshape(-1, spec.size_k)
        if x2d.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], spec.size_n)
        y = triton_gemm.reconstruct_gemm(x2d.contiguous(), trellis, suh, svh, spec.bits, spec.codebook, bias)
        return y.reshape(*x.shape[:-1], spec.size_n)


class CpuLinearKernel(Exl3Kernel):
    """kernels/cpu: the C++ library (AVX-512, AVX2 or portable tier), bound per layer tensor set on first use."""

    backend = "cpu"

    def __init__(self, spec: KernelSpec, device: DeviceInfo) -> None:
        from exl3local.kernels.cpu import ops

        super().__init__(spec, device)
        self.bound: dict[tuple, object] = {}
        self.int8 = ops.int8_active(spec.codebook)  # read once: path_for names what apply runs
        # The GEMM path runs on AMX where the CPU has it and ops.CpuLinear.amx_rows says (bf16 rows; fp32 and fp16
        # rows up to AMX_U_MAX_ROWS), in fp32 otherwise (the library's own GEMM or BLAS: ops.own_gemm_serves).
        self.amx = ops.amx_active(ops.library())
        self.gemv_rows = ops.gemv_max_rows(ops.library())

    @classmethod
    def refuse(cls, spec: KernelSpec, device: DeviceInfo) -> str | None:
        why = spec_refusal(spec)
        if why is not None:
            return why
        if device.backend != "cpu":
            return f"runs on CPU tensors only, not {device.backend!r}"
        from exl3local.kernels.cpu import ops

        return ops.refusal()

    def path_for(self, rows: int) -> KernelPath:
        from exl3local.kernels.cpu import ops

        if rows > self.gemv_rows:
            amx = self.amx and ops.CpuLinear.amx_rows(self.spec.act_dtype, rows)
            return KernelPath.CPU_GEMM_AMX if amx else KernelPath.CPU_GEMM
        return KernelPath.CPU_GEMV_INT8 if ops.int8_serves(self.int8, rows) else KernelPath.CPU_GEMV

    def apply(self, x, trellis, suh, svh, bias=None):
        if x.shape[-1] != self.spec.size_k:
            raise ValueError(f"x has {x.shape[-1]} input features, the layer expects {self.spec.size_k}")
        return self._bind(trellis, suh, svh)(x.reshape(-1, self.spec.size_k), x.dtype, bias).reshape(
            *x.shape[:-1], self.spec.size_n)

    def _bind(self, trellis, suh, svh):
        key = tuple((t.data_ptr(), t.shape) for t in (trellis, suh, svh))
        bound = self.bound.get(key)
        if bound is None:
            from exl3local.kernels.cpu import ops

            # Holds the trellis (the key's address stays its own) and fp32 copies of suh/svh.
            bound = self.bound[key] = ops.CpuLinear(trellis, suh, svh, self.spec.bits, self.spec.codebook,
                                                    int8=self.int8)
        return bound

    @staticmethod
    def bind_layer(parts, in_features: int):
        """A fused layer's parts [(CpuLinearKernel, trellis, suh, svh, out_features)] as one library call per decode
        step (ops.CpuFusedLinear), or None where they cannot share one."""
        from exl3local.kernels.cpu import ops

        return ops.CpuFusedLinear.make([kernel._bind(t, s, v) for kernel, t, s, v, _ in parts],
                                       [out for *_, out in parts], in_features)


# Per device type, best first. On CPU the C++ kernel goes first; without it (no compiler) the reference,
# which beats Triton's interpreter (that exists for correctness tests only: forced by backend=).
CANDIDATES: dict[str, tuple[type[Exl3Kernel], ...]] = {
    "cuda": (TritonLinearKernel, TritonReconstructKernel, TorchReferenceKernel),
    "xpu": (TritonLinearKernel, TritonReconstructKernel, TorchReferenceKernel),
    "cpu": (CpuLinearKernel, TorchReferenceKernel, TritonLinearKernel),
}


def candidates(device: DeviceInfo) -> tuple[type[Exl3Kernel], ...]:
    """Kernels to try for `device`, best first."""
    return CANDIDATES.get(device.backend, (TorchReferenceKernel,))


def choose_kernel(
    spec: KernelSpec,
    device: DeviceInfo,
    disabled: frozenset[str] | set[str] = frozenset(),
    backend: str | None = None,
    verify: torch.device | None = None,
) -> type[Exl3Kernel]:
    """The first candidate for `device` that accepts `spec`; NoKernelError lists every refusal.

    `disabled` holds class names to skip (defaults come from EXL3LOCAL_DISABLED_KERNELS via `prepare`);
    `backend` ("triton" | "triton_dense" | "cpu" | "reference") keeps only that backend's kernels.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    reasons = []
    for kernel in candidates(device):
        if kernel.__name__ in disabled:
            why = "disabled"
        elif backend is not None and kernel.backend != backend:
            why = f"backend {backend!r} requested"
        else:
            why = kernel.refuse(spec, device)
            if why is None and verify is not None:
                # Fail closed: a kernel that does not compile or match the reference on this device is not
                # used; the next candidate serves (kernels/selftest.py, once per kernel, rate and device).
                from exl3local.kernels import selftest

                why = selftest.refusal(kernel, spec.bits, spec.codebook, verify, spec.act_dtype)
        if why is None:
            return kernel
        reasons.append(f"{kernel.__name__}: {why}")
    raise NoKernelError(spec, reasons)


def disabled_kernels() -> frozenset[str]:
    """Kernel class names switched off by EXL3LOCAL_DISABLED_KERNELS (comma-separated)."""
    return frozenset(name.strip() for name in env.DISABLED_KERNELS.get().split(",") if name.strip())


def prepare(
    spec: KernelSpec, device: torch.device | str | DeviceInfo, backend: str | None = None
) -> Exl3Kernel:
    """Choose once per layer and return the kernel instance that serves it. Given a torch device, each candidate
    is self-tested there before it is chosen (kernels/selftest.py; EXL3LOCAL_KERNEL_SELFTEST)."""
    info = device if isinstance(device, DeviceInfo) else DeviceInfo.of(device)
    verify = None if isinstance(device, DeviceInfo) else torch.device(device)
    return choose_kernel(spec, info, disabled_kernels(), backend, verify)(spec, info)


def spec_of(
    x: torch.Tensor, trellis: torch.Tensor, bits: float, codebook: str, bias: torch.Tensor | None = None
) -> KernelSpec:
    """The KernelSpec of a layer given its tensors."""
    return KernelSpec(
        trellis.shape[0] * reference.TILE,
        trellis.shape[1] * reference.TILE,
        bits,
        codebook,
        x.dtype,
        bias is not None,
    )


def linear(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    bits: float,
    codebook: str,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y = x @ W (+ bias) for one EXL3 layer. Chooses the kernel on every call: layers that run more
    than once should `prepare` once and call `kernel.apply`."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    kernel = prepare(spec_of(x, trellis, bits, codebook, bias), x.device, backend)
    return kernel.apply(x, trellis, suh, svh, bias)
