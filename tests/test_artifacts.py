import pytest

from dschat_lib import artifacts


def test_same_key_hits_changed_key_rebuilds(tmp_path):
    builds = []

    def build(directory):
        builds.append(directory)
        (directory / "weights.txt").write_text(str(len(builds)))

    first = artifacts.cached("sft", {"lr": 1e-3, "data": "abc"}, build, root=tmp_path)
    again = artifacts.cached("sft", {"lr": 1e-3, "data": "abc"}, build, root=tmp_path)
    other = artifacts.cached("sft", {"lr": 1e-3, "data": "abd"}, build, root=tmp_path)
    assert first == again != other
    assert len(builds) == 2
    assert (first / "weights.txt").read_text() == "1" and (other / "weights.txt").read_text() == "2"


def test_interrupted_build_leaves_nothing_trusted(tmp_path):
    def failing(directory):
        (directory / "half.bin").write_text("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        artifacts.cached("rm", {"seed": 1}, failing, root=tmp_path)
    assert list(tmp_path.iterdir()) == []           # no staging dir, no final dir
    calls = []
    path = artifacts.cached("rm", {"seed": 1}, lambda d: calls.append(d), root=tmp_path)
    assert calls and (path / artifacts.COMPLETE_MARKER).exists()


def test_library_fingerprint_is_stable():
    assert artifacts.library_fingerprint() == artifacts.library_fingerprint()
