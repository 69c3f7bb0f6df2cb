"""Buffer state files under faults: a full disk or an unwritable folder is a BufferStateError
naming the path and leaves the file already there as it was; a file cut short is refused
naming it."""

import pytest

from rlkit.buffers import BufferStateError, Place, load_buffer, save_buffer
from tests.buffers.helpers import buffer_with_a_partial, make_buffer
from tests.faults import make_read_only, run_with_file_size_limit


def _saved(path):
    buf = buffer_with_a_partial()
    return save_buffer(buf, path)


def _assert_intact(path):
    fresh = make_buffer(n=2)
    load_buffer(fresh, path)
    (partial,) = fresh.queued(Place.PARTIAL)
    assert partial.samples[0].response_ids == [1, 2, 3]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path):
    path = _saved(tmp_path / "b.json.gz")
    done = run_with_file_size_limit(f"""
        import random
        from rlkit.buffers import BufferStateError, save_buffer
        from tests.buffers.helpers import make_buffer
        buf = make_buffer(n=2, rows=20)
        rng = random.Random(0)
        for g in buf.acquire(10):
            g.samples[0].start_request()
            g.samples[0].append([rng.randrange(50000) for _ in range(2000)], [-0.5] * 2000, 0)
            buf.requeue(g)
        try:
            save_buffer(buf, {str(path)!r})
        except BufferStateError as e:
            print(e)
        else:
            raise SystemExit("saved")
    """, limit=16 * 1024)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"{path}: cannot write the buffer state (File too large)"
    _assert_intact(path)


def test_an_unwritable_folder_names_the_file_and_keeps_the_old_one(tmp_path):
    path = _saved(tmp_path / "b.json.gz")
    make_read_only(tmp_path)
    try:
        with pytest.raises(BufferStateError, match=f"{path}: cannot write the buffer state \\(Permission denied\\)"):
            save_buffer(make_buffer(n=2), path)
    finally:
        tmp_path.chmod(0o755)
    _assert_intact(path)


def test_a_file_cut_short_is_refused_naming_it(tmp_path):
    path = _saved(tmp_path / "b.json.gz")
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(BufferStateError, match=f"{path}: corrupt or not a buffer state file"):
        load_buffer(make_buffer(n=2), path)
