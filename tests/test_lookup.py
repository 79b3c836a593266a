"""Context lookup drafts what followed the latest earlier occurrence of the record's longest suffix
(up to MAX_N tokens), whatever way the record arrived; its trees are chains that verification accepts.
Exactness with the verifier: test_greedy.py and test_sampling_exact.py."""

import random

import pytest

from specinfer.lookup import MAX_N, ContextIndex, chain_tree
from specinfer.tree import check_verifiable


def brute_force(record: list[int], depth: int, max_n: int = MAX_N) -> list[int]:
    """The definition, by scanning: longest n first, latest occurrence first, the draft extending
    the record past its end."""
    for n in range(min(max_n, len(record)), 0, -1):
        suffix = record[len(record) - n:]
        for end in range(len(record) - 1, n - 1, -1):  # occurrences ending at end - 1, followed by record[end]
            if record[end - n:end] == suffix:
                ext = list(record)
                for k in range(depth):
                    ext.append(ext[end + k])
                return ext[len(record):]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_draft_is_the_continuation_of_the_latest_longest_match(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])
    record = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    whole, pieces = ContextIndex(), ContextIndex()
    whole.extend(record)
    at = 0
    while at < len(record):  # the same record in random chunks, as steps commit it
        step = rng.randrange(1, 6)
        pieces.extend(record[at:at + step])
        at += step
    for depth in (1, 3, 8):
        assert whole.draft(depth) == pieces.draft(depth) == brute_force(record, depth)


def test_a_loop_goes_on_looping_past_the_end_of_the_record():
    ctx = ContextIndex()
    ctx.extend([5, 6, 7, 5, 6])
    assert ctx.draft(5) == [7, 5, 6, 7, 5]
    ctx.extend([9])
    assert ctx.draft(3) == []  # 9 never occurred before: nothing to draft


def test_longer_matches_win_over_later_shorter_ones():
    ctx = ContextIndex()
    ctx.extend([1, 2, 3, 4, 9, 3, 8, 1, 2, 3])  # [2, 3] last occurred before 4; 3 alone last before 8
    assert ctx.draft(2) == [4, 9]


def test_chains_are_verifiable_and_sampled_ones_are_point_masses():
    assert chain_tree([], groups=False).tokens == []
    greedy = chain_tree([4, 4, 2], groups=False)
    assert greedy.parents == [-1, 0, 1] and not greedy.groups
    sampled = chain_tree([4, 4, 2], groups=True)
    check_verifiable(sampled)
    assert [(g.parent, g.q_ids, g.q_probs, g.children) for g in sampled.groups] == [
        (-1, [4], [1.0], [0]), (0, [4], [1.0], [1]), (1, [2], [1.0], [2])]
