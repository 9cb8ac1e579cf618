"""What the tests share: the real gateway's settings from the environment, and a loopback
HTTP server that either forwards to the gateway (to count and inspect the requests a call
really sent) or answers from a script (to fail in ways the gateway will not on demand)."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import unittest
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union
from urllib.parse import urlsplit

from conveyor_client import Client, RetryPolicy, Task


def env(name: str) -> str:
    """A setting the suite cannot run without: missing fails the tests, never skips them."""
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"{name} is not set: these tests run against a real gateway; "
            "see clients/python/README.md"
        )
    return value


class Gateway:
    """The gateway under test and its task types (see the README for each one's part)."""

    def __init__(self) -> None:
        self.url = env("CONVEYOR_URL")
        self.token = env("CONVEYOR_TOKEN")
        self.ok = env("CONVEYOR_TYPE_OK")
        self.failing = env("CONVEYOR_TYPE_FAILING")
        self.full = env("CONVEYOR_TYPE_FULL")
        self.strict = env("CONVEYOR_TYPE_STRICT")

    def client(self, url: Optional[str] = None, **options: Any) -> Client:
        return Client(url or self.url, self.token, **options)


# Tests that count requests want them quick and few.
FAST_RETRIES = RetryPolicy(max_attempts=3, base_delay=0.05, max_wait=0.2, deadline=10)


def run_label() -> str:
    """A label value of this test's own, so that it finds its own tasks only."""
    return uuid.uuid4().hex[:16]


def wait_all(client: Client, ids: Iterable[str], timeout: float = 60) -> List[Task]:
    return [client.wait(task_id, timeout=timeout) for task_id in ids]


def eventually(what: str, check: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


class Seen(NamedTuple):
    """A request as the local server received it; header names in lower case."""

    method: str
    path: str
    headers: Dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


#: An answer: status, headers, body. None hangs up without answering.
Reply = Optional[Tuple[int, Dict[str, str], bytes]]
Answerer = Callable[[Seen], Reply]


class LocalServer:
    """An HTTP server on 127.0.0.1, on a thread of its own for a `with` block; keeps every
    request it received in `requests`."""

    def __init__(self, answer: Answerer) -> None:
        self.answer = answer
        self.requests: List[Seen] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                seen = Seen(
                    self.command,
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    self.rfile.read(length),
                )
                owner.requests.append(seen)
                reply = owner.answer(seen)
                if reply is None:
                    return  # HTTP/1.0: the server closes the connection, nothing said
                status, headers, body = reply
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = serve

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "LocalServer":
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def of(self, method: str, path: str) -> List[Seen]:
        return [r for r in self.requests if r.method == method and r.path.split("?")[0] == path]


def forward_to(url: str) -> Answerer:
    """Passes each request on to `url` and its answer back, as a proxy would."""
    target = urlsplit(url)

    def forward(seen: Seen) -> Reply:
        connection = http.client.HTTPConnection(target.hostname or "", target.port, timeout=60)
        try:
            headers = {k: v for k, v in seen.headers.items() if k not in ("host", "connection")}
            connection.request(seen.method, seen.path, body=seen.body, headers=headers)
            answer = connection.getresponse()
            kept = {
                k: v for k, v in answer.getheaders() if k.lower() in ("content-type", "retry-after")
            }
            return answer.status, kept, answer.read()
        finally:
            connection.close()

    return forward


Step = Union[Reply, Answerer]


def script(*steps: Step) -> Answerer:
    """Answers with each step in turn, the last one from then on; a step is an answer,
    None (hang up) or a function of the request."""
    remaining = list(steps)

    def answer(seen: Seen) -> Reply:
        step = remaining.pop(0) if len(remaining) > 1 else remaining[0]
        return step(seen) if callable(step) else step

    return answer


def json_reply(status: int, body: Any, **headers: str) -> Tuple[int, Dict[str, str], bytes]:
    named = {k.replace("_", "-"): v for k, v in headers.items()}
    return status, {"Content-Type": "application/json", **named}, json.dumps(body).encode()


class GatewayTest(unittest.TestCase):
    """A test against the real gateway: `self.gateway`, `self.client`."""

    gateway: Gateway
    client: Client

    @classmethod
    def setUpClass(cls) -> None:
        cls.gateway = Gateway()
        cls.client = cls.gateway.client()
