"""Submitting and reading tasks on the real gateway: each result the client returns is
checked against a separate read of what the gateway holds."""

from __future__ import annotations

import uuid

from conveyor_client import Client, ConveyorError, NewTask, RetryPolicy, State

from .support import FAST_RETRIES, GatewayTest, LocalServer, Reply, Seen, forward_to, run_label


class SubmitTests(GatewayTest):
    def test_a_submitted_task_completes_and_the_gateway_agrees(self) -> None:
        run = run_label()
        accepted = self.client.submit(self.gateway.ok, {"n": 1}, labels={"run": run})
        self.assertTrue(accepted.created)
        self.assertEqual(accepted.state, State.QUEUED)
        self.assertEqual(uuid.UUID(accepted.idempotency_key).version, 4, "the client's own key")

        done = self.client.wait(accepted.id, timeout=30)
        self.assertEqual(done.state, State.COMPLETED)

        task = self.client.get(accepted.id)
        self.assertEqual(task.state, State.COMPLETED)
        self.assertEqual(task.task_type, self.gateway.ok)
        self.assertEqual(task.payload, {"n": 1})
        self.assertEqual(task.labels, {"run": run})
        self.assertEqual(task.idempotency_key, accepted.idempotency_key)
        self.assertLessEqual(task.created_at, task.updated_at)
        events = self.client.events(accepted.id)
        self.assertTrue(all(e.task_id == accepted.id for e in events))
        self.assertEqual([e.seq for e in events], sorted(e.seq for e in events), "oldest first")
        self.assertEqual(events[-1].to_state, State.COMPLETED)

    def test_the_same_key_twice_is_one_task(self) -> None:
        run = run_label()
        key = str(uuid.uuid4())
        first = self.client.submit(
            self.gateway.ok, {"n": 2}, labels={"run": run}, idempotency_key=key
        )
        again = self.client.submit(
            self.gateway.ok, {"n": 2}, labels={"run": run}, idempotency_key=key
        )
        self.assertTrue(first.created)
        self.assertFalse(again.created, "answered 200: the key was seen before")
        self.assertEqual((again.id, again.idempotency_key), (first.id, key))
        listed = list(self.client.iter_tasks(label_selector=f"run={run}"))
        self.assertEqual([t.id for t in listed], [first.id], "the gateway holds one task")

        # Without a key of the caller's, each call is a submission of its own.
        one = self.client.submit(self.gateway.ok, {"n": 2})
        other = self.client.submit(self.gateway.ok, {"n": 2})
        self.assertNotEqual(one.id, other.id)
        self.assertNotEqual(one.idempotency_key, other.idempotency_key)

    def test_a_key_reused_for_another_payload_is_refused(self) -> None:
        key = str(uuid.uuid4())
        first = self.client.submit(self.gateway.ok, {"n": 3}, idempotency_key=key)
        with self.assertRaises(ConveyorError) as caught:
            self.client.submit(self.gateway.ok, {"n": 4}, idempotency_key=key)
        self.assertEqual(
            (caught.exception.status, caught.exception.code), (409, "idempotency_key_reused")
        )
        self.assertEqual(self.client.get(first.id).payload, {"n": 3})

    def test_a_batch_is_answered_task_by_task(self) -> None:
        run = run_label()
        tasks = [
            NewTask(self.gateway.strict, {"video": "a.mp4"}, labels={"run": run}),
            NewTask(self.gateway.strict, {"video": 42}, labels={"run": run}),
            NewTask(self.gateway.ok, {"n": 5}, labels={"run": run}),
        ]
        good, bad, also_good = self.client.submit_batch(tasks)

        self.assertTrue(good.ok and also_good.ok)
        assert good.accepted is not None and also_good.accepted is not None
        self.assertEqual((good.status, good.accepted.created), (201, True))
        self.assertFalse(bad.ok)
        assert bad.error is not None
        self.assertEqual(bad.status, 400)
        self.assertEqual(
            (bad.error.status, bad.error.code, bad.error.path), (400, "invalid_payload", "/video")
        )
        with self.assertRaises(ConveyorError):
            bad.unwrap()
        self.assertEqual(
            len({good.idempotency_key, bad.idempotency_key, also_good.idempotency_key}), 3
        )

        # The gateway holds the two good ones, under the keys the client made for them.
        listed = {t.id: t for t in self.client.iter_tasks(label_selector=f"run={run}")}
        self.assertEqual(set(listed), {good.accepted.id, also_good.accepted.id})
        self.assertEqual(listed[good.accepted.id].idempotency_key, good.idempotency_key)
        self.assertEqual(self.client.get(also_good.accepted.id).payload, {"n": 5})

        # Sent again with the keys it was answered with, the batch makes nothing new.
        keyed = [
            NewTask(t.task_type, t.payload, t.labels, idempotency_key=r.idempotency_key)
            for t, r in zip(tasks, (good, bad, also_good))
        ]
        again = self.client.submit_batch(keyed)
        self.assertEqual([r.status for r in again], [200, 400, 200])
        self.assertEqual(again[0].unwrap().id, good.accepted.id)
        self.assertEqual(len(list(self.client.iter_tasks(label_selector=f"run={run}"))), 2)


