"""GRPO's pieces that need no engine (weightsync/apps/grpo.py, weightsync/engine/sampling.py): sampling
options refused before any request, rewards, group advantages, the mismatch measure, one
policy step on a real tiny model (on- and off-policy), the demo's exit rule (on- and off-policy)
and its output in a log."""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console
from rich.text import Text

from weightsync.apps.demo import LiveView, grpo_cells, grpo_table
from weightsync.apps.grpo import (
    LEARNING_MIN_STEPS,
    GrpoConfig,
    Verdict,
    group_advantages,
    mismatch,
    policy_step,
    reward,
    version_index,
)
from weightsync.engine.sampling import SamplingOptions


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"temperature": -0.5}, r"temperature=-0\.5"),
        ({"temperature": 2.5}, r"temperature=2\.5: must be in \[0, 2\]"),
        ({"n": 0}, "n=0"),
        ({"n": 4}, "n=4 with temperature=0: .* set temperature > 0 or n=1"),
        ({"top_p": 0.0}, r"top_p=0\.0"),
        ({"top_p": 1.5}, r"top_p=1\.5"),
        ({"top_k": -1}, "top_k=-1: .* 0 for every token"),
        ({"min_p": 1.5}, r"min_p=1\.5"),
        ({"repetition_penalty": 0}, r"repetition_penalty=0: must be in \(0, 2\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty=2\.5: must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, "frequency_penalty=-3"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens=5: .*max_new_tokens=4"),
        ({"ignore_eos": "yes"}, "ignore_eos='yes': must be True or False"),
        ({"stop": ["ok", ""]}, r"stop=\['ok', ''\]: must be a non-empty string"),
        ({"stop_token_ids": [3, -1]}, r"stop_token_ids=\[3, -1\]"),
        ({"top_logprobs": 21}, r"top_logprobs=21: must be an int in \[0, 20\]"),
    ],
)
def test_bad_sampling_options_are_refused_naming_the_value(options, named):
    with pytest.raises(ValueError, match=named):
        SamplingOptions(**options)


def test_stop_token_ids_with_ignore_eos_are_refused_since_sglang_would_ignore_them():
    with pytest.raises(ValueError, match=r"stop_token_ids=\[7\] with ignore_eos=True: SGLang"):
        SamplingOptions(stop_token_ids=[7], ignore_eos=True)
    assert SamplingOptions(stop=["."], ignore_eos=True).stop == (".",)  # strings are honoured


def test_end_of_sequence_ends_samples_unless_asked_and_stops_are_kept_as_tuples():
    options = SamplingOptions(stop="\n", stop_token_ids=[5, 6])
    assert not options.ignore_eos
    assert options.stop == ("\n",) and options.stop_token_ids == (5, 6)


def test_grpo_samples_ignore_end_of_sequence_so_every_completion_has_its_length():
    options = GrpoConfig().sampling(3)
    assert options.ignore_eos and options.max_new_tokens == GrpoConfig().max_new_tokens


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


def _step(step: int, reward_: float, *, verified: bool = True) -> dict:
    """A step record as `GrpoLoop.step` makes it, for two engines."""
    engine = {
        "reward": reward_,
        "mean_abs": 2.5e-7,
        "kl": 6.9e-14,
        "versions": [f"step-{step - 1}"],
        "expected_version": f"step-{step - 1}",
        "on_version": True,
        "verified": verified,
        "sample": "weightsync says: hello",
    }
    return {
        "step": step,
        "rollout_s": 0.25,
        "train_s": 0.45,
        "sync_s": 0.05,
        "engines": {"sglang": dict(engine), "vllm": dict(engine)},
    }


def test_a_short_run_whose_syncs_verified_passes_without_the_learning_rule():
    steps = [_step(s, 0.06) for s in range(1, 4)]  # a flat reward: 3 steps cannot show learning
    verdict = Verdict(max_mean_abs=1e-5).judge(steps, start_verified={"sglang": True})
    assert verdict.ok, verdict.failures
    assert not verdict.learning_judged


def test_a_short_run_still_fails_on_a_sync_that_did_not_verify():
    steps = [_step(1, 0.06), _step(2, 0.06, verified=False)]
    verdict = Verdict(max_mean_abs=1e-5).judge(steps, start_verified={"sglang": True})
    assert verdict.failures == [
        "step 2: sglang's sync did not verify",
        "step 2: vllm's sync did not verify",
    ]


def test_a_run_long_enough_to_learn_fails_when_the_reward_stays_flat_and_passes_when_it_rose():
    flat = [_step(s, 0.06) for s in range(1, LEARNING_MIN_STEPS + 1)]
    verdict = Verdict(max_mean_abs=1e-5).judge(flat, start_verified={})
    assert verdict.learning_judged
    assert [f.split(":")[0] for f in verdict.failures] == ["sglang", "vllm"]
    assert "is not 0.15 above the first 3' 0.060" in verdict.failures[0]
    rising = [_step(s, 0.05 * s) for s in range(1, LEARNING_MIN_STEPS + 1)]
    assert Verdict(max_mean_abs=1e-5).judge(rising, start_verified={}).ok


