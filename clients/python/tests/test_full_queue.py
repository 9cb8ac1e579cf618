"""The real gateway's full type: a queue of at most one task and no worker, so a task
there waits for ever (and can be cancelled), and once two wait there every submission is
turned away with 429 `queue_full`. Nothing ever drains it: the task to cancel is
submitted first, while there is room."""

from __future__ import annotations

import time

from conveyor_client import Accepted, ConveyorError, RetryPolicy, State, WaitTimeout

from .support import FAST_RETRIES, GatewayTest, LocalServer, forward_to


class FullQueueTests(GatewayTest):
    waiting: Accepted

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.waiting = cls.client.submit(cls.gateway.full, {"wait": "for ever"})

    def test_a_waiting_task_is_cancelled_once(self) -> None:
        with self.assertRaises(WaitTimeout) as timed_out:
            self.client.wait(self.waiting.id, timeout=0.5)
        self.assertIsInstance(timed_out.exception, TimeoutError)
        self.assertEqual(timed_out.exception.task.state, State.QUEUED, "nobody takes it")

        cancelled = self.client.cancel(self.waiting.id)
        self.assertEqual(cancelled.state, State.CANCELLED)

        self.assertEqual(self.client.get(self.waiting.id).state, State.CANCELLED)
        last = self.client.events(self.waiting.id)[-1]
        self.assertEqual(
            (last.to_state, last.detail), (State.CANCELLED, "cancelled by client tests")
        )

        with self.assertRaises(ConveyorError) as caught:
            self.client.cancel(self.waiting.id)
        error = caught.exception
        self.assertEqual((error.status, error.code, error.attempts), (409, "not_cancellable", 1))

    def test_a_full_queue_is_retried_with_the_same_key_then_raised(self) -> None:
        self.fill_the_queue()
        with LocalServer(forward_to(self.gateway.url)) as proxy:
            client = self.gateway.client(proxy.url, retry=FAST_RETRIES)
            started = time.monotonic()
            with self.assertRaises(ConveyorError) as caught:
                client.submit(self.gateway.full, {"late": True})
            took = time.monotonic() - started

        error = caught.exception
        self.assertEqual((error.status, error.code, error.attempts), (429, "queue_full", 3))
        assert error.retry_after is not None
        self.assertGreaterEqual(error.retry_after, 1, "the gateway's Retry-After")
        self.assertTrue(error.retryable)
        sent = proxy.of("POST", "/v1/tasks")
        self.assertEqual(len(sent), 3)
        keys = {r.headers["idempotency-key"] for r in sent}
        self.assertEqual(len(keys), 1, "every attempt is the same submission")
        self.assertEqual({r.body for r in sent}, {sent[0].body})
        # Two waits, each Retry-After capped at max_wait (0.2 s), not the seconds it asks.
        self.assertGreaterEqual(took, 0.4)
        self.assertLess(took, error.retry_after)
        # Turned away, it was never recorded.
        recorded = {t.idempotency_key for t in self.client.iter_tasks(task_type=self.gateway.full)}
        self.assertNotIn(keys.pop(), recorded)
        self.assertIn(self.waiting.idempotency_key, recorded)

    def fill_the_queue(self) -> None:
        """Submits until the gateway, which reads queue depths every 200 ms, says full."""
        once = self.gateway.client(retry=RetryPolicy(max_attempts=1))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                once.submit(self.gateway.full, {"filler": True})
            except ConveyorError as error:
                if error.code == "queue_full":
                    return
                raise
            time.sleep(0.1)
        self.fail("the full type's queue never answered queue_full")
