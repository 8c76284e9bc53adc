"""The reference decoder against exllamav3's own outputs (fixtures/exl3) and the spec's worked examples."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from exl3local.kernels import reference
from exl3local.kernels.codebook import decode_states, lut

ALL_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5)


def _cases(fixtures_dir):
    meta = json.loads((fixtures_dir / "exl3" / "tensors_public.json").read_text())
    tensors = load_file(fixtures_dir / "exl3" / "tensors_public.safetensors")
    for case in meta["cases"]:
        name = case["case"]
        yield case, {key.split(".", 1)[1]: tensors[key] for key in case["keys"]}


@pytest.fixture(scope="module")
def cases(fixtures_dir):
    return list(_cases(fixtures_dir))


def _exact_weight_fp64(t, bits, codebook):
    """W = diag(suh)·Hk·Ŵ·Hn·diag(svh) in fp64, with H built from its definition (not our module)."""
    h = torch.tensor(
        [[(-1) ** bin(i & j).count("1") for j in range(128)] for i in range(128)], dtype=torch.float64
    ) / math.sqrt(128)
    w_inner = reference.decode_trellis(t["trellis"], bits, codebook).double()
    hk = torch.block_diag(*[h] * (w_inner.shape[0] // 128))
    hn = torch.block_diag(*[h] * (w_inner.shape[1] // 128))
    return t["suh"].double()[:, None] * (hk @ w_inner @ hn) * t["svh"].double()[None, :]


def _int8_gemv_eligible(case, rows):
    """exllamav3's default-on int8-activation GEMV for mul1 (spec §5) is ~1% off the fp16 paths."""
    return (
        case["codebook"] == "mul1"
        and rows <= 2
        and case["n"] % 256 == 0
        and case["k"] % 128 == 0
        and math.ceil(case["K"]) <= 6
    )


def test_decode_is_bit_exact_for_every_case(cases):
    assert len(cases) >= 29
    for case, t in cases:
        decoded = reference.decode_trellis(t["trellis"], case["K"], case["codebook"])
        assert decoded.dtype == torch.float16 and decoded.shape == t["w_inner"].shape
        mismatched = (decoded.view(torch.int16) != t["w_inner"].view(torch.int16)).sum().item()
        assert mismatched == 0, f"{case['case']}: {mismatched} weights differ from exllamav3's w_inner"


def test_reconstruct_is_within_exllamav3_spread(cases):
    for case, t in cases:
        w = reference.reconstruct(t["trellis"], t["suh"], t["svh"], case["K"], case["codebook"])
        assert w.dtype == torch.float16
        tolerance = 2e-3 * t["w_recon"].float().abs().max().item()
        err = (w.float() - t["w_recon"].float()).abs().max().item()
        assert err <= tolerance, f"{case['case']}: max |W - w_recon| = {err:.2e} > {tolerance:.2e}"


def test_linear_matches_exllamav3_outputs_per_row_count(cases):
    for case, t in cases:
        x = t["x"].float()
        for rows in (1, 5, 64):
            y = reference.linear(x[:rows], t["trellis"], t["suh"], t["svh"], case["K"], case["codebook"])
            oracle = t[f"y_m{rows}"].double()
            rel = ((y.double() - oracle).norm() / oracle.norm()).item()
            tolerance = 1.5e-2 if _int8_gemv_eligible(case, rows) else 1e-3
            assert rel <= tolerance, f"{case['case']} M={rows}: rel err {rel:.2e} > {tolerance}"


def test_linear_matches_fp64_dense_product_tightly(cases):
    for case, t in cases:
        x = t["x"].float()
        y = reference.linear(x, t["trellis"], t["suh"], t["svh"], case["K"], case["codebook"]).double()
        exact = x.double() @ _exact_weight_fp64(t, case["K"], case["codebook"])
        rel = ((y - exact).norm() / exact.norm()).item()
        assert rel <= 1e-5, f"{case['case']}: rel err vs fp64 {rel:.2e}"


def test_linear_keeps_dtype_leading_dims_and_adds_bias(cases):
    case, t = cases[0]
    bias = torch.linspace(-1, 1, case["n"], dtype=torch.float16)
    x = t["x"][:6].reshape(2, 3, case["k"])
    y = reference.linear(x, t["trellis"], t["suh"], t["svh"], case["K"], case["codebook"], bias=bias)
    plain = reference.linear(x, t["trellis"], t["suh"], t["svh"], case["K"], case["codebook"])
    assert y.dtype == torch.float16 and y.shape == (2, 3, case["n"])
    torch.testing.assert_close((y.float() - plain.float()), bias.float().expand_as(y), atol=2e-3, rtol=0)


# Spec §3.5: state -> fp16 bits, verified there against the fixtures.
CODEBOOK_EXAMPLES = [
    ("3inst", 0x0000, 0x3A25),
    ("3inst", 0x1234, 0xC066),
    ("3inst", 0xFFFF, 0xB110),
    ("mcg", 0x0000, 0x3F60),
    ("mcg", 0x1234, 0x3E0F),
    ("mcg", 0xBEEF, 0xC293),
    ("mul1", 0x0000, 0xC2E8),
    ("mul1", 0x0001, 0x3921),
    ("mul1", 0x1234, 0xB89E),
    ("mul1", 0xBEEF, 0x3124),
]


@pytest.mark.parametrize(("codebook", "state", "fp16_bits"), CODEBOOK_EXAMPLES)
def test_codebook_worked_examples(codebook, state, fp16_bits):
    value = decode_states(torch.tensor([state]), codebook)
    assert value.view(torch.int16).item() & 0xFFFF == fp16_bits


