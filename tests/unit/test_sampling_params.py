"""SamplingParams: defaults, normalisation and one ValueError per invalid field."""

from __future__ import annotations

import pytest

from tidal.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert p.logprobs is None and p.prompt_logprobs is None
    assert not p.greedy and not p.needs_penalties


def test_stop_string_becomes_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties


def test_valid_edges_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, frequency_penalty=2.0, presence_penalty=-2.0)
    SamplingParams(max_tokens=None, min_tokens=1000, logprobs=0, prompt_logprobs=0)
    SamplingParams(max_tokens=4, min_tokens=4, stop_token_ids=[0], top_k=50)


@pytest.mark.parametrize(
    ("field", "value", "extra"),
    [
        ("n", 0, {}),
        ("temperature", -0.1, {}),
        ("temperature", float("nan"), {}),
        ("top_p", 0.0, {}),
        ("top_p", 1.5, {}),
        ("top_k", -2, {}),
        ("min_p", -0.1, {}),
        ("min_p", 1.1, {}),
        ("repetition_penalty", 0.0, {}),
        ("frequency_penalty", 2.5, {}),
        ("presence_penalty", -2.5, {}),
        ("max_tokens", 0, {}),
        ("min_tokens", -1, {}),
        ("min_tokens", 10, {"max_tokens": 5}),
        ("logprobs", -1, {}),
        ("prompt_logprobs", -1, {}),
        ("stop", [""], {}),
        ("stop_token_ids", [-1], {}),
    ],
)
def test_invalid_field_raises_naming_it(field, value, extra):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value}, **extra)


def test_allowed_token_ids_kept_once_in_order():
    assert SamplingParams(allowed_token_ids=(3, 3, 1, 3)).allowed_token_ids == [3, 1]
