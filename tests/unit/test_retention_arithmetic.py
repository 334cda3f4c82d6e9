"""``retention.Retention`` on plain objects: which B boundaries vLLM keeps.

``tests/test_retention.py`` holds these predictions against what the real
scheduler publishes; here their arithmetic, and that the four questions it
answers (keeps, first kept after, kept in, count between) agree.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_mamba_align.retention import Retention

B = 1632
P = 16764


def request(junction: int = 0) -> SimpleNamespace:
    return SimpleNamespace(num_prompt_tokens=P, shared_prefix_boundary=junction)


CASES = {
    "dense": Retention(None, B, 16, "test"),
    "zero": Retention(0, B, 16, "test"),
    "segments": Retention(4 * B, B, 16, "test"),
    "one block per segment": Retention(B, B, 16, "test"),
}


def test_dense_and_zero() -> None:
    assert CASES["dense"].dense and CASES["one block per segment"].dense
    assert not CASES["zero"].dense and not CASES["segments"].dense
    # Retention 0 keeps the replay boundary (P - 1 floored to B) and a junction.
    assert CASES["zero"].reachable(request()) == (16320,)
    assert CASES["zero"].reachable(request(junction=9000)) == (8160, 16320)
    assert CASES["segments"].keeps(request(), 4 * B)
    assert not CASES["segments"].keeps(request(), 5 * B)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("junction", [0, 9000])
def test_the_four_questions_agree(name: str, junction: int) -> None:
    retention = CASES[name]
    r = request(junction)
    kept = [b for b in range(B, P, B) if retention.keeps(r, b)]
    assert retention.kept_in(r, 0, P) == kept
    for low in (0, 1, B, 5000, 3 * B):
        for high in (low + 1, low + B, low + 5 * B + 7, P):
            inside = [b for b in kept if low < b < high]
            assert retention.count_kept_between(r, low, high) == len(inside)
            assert retention.kept_in(r, low, high) == [
                b for b in kept if low < b <= high
            ]
        after = [b for b in kept if b > low]
        first = retention.first_kept_after(r, low)
        if retention.dense:
            assert first == (low // B + 1) * B
        elif after:
            assert first == after[0]


def test_a_boundary_kept_only_as_replay() -> None:
    """lean leaves a replay boundary to vLLM's prompt checkpoint only where
    nothing else keeps it: not a junction (a sibling resumes there), not a
    multiple of the retention interval, not under dense retention."""
    zero, segments = CASES["zero"], CASES["segments"]
    replay = 16320  # P - 1 floored to B
    assert zero.kept_only_as_replay(request(), replay)
    assert zero.kept_only_as_replay(request(junction=9000), replay)
    assert not zero.kept_only_as_replay(request(junction=9000), 8160)
    assert not zero.kept_only_as_replay(request(junction=16400), replay)
    assert not zero.kept_only_as_replay(request(), 8160)  # not kept at all
    assert not CASES["dense"].kept_only_as_replay(request(), replay)
    # 16320 = 10 B: a multiple of 5 B is kept by the interval too
    assert not Retention(5 * B, B, 16, "test").kept_only_as_replay(request(), replay)
    assert segments.kept_only_as_replay(request(), replay)  # 10 B is no multiple of 4 B
    eagle = Retention(0, B, 16, "test", eagle_junction=True)
    assert not eagle.kept_only_as_replay(request(junction=replay + B + 5), replay)