def test_mul1_table_spans_the_documented_range():
    table = lut("mul1").float()
    assert table.min().item() == -3.453125 and table.max().item() == 3.34765625


def _pack_ring(codes, bits):
    """Independent packer (spec §2.2/§2.4): MSB-first codes, logical uint16 words, pairwise swap."""
    widths = [int(bits) + (p & 1) if bits in reference.HALF_BITS else int(bits) for p in range(256)]
    stream = []
    for code, width in zip(codes, widths):
        stream += [(code >> (width - 1 - i)) & 1 for i in range(width)]
    logical = [int("".join(map(str, stream[16 * w : 16 * w + 16])), 2) for w in range(len(stream) // 16)]
    stored = []
    for i in range(0, len(logical), 2):
        stored += [logical[i + 1], logical[i]]
    return torch.tensor([w - 65536 if w >= 32768 else w for w in stored], dtype=torch.int16), widths


def _shift_register_states(codes, widths):
    """Spec §2.1: s_p = ((s_{p-1} << D(p)) | c_p) & 0xFFFF, tail-biting: run the ring twice."""
    state, states = 0, []
    for _ in range(2):
        states = []
        for code, width in zip(codes, widths):
            state = ((state << width) | code) & 0xFFFF
            states.append(state)
    return states


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(ALL_BITS), data=st.data())
def test_states_equal_the_shift_register_definition(bits, data):
    widths_probe = [int(bits) + (p & 1) if bits in reference.HALF_BITS else int(bits) for p in range(256)]
    codes = [data.draw(st.integers(0, (1 << w) - 1)) for w in widths_probe]
    words, widths = _pack_ring(codes, bits)
    assert words.numel() == reference.words_per_tile(bits)
    states = reference.tile_states(words.reshape(1, 1, -1), bits).reshape(-1).tolist()
    assert states == _shift_register_states(codes, widths)


def test_worked_bitstream_example_k4():
    """Spec §2.5: codes c_p = (5p+3) mod 16 give U[0] = 0x38D27C16 and s_0 = 0x49E3 (wrap-around)."""
    words, _ = _pack_ring([(5 * p + 3) % 16 for p in range(256)], 4)
    assert [w & 0xFFFF for w in words[:4].tolist()] == [0x7C16, 0x38D2, 0xF49E, 0xB05A]
    states = reference.tile_states(words.reshape(1, 1, -1), 4).reshape(-1)
    assert [states[0].item(), states[1].item(), states[2].item(), states[255].item()] == [
        0x49E3, 0x9E38, 0xE38D, 0xF49E,
    ]


def test_tile_placement_examples():
    """Spec §4: p=0→(0,0), 1→(1,0), 2→(8,0), 4→(0,8), 7→(9,8), 8→(2,0), 32→(0,1), 255→(15,15)."""
    codes = list(range(256))
    bits = 8
    words, _ = _pack_ring(codes, bits)
    states = reference.tile_states(words.reshape(1, 1, -1), bits).reshape(-1)
    decoded = reference.decode_trellis(words.reshape(1, 1, -1).repeat(8, 8, 1), bits, "mul1")[:16, :16]
    values = decode_states(states, "mul1")
    for p, (row, col) in {0: (0, 0), 1: (1, 0), 2: (8, 0), 4: (0, 8), 7: (9, 8), 8: (2, 0), 32: (0, 1), 255: (15, 15)}.items():
        assert decoded[row, col].view(torch.int16) == values[p].view(torch.int16), f"position {p}"


@pytest.mark.parametrize(
    ("shape", "bits", "codebook", "message"),
    [
        ((8, 8, 64), 4, "nope", "unknown EXL3 codebook"),
        ((8, 8, 64), 9, "mul1", "bits must be one of"),
        ((8, 8, 40), 2.5, "mcg", "only with the mul1"),
        ((8, 8, 48), 4, "mul1", "does not match bits=4"),
        ((8, 64), 4, "mul1", "must be 3-D"),
    ],
)
def test_bad_arguments_are_refused_clearly(shape, bits, codebook, message):
    with pytest.raises(ValueError, match=message):
        reference.decode_trellis(torch.zeros(shape, dtype=torch.int16), bits, codebook)


def test_scale_and_input_shapes_are_checked():
    trellis = torch.zeros(8, 8, 64, dtype=torch.int16)
    ones = torch.ones(128, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"suh must have shape \(128,\)"):
        reference.reconstruct(trellis, torch.ones(64, dtype=torch.float16), ones, 4, "mul1")
    with pytest.raises(ValueError, match="x has 64 input features"):
        reference.linear(torch.ones(1, 64), trellis, ones, ones, 4, "mul1")
    with pytest.raises(ValueError, match="multiples of 128"):
        reference.reconstruct(torch.zeros(4, 8, 64, dtype=torch.int16), ones[:64], ones, 4, "mul1")
    with pytest.raises(ValueError, match="must be int16"):
        reference.decode_trellis(torch.zeros(8, 8, 64, dtype=torch.int32), 4, "mul1")


@pytest.mark.gpu
def test_reference_runs_bit_exact_on_cuda(cases):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for case, t in cases:
        decoded = reference.decode_trellis(t["trellis"].cuda(), case["K"], case["codebook"]).cpu()
        assert torch.equal(decoded.view(torch.int16), t["w_inner"].view(torch.int16)), case["case"]
