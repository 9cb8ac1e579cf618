"""Listing on the real gateway: filters by type, labels, state and time, and pages
followed to the end without a task twice."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, List, Set

from conveyor_client import NewTask, State

from .support import GatewayTest, LocalServer, forward_to, run_label, wait_all


class ListingTests(GatewayTest):
    label: str
    gold: List[str]
    silver: List[str]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.label = run_label()
        tasks = [
            NewTask(cls.gateway.ok, {"n": n}, {"run": cls.label, "tier": "gold"}) for n in range(5)
        ]
        tasks += [
            NewTask(cls.gateway.ok, {"n": n}, {"run": cls.label, "tier": "silver"})
            for n in range(2)
        ]
        ids = [r.unwrap().id for r in cls.client.submit_batch(tasks)]
        wait_all(cls.client, ids)
        cls.gold, cls.silver = ids[:5], ids[5:]

    def test_pages_of_two_are_followed_to_the_end_without_repeats(self) -> None:
        with LocalServer(forward_to(self.gateway.url)) as proxy:
            client = self.gateway.client(proxy.url)
            found = list(
                client.iter_tasks(
                    task_type=self.gateway.ok,
                    label_selector=f"run={self.label},tier=gold",
                    states=[State.COMPLETED],
                    page_size=2,
                )
            )
        ids = [t.id for t in found]
        self.assertEqual(len(ids), len(set(ids)), "no task twice")
        self.assertEqual(set(ids), set(self.gold))
        self.assertGreaterEqual(len(proxy.of("GET", "/v1/tasks")), 3, "five tasks, two a page")
        created = [t.created_at for t in found]
        self.assertEqual(created, sorted(created, reverse=True), "newest first")
        for summary in found:
            self.assertEqual(summary.labels, {"run": self.label, "tier": "gold"})
            self.assertEqual(summary.state, State.COMPLETED)

        # A summary says what a read of the task says.
        task = self.client.get(found[0].id)
        self.assertEqual(
            (task.state, task.labels, task.created_at),
            (found[0].state, found[0].labels, found[0].created_at),
        )

    def test_one_page_and_its_cursor(self) -> None:
        first = self.client.list_tasks(label_selector=f"run={self.label}", page_size=2)
        self.assertEqual(len(first.tasks), 2)
        self.assertIsNotNone(first.next_cursor)
        second = self.client.list_tasks(
            label_selector=f"run={self.label}", page_size=2, cursor=first.next_cursor
        )
        self.assertEqual(len(second.tasks), 2)
        self.assertFalse({t.id for t in first.tasks} & {t.id for t in second.tasks})

    def test_selectors_states_and_times_narrow_the_list(self) -> None:
        def ids(**filters: Any) -> Set[str]:
            return {t.id for t in self.client.iter_tasks(**filters)}

        run = f"run={self.label}"
        self.assertEqual(ids(label_selector=f"{run},tier in (silver)"), set(self.silver))
        self.assertEqual(ids(label_selector=f"{run},tier notin (silver)"), set(self.gold))
        self.assertEqual(ids(label_selector=f"{run},!tier"), set())
        self.assertEqual(
            ids(label_selector=run, states=[State.DEAD_LETTER, State.CANCELLED]), set()
        )
        self.assertEqual(ids(label_selector=run, task_type=self.gateway.failing), set())

        later = datetime.now(timezone.utc) + timedelta(hours=1)
        earlier = datetime.now(timezone.utc) - timedelta(hours=1)
        everything = set(self.gold + self.silver)
        self.assertEqual(
            ids(label_selector=run, created_after=earlier, created_before=later), everything
        )
        self.assertEqual(ids(label_selector=run, created_after=later), set())
        self.assertEqual(ids(label_selector=run, updated_before=earlier.isoformat()), set())
        self.assertEqual(ids(label_selector=run, updated_after=earlier.isoformat()), everything)
