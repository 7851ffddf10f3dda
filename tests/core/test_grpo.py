"""GRPO's pieces that need no engine (weightsync/apps/grpo.py, weightsync/engine/sampling.py): sampling
options refused before any request, rewards, group advantages, the mismatch measure, and one
policy step on a real tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from weightsync.apps.grpo import GrpoConfig, group_advantages, mismatch, policy_step, reward
from weightsync.engine.sampling import SamplingOptions


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"n": 0}, "n=0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ],
)
def test_bad_sampling_options_are_refused_naming_the_value(options, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        SamplingOptions(**options)


def test_a_grpo_config_with_bad_sampling_is_refused_before_any_engine():
    with pytest.raises(ValueError, match=r"temperature=-1"):
        GrpoConfig(temperature=-1.0)
    with pytest.raises(ValueError, match=r"group_size=1"):
        GrpoConfig(group_size=1)


def test_reward_is_the_share_of_lowercase_letter_tokens():
    assert reward("abcd", 4) == 1.0
    assert reward("aB1 ", 4) == 0.25
    assert reward("ab", 4) == 0.5  # two special tokens were skipped in decoding


def test_group_advantages_are_normalised_within_each_group():
    adv = group_advantages([0.0, 1.0, 0.5, 0.5], 2)
    assert adv[0] < 0 < adv[1] and abs(adv[0] + adv[1]) < 1e-9
    assert adv[2:] == [0.0, 0.0]
    with pytest.raises(ValueError, match="3 rewards in groups of 2"):
        group_advantages([0.0, 1.0, 0.5], 2)


def test_mismatch_is_zero_for_equal_logprobs_and_positive_otherwise():
    same = mismatch([[-1.0, -2.0]], [[-1.0, -2.0]])
    assert same["mean_abs"] == 0 and same["kl"] == 0
    off = mismatch([[-1.0, -2.0]], [[-1.1, -2.0]])
    assert math.isclose(off["mean_abs"], 0.05) and off["kl"] > 0


def test_policy_step_returns_the_logprobs_before_the_update_and_raises_good_samples():
    from weightsync.apps.grpo import token_logprobs
    from weightsync.apps.models import build_model

    model = build_model("qwen2")  # a rope model: the learner side must work for it too
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rollouts = [
        {"prompt": [5, 6, 7], "tokens": [70, 71], "advantage": 1.0},
        {"prompt": [5, 6], "tokens": [200, 201, 202], "advantage": -1.0},
    ]
    with torch.no_grad():
        before = [lp.tolist() for lp in token_logprobs(model, rollouts, temperature=1.0)]
    out = policy_step(model, optimizer, rollouts, num_updates=1)
    assert [len(lp) for lp in out["learner_logprobs"]] == [2, 3]
    assert mismatch(before, out["learner_logprobs"])["max_abs"] < 1e-5
    with torch.no_grad():
        after = token_logprobs(model, rollouts, temperature=1.0)
    assert after[0].sum() > sum(before[0]) and after[1].sum() < sum(before[1])