class FollowTests(GatewayTest):
    """Waiting follows the task's event stream; judged by what a proxy in between saw."""

    def test_waiting_follows_the_stream_instead_of_reading_again_and_again(self) -> None:
        accepted = self.client.submit(self.gateway.ok, {"n": 5}, labels={"run": run_label()})
        with LocalServer(forward_to(self.gateway.url)) as proxy:
            client = self.gateway.client(proxy.url)
            done = client.wait(accepted.id, timeout=60)
            self.assertEqual(done.state, State.COMPLETED)
            seen = [s.state for s in client.follow(accepted.id)]
        self.assertEqual(seen, [State.COMPLETED], "a settled task's stream says so and ends")
        path = f"/v1/tasks/{accepted.id}"
        self.assertEqual(len(proxy.of("GET", path + "/stream")), 2)
        self.assertEqual(len(proxy.of("GET", path)), 1, "one read, for the result, no polling")

    def test_the_stream_shows_each_change_until_the_task_settles(self) -> None:
        accepted = self.client.submit(self.gateway.ok, {"n": 6})
        states = [s.state for s in self.client.follow(accepted.id, timeout=60)]
        self.assertEqual(states[-1], State.COMPLETED)
        order = [State.INGESTED, State.QUEUED, State.PROCESSING, State.COMPLETED]
        self.assertEqual(states, sorted(states, key=order.index), "in lifecycle order")

    def test_waiting_goes_on_by_polling_when_a_proxy_refuses_the_stream(self) -> None:
        forward = forward_to(self.gateway.url)

        def no_streams(seen: Seen) -> Reply:
            if seen.path.endswith("/stream"):
                return 502, {"Content-Type": "text/plain"}, b"streams are not allowed here"
            return forward(seen)

        accepted = self.client.submit(self.gateway.ok, {"n": 7})
        with LocalServer(no_streams) as proxy:
            done = self.gateway.client(proxy.url, retry=FAST_RETRIES).wait(accepted.id, timeout=60)
        self.assertEqual(done.state, State.COMPLETED)
        path = f"/v1/tasks/{accepted.id}"
        self.assertGreaterEqual(len(proxy.of("GET", path + "/stream")), 1)
        self.assertGreaterEqual(len(proxy.of("GET", path)), 1)

    def test_an_unknown_task_cannot_be_followed(self) -> None:
        with self.assertRaises(ConveyorError) as caught:
            self.client.wait(str(uuid.uuid4()), timeout=5)
        self.assertEqual((caught.exception.status, caught.exception.code), (404, "task_not_found"))


class ErrorTests(GatewayTest):
    def test_an_invalid_payload_raises_with_its_path_and_is_sent_once(self) -> None:
        with LocalServer(forward_to(self.gateway.url)) as proxy:
            client = self.gateway.client(proxy.url, retry=RetryPolicy(max_attempts=5))
            for payload, path in (({"video": 7}, "/video"), ({}, "/")):
                with self.subTest(payload=payload):
                    with self.assertRaises(ConveyorError) as caught:
                        client.submit(self.gateway.strict, payload)
                    error = caught.exception
                    self.assertEqual(
                        (error.status, error.code, error.path), (400, "invalid_payload", path)
                    )
                    self.assertEqual((error.attempts, error.retry_after), (1, None))
                    self.assertFalse(error.retryable)
        self.assertEqual(len(proxy.of("POST", "/v1/tasks")), 2, "one request per call: no retries")

    def test_an_unknown_task_is_not_found(self) -> None:
        unknown = str(uuid.uuid4())
        for call in (self.client.get, self.client.events, self.client.cancel, self.client.retry):
            with self.subTest(call=call.__name__):
                with self.assertRaises(ConveyorError) as caught:
                    call(unknown)
                self.assertEqual(
                    (caught.exception.status, caught.exception.code), (404, "task_not_found")
                )
        with self.assertRaises(ConveyorError) as caught:
            self.client.get("not-a-uuid")
        self.assertEqual((caught.exception.status, caught.exception.code), (400, "invalid_id"))

    def test_a_bad_token_is_unauthorized_and_not_retried(self) -> None:
        with LocalServer(forward_to(self.gateway.url)) as proxy:
            client = Client(proxy.url, "not-the-token", retry=FAST_RETRIES)
            with self.assertRaises(ConveyorError) as caught:
                client.submit(self.gateway.ok, {})
        self.assertEqual((caught.exception.status, caught.exception.code), (401, "unauthorized"))
        self.assertEqual(len(proxy.requests), 1)
