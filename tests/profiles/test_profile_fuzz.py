"""Malformed profiles always end in a ConfigError, never another exception."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from exl3local import profiles
from exl3local.errors import ConfigError

scalars = st.one_of(st.integers(-(2**64), 2**64), st.floats(allow_nan=True), st.booleans(), st.text(max_size=12),
                    st.lists(st.text(max_size=6), max_size=3))
keys = st.sampled_from([*profiles.SCHEMA[""], *(k for s in profiles.SCHEMA.values() for k in s), "x", "FOO"])


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else repr(v).replace("inf", "inf")
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').encode("unicode_escape").decode() + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["", "match", "model", "vllm", "env", "memory", "extra"]),
                       st.dictionaries(keys, scalars, max_size=4), max_size=5))
def test_structured_garbage_is_a_config_error_or_a_profile(tables):
    text = 'description = "d"\nbackend = "cpu"\n'
    for table, items in tables.items():
        if table:
            text += f"[{table}]\n"
        text += "".join(f'"{k}" = {_toml_value(v)}\n' for k, v in items.items())
    try:
        prof = profiles.parse(text, "fuzz", "fuzz.toml")
    except ConfigError as err:
        assert "fuzz.toml" in str(err)
    else:
        assert prof.backend in ("xpu", "cuda", "cpu")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_a_config_error_or_a_profile(text):
    try:
        profiles.parse(text, "fuzz", "fuzz.toml")
    except ConfigError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=3))
def test_any_override_is_a_config_error_or_applies(overrides):
    try:
        profiles.with_overrides(profiles.load("cpu"), overrides)
    except ConfigError:
        pass
