"""One JSON request to the gateway, sent again while that is safe and worth it.

Every call the client makes may be repeated: a submission carries its idempotency keys, a
read changes nothing, and a remedy repeated answers 409 or finds nothing left to do. So a
call is sent again, unchanged, after an answer in `RETRYABLE_STATUSES` or none at all;
never after another error, which would only answer the same.
"""

from __future__ import annotations

import http.client
import json
import random
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

from . import __version__
from .errors import ConveyorError, NoAnswer


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long one call is tried.

    A call stops at `max_attempts` requests, or when the next wait would end past
    `deadline` seconds after it began. Between attempts it waits what `Retry-After` says,
    else `base_delay` doubled at each attempt with jitter; either at most `max_wait`.
    """

    max_attempts: int = 5
    deadline: float = 60.0
    base_delay: float = 0.25
    max_wait: float = 30.0

    def delay(self, attempt: int, retry_after: Optional[float]) -> float:
        """The wait after `attempt` (1 for the first) failed."""
        if retry_after is not None:
            return min(retry_after, self.max_wait)
        ceiling = min(self.base_delay * 2 ** (attempt - 1), self.max_wait)
        # Jittered so that clients turned away together do not come back together.
        return random.uniform(ceiling / 2, ceiling)


class Reply(NamedTuple):
    status: int
    body: Any


def _retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds from a `Retry-After` header: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _never_better(error: BaseException) -> bool:
    """A transport failure that repeating cannot mend: a certificate not trusted."""
    reason = getattr(error, "reason", error)
    return isinstance(reason, ssl.SSLCertVerificationError)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """The gateway never redirects: a 3xx comes from something else (a proxy, a login
    page, another host), and following it would hand the token to it. The 3xx is answered
    as an error instead."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


class Http:
    """Sends JSON requests with the token, following a `RetryPolicy`; never a redirect."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float,
        ca_file: Optional[str],
        retry: RetryPolicy,
    ) -> None:
        self.base = url.rstrip("/")
        self.timeout = timeout
        self.retry = retry
        self.headers = {
            "Authorization": f"Bearer {token}",
            "Accept": "application/json",
            "User-Agent": f"conveyor-client-python/{__version__}",
        }
        context = ssl.create_default_context(cafile=ca_file)
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPSHandler(context=context), _NoRedirects()
        )

    def call(
        self,
        method: str,
        path: str,
        *,
        query: Optional[Mapping[str, str]] = None,
        body: Any = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> Reply:
        """The answer to `method path`, parsed; an error answer or none raises."""
        url = self.base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        sent = {**self.headers, **(headers or {})}
        if data is not None:
            sent["Content-Type"] = "application/json"
        began = time.monotonic()
        unanswered = 0
        attempt = 0
        while True:
            attempt += 1
            left = self.retry.deadline - (time.monotonic() - began)
            try:
                status, retry_after, raw = self._send(method, url, data, sent, max(left, 0.001))
            except (OSError, http.client.HTTPException) as failure:
                unanswered += 1
                error: ConveyorError = NoAnswer(
                    f"{method} {path}: no answer ({failure})",
                    attempts=attempt,
                    unanswered=unanswered,
                )
                error.__cause__ = failure
                if _never_better(failure):
                    raise error
            else:
                if status < 300:
                    return Reply(status, self._parse(status, raw))
                if status < 400:
                    raise ConveyorError(
                        f"{method} {path}: answered {status}, a redirect, which is not followed "
                        "(the token goes to the gateway's URL only); check the URL",
                        status=status,
                        code="redirect_refused",
                    )
                error = ConveyorError.from_answer(status, raw, retry_after)
                error.attempts, error.unanswered = attempt, unanswered
                if not error.retryable:
                    raise error
            wait = self.retry.delay(attempt, error.retry_after)
            spent = time.monotonic() - began
            if attempt >= self.retry.max_attempts or spent + wait >= self.retry.deadline:
                raise error
            time.sleep(wait)

    def _send(
        self, method: str, url: str, data: Optional[bytes], headers: Dict[str, str], timeout: float
    ) -> Tuple[int, Optional[float], bytes]:
        """One request: its status, Retry-After and body, whatever the status."""
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self.opener.open(request, timeout=min(self.timeout, timeout)) as response:
                return response.status, None, response.read()
        except urllib.error.HTTPError as answer:
            with answer:
                return answer.code, _retry_after(answer.headers.get("Retry-After")), answer.read()

    def events(self, path: str, *, read_timeout: float) -> Iterator[Tuple[str, str]]:
        """Server-sent events from `path`, as (event, data), until the gateway ends the
        stream. Not retried: an error answer raises `ConveyorError`, none `NoAnswer`; a
        read that waits `read_timeout` seconds (the gateway sends a comment every 15 s)
        or a dropped connection raises `OSError`."""
        headers = {**self.headers, "Accept": "text/event-stream"}
        request = urllib.request.Request(self.base + path, headers=headers)
        try:
            response = self.opener.open(request, timeout=read_timeout)
        except urllib.error.HTTPError as answer:
            with answer:
                raise ConveyorError.from_answer(
                    answer.code, answer.read(), _retry_after(answer.headers.get("Retry-After"))
                ) from None
        except (OSError, http.client.HTTPException) as failure:
            raise NoAnswer(f"GET {path}: no answer ({failure})", attempts=1, unanswered=1) from failure
        if response.status >= 300:
            response.close()
            raise ConveyorError(
                f"GET {path}: answered {response.status}, a redirect, which is not followed",
                status=response.status,
                code="redirect_refused",
            )
        with response:
            event, data = "message", []  # type: Tuple[str, List[str]]
            for raw in response:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line:
                    if data:
                        yield event, "\n".join(data)
                    event, data = "message", []
                elif not line.startswith(":"):  # a comment keeps the connection alive
                    field, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if field == "event":
                        event = value
                    elif field == "data":
                        data.append(value)

    @staticmethod
    def _parse(status: int, raw: bytes) -> Any:
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise ConveyorError(
                f"the gateway answered {status} with a body that is not JSON",
                status=status,
                code="invalid_answer",
            ) from None
