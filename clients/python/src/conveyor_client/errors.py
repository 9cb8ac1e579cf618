"""What a call raises: the gateway's error answer, or the lack of one."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    from .models import Task

#: Answers worth asking again with the same request: 429 and 503 as the gateway says (with
#: Retry-After), 500 because its `internal` says to retry with the same key, 502 and 504
#: from a proxy in front of it.
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})


class ConveyorError(Exception):
    """An error from the gateway: `code` is stable and meant for programs (`queue_full`,
    `invalid_payload`...), `message` for people, `path` the JSON pointer of a payload's
    first offending value.

    `attempts` is how many requests the call sent, and `unanswered` how many of them got
    no answer: an unanswered request may still have done its work.
    """

    def __init__(
        self,
        message: str,
        *,
        status: Optional[int] = None,
        code: str = "",
        path: Optional[str] = None,
        retry_after: Optional[float] = None,
        attempts: int = 1,
        unanswered: int = 0,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.path = path
        self.retry_after = retry_after
        self.attempts = attempts
        self.unanswered = unanswered

    @property
    def retryable(self) -> bool:
        """Whether the same request, with the same idempotency keys, may succeed later."""
        return self.status in RETRYABLE_STATUSES

    @classmethod
    def from_json(cls, error: Mapping[str, Any], status: Optional[int] = None) -> ConveyorError:
        """An `error` object of the API, as answers, batch entries and redrives carry it."""
        return cls(
            str(error.get("message", "")),
            status=status,
            code=str(error.get("code", "")),
            path=error.get("path"),
        )

    @classmethod
    def from_answer(
        cls, status: int, body: bytes, retry_after: Optional[float] = None
    ) -> ConveyorError:
        """An error answer; a body that is not the API's (a proxy's page) is kept as text."""
        try:
            error = json.loads(body)["error"]
            if not isinstance(error, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            text = body.decode("utf-8", "replace").strip()[:500]
            error = {"code": f"http_{status}", "message": text or f"HTTP {status}"}
        found = cls.from_json(error, status)
        found.retry_after = retry_after
        return found

    def __str__(self) -> str:
        where = f" at {self.path}" if self.path else ""
        status = f"{self.status} " if self.status is not None else ""
        return f"{status}{self.code}: {self.message}{where}"

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(status={self.status!r}, code={self.code!r}, message={self.message!r})"


class NoAnswer(ConveyorError):
    """The call's last attempt got no answer: the connection failed, was dropped or timed
    out. A submission may still have been recorded: submit again with the same key."""

    def __init__(self, message: str, *, attempts: int, unanswered: int) -> None:
        super().__init__(message, code="no_answer", attempts=attempts, unanswered=unanswered)


class WaitTimeout(ConveyorError, TimeoutError):
    """`Client.wait` ran out of time before the task settled; `task` is its last reading."""

    def __init__(self, task: Task, timeout: float) -> None:
        super().__init__(
            f"task {task.id} is still {task.state} after {timeout:g} s",
            code="wait_timeout",
        )
        self.task = task
