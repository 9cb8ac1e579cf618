//! The task lifecycle: states and the one table of allowed transitions.
//!
//! Every write to `tasks.state` in [`crate::db`] follows an edge of [`TRANSITIONS`]; the SQL
//! names its states through [`TaskState::as_str`], and the tests below check the table
//! exhaustively, so a new edge is a deliberate change here and nowhere else.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a task is in its life. Stored as its `SCREAMING_SNAKE_CASE` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskState {
    /// Recorded by the gateway, not yet confirmed by the broker.
    Ingested,
    /// In a queue (main or retry), waiting for a worker.
    Queued,
    /// Claimed by a worker through the compare-and-set.
    Claimed,
    /// The worker's handler is running.
    Processing,
    /// Done; terminal.
    Completed,
    /// The handler failed this attempt.
    Failed,
    /// The owner stopped heartbeating (or released the task); it is being re-queued.
    RetryClaimed,
    /// Retries exhausted; parked in the remediation queue until redriven.
    DeadLetter,
    /// Withdrawn by its client before a worker claimed it; terminal.
    Cancelled,
}

use TaskState::*;

impl TaskState {
    pub const ALL: [TaskState; 9] = [
        Ingested,
        Queued,
        Claimed,
        Processing,
        Completed,
        Failed,
        RetryClaimed,
        DeadLetter,
        Cancelled,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Ingested => "INGESTED",
            Queued => "QUEUED",
            Claimed => "CLAIMED",
            Processing => "PROCESSING",
            Completed => "COMPLETED",
            Failed => "FAILED",
            RetryClaimed => "RETRY_CLAIMED",
            DeadLetter => "DEAD_LETTER",
            Cancelled => "CANCELLED",
        }
    }

    /// States a task can rest in with nobody working on it.
    pub const fn is_settled(self) -> bool {
        matches!(self, Completed | DeadLetter | Cancelled)
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown task state {0:?}")]
pub struct UnknownState(pub String);

impl FromStr for TaskState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TaskState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// Every allowed transition, and why it happens.
pub const TRANSITIONS: [(TaskState, TaskState, &str); 15] = [
    (
        Ingested,
        Queued,
        "the broker confirmed the publish, or the sweeper re-published it",
    ),
    (
        Queued,
        Queued,
        "its message was lost: re-published with attempt + 1 (decision 0011)",
    ),
    (Queued, Claimed, "a worker won the compare-and-set"),
    (Claimed, Processing, "the handler started"),
    (Processing, Completed, "the handler succeeded"),
    (Processing, Failed, "the handler failed"),
    (Failed, Queued, "retries left: re-enqueued after backoff"),
    (Failed, DeadLetter, "retries exhausted"),
    (
        Claimed,
        RetryClaimed,
        "heartbeat timeout before the handler started",
    ),
    (
        Processing,
        RetryClaimed,
        "heartbeat timeout, or released by a draining worker",
    ),
    (RetryClaimed, Queued, "re-enqueued with attempt + 1"),
    (RetryClaimed, DeadLetter, "retries exhausted"),
    (
        DeadLetter,
        Queued,
        "redriven by an operator, or retried through the API",
    ),
    (
        Ingested,
        Cancelled,
        "cancelled through the API before the broker's confirm was recorded",
    ),
    (
        Queued,
        Cancelled,
        "cancelled through the API before a worker claimed it (its message is then stale)",
    ),
];

/// Whether `from → to` is an edge of the lifecycle.
pub fn is_allowed(from: TaskState, to: TaskState) -> bool {
    TRANSITIONS.iter().any(|&(f, t, _)| f == from && t == to)
}

/// A transition that is not in the table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("transition {from} → {to} is not part of the task lifecycle")]
pub struct InvalidTransition {
    pub from: TaskState,
    pub to: TaskState,
}

/// Checks one step.
pub fn check(from: TaskState, to: TaskState) -> Result<(), InvalidTransition> {
    if is_allowed(from, to) {
        Ok(())
    } else {
        Err(InvalidTransition { from, to })
    }
}

/// Checks a whole audit chain: it starts at INGESTED and every step is an allowed edge.
pub fn check_chain(chain: &[(Option<TaskState>, TaskState)]) -> Result<(), String> {
    let mut current: Option<TaskState> = None;
    for (i, &(from, to)) in chain.iter().enumerate() {
        if from != current {
            return Err(format!(
                "event {i}: recorded from {from:?} but the task was in {current:?}"
            ));
        }
        match from {
            None if to != Ingested => {
                return Err(format!(
                    "event {i}: a chain must start at INGESTED, not {to}"
                ))
            }
            None => {}
            Some(from) => check(from, to).map_err(|e| format!("event {i}: {e}"))?,
        }
        current = Some(to);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_the_table_is_allowed() {
        let expected: &[(TaskState, TaskState)] = &[
            (Ingested, Queued),
            (Queued, Queued),
            (Queued, Claimed),
            (Claimed, Processing),
            (Processing, Completed),
            (Processing, Failed),
            (Failed, Queued),
            (Failed, DeadLetter),
            (Claimed, RetryClaimed),
            (Processing, RetryClaimed),
            (RetryClaimed, Queued),
            (RetryClaimed, DeadLetter),
            (DeadLetter, Queued),
            (Ingested, Cancelled),
            (Queued, Cancelled),
        ];
        let mut allowed = 0;
        for from in TaskState::ALL {
            for to in TaskState::ALL {
                let want = expected.contains(&(from, to));
                assert_eq!(is_allowed(from, to), want, "{from} → {to}");
                assert_eq!(check(from, to).is_ok(), want);
                allowed += usize::from(want);
            }
        }
        assert_eq!(allowed, expected.len());
    }

    #[test]
    fn completed_and_cancelled_are_terminal_and_nothing_reenters_ingested() {
        for to in TaskState::ALL {
            assert!(!is_allowed(Completed, to));
            assert!(!is_allowed(Cancelled, to));
            assert!(!is_allowed(to, Ingested));
        }
    }

    #[test]
    fn names_round_trip() {
        for state in TaskState::ALL {
            assert_eq!(state.as_str().parse::<TaskState>().ok(), Some(state));
            let json = serde_json::to_string(&state).unwrap();
            assert_eq!(json, format!("\"{}\"", state.as_str()));
        }
        assert!("DONE".parse::<TaskState>().is_err());
    }

    #[test]
    fn chains() {
        let happy = [
            (None, Ingested),
            (Some(Ingested), Queued),
            (Some(Queued), Claimed),
            (Some(Claimed), Processing),
            (Some(Processing), Completed),
        ];
        assert!(check_chain(&happy).is_ok());
        let skipped = [(None, Ingested), (Some(Ingested), Claimed)];
        assert!(check_chain(&skipped).is_err());
        let gap = [(None, Ingested), (Some(Queued), Claimed)];
        assert!(check_chain(&gap).is_err());
        assert!(check_chain(&[(None, Queued)]).is_err());
    }

    #[test]
    fn only_waiting_tasks_can_be_cancelled() {
        for from in TaskState::ALL {
            let waiting = matches!(from, Ingested | Queued);
            assert_eq!(is_allowed(from, Cancelled), waiting, "{from}");
        }
        assert!(Cancelled.is_settled());
    }
}
