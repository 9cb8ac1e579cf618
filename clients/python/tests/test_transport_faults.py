"""Transport-fault tests: what the real gateway will not do on demand (answer 503, hang up
without answering) done by a local server on 127.0.0.1 that plays the gateway from a
script. Each checks that the call was sent again unchanged, with the same keys."""

from __future__ import annotations

import time
import unittest
import uuid
from typing import Any, Dict

from conveyor_client import Client, ConveyorError, NewTask, NoAnswer, RetryPolicy, State

from .support import FAST_RETRIES, LocalServer, Reply, Seen, json_reply, script

HANG_UP = None


def accepted(seen: Seen) -> Reply:
    """The gateway's 201 for a submission, with the key it was sent."""
    key = seen.headers["idempotency-key"]
    return json_reply(201, {"id": str(uuid.uuid4()), "state": "QUEUED", "idempotencyKey": key})


def batch_accepted(seen: Seen) -> Reply:
    results = [
        {
            "status": 201,
            "id": str(uuid.uuid4()),
            "state": "QUEUED",
            "idempotencyKey": t["idempotencyKey"],
        }
        for t in seen.json()["tasks"]
    ]
    return json_reply(200, {"results": results})


def task_view(task_id: str, state: str) -> Dict[str, Any]:
    now = "2025-01-01T00:00:00.123456789Z"
    return {
        "id": task_id,
        "namespace": "default",
        "taskType": "t",
        "idempotencyKey": task_id,
        "state": state,
        "attempt": 1,
        "retries": 0,
        "labels": {},
        "createdAt": now,
        "updatedAt": now,
        "suspect": False,
        "payload": {},
    }


class TransportFaultTests(unittest.TestCase):
    def client(self, server: LocalServer, retry: RetryPolicy = FAST_RETRIES) -> Client:
        return Client(server.url, "token", retry=retry)

    def test_a_503_is_retried_after_its_retry_after_with_the_same_key(self) -> None:
        unavailable = json_reply(
            503, {"error": {"code": "broker_unavailable", "message": "no confirm"}}, Retry_After="1"
        )
        with LocalServer(script(unavailable, accepted)) as server:
            started = time.monotonic()
            answer = self.client(server, RetryPolicy(max_wait=5)).submit("t", {"n": 1})
            took = time.monotonic() - started
        first, second = server.requests
        self.assertEqual(first.headers["idempotency-key"], second.headers["idempotency-key"])
        self.assertEqual(first.body, second.body)
        self.assertEqual(answer.idempotency_key, first.headers["idempotency-key"])
        self.assertTrue(answer.created)
        self.assertGreaterEqual(took, 0.95, "waited the second Retry-After asked for")

    def test_a_redirect_is_not_followed_and_the_token_goes_nowhere_else(self) -> None:
        # Issue 33, item 7: a 3xx (a proxy, another host) must not receive the token.
        with LocalServer(script(json_reply(200, task_view(str(uuid.uuid4()), "QUEUED")))) as elsewhere:
            moved = (302, {"Location": elsewhere.url + "/v1/tasks/x"}, b"")
            with LocalServer(script(moved)) as server:
                for call in (
                    lambda c: c.get(str(uuid.uuid4())),
                    lambda c: c.submit("t", {"n": 3}),
                ):
                    with self.assertRaises(ConveyorError) as raised:
                        call(self.client(server))
                    self.assertEqual(raised.exception.status, 302)
        self.assertEqual(elsewhere.requests, [], "nothing reached the redirect's target")

    def test_a_dropped_connection_is_retried_with_the_same_key(self) -> None:
        with LocalServer(script(HANG_UP, accepted)) as server:
            answer = self.client(server).submit("t", {"n": 2})
        first, second = server.requests
        self.assertEqual(first.headers["idempotency-key"], second.headers["idempotency-key"])
        self.assertEqual(answer.idempotency_key, second.headers["idempotency-key"])

    def test_a_batch_sent_again_keeps_each_tasks_key(self) -> None:
        with LocalServer(script(HANG_UP, batch_accepted)) as server:
            results = self.client(server).submit_batch([NewTask("t", {"n": n}) for n in range(3)])
        first, second = (r.json()["tasks"] for r in server.requests)
        self.assertEqual(first, second)
        keys = [t["idempotencyKey"] for t in first]
        self.assertEqual(len(set(keys)), 3)
        self.assertEqual([r.unwrap().idempotency_key for r in results], keys)

    def test_no_answer_at_all_raises_no_answer(self) -> None:
        with LocalServer(script(HANG_UP)) as server:
            with self.assertRaises(NoAnswer) as caught:
                self.client(server).get(str(uuid.uuid4()))
        error = caught.exception
        self.assertEqual(
            (error.status, error.code, error.attempts, error.unanswered), (None, "no_answer", 3, 3)
        )
        self.assertEqual(len(server.requests), 3)

    def test_a_cancel_whose_answer_was_lost_reads_the_task(self) -> None:
        task_id = str(uuid.uuid4())
        conflict = json_reply(
            409, {"error": {"code": "not_cancellable", "message": "task is CANCELLED"}}
        )
        read = json_reply(200, task_view(task_id, State.CANCELLED))
        with LocalServer(script(HANG_UP, conflict, read)) as server:
            task = self.client(server).cancel(task_id)
        self.assertEqual(task.state, State.CANCELLED)
        self.assertEqual([r.method for r in server.requests], ["POST", "POST", "GET"])
