"""The client: submit tasks, follow them, and fix them."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
import uuid
from dataclasses import replace
from datetime import datetime
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Union

from ._http import Http, RetryPolicy
from .errors import ConveyorError, WaitTimeout
from .models import (
    Accepted,
    BatchResult,
    Event,
    NewTask,
    Page,
    RedriveResult,
    State,
    Task,
    TaskSummary,
    format_time,
)

Time = Union[datetime, str]


class Client:
    """A Conveyor gateway's `/v1` API.

    `url` is the gateway's (`https://...` or `http://...`), `token` a bearer token;
    `namespace` is used wherever a call names none (a token of several namespaces must
    name one); `ca_file` trusts a private CA; `timeout` bounds each request, `retry` each
    call. It holds no state between calls, so one client serves any number of threads.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        namespace: Optional[str] = None,
        timeout: float = 30.0,
        ca_file: Optional[str] = None,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.namespace = namespace
        self._http = Http(url, token, timeout=timeout, ca_file=ca_file, retry=retry)

    # Submitting

    def submit(
        self,
        task_type: str,
        payload: Any,
        *,
        labels: Optional[Mapping[str, str]] = None,
        namespace: Optional[str] = None,
        idempotency_key: Optional[str] = None,
    ) -> Accepted:
        """Submits one task. Every retry of this call carries the same key (a new UUID
        unless given), so the task is recorded once however often it is sent; give your
        own key to make a later call the same submission."""
        task = NewTask(task_type, payload, labels, namespace, idempotency_key or str(uuid.uuid4()))
        reply = self._http.call(
            "POST",
            "/v1/tasks",
            body=self._submission(task, with_key=False),
            headers={"Idempotency-Key": str(task.idempotency_key)},
        )
        return Accepted.from_json(reply.body, reply.status)

    def submit_batch(self, tasks: Iterable[NewTask]) -> List[BatchResult]:
        """Submits tasks in one request; answers one `BatchResult` per task, in order. Each
        task gets its own key (unless it has one), kept across retries of the request.
        Tasks refused one by one are not retried: resubmit those whose `error.retryable`
        with their `idempotency_key`."""
        keyed = [
            t if t.idempotency_key else replace(t, idempotency_key=str(uuid.uuid4())) for t in tasks
        ]
        reply = self._http.call(
            "POST", "/v1/tasks:batch", body={"tasks": [self._submission(t) for t in keyed]}
        )
        answers = reply.body["results"]
        if len(answers) != len(keyed):
            raise ConveyorError(
                f"{len(answers)} answers for {len(keyed)} tasks",
                status=reply.status,
                code="invalid_answer",
            )
        return [BatchResult.from_json(a, str(t.idempotency_key)) for t, a in zip(keyed, answers)]

    def _submission(self, task: NewTask, *, with_key: bool = True) -> Dict[str, Any]:
        body: Dict[str, Any] = {"taskType": task.task_type, "payload": task.payload}
        namespace = task.namespace or self.namespace
        if namespace:
            body["namespace"] = namespace
        if task.labels:
            body["labels"] = dict(task.labels)
        if with_key:
            body["idempotencyKey"] = task.idempotency_key
        return body

    # Reading

    def get(self, task_id: str) -> Task:
        """The task with its payload and result; 404 `task_not_found` if it is not yours."""
        return Task.from_json(self._http.call("GET", _task_path(task_id)).body)

    def events(self, task_id: str) -> List[Event]:
        """The task's audit timeline, oldest first."""
        reply = self._http.call("GET", _task_path(task_id) + "/events")
        return [Event.from_json(e) for e in reply.body["events"]]

    def wait(
        self, task_id: str, *, timeout: float = 60.0, poll: float = 0.2, max_poll: float = 2.0
    ) -> Task:
        """The task once settled (COMPLETED, DEAD_LETTER or CANCELLED), with its result.

        Follows the task's event stream, so a long wait holds one open request instead of
        reading the task again and again. When the stream cannot be had or breaks off (a
        gateway restarting, a proxy that buffers), it reads the task once, waits `poll`
        seconds (half as long again each time, up to `max_poll`) and follows again. Raises
        `WaitTimeout` after `timeout` seconds, `ConveyorError` if the task is not yours."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                for summary in self.follow(task_id, timeout=deadline - time.monotonic()):
                    if summary.settled:
                        return self.get(task_id)
            except ConveyorError as broken:
                # An answer that another try could change goes on by polling; a refusal
                # (not yours, not allowed) raises. No answer, or an error event: no status.
                if broken.status is not None and not broken.retryable:
                    raise
            except (OSError, http.client.HTTPException):
                pass  # dropped or silent: poll, then follow again
            task = self.get(task_id)
            if task.settled:
                return task
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(task, timeout)
            time.sleep(min(poll, left))
            poll = min(poll * 1.5, max_poll)

    def follow(self, task_id: str, *, timeout: float = 3600.0) -> Iterator[TaskSummary]:
        """The task now and at each change (state, attempt or progress), from its event
        stream, until it settles, the gateway ends the stream (after an hour), or `timeout`
        seconds pass. Raises `ConveyorError` for an error answer or an error event, and
        `OSError` if the connection drops or stays silent."""
        deadline = time.monotonic() + timeout
        path = _task_path(task_id) + "/stream"
        # The gateway's comments every 15 s keep a healthy stream from timing out.
        read_timeout = max(min(30.0, timeout), 0.001)
        for event, data in self._http.events(path, read_timeout=read_timeout):
            if event == "error":
                raise ConveyorError.from_json(json.loads(data))
            if event == "task":
                summary = TaskSummary.from_json(json.loads(data))
                yield summary
                if summary.settled:
                    return
            if time.monotonic() >= deadline:
                return

    def list_tasks(
        self,
        *,
        task_type: Optional[str] = None,
        namespace: Optional[str] = None,
        states: Optional[Iterable[str]] = None,
        label_selector: Optional[str] = None,
        created_after: Optional[Time] = None,
        created_before: Optional[Time] = None,
        updated_after: Optional[Time] = None,
        updated_before: Optional[Time] = None,
        page_size: Optional[int] = None,
        cursor: Optional[str] = None,
    ) -> Page:
        """One page of your tasks, newest first. Every filter narrows the list: `states`
        any of these, `label_selector` Kubernetes syntax (`tier in (gold),!canary`), times
        as aware datetimes or RFC 3339. `page_size` is 1 to 500 (the gateway's default 50);
        pass a page's `next_cursor` as `cursor` for the next."""
        query = {
            "type": task_type,
            "namespace": namespace or self.namespace,
            "state": ",".join(states) if states is not None else None,
            "labelSelector": label_selector,
            "createdAfter": created_after,
            "createdBefore": created_before,
            "updatedAfter": updated_after,
            "updatedBefore": updated_before,
            "limit": page_size,
            "cursor": cursor,
        }
        sent = {k: _query_value(v) for k, v in query.items() if v is not None}
        return Page.from_json(self._http.call("GET", "/v1/tasks", query=sent).body)

    def iter_tasks(
        self,
        *,
        task_type: Optional[str] = None,
        namespace: Optional[str] = None,
        states: Optional[Iterable[str]] = None,
        label_selector: Optional[str] = None,
        created_after: Optional[Time] = None,
        created_before: Optional[Time] = None,
        updated_after: Optional[Time] = None,
        updated_before: Optional[Time] = None,
        page_size: Optional[int] = None,
    ) -> Iterator[TaskSummary]:
        """Every task `list_tasks` would find with these filters, page after page, each
        page read as the iteration reaches it."""
        states = list(states) if states is not None else None
        cursor: Optional[str] = None
        while True:
            page = self.list_tasks(
                task_type=task_type,
                namespace=namespace,
                states=states,
                label_selector=label_selector,
                created_after=created_after,
                created_before=created_before,
                updated_after=updated_after,
                updated_before=updated_before,
                page_size=page_size,
                cursor=cursor,
            )
            yield from page.tasks
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    # Remedies, audited with the token's client name

    def cancel(self, task_id: str) -> Task:
        """Cancels a task still waiting (INGESTED or QUEUED): it becomes CANCELLED and never
        runs. 409 `not_cancellable` once a worker has it or it is settled. If an earlier
        attempt of this call went unanswered and the task is CANCELLED now, that attempt
        did it (or someone else did): the task is returned rather than the 409."""
        try:
            return Task.from_json(self._http.call("POST", _task_path(task_id) + ":cancel").body)
        except ConveyorError as error:
            if error.status == 409 and error.unanswered:
                task = self.get(task_id)
                if task.state == State.CANCELLED:
                    return task
            raise

    def retry(self, task_id: str) -> Task:
        """Sends a DEAD_LETTER task back to work with a fresh retry budget; 409
        `not_dead_lettered` otherwise. A 409 with `error.unanswered` set may follow an
        earlier attempt of this call that did send it back: `events` tells."""
        return Task.from_json(self._http.call("POST", _task_path(task_id) + ":retry").body)

    def redrive(
        self,
        task_type: str,
        label_selector: Optional[str] = None,
        limit: Optional[int] = None,
        namespace: Optional[str] = None,
    ) -> RedriveResult:
        """Sends up to `limit` (1 to 1000, the default) of a type's dead letters matching
        `label_selector` back to work, newest first; call again while `more`. After an
        unanswered attempt the counts are the last attempt's only."""
        body: Dict[str, Any] = {"taskType": task_type}
        namespace = namespace or self.namespace
        for name, value in (
            ("namespace", namespace),
            ("labelSelector", label_selector),
            ("limit", limit),
        ):
            if value is not None:
                body[name] = value
        return RedriveResult.from_json(self._http.call("POST", "/v1/tasks:redrive", body=body).body)


def _task_path(task_id: str) -> str:
    return "/v1/tasks/" + urllib.parse.quote(str(task_id), safe="")


def _query_value(value: Union[Time, int]) -> str:
    return format_time(value) if isinstance(value, datetime) else str(value)
