"""Evaluation on a worker (run.eval_on=workers): the coordinator's state machine, and its routes over real HTTP.

Only a worker that joined with the run secret is handed the held-out rows; its greedy completions are parsed as
pushed rollouts are, judged with the task's own check, and come back to the learner with the version measured. A bad
answer, a missed deadline or a retired worker puts the evaluation back to be handed out again.
"""

from __future__ import annotations

import pytest

from conftest import small_coordinator
from echo2.coordinator.evaluation import WorkerEval
from echo2.credential import worker_credential
from echo2.metrics import EVAL_ACCURACY, EVAL_EXAMPLES, EVAL_TIME_S, EVAL_UNSCORED, EVAL_VERSION
from echo2.net.http import BadRequest, Client, RemoteError
from echo2.records import Completion, Rollout, RolloutGroup


def _evals(n: int = 3) -> WorkerEval:
    return WorkerEval([{"prompt": f"{i}=", "answer": str(i)} for i in range(n)], [[i] for i in range(n)])


def _judged(correct: list[bool]) -> list[RolloutGroup]:
    groups = []
    for c in correct:
        r = Rollout([1], Completion([2], [-0.1], "stop"), version=0, reward=float(c), rewards={"correct": float(c)})
        groups.append(RolloutGroup(row={}, rollouts=[r]))
    return groups


def test_a_job_goes_to_a_worker_holding_the_oldest_wanted_version_and_answers_every_wanted_one_it_covers():
    ev = _evals()
    assert ev.hand_out("w0", 5, 60.0, now=0.0) is None  # nothing wanted yet
    ev.request(4)
    ev.request(6)
    assert ev.hand_out("w0", 3, 60.0, now=0.0) is None  # it holds weights older than any wanted
    job = ev.hand_out("w0", 5, 60.0, now=0.0)
    assert job["version"] == 5 and job["prompt_ids"] == [[0], [1], [2]] and "rows" not in job
    assert ev.job.covers == [4] and ev.hand_out("w1", 9, 60.0, now=0.0) is None  # one job out at a time
    claimed = ev.claim("w0", job["job_id"])
    result = ev.finish(claimed, 5, _judged([True, False, True]), [None, None, "reward_timeout"], now=2.5)
    # the timed-out row is not correct, and is counted as unscored
    assert result[EVAL_ACCURACY] == pytest.approx(1 / 3) and result[EVAL_EXAMPLES] == 3
    assert result[EVAL_UNSCORED] == 1 and result[EVAL_VERSION] == 5 and result["requested"] == [4]
    assert result[EVAL_TIME_S] == 2.5 and ev.wanted == {6} and ev.take_results() == [result] and ev.results == []
    # a worker at v9 answers v6 with its own, newer weights
    assert ev.hand_out("w1", 9, 60.0, now=3.0)["version"] == 9 and ev.job.covers == [6]


def test_a_job_comes_back_after_its_deadline_a_retired_worker_or_a_refused_answer_and_never_while_judged():
    ev = _evals()
    ev.request(0)
    first = ev.hand_out("w0", 0, 10.0, now=0.0)
    assert ev.expire(now=5.0) is None and ev.expire(now=11.0) == "w0"
    with pytest.raises(BadRequest, match="no evaluation"):
        ev.claim("w0", first["job_id"])  # too late: it went back
    second = ev.hand_out("w1", 0, 10.0, now=12.0)
    with pytest.raises(BadRequest):
        ev.claim("w0", second["job_id"])  # another worker's job
    ev.retire("w1")
    third = ev.hand_out("w2", 0, 10.0, now=13.0)
    job = ev.claim("w2", third["job_id"])
    assert ev.expire(now=100.0) is None  # being judged: neither expired
    ev.retire("w2")  # nor taken from it
    assert ev.job is job
    ev.give_back(job, "refused")
    assert ev.job is None and ev.wanted == {0}
    assert ev.counts["retries"] == 3 and ev.counts["retry_deadline"] == ev.counts["retry_worker_gone"] == 1


def test_too_many_or_no_held_out_rows_are_refused_with_what_to_set():
    with pytest.raises(ValueError, match="task.eval_size"):
        WorkerEval([], [])


# ---------------------------------------------------------------------------------------------- over HTTP


@pytest.fixture
def coord(tiny_model_dir):
    from echo2.tasks.arith import ArithTask

    rows = list(ArithTask(level="copy", eval_size=4).eval_dataset())
    c = small_coordinator(tiny_model_dir, group_size=2, eval_rows=rows)
    yield c
    c.close()


