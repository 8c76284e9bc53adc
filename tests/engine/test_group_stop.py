"""Stopping a real process group: SIGTERM first, SIGKILL for what ignores it, zombies ignored."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from exl3local.engine.procgroup import Unkillable, end_group, group_alive

from private_user import pid_alive

STUBBORN = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"


async def test_group_that_ignores_sigterm_is_killed_after_the_timeout():
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    t0 = time.monotonic()
    killed = await end_group(proc.pid, 0.5)
    assert killed and 0.5 <= time.monotonic() - t0 < 5
    proc.wait()
    assert not group_alive(proc.pid)


async def test_polite_group_ends_on_sigterm_without_a_kill():
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    # the leader stays a zombie until wait(): a zombie must not count as alive
    assert await end_group(proc.pid, 5.0) is False
    assert not pid_alive(proc.pid)
    proc.wait()


async def test_a_group_that_outlives_sigkill_is_reported_not_waited_for():
    """A member in uninterruptible sleep (D: a GPU hang) survives SIGKILL; here /proc is made to say
    so for a real group, which really dies."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    t0 = time.monotonic()
    with pytest.raises(Unkillable) as err:
        await end_group(proc.pid, 0.2, kill_wait_s=0.5, states=lambda pgid, among: {pgid: "D"})
    assert 0.7 <= time.monotonic() - t0 < 5
    assert err.value.states == {proc.pid: "D"} and f"pid {proc.pid}, state D" in str(err.value)
    proc.wait()
