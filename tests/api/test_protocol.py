"""The API vocabulary: `up` requests checked on the daemon's side, the GPU's wire shape."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from exl3local.api.protocol import GpuStatus, UpRequest
from exl3local.errors import ConfigError
from exl3local.machine import hardware


@pytest.mark.parametrize("body", [[], {"port": 0}, {"port": "80"}, {"port": True}, {"set": {"a.b": 1}}, {"model": 3},
                                  {"demo": "no"}, {"demo": 1}, {"demo": None}, {"modle": "x"}, {"model": ""},
                                  {"model": "a\x00b"}, {"model": "m" * 256}, {"model": "/" + "d/" * 2100},
                                  {"profile": "p" * 256}, {"set": {"vllm.x": "v" * 5000}}])
def test_bad_up_requests_are_config_errors(body):
    with pytest.raises(ConfigError) as err:
        UpRequest.from_json(body)
    assert len(err.value.message) < 200  # never echoes the input whole


def test_names_at_the_limits_are_accepted():
    assert UpRequest.from_json({"model": "/models/" + "m" * 255, "demo": True}).demo is True


def test_an_up_request_survives_the_wire():
    req = UpRequest(model="org/m:4.0bpw", profile="cpu", port=8000, overrides={"vllm.max_num_seqs": "2"}, demo=False)
    assert UpRequest.from_json(req.to_json()) == req
    assert UpRequest.from_json(UpRequest().to_json()) == UpRequest()


def test_the_gpu_on_the_wire_is_the_probed_device_minus_the_probe_details():
    gpu = hardware.GpuInfo(vendor="intel", name="Arc Pro B70", kind="discrete", supported=True, slot="0000:03:00.0",
                           pci_id="8086:e223", device_id=0xE223, codename="BMG-G31", xe_gen="Xe2-HPG", driver="xe",
                           render_node="/dev/dri/renderD128", memory_bytes=32 * 2**30, memory_source="xe")
    wire = asdict(GpuStatus.of(gpu))
    assert wire == {"name": "Arc Pro B70", "vendor": "intel", "kind": "discrete", "pci_id": "8086:e223",
                    "slot": "0000:03:00.0", "driver": "xe", "render_node": "/dev/dri/renderD128",
                    "xe_gen": "Xe2-HPG", "memory_bytes": 32 * 2**30}
    assert GpuStatus.from_json(wire) == GpuStatus.of(gpu)