def _answers(coord, job, right: int, version: int = 0) -> list[dict]:
    """One completion per held-out row: the answer's own tokens for the first ``right`` rows, a wrong digit after."""
    out = []
    for i, row in enumerate(coord.evals.rows):
        text = row["answer"] if i < right else str((int(row["answer"]) + 1) % 10) + "0"
        ids = coord.tokenizer.encode(text, add_special_tokens=False)[:3]
        out.append({"version": version, "completions": [{"token_ids": ids, "logprobs": [-0.1] * len(ids),
                                                         "finish_reason": "stop"}]})
    return out


def test_only_a_run_secret_worker_evaluates_and_its_answer_is_judged_with_the_tasks_check(coord):
    ours, theirs = Client(coord.url, "secret"), Client(coord.url, worker_credential("secret", "stranger"))
    wid_ours = ours.post("/register", {})["worker_id"]
    wid_theirs = theirs.post("/register", {})["worker_id"]
    coord.request_eval(0)
    # the stranger gets training work, never the held-out rows
    reply = theirs.post("/pull", {"worker_id": wid_theirs, "version": 0, "max_groups": 1})
    assert reply["work"] and "eval" not in reply
    job = ours.post("/pull", {"worker_id": wid_ours, "version": 0, "max_groups": 1})["eval"]
    assert len(job["prompt_ids"]) == len(coord.evals.rows) == 4
    body = {"worker_id": wid_ours, "version": 0, "job_id": job["job_id"]}
    with pytest.raises(RemoteError, match="401"):
        theirs.post("/eval", {**body, "worker_id": wid_theirs, "results": _answers(coord, job, 4)})
    # a bad answer is refused, and the rows handed out again
    with pytest.raises(RemoteError, match="3 results for 4"):
        ours.post("/eval", {**body, "results": _answers(coord, job, 4)[:3]})
    job = ours.post("/pull", {"worker_id": wid_ours, "version": 0, "max_groups": 1})["eval"]
    body["job_id"] = job["job_id"]
    mixed = _answers(coord, job, 4)
    mixed[1]["version"] = 1
    with pytest.raises(RemoteError, match="one version"):
        ours.post("/eval", {**body, "results": mixed})
    job = ours.post("/pull", {"worker_id": wid_ours, "version": 0, "max_groups": 1})["eval"]
    body["job_id"] = job["job_id"]
    assert ours.post("/eval", {**body, "results": _answers(coord, job, 3)})["accepted"]
    with pytest.raises(RemoteError, match="no evaluation"):  # answered once only
        ours.post("/eval", {**body, "results": _answers(coord, job, 3)})
    out = coord.evaluations()
    (result,) = out["results"]
    assert result[EVAL_ACCURACY] == 0.75 and result["version"] == 0 and result["worker_id"] == wid_ours
    assert out["wanted"] == [] and coord.evals.counts["retries"] == 2
    assert coord.evaluations()["results"] == []  # handed to the learner once


def test_a_claim_of_weights_the_worker_does_not_hold_is_refused(coord):
    ours = Client(coord.url, "secret")
    wid = ours.post("/register", {})["worker_id"]
    coord.request_eval(0)
    job = ours.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 1})["eval"]
    coord.set_version(1)  # the learner moved on; this worker was never handed v1
    with pytest.raises(RemoteError, match="not the version this worker holds"):
        ours.post("/eval", {"worker_id": wid, "version": 1, "job_id": job["job_id"],
                            "results": _answers(coord, job, 4, version=1)})


def test_a_retired_workers_evaluation_goes_to_the_next_worker(coord):
    ours = Client(coord.url, "secret")
    first, second = (ours.post("/register", {})["worker_id"] for _ in range(2))
    coord.request_eval(0)
    assert ours.post("/pull", {"worker_id": first, "version": 0, "max_groups": 1})["eval"]
    assert "eval" not in ours.post("/pull", {"worker_id": second, "version": 0, "max_groups": 1})
    ours.post("/leave", {"worker_id": first})
    assert ours.post("/pull", {"worker_id": second, "version": 0, "max_groups": 1})["eval"]


def test_a_coordinator_without_held_out_rows_has_no_evaluation_route(tiny_model_dir):
    c = small_coordinator(tiny_model_dir)
    try:
        with pytest.raises(RemoteError, match="404"):
            Client(c.url, "secret").post("/eval", {"worker_id": "w", "job_id": "j", "results": []})
        with pytest.raises(RuntimeError, match="eval_on=learner"):
            c.request_eval(0)
    finally:
        c.close()
