"""Hardware profiles: one TOML file per profile in this folder (user copies in
`<config dir>/profiles/` shadow them). A profile names the default model, the vLLM arguments,
the engine environment and the memory policy, and says which machines it matches.

What a profile is and how it is parsed lives in `profile.py`; which one applies in `select.py`.
"""

from exl3local.profiles.profile import (
    DEFAULTS,
    ID_RE,
    SCHEMA,
    Profile,
    parse,
    parse_overrides,
    speculative_config,
    with_overrides,
)
from exl3local.profiles.select import BUNDLED, detect, load, names, read_settings, select

__all__ = [
    "BUNDLED", "DEFAULTS", "ID_RE", "SCHEMA", "Profile", "detect", "load", "names", "parse", "parse_overrides",
    "read_settings", "select", "speculative_config", "with_overrides",
]
