"""The machine's compute lock (kafila/session/ring/cores.py): one stage computes at a time among the
members of one machine; members alone on theirs take nothing."""

import subprocess
import sys
import threading
import time

from kafila.session.ring.cores import CoreLock, NoLock, core_lock


def test_a_member_alone_on_its_machine_takes_no_lock(monkeypatch):
    monkeypatch.delenv("KAFILA_CORE_LOCK", raising=False)
    assert isinstance(core_lock("m1", {"m1": "a", "m2": "b", "m3": "c"}), NoLock)
    assert isinstance(core_lock("m1", None), NoLock)
    shared = core_lock("m1", {"m1": "a", "m2": "a", "m3": "c"})
    assert isinstance(shared, CoreLock)
    shared.close()
    assert isinstance(core_lock("m3", {"m1": "a", "m2": "a", "m3": "c"}), NoLock)


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("KAFILA_CORE_LOCK", "0")
    assert isinstance(core_lock("m1", {"m1": "a", "m2": "a"}), NoLock)


def test_two_members_of_one_machine_compute_one_after_the_other(tmp_path):
    first, second = CoreLock("box", str(tmp_path)), CoreLock("box", str(tmp_path))
    other_machine = CoreLock("other", str(tmp_path))
    order: list[str] = []
    with first:
        t = threading.Thread(target=lambda: (second.__enter__(), order.append("second in"), second.__exit__()))
        t.start()
        with other_machine:  # another machine's lock is free meanwhile
            order.append("other machine in")
        time.sleep(0.3)
        order.append("first out")
    t.join(5)
    assert order == ["other machine in", "first out", "second in"]
    for lock in (first, second, other_machine):
        lock.close()


def test_a_member_that_dies_holding_it_does_not_keep_it(tmp_path):
    code = ("import os, sys; from kafila.session.ring.cores import CoreLock; "
            f"l = CoreLock('box', {str(tmp_path)!r}); l.__enter__(); print('held', flush=True); os._exit(1)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "held" in p.stdout
    lock = CoreLock("box", str(tmp_path))
    done = threading.Event()
    threading.Thread(target=lambda: (lock.__enter__(), done.set()), daemon=True).start()
    assert done.wait(5), "the lock of a process that died was still held"
    lock.__exit__(None, None, None)
    lock.close()


def test_the_wait_for_another_member_is_seen(tmp_path):
    """The stage's hang watchdog reads `waiting` and does not count a wait behind another member."""
    first, second = CoreLock("box", str(tmp_path)), CoreLock("box", str(tmp_path))
    with first:
        t = threading.Thread(target=lambda: (second.__enter__(), second.__exit__()))
        t.start()
        deadline = time.monotonic() + 5
        while not second.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert second.waiting
        time.sleep(0.2)
        assert second.wait_s() >= 0.2
    t.join(5)
    assert not second.waiting and not t.is_alive() and second.wait_s() == 0.0  # released: no step holds it
    first.close()
    second.close()


def test_a_lock_file_that_is_not_this_users_is_not_waited_on(tmp_path):
    """In a shared temporary directory a stranger's file (or a link) at the lock's path would let
    them stall this member's compute: it is not used, and the member computes unlocked."""
    import os

    if os.getuid() == 0:  # (CI runs as root: it can make another user's file)
        theirs = CoreLock("box", str(tmp_path))
        with open(theirs.path, "w"):
            pass
        os.chown(theirs.path, 12345, 12345)
        mine = CoreLock("box", str(tmp_path))
        done = threading.Event()
        with theirs:  # neither takes the stranger's lock, so neither waits for the other
            threading.Thread(target=lambda: (mine.__enter__(), mine.__exit__(), done.set()), daemon=True).start()
            assert done.wait(5), "waited on a lock file that is not this user's"
        theirs.close()
        mine.close()
    link = CoreLock("linked", str(tmp_path))
    os.symlink(str(tmp_path / "elsewhere"), link.path)
    with link:
        pass
    assert not (tmp_path / "elsewhere").exists()
    link.close()
