//! The worker's circuit breaker on the database (decision 0010).
//!
//! Closed: work flows. Open: the database is unreachable or slow past a timeout; the worker
//! takes no new deliveries (they stay in RabbitMQ), and finished tasks' outcomes go to the
//! degraded-mode buffer. Half-open: the recovery loop probes the database and replays the
//! buffer; only when the buffer is empty does the breaker close again. Reapers hold off for a
//! heartbeat timeout after the breaker closes, so that owners which were cut off too get to
//! heartbeat (and replay) before their tasks are judged abandoned.

use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use conveyor_core::db::DbError;
use conveyor_core::metrics::Metrics;
use tokio::sync::watch;

/// Consecutive unavailable answers that open the breaker.
const FAILURES_TO_OPEN: u32 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed { since: Instant },
    HalfOpen,
    Open,
}

/// Errors that can say the database (rather than the request) was the problem.
pub trait Availability {
    fn is_unavailable(&self) -> bool;
    fn timed_out(after: Duration) -> Self;
}

impl Availability for DbError {
    fn is_unavailable(&self) -> bool {
        DbError::is_unavailable(self)
    }
    fn timed_out(after: Duration) -> Self {
        DbError::TimedOut(after)
    }
}

pub struct Breaker {
    state: watch::Sender<State>,
    failures: Mutex<u32>,
    /// Longest a database call may take before it counts as unavailable.
    pub call_timeout: Duration,
    metrics: Metrics,
}

impl Breaker {
    pub fn new(open: bool, call_timeout: Duration, metrics: Metrics) -> Breaker {
        let state = if open {
            State::Open
        } else {
            State::Closed {
                since: Instant::now(),
            }
        };
        let breaker = Breaker {
            state: watch::channel(state).0,
            failures: Mutex::new(0),
            call_timeout,
            metrics,
        };
        breaker.publish(state);
        breaker
    }

    pub fn state(&self) -> State {
        *self.state.borrow()
    }

    pub fn is_closed(&self) -> bool {
        matches!(self.state(), State::Closed { .. })
    }

    /// How long the breaker has been closed; `None` while it is not.
    pub fn closed_for(&self) -> Option<Duration> {
        match self.state() {
            State::Closed { since } => Some(since.elapsed()),
            _ => None,
        }
    }

    /// Resolves once the breaker is closed.
    pub async fn wait_closed(&self) {
        let mut state = self.state.subscribe();
        let _ = state.wait_for(|s| matches!(s, State::Closed { .. })).await;
    }

    /// Resolves once the breaker is open.
    pub async fn wait_open(&self) {
        let mut state = self.state.subscribe();
        let _ = state.wait_for(|s| *s == State::Open).await;
    }

    /// Runs one database call under the call timeout and learns from its answer.
    pub async fn call<T, E: Availability>(
        &self,
        call: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let answer = match tokio::time::timeout(self.call_timeout, call).await {
            Ok(answer) => answer,
            Err(_) => Err(E::timed_out(self.call_timeout)),
        };
        match &answer {
            Err(err) if err.is_unavailable() => self.failure(),
            _ => self.success(),
        }
        answer
    }

    fn success(&self) {
        *self.lock_failures() = 0;
    }

    fn failure(&self) {
        let mut failures = self.lock_failures();
        *failures += 1;
        if *failures >= FAILURES_TO_OPEN && self.is_closed() {
            drop(failures);
            self.open("the database stopped answering");
        }
    }

    /// Opens the breaker (from any state): stop taking work.
    pub fn open(&self, why: &str) {
        if self.set(State::Open) {
            tracing::warn!(why, "database circuit breaker open: taking no new work");
        }
    }

    /// The recovery loop is probing.
    pub fn half_open(&self) {
        self.set(State::HalfOpen);
    }

    /// The database answers and nothing is left buffered: take work again.
    pub fn close(&self) {
        *self.lock_failures() = 0;
        let since = Instant::now();
        if self.set(State::Closed { since }) {
            tracing::info!("database circuit breaker closed: taking work again");
        }
    }

    /// Moves to `to`; `false` when already there (Closed compares by kind only).
    fn set(&self, to: State) -> bool {
        let changed = self.state.send_if_modified(|state| {
            let same = std::mem::discriminant(state) == std::mem::discriminant(&to);
            if !same {
                *state = to;
            }
            !same
        });
        if changed {
            self.publish(to);
        }
        changed
    }

    fn publish(&self, state: State) {
        let (value, name) = match state {
            State::Closed { .. } => (0, "closed"),
            State::HalfOpen => (1, "half_open"),
            State::Open => (2, "open"),
        };
        self.metrics.breaker_state.set(value);
        self.metrics
            .breaker_transitions
            .with_label_values(&[name])
            .inc();
    }

    fn lock_failures(&self) -> std::sync::MutexGuard<'_, u32> {
        self.failures.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(false, Duration::from_millis(50), Metrics::new())
    }

    type Answer = Result<(), DbError>;

    fn down() -> Answer {
        Err(DbError::TimedOut(Duration::ZERO))
    }

    #[tokio::test]
    async fn opens_after_consecutive_failures_only() {
        let b = breaker();
        for _ in 0..FAILURES_TO_OPEN - 1 {
            let _ = b.call(async { down() }).await;
        }
        b.call(async { Ok::<_, DbError>(()) }).await.unwrap();
        let _ = b.call(async { down() }).await;
        assert!(b.is_closed(), "a success in between resets the count");
        for _ in 0..FAILURES_TO_OPEN {
            let _ = b.call(async { down() }).await;
        }
        assert_eq!(b.state(), State::Open);
    }

    #[tokio::test]
    async fn a_silent_database_times_out_and_counts_as_down() {
        let b = breaker();
        let err = b.call(std::future::pending::<Answer>()).await.unwrap_err();
        assert!(matches!(err, DbError::TimedOut(_)), "{err}");
    }

    #[tokio::test]
    async fn waiters_wake_on_close_and_reapers_see_how_long_it_has_been() {
        let b = std::sync::Arc::new(Breaker::new(true, Duration::from_secs(1), Metrics::new()));
        assert_eq!(b.closed_for(), None);
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { b.wait_closed().await }
        });
        b.half_open();
        assert!(!waiter.is_finished());
        b.close();
        waiter.await.unwrap();
        assert!(b.closed_for().is_some());
    }

    #[tokio::test]
    async fn metrics_follow_the_state() {
        let metrics = Metrics::new();
        let b = Breaker::new(false, Duration::from_secs(1), metrics.clone());
        b.open("test");
        b.open("again");
        assert_eq!(metrics.breaker_state.get(), 2);
        let opened = metrics.breaker_transitions.with_label_values(&["open"]);
        assert_eq!(opened.get(), 1, "opening twice is one transition");
        b.half_open();
        b.close();
        assert_eq!(metrics.breaker_state.get(), 0);
    }
}
