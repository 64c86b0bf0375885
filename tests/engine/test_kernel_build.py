"""A kernel build killed midway must not make every later process wait forever on its lock,
and a live build's lock must be waited for, not broken."""

import subprocess
import sys
import threading

from kvpool.engine.kernels import _build_lock, build_dir

HOLDER = """
import sys, time
from pathlib import Path
from kvpool.engine.kernels import _build_lock
path = Path(sys.argv[1])
with _build_lock(path):
    (path / "lock").write_text("")  # torch's own lock, as a live build holds it
    print("holding", flush=True)
    time.sleep(60)
"""


def test_a_live_build_is_waited_for_and_a_killed_ones_lock_removed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        acquired = threading.Event()

        def build() -> None:
            with _build_lock(tmp_path):
                acquired.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not acquired.wait(1.0), "a second builder went ahead of a live build"
        assert (tmp_path / "lock").exists(), "a live build's lock was removed"
        holder.kill()  # the builder dies mid-build, leaving torch's lock file behind
        holder.wait()
        assert acquired.wait(30), "the build lock of a killed builder was never released"
        waiter.join(5)
        assert not (tmp_path / "lock").exists(), "the killed build's lock file would block torch forever"
    finally:
        holder.kill()


def test_each_checkout_builds_in_its_own_directory(tmp_path):
    """torch's build.ninja names the source's path: two checkouts sharing one directory would
    rebuild each other's kernel at every start."""
    a, b = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for src in (a, b):
        src.parent.mkdir()
        src.write_text("int f() { return 1; }\n")
    assert build_dir(a) != build_dir(b)  # same content, same machine: only the path differs
    assert build_dir(a) == build_dir(a)
