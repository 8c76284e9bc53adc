"""Desktop/systemd integration templates shipped in the wheel."""
