//! Handlers' progress: each running attempt may report how far it is, and the latest report
//! of each is written to its task once a second, all of them in one statement.
//!
//! - exec handlers write lines on descriptor 3 (or append them to `$CONVEYOR_PROGRESS_FILE`,
//!   the same file): a JSON object, a number (a percentage), or text (a message); the last
//!   complete line counts.
//! - http handlers POST JSON to the URL in `X-Conveyor-Progress-Url` (this worker's admin
//!   port, `/progress/{task}/{attempt}`).
//!
//! A report is bounded ([`MAX_REPORT`] bytes of JSON); a larger one is refused, not cut.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use conveyor_core::db::Fence;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::inflight::InFlight;
use crate::outcome::Recorder;

/// Largest report stored, as JSON.
pub const MAX_REPORT: usize = 1024;
/// How often reports are written.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// The latest unwritten report of each running attempt.
#[derive(Clone, Default)]
pub struct ProgressBoard {
    pending: Arc<Mutex<HashMap<(Uuid, i32), serde_json::Value>>>,
    /// `http://host:port` of this worker's admin server, for http handlers' callbacks.
    callback_base: Option<String>,
}

/// Why a report was refused.
#[derive(Debug, PartialEq, Eq)]
pub struct TooLarge(pub usize);

impl ProgressBoard {
    pub fn new(callback_base: Option<String>) -> ProgressBoard {
        ProgressBoard {
            callback_base,
            ..ProgressBoard::default()
        }
    }

    /// The sink of one attempt.
    pub fn sink(&self, id: Uuid, attempt: i32) -> ProgressSink {
        ProgressSink {
            board: self.clone(),
            id,
            attempt,
        }
    }

    fn report(&self, id: Uuid, attempt: i32, value: serde_json::Value) -> Result<(), TooLarge> {
        let size = value.to_string().len();
        if size > MAX_REPORT {
            return Err(TooLarge(size));
        }
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.insert((id, attempt), value);
        Ok(())
    }

    /// The pending report of one attempt, taken off the board.
    pub fn take_one(&self, id: Uuid, attempt: i32) -> Option<serde_json::Value> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.remove(&(id, attempt))
    }

    fn take(&self) -> Vec<((Uuid, i32), serde_json::Value)> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.drain().collect()
    }
}

/// Where one attempt's handler reports.
#[derive(Clone)]
pub struct ProgressSink {
    board: ProgressBoard,
    id: Uuid,
    attempt: i32,
}

impl ProgressSink {
    /// A sink that goes nowhere (tests of handlers alone).
    pub fn detached() -> ProgressSink {
        ProgressBoard::default().sink(Uuid::nil(), 0)
    }

    pub fn report(&self, value: serde_json::Value) -> Result<(), TooLarge> {
        self.board.report(self.id, self.attempt, value)
    }

    /// The URL an http handler POSTs its reports to, when the admin server runs.
    pub fn callback_url(&self) -> Option<String> {
        let base = self.board.callback_base.as_ref()?;
        Some(format!("{base}/progress/{}/{}", self.id, self.attempt))
    }
}

/// One line of an exec handler's progress file as a report: JSON as it is (a bare number
/// is a percentage), anything else a message.
pub fn parse_line(line: &str) -> serde_json::Value {
    match serde_json::from_str::<serde_json::Value>(line.trim()) {
        Ok(serde_json::Value::Number(n)) => serde_json::json!({ "percent": n }),
        Ok(value) => value,
        Err(_) => serde_json::json!({ "message": line.trim() }),
    }
}

/// Writes the pending reports every [`FLUSH_EVERY`], fenced by owner and attempt, until
/// `stop`. A report that cannot be written now is dropped: a newer one follows.
pub async fn flush_loop(
    recorder: Recorder,
    worker_id: String,
    board: ProgressBoard,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let reports: Vec<(Fence, serde_json::Value)> = board
            .take()
            .into_iter()
            .map(|((id, attempt), value)| {
                let owner = worker_id.clone();
                (Fence { id, attempt, owner }, value)
            })
            .collect();
        if reports.is_empty() || !recorder.breaker.is_closed() {
            continue;
        }
        if let Err(err) = recorder.db.report_progress(&reports).await {
            recorder
                .metrics
                .errors
                .with_label_values(&["database", err.category()])
                .inc();
            tracing::debug!(error = %err, reports = reports.len(), "progress not written");
        }
    }
}

/// `POST /progress/{task}/{attempt}` on the admin port, for http handlers: accepted only
/// for an attempt running here.
pub fn router(board: ProgressBoard, in_flight: InFlight) -> Router {
    Router::new()
        .route("/progress/{id}/{attempt}", post(callback))
        .with_state((board, in_flight))
}

async fn callback(
    State((board, in_flight)): State<(ProgressBoard, InFlight)>,
    Path((id, attempt)): Path<(Uuid, i32)>,
    Json(value): Json<serde_json::Value>,
) -> (StatusCode, String) {
    if !in_flight.claims().contains(&(id, attempt)) {
        return (
            StatusCode::NOT_FOUND,
            format!("task {id} attempt {attempt} is not running on this worker"),
        );
    }
    match board.report(id, attempt, value) {
        Ok(()) => (StatusCode::NO_CONTENT, String::new()),
        Err(TooLarge(size)) => (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a progress report is at most {MAX_REPORT} bytes of JSON, not {size}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_reports_and_the_latest_of_an_attempt_wins() {
        assert_eq!(parse_line("42\n"), serde_json::json!({"percent": 42}));
        assert_eq!(
            parse_line(r#"{"frame": 10, "of": 200}"#),
            serde_json::json!({"frame": 10, "of": 200})
        );
        assert_eq!(
            parse_line("pass 2 of 3"),
            serde_json::json!({"message": "pass 2 of 3"})
        );
        let board = ProgressBoard::new(Some("http://127.0.0.1:9".into()));
        let id = Uuid::new_v4();
        let sink = board.sink(id, 3);
        sink.report(serde_json::json!({"percent": 1})).unwrap();
        sink.report(serde_json::json!({"percent": 2})).unwrap();
        let big = serde_json::json!({ "message": "x".repeat(MAX_REPORT) });
        assert!(sink.report(big).is_err());
        assert_eq!(
            board.take(),
            vec![((id, 3), serde_json::json!({"percent": 2}))]
        );
        assert!(board.take().is_empty());
        assert_eq!(
            sink.callback_url().unwrap(),
            format!("http://127.0.0.1:9/progress/{id}/3")
        );
    }
}
