"""engine.log: rotation by size, and byte offsets that tell `logs -f` what it missed."""

from __future__ import annotations

from exl3local.engine.log import EngineLog


def test_engine_log_rotates_and_offsets_report_it(tmp_path):
    (tmp_path / "engine.log").write_bytes(b"from an earlier daemon\n")
    log = EngineLog(tmp_path / "engine.log", max_bytes=100, backups=2)
    assert log.read(tail=5) == {"text": "from an earlier daemon\n", "offset": 0, "rotated": False}
    log.write(b"a" * 60 + b"\n")
    first = log.read(tail=1)
    assert first["offset"] == 61 and first["text"].startswith("a")
    assert log.read(offset=61) == {"text": "", "offset": 61, "rotated": False}
    log.write(b"b" * 60 + b"\n")  # would pass 100 bytes: rotate first
    assert (tmp_path / "engine.log.1").read_bytes().endswith(b"a\n")
    after = log.read(offset=first["offset"])
    # nothing was lost: the new file starts exactly where the client stopped
    assert not after["rotated"] and after["text"].startswith("b") and after["offset"] == 61 + 61
    assert log.read(offset=10**9)["rotated"]  # an offset from another daemon's life
    for _ in range(5):
        log.write(b"c" * 60 + b"\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.log", "engine.log.1", "engine.log.2"]
    behind = log.read(offset=after["offset"])  # lines went to files the client never read
    assert behind["rotated"] and behind["text"].startswith("c")
    log.close()
