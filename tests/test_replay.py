"""benchmarks/replay.py: a recorded text's confidence and agreement drive the loop on fakes at a host's costs;
benchmarks/loop_cpu.py drives it the same way to time the coordinator's own work."""

import pytest

from benchmarks import loop_cpu
from benchmarks.replay import HostCosts, by_class, ceiling, ceilings, replay


def trace(name: str, kind: str, agree: int, confidence: float) -> dict:
    return {"name": name, "kind": kind, "prompt_tokens": 30, "agree": [agree] * 128, "confidence": [confidence] * 128}


def test_a_text_the_draft_knows_speculates_and_one_it_does_not_stays_near_plain():
    costs = HostCosts()
    known, known_drafts = replay(trace("code", "code", 1, 0.95), costs)
    unknown, unknown_drafts = replay(trace("prose", "prose", 0, 0.3), costs)
    misled, misled_drafts = replay(trace("sure", "prose", 0, 0.9), costs)  # the target is sure; the draft is wrong
    assert known > 1.2 and known_drafts > 64
    assert unknown == pytest.approx(1.0) and unknown_drafts == 0
    assert 0.95 <= misled < 1.0 and 0 < misled_drafts < 8


def test_a_cheaper_draft_step_replays_faster_and_classes_report_their_mean_and_worst():
    traces = [trace("a", "code", 1, 0.95), trace("b", "code", 1, 0.6)]
    slow, fast = by_class(traces, HostCosts(draft_step=0.024)), by_class(traces, HostCosts(draft_step=0.012))
    assert fast["classes"]["code"]["mean"] > slow["classes"]["code"]["mean"]
    code = slow["classes"]["code"]
    assert code["worst"] == min(p["speedup"] for p in slow["prompts"].values()) <= code["mean"]


def test_a_pinned_k_replays_at_that_k_beside_the_adaptive_policy():
    traces = [trace("a", "code", 1, 0.95)]
    pinned = by_class(traces, HostCosts(), fixed_k=2)
    _, drafts = replay(traces[0], HostCosts(), fixed_k=2)
    assert 2 * 40 <= drafts <= 2 * 43  # two a round (the last may draft fewer): a draft always right, ~42 rounds
    assert pinned["classes"]["code"]["mean"] != by_class(traces, HostCosts())["classes"]["code"]["mean"]


def test_a_trace_with_its_token_ids_lets_the_model_free_drafter_copy_what_the_output_repeats():
    body = [100 + (i * 37) % 500 for i in range(128)]  # no n-gram repeats within it
    copying = {"name": "edit", "kind": "edit", "prompt_tokens": 130, "prompt": [1, 2, *body], "output": body,
               "agree": [0] * 128, "confidence": [0.9] * 128}  # the draft model is always wrong
    hybrid_speedup, model_drafts = replay(copying, HostCosts())
    made_up_ids, _ = replay({k: v for k, v in copying.items() if k not in ("prompt", "output")}, HostCosts())
    assert hybrid_speedup > 2.0 and model_drafts < 8
    assert 0.85 <= made_up_ids < 1.0  # the draft model tried: its catch-up on the prompt and a few rounds


def test_the_ceiling_is_plain_where_nothing_helps_and_bounds_every_policy_where_something_does():
    body = [100 + (i * 37) % 500 for i in range(128)]  # no token repeats within it
    nothing = {"name": "n", "kind": "prose", "prompt_tokens": 2, "prompt": [1, 2], "output": body,
               "agree": [0] * 128, "confidence": [0.3] * 128}
    copying = {**nothing, "prompt_tokens": 130, "prompt": [1, 2, *body]}
    drafted = trace("code", "code", 1, 0.95)
    assert ceiling(nothing, HostCosts()) == pytest.approx(1.0)
    for t in (copying, drafted):
        bound = ceiling(t, HostCosts())
        assert bound > 1.5
        assert all(replay(t, HostCosts(), fixed_k=k)[0] <= bound for k in (None, 2, 4, 8))
    assert ceilings([copying, drafted], HostCosts())["prose"]["mean"] == round(ceiling(copying, HostCosts()), 3)


def test_the_drafts_recorded_probability_stops_its_drafting_as_the_service_does():
    """A draft the recording gave a low probability ends the round's drafting (the confidence stop)
    under the adaptive policy; a pinned K drafts through it."""
    sure = trace("code", "code", 1, 0.95)
    unsure_every_other = {**sure, "draft_confidence": [0.99, 0.2] * 64}
    _, drafts_when_sure = replay(sure, HostCosts(), fixed_k=None)
    speedup, drafts_when_unsure = replay(unsure_every_other, HostCosts())
    _, pinned = replay(unsure_every_other, HostCosts(), fixed_k=4)
    assert drafts_when_unsure < drafts_when_sure
    assert speedup < replay(sure, HostCosts())[0]
    assert pinned == replay(sure, HostCosts(), fixed_k=4)[1]


def test_the_loop_cpu_bench_runs_every_session_to_its_tokens():
    """benchmarks/loop_cpu.py: N sessions at once on free fakes, plain and adaptive, each to its tokens."""
    traces = loop_cpu.with_output()[:3]
    for fixed_k in loop_cpu.CONFIGS.values():
        seconds, tokens = loop_cpu.cpu_per_token(traces, 4, fixed_k)
        assert tokens == 4 * loop_cpu.TOKENS and seconds > 0
