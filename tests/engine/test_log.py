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


def test_a_full_disk_drops_and_counts_writes_and_logging_resumes_when_there_is_room(tmp_path):
    (tmp_path / "engine.log").symlink_to("/dev/full")  # every write fails with ENOSPC
    log = EngineLog(tmp_path / "engine.log")
    for _ in range(3):
        log.write(b"x" * 100 + b"\n")  # never raises: the engine's output pipe must keep draining
    log.mark("up: " + "m" * 10_000)
    assert log.errors == 4 and 3 * 101 + 2000 < log.dropped_bytes < 3 * 101 + 2100  # the mark was clipped
    assert "No space left on device" in log.health()["log_last_error"]
    log.close()
    (tmp_path / "engine.log").unlink()  # room again: a fresh daemon's log works
    log = EngineLog(tmp_path / "engine.log", max_bytes=150)
    log.write(b"a" * 100 + b"\n")
    log.write(b"b" * 100 + b"\n")  # rotates
    assert log.errors == 0 and (tmp_path / "engine.log").read_bytes() == b"b" * 100 + b"\n"
    log.close()


def test_a_failed_rotation_is_counted_and_retried(tmp_path):
    log = EngineLog(tmp_path / "engine.log", max_bytes=150, backups=1)
    log.write(b"a" * 100 + b"\n")
    (tmp_path / "engine.log.1").mkdir()  # the rename target is a non-empty directory: rotation fails
    (tmp_path / "engine.log.1" / "x").write_text("keeps it non-empty")
    log.write(b"b" * 100 + b"\n")
    assert log.errors == 1 and "engine.log" in log.last_error
    (tmp_path / "engine.log.1" / "x").unlink()
    (tmp_path / "engine.log.1").rmdir()
    log.write(b"c" * 100 + b"\n")  # next write rotates and lands
    assert log.errors == 1 and (tmp_path / "engine.log").read_bytes() == b"c" * 100 + b"\n"
    assert log.read(tail=1)["offset"] == 101 + 101  # the dropped line takes no offset
    log.close()


def test_reads_from_an_offset_are_bounded_and_follow_on_exactly(tmp_path, monkeypatch):
    """`logs -f` polls with an offset: each answer reads at most READ_MAX_BYTES, in whole lines."""
    import exl3local.engine.log as engine_log

    monkeypatch.setattr(engine_log, "READ_MAX_BYTES", 4096)
    log = EngineLog(tmp_path / "engine.log")
    lines = [f"line {i} ".encode() + b"\xc3\xa9" * (i % 50) + b"\n" for i in range(2000)]
    for line in lines:
        log.write(line)
    got, offset, answers = b"", 0, 0
    while True:
        chunk = log.read(offset=offset)
        assert len(chunk["text"].encode()) <= 4096 and not chunk["rotated"]
        if not chunk["text"]:
            break
        assert chunk["text"].endswith("\n")  # never a character or line cut between two answers
        got += chunk["text"].encode()
        offset, answers = chunk["offset"], answers + 1
    assert got == b"".join(lines) and answers > 10
    assert log.read(tail=3)["text"].encode() == b"".join(lines[-3:])
    monkeypatch.setattr(engine_log, "TAIL_MAX_BYTES", 4096)
    t = log.read(tail=5000)["text"].encode()  # more lines than the bound holds: whole lines up to it
    assert b"".join(lines).endswith(t) and t.startswith(b"line ") and 4096 <= len(t) < len(b"".join(lines))
    log.close()
