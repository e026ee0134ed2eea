"""The inotify tree watcher (tests/fs_watch.py) replays every change under a tree and keeps its peak."""

import time

from tests.fs_watch import TreeWatcher


def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"the watcher never saw {what}"
        time.sleep(0.001)


def test_the_watcher_keeps_the_peak_of_the_tree_across_creates_renames_and_deletes(tmp_path):
    root = tmp_path / "window"
    watcher = TreeWatcher(root)  # the root does not exist yet: its parent is watched until it appears
    watcher.start()
    root.mkdir()
    (root / "e0001-a").mkdir()
    (root / "e0001-b").mkdir()
    (root / "e0001-a" / "part-0").write_bytes(b"x" * 20_000)
    (root / "e0001-b" / ".part-0.tmp").write_bytes(b"y" * 10_000)
    (root / "e0001-b" / ".part-0.tmp").rename(root / "e0001-b" / "part-0")
    _until(lambda: sum(watcher.sizes.values()) == 30_000, "both shards' files")
    (root / "e0001-a" / "part-0").unlink()
    (root / "e0001-a").rmdir()
    (root / "e0001-c").mkdir()
    (root / "e0001-c" / "part-0").write_bytes(b"z" * 5_000)
    watcher.finish()
    assert not watcher.overflowed
    assert watcher.peak_bytes == 30_000 and watcher.peak_dirs == 2
    assert watcher.names == {"e0001-a", "e0001-b", "e0001-c"}
    assert watcher.sizes == {root / "e0001-b" / "part-0": 10_000, root / "e0001-c" / "part-0": 5_000}
