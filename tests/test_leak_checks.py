"""The leak checks count only what is the test's own, and can fail.

Other programs on the machine (a second test run, anything using
multiprocessing) create and remove /dev/shm entries while a test runs; the
checks must not count those, and must still see an entry that weightsync or
the test's own processes leave behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from harness import shm_entries


def _make(name: str) -> str:
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    return path


def test_another_programs_orphaned_entry_is_not_counted() -> None:
    # A multiprocessing semaphore of another program, named but mapped by
    # no one (it waits for its own resource tracker to remove it).
    before = shm_entries()
    path = _make(f"sem.mp-{uuid.uuid4().hex[:8]}")
    try:
        assert shm_entries() <= before
    finally:
        os.unlink(path)


def test_an_entry_with_weightsyncs_name_is_counted() -> None:
    before = shm_entries()
    name = f"weightsync-{uuid.uuid4().hex[:8]}"
    path = _make(name)
    try:
        assert name in shm_entries() - before
    finally:
        os.unlink(path)
    assert shm_entries() <= before


def test_an_entry_a_child_process_holds_is_counted() -> None:
    name = f"sem.mp-{uuid.uuid4().hex[:8]}"
    path = _make(name)
    before = shm_entries()
    assert name not in before
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys; f = open({path!r}, 'rb'); sys.stdin.read()"],
        stdin=subprocess.PIPE,
    )
    try:
        # The child has the file open once it is running; wait for that.
        for _ in range(200):
            if name in shm_entries():
                break
            child.poll()
            assert child.returncode is None
            time.sleep(0.02)
        assert name in shm_entries() - before
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        os.unlink(path)
    assert name not in shm_entries()
