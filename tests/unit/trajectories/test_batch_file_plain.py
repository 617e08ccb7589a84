"""A mining worker's batch file is plain data: a pickle planted in its place is never run."""

from __future__ import annotations

import pickle

import pytest

from marft_lg.trajectories.range_worker import _load_batch


class Payload:
    """Unpickling this writes a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_a_planted_pickle_batch_is_refused_not_run(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "rows-0.bin"
    path.write_bytes(pickle.dumps((None, [{"episode_id": "e"}], Payload(str(marker)))))
    with path.open("rb") as fh, pytest.raises((ValueError, EOFError, TypeError)):
        _load_batch(fh)
    assert not marker.exists()
