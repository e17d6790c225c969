"""N-gram prompt lookup: longest suffix match first, most recent occurrence, capped continuation."""

from __future__ import annotations

from tandem.sample.sampler import SamplingState
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.ngram import NgramProposer, ngram_lookup
from tandem.spec_decode.proposer import ProposeRow


def test_longest_ngram_wins_over_shorter_more_recent_match():
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 8, 5, 3, 7, 6, 2, 3]
    # The 2-gram [2, 3] occurs at 1 (then 9, 8, 5); the 1-gram [3] occurs later at 6 (then 7, 6).
    assert ngram_lookup(tokens, 1, 2, 3) == [9, 8, 5]
    assert ngram_lookup(tokens, 1, 1, 3) == [7, 6, 2]


def test_most_recent_occurrence_and_caps():
    tokens = [5, 1, 10, 11, 5, 1, 20, 21, 22, 5, 1]
    assert ngram_lookup(tokens, 2, 3, 2) == [20, 21]  # latest earlier [5, 1] is at 4
    assert ngram_lookup(tokens, 2, 3, 10) == [20, 21, 22, 5, 1]  # runs to the end of the history
    assert ngram_lookup(tokens, 3, 4, 2) == []  # no earlier [22, 5, 1]
    assert ngram_lookup([4], 1, 3, 2) == []  # nothing before the suffix
    assert ngram_lookup([4, 4], 1, 3, 2) == [4]


def test_min_n_is_respected():
    tokens = [1, 2, 3, 4, 9, 4]
    assert ngram_lookup(tokens, 1, 3, 2) == [9, 4]
    assert ngram_lookup(tokens, 2, 3, 2) == []


def test_proposer_rows_and_stats():
    proposer = NgramProposer(1, 3)
    state = SamplingState.create(SamplingParams(temperature=0.0), [7, 8, 9, 7], [8])
    rows = [
        ProposeRow("a", [8], 4, [0], num_drafts=2, state=state),
        ProposeRow("b", [1], 0, [1], num_drafts=0, state=state),  # not proposing (e.g. a prompt chunk)
        ProposeRow("c", [3], 0, [2], num_drafts=2, state=SamplingState.create(SamplingParams(), [1, 2, 3])),
    ]
    a, b, c = proposer.propose(rows)
    assert a is not None and a.token_ids == [9, 7] and a.probs is None  # one-hot q
    assert b is None and c is None
    assert proposer.stats() == {"ngram_lookups": 2, "ngram_hits": 1}
