"""Python client for Conveyor's gateway API: submit tasks, follow them, and fix them.

from conveyor_client import Client
client = Client("https://conveyor.example.com", token)
task = client.wait(client.submit("transcode", {"video": "a.mp4"}).id)
"""

# First: the modules below read it while this package is still being imported.
__version__ = "0.1.0"

from ._http import RetryPolicy
from .client import Client
from .errors import RETRYABLE_STATUSES, ConveyorError, NoAnswer, WaitTimeout
from .models import (
    SETTLED,
    Accepted,
    BatchResult,
    Event,
    NewTask,
    Page,
    RedriveResult,
    State,
    Task,
    TaskSummary,
)

__all__ = [
    "RETRYABLE_STATUSES",
    "SETTLED",
    "Accepted",
    "BatchResult",
    "Client",
    "ConveyorError",
    "Event",
    "NewTask",
    "NoAnswer",
    "Page",
    "RedriveResult",
    "RetryPolicy",
    "State",
    "Task",
    "TaskSummary",
    "WaitTimeout",
    "__version__",
]
