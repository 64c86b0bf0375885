"""A kernel build killed midway must not make every later process wait forever on its lock."""

import os
import time

from kvpool.engine.kernels import STALE_LOCK_S, _drop_stale_lock


def test_a_stale_build_lock_is_dropped_and_a_live_one_kept(tmp_path):
    stale, live = tmp_path / "stale", tmp_path / "live"
    stale.write_text("")
    live.write_text("")
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    _drop_stale_lock(stale)
    _drop_stale_lock(live)
    _drop_stale_lock(tmp_path / "absent")
    assert not stale.exists() and live.exists()
