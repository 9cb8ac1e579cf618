"""Another tenant's token, through the client: it sees its own tasks only (its namespace has
a type of the same name as ours), and every call about ours answers as for tasks and types
that do not exist."""

from __future__ import annotations

import unittest

from conveyor_client import Client, ConveyorError

from .support import Gateway, env, run_label


class AnotherTenant(unittest.TestCase):
    def test_another_tenants_token_sees_and_changes_nothing_of_ours(self) -> None:
        gateway = Gateway()
        ours = gateway.client()
        label = run_label()
        accepted = ours.submit(gateway.ok, {"n": 1}, labels={"run": label})
        theirs = Client(gateway.url, env("CONVEYOR_OTHER_TOKEN"))
        # The same type name and labels, in their namespace.
        own = theirs.submit(gateway.ok, {"n": 2}, labels={"run": label})
        self.assertEqual(theirs.get(own.id).namespace, "elsewhere")

        for listed in (theirs.iter_tasks(), theirs.iter_tasks(label_selector=f"run={label}")):
            self.assertEqual([t.id for t in listed], [own.id])
        self.assertEqual([t.id for t in ours.iter_tasks(label_selector=f"run={label}")], [accepted.id])
        for call in (theirs.get, theirs.events, theirs.cancel, theirs.retry, theirs.wait):
            with self.assertRaises(ConveyorError) as refused:
                call(accepted.id)
            self.assertEqual((refused.exception.status, refused.exception.code), (404, "task_not_found"))
        with self.assertRaises(ConveyorError) as refused:
            theirs.redrive(gateway.failing)
        self.assertEqual(refused.exception.code, "unknown_task_type")
        # Ours is still ours, and was not cancelled.
        self.assertEqual(ours.wait(accepted.id, timeout=60).state, "COMPLETED")
        self.assertIn(accepted.id, [t.id for t in ours.iter_tasks(label_selector=f"run={label}")])


if __name__ == "__main__":
    unittest.main()
