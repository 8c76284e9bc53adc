"""The int8-activation mul1 study (kernels/triton_int8.py), no GPU: its K loop against the served exact kernel's,
compiled locally with the installed Triton (registers and SASS instructions per weight by opcode for sm_90, or the
SPIR-V compile for Intel's XPU backend: whether the int8 dot gets DPAS, which operands go through shared local memory),
and its accuracy on random mul1 layers (relative error of y against fp64 x·W, by slice size, against the fp16 path).

    python3 -P bench/int8_study.py                      # sm_90: served exact 4-bit mul1, then the int8 variants
    python3 -P bench/int8_study.py --aligned            # as a launch specialises: pointers and k, n divisible by 16
    PYTHONPATH=.venv/triton-xpu python3 -P bench/int8_study.py --xpu
    python3 -P bench/int8_study.py --accuracy           # emulation only (torch, CPU)
    python3 -P bench/int8_study.py --time               # on a GPU: the int8 kernel alone vs the served bound linear
    python3 -P bench/int8_study.py --kl DIR ORACLE      # a tiny llama fixture (untarred) + its oracle_logits

The loop counted is the first backward branch (bench/sass_loop.py): the int8 kernel's inner loop over a slice's steps.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import triton
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sass_loop (python -P leaves the script's dir out)
import compile_kernels  # noqa: E402

from exl3local.kernels import triton_int8  # noqa: E402
from exl3local.kernels.triton_decode import rate_constants  # noqa: E402

INT8_ARGS = {"a_ptr": "*i8", "fs_ptr": "*fp32", "w_ptr": "*i32", "z_ptr": "*fp32", "M": "i32", "size_k": "i32",
             "tiles_n": "i32", "slices": "i32", "slices_per_split": "i32", "stride_zs": "i32"}
# (BNT, KT, KW): the default, the other operand order (KW), fewer rows per step, more columns per program
VARIANTS = [(8, 2, triton_int8.KWIDTH), (8, 2, 12 - triton_int8.KWIDTH), (8, 1, triton_int8.KWIDTH),
            (16, 1, triton_int8.KWIDTH)]
ALIGNED_INTS = ("size_k", "tiles_n", "k_steps")


def aligned_source(fn, signature: dict[str, str], constants: dict) -> ASTSource:
    """The kernel as a launch with 16-byte aligned tensors and k, n multiples of 16 specialises it (less the pointers
    the kernel asks not to be specialised on alignment)."""
    unaligned = getattr(fn, "do_not_specialize_on_alignment", [])
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
             if (kind.startswith("*") and name not in unaligned) or name in ALIGNED_INTS}
    return ASTSource(fn, signature, constants, attrs)


def compile_int8(bnt: int, kt: int, kw: int, target, options: dict, aligned: bool):
    rate = rate_constants(4, "mul1")
    constants = dict(KA=rate["KA"], HALF=rate["HALF"], W32=rate["W32"], KT=kt, BNT=bnt,
                     SLICE_STEPS=triton_int8.SLICE // (16 * kt), BM=16, KW=kw)
    signature = dict(INT8_ARGS, **{name: "constexpr" for name in constants})
    source = (aligned_source if aligned else ASTSource)(triton_int8.mul1_int8_kernel, signature, constants)
    return triton.compile(source, target=target, options=dict(num_warps=triton_int8.WARPS, num_stages=1, **options))


def cuda(args) -> None:
    import sass_loop

    if args.aligned:  # sass_loop's own compile of the served kernel, with the launch's divisibility facts
        sass_loop.ASTSource = aligned_source
    served = sass_loop.compile_fused(4, "mul1", {}, {})
    print(f"Triton {triton.__version__}, sm_90, mul1 4 bits, 16 rows, aligned {args.aligned}")
    kt_served = sass_loop.triton_gemv.ring_dot_config(4)[1]
    rows = [("served exact", served, 16 * kt_served * 128 // 128)]
    for bnt, kt, kw in VARIANTS:
        for cap in (int(c) for c in args.maxnreg.split(",")):
            kernel = compile_int8(bnt, kt, kw, compile_kernels.TARGETS["cuda"], {"maxnreg": cap} if cap else {},
                                  args.aligned)
            rows.append((f"int8 BNT {bnt} KT {kt} KW {kw} cap {cap or '-'}", kernel, 16 * kt * 16 * bnt // 128))
    for name, kernel, weights in rows:
        regs, count, ops = sass_loop.loop_mix(kernel.asm["cubin"])
        print(f"{name:31s}: {regs:3d} registers, {count:4d} loop instructions / {weights} weights per thread = "
              f"{count / weights:5.2f} per weight  " + " ".join(f"{op} {n}" for op, n in ops.most_common(30)))


def loop_ir(llir: str) -> collections.Counter:
    """Opcodes of the first loop in LLVM IR (the blocks from a branch's earlier target to the branch): a proxy for
    the K loop's cost before Intel's graphics compiler, which this box cannot run."""
    blocks: list[tuple[str, list[str]]] = []
    for line in llir.split("\n"):
        label = re.match(r"^([\w.]+):", line)
        if label:
            blocks.append((label.group(1), []))
        elif blocks and line.startswith("  "):
            blocks[-1][1].append(line.strip())
    index = {name: i for i, (name, _) in enumerate(blocks)}
    for i, (_, body) in enumerate(blocks):
        targets = [index[t] for t in re.findall(r"label %([\w.]+)", body[-1] if body else "") if t in index]
        if any(t <= i for t in targets):
            ops = collections.Counter()
            for _, lines in blocks[min(targets):i + 1]:
                for text in lines:
                    op = re.sub(r"^%\S+ = ", "", text).split()[0]
                    ops[op + (" addrspace(3)" if op in ("load", "store") and "addrspace(3)" in text else "")] += 1
            return ops
    return collections.Counter()


def xpu(args) -> None:
    import sass_loop

    compile_kernels.BACKEND[0] = "xpu"
    compile_kernels.offline_intel_backend()
    print(f"Triton {triton.__version__} ({triton.__file__}), target {compile_kernels.TARGETS['xpu']}")
    sass_loop.TARGETS = {"cuda": compile_kernels.TARGETS["xpu"]}  # its compile, for Intel's target
    served = sass_loop.compile_fused(4, "mul1", dict(FRAG=0, PF=False), {})  # ring order on XPU (fragment_order)
    ops = loop_ir(served.asm["llir"])
    per_item = 16 * 1 * 128 // (4 * 16)  # KT 1, 128 columns, 4 sub-groups of 16
    print(f"served exact (ring order): {sum(ops.values())} LLVM IR ops in the K loop / {per_item} weights per "
          f"work-item = {sum(ops.values()) / per_item:.2f}  " + " ".join(f"{o} {n}" for o, n in ops.most_common(16)))
    for bnt, kt, kw in VARIANTS:
        kernel = compile_int8(bnt, kt, kw, compile_kernels.TARGETS["xpu"], {}, args.aligned)
        ops = loop_ir(kernel.asm["llir"])
        per_item = 16 * kt * 16 * bnt // (4 * 16)
        print(f"int8 BNT {bnt} KT {kt} KW {kw}: {sum(ops.values())} LLVM IR ops in the K loop / {per_item} weights per "
              f"work-item = {sum(ops.values()) / per_item:.2f}  "
              + " ".join(f"{o} {n}" for o, n in ops.most_common(16)))
        ttgir = kernel.asm["ttgir"]
        dpas = ttgir[ttgir.find("#triton_intel_gpu.dpas<"):].split(">")[0] if "dpas<" in ttgir else "NO DPAS layout"
        staged = [line.split("->")[-1].split("loc(")[0].strip() for line in ttgir.splitlines()
                  if "ttg.local_load" in line]
        print(f"int8 BNT {bnt} KT {kt} KW {kw}: SPIR-V {len(kernel.asm['spv'])} bytes, {dpas}>; "
              f"operands through shared local memory: {staged or 'none'}; "
              f"i8 matrix_mad_k32 (DPAS) mentions in LLVM IR: {kernel.asm['llir'].count('i8_matrix_mad_k32')}")


def accuracy(args) -> None:
    import torch

    from exl3local.kernels import reference
    from exl3local.kernels.hadamard import hadamard_128

    def had(v):  # H128 per block of the last dimension, fp64
        return (v.double().reshape(-1, 128) @ hadamard_128().double()).reshape(v.shape)

    print("relative error of y = H(z)⊙svh against fp64 x·W (8 rows each; int8: exllamav3's numerics, per slice size)")
    slices = (128, 256, 512, 1024)
    for size_k, size_n in ((5120, 1024), (17408, 512)):
        g = torch.Generator().manual_seed(size_k)
        trellis = torch.randint(-32768, 32768, (size_k // 16, size_n // 16, 64), generator=g, dtype=torch.int16)
        suh = (torch.randn(size_k, generator=g) * 0.05).half()
        svh = (torch.randn(size_n, generator=g) * 0.05).half()
        w_hat = reference.decode_trellis(trellis, 4, "mul1")
        for kind in ("gaussian", "outliers"):
            x = torch.randn(8, size_k, generator=g)
            if kind == "outliers":  # 1 % of the channels 30x larger, as LLM activations have
                x[:, torch.randperm(size_k, generator=g)[: size_k // 100]] *= 30
            exact = had(had(x.double() * suh.double()) @ w_hat.double()) * svh.double()
            u = had((x.half() * suh).float()).half()  # the fp16 input transform (spec §5, step order aside)

            def err(z):
                return ((had(z) * svh.double() - exact).norm(dim=1) / exact.norm(dim=1)).mean().item()

            cells = [f"fp16 path {err(u.double() @ w_hat.double()):.2e}"]
            cells += [f"int8/{s} {err(triton_int8.emulate_z(u, w_hat, s)):.2e}" for s in slices]
            print(f"{size_k}x{size_n} mul1 K4 {kind:8s}: " + "  ".join(cells), flush=True)


def time_kernels(args) -> None:
    """µs (do_bench median, then graph replay) of the int8 kernel alone (its A' and fs made beforehand: a served path
    would fuse the quantization into the input transform and add the output Hadamard) at several split counts, against
    the served exact bound linear (input transform + fused K loop and epilogue) and its input transform alone (what the
    served K loop's time is, less it) on the same layer."""
    import torch
    from kernels_common import bound_linear, make_layer, timed
    from step_timing import DEVICE

    from exl3local.kernels.triton_hadamard import input_transform

    if not torch.cuda.is_available():
        DEVICE[0] = "cpu"  # the interpreter: checks the run, its times mean nothing
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for size_k, size_n in shapes:
        trellis, suh, svh = make_layer(size_k, size_n, 4, "mul1", seed=5)
        bound = bound_linear(trellis, suh, svh, 4, "mul1")
        for rows in (1, 2):
            x = torch.randn(rows, size_k, device=DEVICE[0]).half()
            graph = DEVICE[0] == "cuda"
            cells = [f"served {timed(lambda: bound(x)):7.1f} / {timed(lambda: bound(x), graph=graph):7.1f}",
                     f"its input transform {timed(lambda: input_transform(x, suh)):5.1f} / "
                     f"{timed(lambda: input_transform(x, suh), graph=graph):5.1f}"]
            v, q = triton_int8.quantize(x)
            a_op, fs = triton_int8.activation_operand(v), (q * triton_int8.K_INV).contiguous()
            for splits in (int(s) for s in args.splits.split(",")):
                z = torch.empty(splits, rows, size_n, dtype=torch.float32, device=x.device)

                def run():
                    triton_int8.mul1_int8_partials(a_op, fs, trellis, 4, z)
                cells.append(f"int8 x{splits} {timed(run):7.1f} / {timed(run, graph=graph):7.1f}")
            print(f"{size_k}x{size_n} mul1 K4 M {rows} (µs eager / graph): " + "  ".join(cells), flush=True)


def kl_llama(args) -> None:
    """Teacher-forced logits of a tiny Llama EXL3 fixture in plain torch, every linear through the fp32 reference
    (the baseline), the fp16 input path (u rounded to fp16, exact Ŵ), or int8 activations (exllamav3's numerics on the
    layers its int8 GEMV takes: n % 256 == 0, K <= 6; rows quantized one by one, so a teacher-forced pass is what
    decoding one token at a time computes). Mean KL(fp32 || mode) and KL(exllamav3's logits || mode) per sequence."""
    import json

    import torch
    from safetensors.torch import load_file

    from exl3local.kernels import reference
    from exl3local.kernels.hadamard import hadamard_128

    def had(v):
        return (v.double().reshape(-1, 128) @ hadamard_128().double()).reshape(v.shape)

    config = json.loads((Path(args.kl[0]) / "config.json").read_text())
    t = load_file(Path(args.kl[0]) / "model.safetensors")
    oracle = load_file(args.kl[1])
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    w_hat = {}

    def linear(name, x, mode):
        trellis, suh, svh = (t[f"{name}.{k}"] for k in ("trellis", "suh", "svh"))
        bits = trellis.shape[-1] / 16
        if name not in w_hat:
            w_hat[name] = reference.decode_trellis(trellis, bits, "mul1")
        if mode == "fp32":
            return reference.linear(x.float(), trellis, suh, svh, bits, "mul1")
        u = had((x.half() * suh).float()).half()
        if mode.startswith("int8") and svh.shape[0] % 256 == 0 and bits <= 6:
            z = triton_int8.emulate_z(u, w_hat[name], int(mode.split("/")[1]))
        else:
            z = u.double() @ w_hat[name].double()
        return (had(z) * svh.double()).float()

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * weight.float()

    def rope(x, length):
        inv = config["rope_parameters"]["rope_theta"] ** (-torch.arange(0, dim, 2).double() / dim)
        angle = torch.arange(length).double()[:, None] * inv[None, :]
        cos, sin = torch.cat([angle.cos()] * 2, -1).float(), torch.cat([angle.sin()] * 2, -1).float()
        return x * cos + torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1) * sin

    def forward(ids, mode):
        length = len(ids)
        x = t["model.embed_tokens.weight"][ids].float()
        mask = torch.full((length, length), float("-inf")).triu(1)
        for layer in range(config["num_hidden_layers"]):
            p = f"model.layers.{layer}"
            h = norm(x, t[f"{p}.input_layernorm.weight"])
            q, k, v = (linear(f"{p}.self_attn.{n}_proj", h, mode).reshape(length, -1, dim).transpose(0, 1)
                       for n in "qkv")
            q, k = rope(q, length), rope(k, length)
            k, v = (a.repeat_interleave(heads // kv_heads, 0) for a in (k, v))
            attn = torch.softmax(q @ k.transpose(1, 2) / dim ** 0.5 + mask, -1) @ v
            x = x + linear(f"{p}.self_attn.o_proj", attn.transpose(0, 1).reshape(length, -1), mode)
            h = norm(x, t[f"{p}.post_attention_layernorm.weight"])
            gate = linear(f"{p}.mlp.gate_proj", h, mode)
            x = x + linear(f"{p}.mlp.down_proj", torch.nn.functional.silu(gate) * linear(f"{p}.mlp.up_proj", h, mode),
                           mode)
        return linear("lm_head", norm(x, t["model.norm.weight"]), mode).log_softmax(-1)

    def kl(p_log, q_log):
        return (p_log.exp() * (p_log - q_log)).sum(-1).mean().item()

    for seq in sorted({k.split(".")[0] for k in oracle}):
        ids = oracle[f"{seq}.input_ids"]
        exl3 = oracle[f"{seq}.logits"].float().log_softmax(-1)
        base = forward(ids, "fp32")
        cells = [f"exllamav3 logits: KL(fp32||·) {kl(base, exl3):.2e}"]
        for mode in ("fp16", "int8/128", "int8/256"):  # 768-input layers: slices must divide k
            out = forward(ids, mode)
            cells.append(f"{mode}: KL(fp32||·) {kl(base, out):.2e}, KL(exl3||·) {kl(exl3, out):.2e}")
        print(f"{Path(args.kl[0]).name} {seq}: " + "; ".join(cells), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xpu", action="store_true", help="compile for Intel's XPU backend instead of sm_90")
    parser.add_argument("--aligned", action="store_true", help="pointers and k, n divisible by 16, as a launch")
    parser.add_argument("--maxnreg", default="0", help="register caps for the int8 kernel (0: none), sm_90 only")
    parser.add_argument("--accuracy", action="store_true", help="the emulation's error on random layers instead")
    parser.add_argument("--time", action="store_true", help="time the int8 kernel and the served linear (GPU)")
    parser.add_argument("--shapes", default="5120x17408,17408x5120,5120x5120", help="--time: k x n, comma-separated")
    parser.add_argument("--splits", default="1,2,4,8", help="--time: the int8 kernel's K splits")
    parser.add_argument("--kl", nargs=2, metavar=("MODEL_DIR", "ORACLE"), help="KL on a tiny Llama fixture")
    args = parser.parse_args()
    mode = kl_llama if args.kl else time_kernels if args.time else accuracy if args.accuracy else xpu if args.xpu else cuda
    mode(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
