"""The wire conversions every service makes (specinfer_rpc/convert.py): sampling parameters survive the
round trip whatever they hold, and the memoized ones are shared, checked once, and never hold large keys."""

from __future__ import annotations

import pytest

from specinfer.sampling import SamplingParams
from specinfer_rpc import convert
from specinfer_rpc.convert import sampling_from_pb, sampling_to_pb, validated
from specinfer_rpc.v1 import common_pb2

SETTINGS = [SamplingParams(),
            SamplingParams(0.8, 40, 0.9, min_p=0.05, seed=2**64 - 1, mss=True),
            SamplingParams(1.0, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                           logit_bias=((3, -100.0), (17, 2.5)), min_tokens=4, allowed_token_ids=(2, 5, 9)),
            SamplingParams(0.7, allowed_token_ids=tuple(range(0, 300, 2)),  # more tokens than are memoized
                           logit_bias=tuple((t, 1.0) for t in range(100)))]


@pytest.mark.parametrize("s", SETTINGS, ids=range(len(SETTINGS)))
def test_sampling_parameters_survive_the_round_trip(s):
    wire = sampling_to_pb(s).SerializeToString()
    assert sampling_from_pb(common_pb2.SamplingParams.FromString(wire)) == s
    assert validated(s) == s


def test_equal_small_settings_are_converted_once_and_shared_and_large_ones_every_time():
    small, large = SETTINGS[2], SETTINGS[3]
    first = sampling_from_pb(common_pb2.SamplingParams.FromString(sampling_to_pb(small).SerializeToString()))
    again = sampling_from_pb(common_pb2.SamplingParams.FromString(sampling_to_pb(small).SerializeToString()))
    assert first is again
    assert sampling_from_pb(sampling_to_pb(SamplingParams(seed=1))) != sampling_from_pb(sampling_to_pb(SamplingParams(seed=2)))
    held = convert._sampling_of.cache_info().currsize, convert._sampling_pb_of.cache_info().currsize
    assert sampling_from_pb(sampling_to_pb(large)) == large
    # a small setting carrying a field this version does not know (a newer client's, or a hostile one's)
    unknown = sampling_to_pb(small).SerializeToString() + _field(1000, b"x" * 100_000)
    assert sampling_from_pb(common_pb2.SamplingParams.FromString(unknown)) == small
    assert (convert._sampling_of.cache_info().currsize, convert._sampling_pb_of.cache_info().currsize) == held


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, as raw bytes."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@pytest.mark.parametrize("bad,field", [(SamplingParams(top_p=0.0), "top_p"), (SamplingParams(min_tokens=-1), "min_tokens"),
                                       (SamplingParams(allowed_token_ids=(1,), logit_bias=tuple((t, 101.0) for t in range(80))),
                                        "logit_bias")])
def test_invalid_settings_are_refused_every_time_they_come(bad, field):
    for _ in range(2):  # a refusal is not memoized as a pass
        with pytest.raises(ValueError, match=field):
            validated(bad)