def test_the_grpo_table_in_a_log_is_as_wide_as_its_cells_and_follows_a_finished_line(
    monkeypatch,
):
    """Not a terminal (a log, CI) and no COLUMNS: rich would cut the table to 80 columns, every
    cell '0…'; the start-up status line ends in a newline before the table."""
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    console = Console(file=out)
    assert not console.is_terminal
    status = LiveView(Text("sglang: starting, 0 s"), console=console, refresh_per_second=2)
    status.update(Text("sglang: ready after 81 s  vllm: ready after 95 s"))
    status.close()
    table = grpo_table(["sglang", "vllm"])
    view = LiveView(table, console=console)
    for step in range(1, 4):
        table.add_row(*grpo_cells(_step(step, 0.057 * step)))
        view.refresh()
    view.close()
    text = out.getvalue()
    assert text.startswith("sglang: ready after 81 s  vllm: ready after 95 s\n┏")
    header, *_ = [line for line in text.splitlines() if "step" in line]
    assert "sglang reward" in header and "sample (sglang)" in header
    last = [line for line in text.splitlines() if line.startswith("│ 3 ")][0]
    cells = [c.strip() for c in last.strip("│").split("│")]
    assert cells[:6] == ["3", "0.171", "2.5e-07", "6.9e-14", "step-2", "yes"]
    assert cells[-1] == "'weightsync says:'"
    assert "…" not in text
    assert text.endswith("┘\n")


def test_an_off_policy_step_weighs_each_token_by_the_learners_over_the_samplers_probability():
    """A rollout with "behavior" log-probs (of the weights that sampled it) has its loss
    weighed by exp(learner's - behavior): equal log-probs make the on-policy update; a sampler
    that was sure of tokens the learner finds unlikely (behavior 0) makes almost none."""
    from weightsync.apps.grpo import token_logprobs
    from weightsync.apps.models import build_model

    rollout = {"prompt": [5, 6, 7], "tokens": [70, 71], "advantage": 1.0}
    torch.manual_seed(0)
    start = build_model("qwen2").state_dict()
    with torch.no_grad():
        model = build_model("qwen2")
        model.load_state_dict(start)
        own = token_logprobs(model, [rollout], temperature=1.0)[0].tolist()
    moved = {}
    for name, extra in (("on", {}), ("same", {"behavior": own}), ("sure", {"behavior": [0, 0]})):
        model = build_model("qwen2")
        model.load_state_dict(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
        policy_step(model, optimizer, [{**rollout, **extra}], num_updates=1)
        moved[name] = torch.cat(
            [(p.detach() - start[k]).flatten() for k, p in model.named_parameters()]
        )
    assert moved["on"].abs().sum() > 0
    torch.testing.assert_close(moved["same"], moved["on"], rtol=1e-4, atol=1e-7)
    # The learner's log-probs here are about -5.5 a token: a weight of about 4e-3.
    assert moved["sure"].abs().sum() < 0.02 * moved["on"].abs().sum()


def test_version_index_reads_the_demos_versions_and_refuses_others():
    assert version_index("step-12") == 12
    with pytest.raises(ValueError, match="weight version 'v3': expected 'step-N'"):
        version_index("v3")


def _off_policy_step(step: int, lags: list[int], *, mean_abs=2.5e-7, stale=0.3) -> dict:
    """An off-policy step record as `GrpoLoop.step` makes it, for one engine."""
    record = _step(step, 0.1)
    versions = sorted({f"step-{step - 1 - g}" for g in lags})
    allowed = [f"step-{step - 1}"] + ([f"step-{step - 2}"] if step >= 2 else [])
    record["engines"] = {
        "vllm": {
            **record["engines"]["vllm"],
            "versions": versions,
            "lags": lags,
            "allowed_versions": allowed,
            "expected_version": allowed[0],
            "on_version": set(versions) <= set(allowed),
            "mean_abs": mean_abs if 0 in lags else None,
            "kl": 1e-13 if 0 in lags else None,
            "stale_mean_abs": stale if 1 in lags else None,
            "verified": None if step == 1 else True,
            "pause_s": None if step == 1 else 0.012,
        }
    }
    return record


def test_an_off_policy_run_passes_with_rollouts_one_version_behind_and_fails_on_a_wrong_tag():
    steps = [_off_policy_step(1, [0] * 16)] + [
        _off_policy_step(s, [1] * 8 + [0] * 8) for s in range(2, 5)
    ]
    judge = Verdict(max_mean_abs=1e-5).judge
    assert judge(steps, start_verified={"vllm": True}, end_verified={"vllm": True}).ok
    # Two versions behind is not allowed; nor a failed last sync.
    steps[2] = _off_policy_step(3, [2] * 16)
    failures = judge(steps, start_verified={}, end_verified={"vllm": False}).failures
    assert failures == [
        "vllm: the last sync (after step 4) did not verify",
        "step 3: vllm sampled with versions ['step-0'], expected 'step-2' or 'step-1'",
    ]
    # Rollouts tagged one version behind that match the learner's weights: the tag lies.
    steps[2] = _off_policy_step(3, [1] * 16, stale=3e-7)
    assert judge(steps, start_verified={}).failures == [
        "step 3: vllm's rollouts tagged one version behind match the learner's weights "
        "(mean |log-prob delta| 3.00e-07 < bound 1e-05): their version tag is wrong"
    ]


def test_the_off_policy_table_shows_each_engines_lags_and_switch_pause(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = io.StringIO()
    table = grpo_table(["vllm"], off_policy=True)
    table.add_row(*grpo_cells(_off_policy_step(1, [0] * 16)))
    table.add_row(*grpo_cells(_off_policy_step(2, [1] * 8 + [0] * 8)))
    table.add_row(*grpo_cells(_off_policy_step(3, [1] * 16)))
    Console(file=out, width=200).print(table)
    rows = [
        [c.strip() for c in line.strip("│").split("│")]
        for line in out.getvalue().splitlines()
        if line.startswith("│ ")
    ]
    assert [r[:8] for r in rows[-3:]] == [
        ["1", "0.100", "2.5e-07", "1.0e-13", "step-0", "0:16", "-", "yes"],
        ["2", "0.100", "2.5e-07", "1.0e-13", "step-0,step-1", "0:8 1:8", "12.0", "yes"],
        ["3", "0.100", "-", "-", "step-1", "1:16", "12.0", "yes"],
    ]
