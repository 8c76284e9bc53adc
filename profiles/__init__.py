"""Hardware profiles (TOML files beside this module)."""
