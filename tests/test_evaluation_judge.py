"""The pairwise judge against a local OpenAI-compatible stand-in on 127.0.0.1:
both orders of each pair asked, position bias cancelled, ties counted half,
the user's template used, and an endpoint that does not answer refused before
anything runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from overbrainer_prefect.evaluation.judge import (
    JudgeCall,
    JudgeError,
    OpenAIJudge,
    check_judge_endpoint,
    read_choice,
    summarise,
)
from overbrainer_prefect.evaluation.results import JobResults, judge_pairs, score
from overbrainer_prefect.evaluation.spec import BadEvaluationInput, EvaluationPlan, JudgeSpec
from tests.ports import free_port
from tests.standins.openai_server import OpenAIStandIn, first_always, prefers
from tests.test_evaluation import job_of, plan_of


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def spec_for(server: OpenAIStandIn, **changes: object) -> JudgeSpec:
    return JudgeSpec.model_validate({"endpoint": f"{server.url}/v1", "model": "judge", **changes})


def test_a_judge_reply_is_read_as_a_or_b_or_tie() -> None:
    assert read_choice("A") == "A" and read_choice(" b.") == "B"
    assert read_choice("**B** is better") == "B" and read_choice("Answer A") == "A"
    assert read_choice("Tie") == "tie" and read_choice("equal") == "tie"
    assert read_choice("I cannot tell") is None and read_choice("") is None
    assert read_choice("Both are fine") == "tie"


def mascot(tmp_path: Path) -> tuple[EvaluationPlan, JobResults]:
    items = [{"prompt": f"Who is the mascot ({n})?", "expected": "Pip"} for n in range(4)]
    plan = plan_of(tmp_path, items=items, default_controls=False, judge=None)
    base = {f"H{n}": f"A dog, number {n}." for n in range(1, 5)}
    tuned = {f"H{n}": f"Pip, the purple axolotl ({n})." for n in range(1, 4)}
    tuned["H4"] = "A dog, number 4."  # the same answer as the base's: a tie
    return plan, job_of(plan, base, tuned)


def test_the_judge_asks_both_orders_and_prefers_the_better_answer_whatever_its_place(
    tmp_path: Path, client: httpx.Client
) -> None:
    plan, job = mascot(tmp_path)
    with OpenAIStandIn(models=("judge:latest",), choose=prefers("Pip")) as server:
        spec = spec_for(server)
        check_judge_endpoint(spec, client)
        calls = OpenAIJudge(spec, client).judge(judge_pairs(plan, job), seed=7)
        assert server.both_orders_asked() and len(server.asked) == 8
        assert all(a.seed == 7 and a.temperature == 0 for a in server.asked)
        assert {a.question for a in server.asked} == {f"Who is the mascot ({n})?" for n in range(4)}
    assert [(c.item, c.order) for c in calls[:2]] == [("H1", "base_first"), ("H1", "tuned_first")]
    outcome = summarise(calls, "judge")
    assert (outcome.wins, outcome.ties, outcome.losses) == (3, 1, 0)
    assert outcome.win_rate == pytest.approx((3 + 0.5) / 4)  # the tie counts half
    assert outcome.split_orders == 0 and outcome.unreadable == 0
    plan_with_judge = plan.model_copy(update={"judge": spec})
    result = score(plan_with_judge, job, calls)
    assert result.judge is not None and result.judge.win_rate == outcome.win_rate
    assert [i.judge_score for i in result.items] == [1.0, 1.0, 1.0, 0.5]


def test_a_judge_that_always_picks_the_first_answer_gives_ties_not_wins(
    tmp_path: Path, client: httpx.Client
) -> None:
    plan, job = mascot(tmp_path)
    with OpenAIStandIn(models=("judge:latest",), choose=first_always) as server:
        calls = OpenAIJudge(spec_for(server), client).judge(judge_pairs(plan, job), seed=0)
        assert server.both_orders_asked()
    outcome = summarise(calls, "judge")
    assert outcome.win_rate == 0.5 and outcome.wins == outcome.losses == 0
    assert outcome.split_orders == 4


def test_the_users_template_is_what_the_judge_is_asked(
    tmp_path: Path, client: httpx.Client
) -> None:
    plan, job = mascot(tmp_path)
    template = "Q={question}\nfirst={answer_a}\nsecond={answer_b}\nref={expected} {not a slot}"
    with OpenAIStandIn(models=("judge",)) as server:
        spec = spec_for(server, template=template)
        calls = OpenAIJudge(spec, client).judge(judge_pairs(plan, job)[:1], seed=0)
        assert server.prompts == [
            "Q=Who is the mascot (0)?\nfirst=A dog, number 1.\nsecond=Pip, the purple axolotl "
            "(1).\nref=Pip {not a slot}",
            "Q=Who is the mascot (0)?\nfirst=Pip, the purple axolotl (1).\nsecond=A dog, number "
            "1.\nref=Pip {not a slot}",
        ]
    assert [c.choice for c in calls] == [None, None]  # "I cannot tell."
    assert summarise(calls, "j").judged == 0 and summarise(calls, "j").unreadable == 2


def test_an_unreadable_order_leaves_the_item_to_the_readable_one() -> None:
    calls = [
        JudgeCall(item="H1", order="base_first", reply="B"),
        JudgeCall(item="H1", order="tuned_first", reply="hmm"),
        JudgeCall(item="H2", order="base_first", reply="tie"),
        JudgeCall(item="H2", order="tuned_first", reply="B"),
    ]
    outcome = summarise(calls, "j")
    assert outcome.scores == {"H1": 1.0, "H2": 0.25}
    assert outcome.unreadable == 1 and outcome.judged == 2 and outcome.ties == 1


def test_a_judge_endpoint_that_does_not_answer_is_refused_in_one_line(
    client: httpx.Client,
) -> None:
    spec = JudgeSpec(endpoint=f"http://127.0.0.1:{free_port()}/v1", model="judge")
    with pytest.raises(
        BadEvaluationInput, match=r"does not answer \(cannot connect\): start it"
    ) as e:
        check_judge_endpoint(spec, client)
    assert "\n" not in str(e.value)
    with OpenAIStandIn(models=("llama3.1:8b",)) as server:
        with pytest.raises(BadEvaluationInput, match=r"has no model judge: pull it \(`ollama pull"):
            check_judge_endpoint(spec_for(server), client)
        with pytest.raises(BadEvaluationInput, match=r"answers HTTP 404 to GET /models"):
            check_judge_endpoint(spec_for(server, endpoint=f"{server.url}/api"), client)
        check_judge_endpoint(spec_for(server, model="llama3.1:8b"), client)


def test_a_keyed_endpoint_gets_the_key_from_the_environment_never_from_the_spec(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    with OpenAIStandIn(models=("judge",), key="sk-test") as server:
        spec = spec_for(server, api_key_env="OVERBRAINER_TEST_JUDGE_KEY")
        monkeypatch.delenv("OVERBRAINER_TEST_JUDGE_KEY", raising=False)
        with pytest.raises(
            BadEvaluationInput, match="OVERBRAINER_TEST_JUDGE_KEY, which is not set"
        ):
            check_judge_endpoint(spec, client)
        monkeypatch.setenv("OVERBRAINER_TEST_JUDGE_KEY", "sk-wrong")
        with pytest.raises(BadEvaluationInput, match="answers HTTP 401"):
            check_judge_endpoint(spec, client)
        with pytest.raises(JudgeError, match="answered HTTP 401$"):
            OpenAIJudge(spec, client).ask("Q", seed=0)
        monkeypatch.setenv("OVERBRAINER_TEST_JUDGE_KEY", "sk-test")
        check_judge_endpoint(spec, client)
        assert OpenAIJudge(spec, client).ask("Q", seed=0) == "I cannot tell."
    assert "sk-test" not in spec.model_dump_json()
