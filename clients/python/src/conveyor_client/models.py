"""The API's values as typed, immutable objects: the JSON's camelCase fields in snake_case,
times as aware datetimes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional, Union

from .errors import ConveyorError


class State:
    """A task's states. Plain strings rather than an Enum, so that a state a newer gateway
    adds still reads."""

    INGESTED = "INGESTED"
    QUEUED = "QUEUED"
    CLAIMED = "CLAIMED"
    PROCESSING = "PROCESSING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    RETRY_CLAIMED = "RETRY_CLAIMED"
    DEAD_LETTER = "DEAD_LETTER"
    CANCELLED = "CANCELLED"


#: Where a task rests: nothing moves it on but a client's retry or redrive.
SETTLED = frozenset({State.COMPLETED, State.DEAD_LETTER, State.CANCELLED})

_RFC3339 = re.compile(r"(.+?[Tt ]\d\d:\d\d:\d\d)(?:\.(\d+))?([Zz]|[+-]\d\d:\d\d)")


def parse_time(text: str) -> datetime:
    """RFC 3339 as the gateway writes it (`...Z`, up to nanoseconds), which
    `datetime.fromisoformat` takes only from Python 3.11 on."""
    match = _RFC3339.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    base, fraction, zone = match.groups()
    fraction = "." + fraction[:6].ljust(6, "0") if fraction else ""
    zone = "+00:00" if zone in ("Z", "z") else zone
    return datetime.fromisoformat(base + fraction + zone)


def format_time(value: Union[datetime, str]) -> str:
    """A query's time in RFC 3339; a string is taken as already written so."""
    if isinstance(value, str):
        return value
    if value.tzinfo is None:
        raise ValueError("a naive datetime is ambiguous: give it a timezone")
    return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class NewTask:
    """One task of a batch. Without an `idempotency_key` the client makes one."""

    task_type: str
    payload: Any
    labels: Optional[Mapping[str, str]] = None
    namespace: Optional[str] = None
    idempotency_key: Optional[str] = None


@dataclass(frozen=True)
class Accepted:
    """A submission's answer. `created` is False when the key was seen before: then this
    is the task that key made then (answered 200 rather than 201)."""

    id: str
    state: str
    idempotency_key: str
    created: bool

    @classmethod
    def from_json(cls, data: Mapping[str, Any], status: int) -> Accepted:
        return cls(data["id"], data["state"], data["idempotencyKey"], status == 201)


@dataclass(frozen=True)
class BatchResult:
    """One task's answer in a batch, in the order submitted: `accepted` or `error`.
    `idempotency_key` is the key sent for it, to submit it again as the same task."""

    idempotency_key: str
    status: int
    accepted: Optional[Accepted] = None
    error: Optional[ConveyorError] = None

    @property
    def ok(self) -> bool:
        return self.accepted is not None

    def unwrap(self) -> Accepted:
        """The accepted task, or its error raised."""
        if self.accepted is None:
            raise self.error or ConveyorError("no answer for this task", status=self.status)
        return self.accepted

    @classmethod
    def from_json(cls, data: Mapping[str, Any], key: str) -> BatchResult:
        status = int(data["status"])
        if "error" in data:
            return cls(key, status, error=ConveyorError.from_json(data["error"], status))
        return cls(key, status, accepted=Accepted.from_json(data, status))


@dataclass(frozen=True)
class TaskSummary:
    """A task as lists show it: everything but its payload and result."""

    id: str
    namespace: str
    task_type: str
    idempotency_key: str
    state: str
    attempt: int
    retries: int
    labels: Dict[str, str]
    created_at: datetime
    updated_at: datetime
    suspect: bool = False
    owner: Optional[str] = None
    error: Optional[str] = None

    @property
    def settled(self) -> bool:
        return self.state in SETTLED

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TaskSummary:
        return cls(**cls._fields(data))

    @staticmethod
    def _fields(data: Mapping[str, Any]) -> Dict[str, Any]:
        return dict(
            id=data["id"],
            namespace=data["namespace"],
            task_type=data["taskType"],
            idempotency_key=data["idempotencyKey"],
            state=data["state"],
            attempt=data["attempt"],
            retries=data["retries"],
            labels=dict(data.get("labels") or {}),
            created_at=parse_time(data["createdAt"]),
            updated_at=parse_time(data["updatedAt"]),
            suspect=bool(data.get("suspect", False)),
            owner=data.get("owner"),
            error=data.get("error"),
        )


@dataclass(frozen=True)
class Task(TaskSummary):
    """A task with its payload, and its result once COMPLETED."""

    payload: Any = None
    result: Any = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Task:
        return cls(**cls._fields(data), payload=data.get("payload"), result=data.get("result"))


@dataclass(frozen=True)
class Event:
    """One step of a task's audit timeline. `detail` says why (`retried by client x`),
    `worker_id` who moved it."""

    seq: int
    task_id: str
    task_type: str
    to_state: str
    attempt: int
    at: datetime
    from_state: Optional[str] = None
    worker_id: Optional[str] = None
    detail: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Event:
        return cls(
            seq=data["seq"],
            task_id=data["taskId"],
            task_type=data["taskType"],
            to_state=data["toState"],
            attempt=data["attempt"],
            at=parse_time(data["at"]),
            from_state=data.get("fromState"),
            worker_id=data.get("workerId"),
            detail=data.get("detail"),
        )


@dataclass(frozen=True)
class Page:
    """One page of a listing, newest first; `next_cursor` is None on the last."""

    tasks: List[TaskSummary] = field(default_factory=list)
    next_cursor: Optional[str] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Page:
        tasks = [TaskSummary.from_json(t) for t in data.get("tasks", [])]
        return cls(tasks, data.get("nextCursor"))


@dataclass(frozen=True)
class RedriveResult:
    """What a redrive sent back to work. `more`: further dead letters match, so send it
    again. `error`: why it stopped early; what it redrove stays redriven."""

    redriven: int
    skipped: int
    more: bool
    error: Optional[ConveyorError] = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RedriveResult:
        error = data.get("error")
        return cls(
            int(data["redriven"]),
            int(data["skipped"]),
            bool(data["more"]),
            ConveyorError.from_json(error) if error else None,
        )
