"""Retry and redrive on the real gateway's failing type (no retries, a worker that always
fails): a dead letter sent back fails again and rests in DEAD_LETTER once more, and its
timeline says who sent it back."""

from __future__ import annotations

from typing import List

from conveyor_client import ConveyorError, Event, NewTask, State

from .support import GatewayTest, eventually, run_label, wait_all

RETRIED = "retried by client tests"  # the test token's client is named `tests`
REDRIVEN = "redriven by client tests"


def sent_back(events: List[Event]) -> List[Event]:
    return [e for e in events if e.from_state == State.DEAD_LETTER and e.to_state == State.QUEUED]


def dead_lettered(events: List[Event]) -> int:
    return sum(e.to_state == State.DEAD_LETTER for e in events)


class RemedyTests(GatewayTest):
    def rests_again(self, task_id: str) -> bool:
        """Dead-lettered once more after each time it was sent back."""
        events = self.client.events(task_id)
        return (
            events[-1].to_state == State.DEAD_LETTER
            and dead_lettered(events) == len(sent_back(events)) + 1
        )

    def test_a_dead_letter_retried_runs_again(self) -> None:
        accepted = self.client.submit(self.gateway.failing, {"doomed": True})
        dead = self.client.wait(accepted.id, timeout=30)
        self.assertEqual(dead.state, State.DEAD_LETTER)
        self.assertEqual(dead.error, "the fail handler always fails")

        retried = self.client.retry(accepted.id)
        self.assertEqual(retried.id, accepted.id)
        self.assertGreater(retried.attempt, dead.attempt, "back in a queue: a new attempt")

        again = self.client.wait(accepted.id, timeout=30)
        self.assertEqual(again.state, State.DEAD_LETTER)
        events = self.client.events(accepted.id)
        back = sent_back(events)
        self.assertEqual(len(back), 1)
        self.assertEqual(back[0].detail, RETRIED)
        self.assertEqual(dead_lettered(events), 2, "failed again after the retry")

        with self.assertRaises(ConveyorError) as caught:
            self.client.retry(self.client.submit(self.gateway.ok, {}).id)
        self.assertEqual(
            (caught.exception.status, caught.exception.code), (409, "not_dead_lettered")
        )

    def test_redrive_sends_back_the_dead_letters_its_selector_matches(self) -> None:
        run, bystander_run = run_label(), run_label()
        tasks = [NewTask(self.gateway.failing, {"n": n}, {"run": run}) for n in range(3)]
        tasks.append(NewTask(self.gateway.failing, {"n": 3}, {"run": bystander_run}))
        ids = [r.unwrap().id for r in self.client.submit_batch(tasks)]
        mine, bystander = ids[:3], ids[3]
        self.assertTrue(all(t.state == State.DEAD_LETTER for t in wait_all(self.client, ids)))

        first = self.client.redrive(self.gateway.failing, label_selector=f"run={run}", limit=2)
        self.assertEqual(
            (first.redriven, first.skipped, first.more, first.error), (2, 0, True, None)
        )
        eventually("the two redriven fail again", lambda: all(map(self.rests_again, mine)))

        rest = self.client.redrive(self.gateway.failing, label_selector=f"run={run}")
        self.assertEqual((rest.redriven, rest.more), (3, False))
        eventually("all three fail again", lambda: all(map(self.rests_again, mine)))
        counts = sorted(len(sent_back(self.client.events(i))) for i in mine)
        self.assertEqual(counts, [1, 2, 2], "the first redrive took two, the second all three")
        for task_id in mine:
            self.assertTrue(
                all(e.detail == REDRIVEN for e in sent_back(self.client.events(task_id)))
            )

        self.assertEqual(sent_back(self.client.events(bystander)), [], "not selected, not touched")
        self.assertEqual(self.client.get(bystander).state, State.DEAD_LETTER)
