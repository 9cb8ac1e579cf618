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

use std::collections::{HashMap, HashSet};
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

type Attempt = (Uuid, i32);

/// The latest unwritten report of each running attempt.
#[derive(Clone)]
pub struct ProgressBoard {
    pending: Arc<Mutex<HashMap<Attempt, serde_json::Value>>>,
    /// Attempts whose last report was taken for their outcome: a report of theirs that a
    /// failed flush puts back would be older than that one, so it is not put back.
    finished: Arc<Mutex<HashSet<Attempt>>>,
    /// `http://host:port` of this worker's admin server, for http handlers' callbacks.
    callback_base: Option<String>,
    /// This process's key for the callbacks' secrets ([`ProgressBoard::secret`]).
    key: Arc<[u8; 32]>,
}

/// Longest report as the database prints it (`tasks_progress_bounded`, migration
/// `20261203000003`): `jsonb` writes numbers out in full, so a few bytes of JSON (`1e300`)
/// can be hundreds there.
pub const MAX_STORED: usize = 2048;

/// Why a report was refused: too large, or one the database would refuse. Each is refused
/// here, alone: the flush writes every running attempt's report in one statement, which a
/// refused value would fail for all of them, every second.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("a progress report is at most {MAX_REPORT} bytes of JSON, not {0}")]
    TooLarge(usize),
    #[error(
        "a progress report holds a NUL character (\\u0000) at {0:?}, which the task \
         database cannot store"
    )]
    Nul(String),
    #[error(
        "a progress report is {0} bytes as the task database prints it (numbers written out \
         in full), more than {MAX_STORED}"
    )]
    TooLong(usize),
}

impl Default for ProgressBoard {
    fn default() -> Self {
        ProgressBoard {
            pending: Arc::default(),
            finished: Arc::default(),
            callback_base: None,
            key: Arc::new(rand::random()),
        }
    }
}

impl ProgressBoard {
    pub fn new(callback_base: Option<String>) -> ProgressBoard {
        ProgressBoard {
            callback_base,
            ..ProgressBoard::default()
        }
    }

    /// The secret in one attempt's callback URL: only the handler it is given to can report
    /// for that attempt (the admin port is reachable from other pods, issue 33, item 2).
    /// Keyed by this process, so nothing is stored per attempt.
    fn secret(&self, id: Uuid, attempt: i32) -> String {
        let attempt = attempt.to_be_bytes();
        conveyor_core::secrets::keyed_hex(self.key.as_slice(), &[id.as_bytes(), &attempt])
    }

    /// Whether `given` is the secret of the attempt, compared in constant time.
    fn admits(&self, id: Uuid, attempt: i32, given: &str) -> bool {
        conveyor_core::secrets::same(given.as_bytes(), self.secret(id, attempt).as_bytes())
    }

    /// The sink of one attempt.
    pub fn sink(&self, id: Uuid, attempt: i32) -> ProgressSink {
        ProgressSink {
            board: self.clone(),
            id,
            attempt,
        }
    }

    fn report(&self, id: Uuid, attempt: i32, value: serde_json::Value) -> Result<(), Refused> {
        let size = value.to_string().len();
        if size > MAX_REPORT {
            return Err(Refused::TooLarge(size));
        }
        if let Some(at) = conveyor_core::jsonb::nul_at(&value) {
            return Err(Refused::Nul(at));
        }
        let stored = conveyor_core::jsonb::text_len(&value);
        if stored > MAX_STORED {
            return Err(Refused::TooLong(stored));
        }
        lock(&self.pending).insert((id, attempt), value);
        Ok(())
    }

    /// The last pending report of one attempt, taken off the board for its outcome.
    pub fn take_one(&self, id: Uuid, attempt: i32) -> Option<serde_json::Value> {
        lock(&self.finished).insert((id, attempt));
        lock(&self.pending).remove(&(id, attempt))
    }

    fn take(&self) -> Vec<(Attempt, serde_json::Value)> {
        lock(&self.pending).drain().collect()
    }

    /// Reports a flush could not write go back on the board, unless a newer one came
    /// meanwhile or their attempt has ended (its last report is written with its outcome).
    fn put_back(&self, reports: Vec<(Attempt, serde_json::Value)>, running: &[Attempt]) {
        let finished = lock(&self.finished);
        let mut pending = lock(&self.pending);
        for (attempt, value) in reports {
            if running.contains(&attempt) && !finished.contains(&attempt) {
                pending.entry(attempt).or_insert(value);
            }
        }
    }

    /// Forgets ended attempts once they no longer run here.
    fn forget_finished(&self, running: &[Attempt]) {
        lock(&self.finished).retain(|attempt| running.contains(attempt));
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
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

    pub fn report(&self, value: serde_json::Value) -> Result<(), Refused> {
        self.board.report(self.id, self.attempt, value)
    }

    /// The URL an http handler POSTs its reports to, when the admin server runs.
    pub fn callback_url(&self) -> Option<String> {
        let base = self.board.callback_base.as_ref()?;
        let secret = self.board.secret(self.id, self.attempt);
        Some(format!(
            "{base}/progress/{}/{}/{secret}",
            self.id, self.attempt
        ))
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
/// `stop`. A report that cannot be written now (the database breaker open, a failed
/// statement) waits for the next flush: a handler may not report again for an hour.
pub async fn flush_loop(
    recorder: Recorder,
    worker_id: String,
    board: ProgressBoard,
    in_flight: InFlight,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if !recorder.breaker.is_closed() {
            continue;
        }
        let taken = board.take();
        if !taken.is_empty() {
            let reports: Vec<(Fence, serde_json::Value)> = taken
                .iter()
                .map(|&((id, attempt), ref value)| {
                    let owner = worker_id.clone();
                    (Fence { id, attempt, owner }, value.clone())
                })
                .collect();
            match recorder.db.report_progress(&reports).await {
                Ok(_) => {}
                Err(err) if err.is_permanent() => {
                    // Refused as a value (checked when reported, so only a rule this worker
                    // does not know): each alone, so that it fails only its own attempt.
                    let mut kept = Vec::new();
                    for (report, taken) in reports.iter().zip(taken) {
                        match recorder
                            .db
                            .report_progress(std::slice::from_ref(report))
                            .await
                        {
                            Ok(_) => {}
                            Err(err) if err.is_permanent() => {
                                tracing::warn!(task = %report.0.id, error = %conveyor_core::with_causes(&err),
                                    "progress report refused by the database; dropped");
                            }
                            Err(_) => kept.push(taken),
                        }
                    }
                    board.put_back(kept, &in_flight.claims());
                }
                Err(err) => {
                    recorder
                        .metrics
                        .errors
                        .with_label_values(&["database", err.category()])
                        .inc();
                    tracing::debug!(error = %err, reports = reports.len(), "progress not written yet");
                    board.put_back(taken, &in_flight.claims());
                }
            }
        }
        board.forget_finished(&in_flight.claims());
    }
}

/// `POST /progress/{task}/{attempt}` on the admin port, for http handlers: accepted only
/// for an attempt running here.
pub fn router(board: ProgressBoard, in_flight: InFlight) -> Router {
    Router::new()
        .route("/progress/{id}/{attempt}/{secret}", post(callback))
        .with_state((board, in_flight))
}

async fn callback(
    State((board, in_flight)): State<(ProgressBoard, InFlight)>,
    Path((id, attempt, secret)): Path<(Uuid, i32, String)>,
    Json(value): Json<serde_json::Value>,
) -> (StatusCode, String) {
    // A wrong secret answers as an attempt not running here: nothing to learn from it.
    if !board.admits(id, attempt, &secret) || !in_flight.claims().contains(&(id, attempt)) {
        return (
            StatusCode::NOT_FOUND,
            format!("task {id} attempt {attempt} is not running on this worker"),
        );
    }
    match board.report(id, attempt, value) {
        Ok(()) => (StatusCode::NO_CONTENT, String::new()),
        Err(refused @ Refused::TooLarge(_)) => (StatusCode::PAYLOAD_TOO_LARGE, refused.to_string()),
        Err(refused) => (StatusCode::BAD_REQUEST, refused.to_string()),
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
        assert!(matches!(sink.report(big), Err(Refused::TooLarge(_))));
        // What the database would refuse is refused here, and the last good report stays.
        let nul = parse_line("frame\u{0} 10");
        assert_eq!(sink.report(nul), Err(Refused::Nul("/message".into())));
        let long = serde_json::json!([1e300, 1e300, 1e300, 1e300, 1e300, 1e300, 1e300]);
        assert!(long.to_string().len() < MAX_REPORT);
        assert_eq!(sink.report(long), Err(Refused::TooLong(2 + 7 * 301 + 12)));
        assert_eq!(
            board.take(),
            vec![((id, 3), serde_json::json!({"percent": 2}))]
        );
        assert!(board.take().is_empty());
        let url = sink.callback_url().unwrap();
        let secret = url
            .strip_prefix(&format!("http://127.0.0.1:9/progress/{id}/3/"))
            .unwrap();
        assert!(board.admits(id, 3, secret));
        assert!(!board.admits(id, 4, secret), "another attempt's");
        assert!(
            !ProgressBoard::default().admits(id, 3, secret),
            "another worker's"
        );
        assert!(!board.admits(id, 3, ""));
    }

    #[test]
    fn an_unwritten_report_goes_back_unless_a_newer_one_came_or_its_attempt_ended() {
        let board = ProgressBoard::default();
        let (a, b, c) = (
            (Uuid::new_v4(), 1),
            (Uuid::new_v4(), 1),
            (Uuid::new_v4(), 1),
        );
        let running = [a, b, c];
        for attempt in running {
            board
                .sink(attempt.0, attempt.1)
                .report(serde_json::json!({"percent": 10}))
                .unwrap();
        }
        let taken = board.take();
        // Meanwhile: b reports again, c ends (its last report goes with its outcome).
        board
            .sink(b.0, b.1)
            .report(serde_json::json!({"percent": 20}))
            .unwrap();
        assert_eq!(board.take_one(c.0, c.1), None);
        board.put_back(taken, &running);
        let mut left = board.take();
        left.sort_by_key(|(attempt, _)| *attempt == b);
        assert_eq!(
            left,
            vec![
                (a, serde_json::json!({"percent": 10})),
                (b, serde_json::json!({"percent": 20}))
            ]
        );
        // An attempt no longer running here gets nothing back, and is forgotten.
        board.put_back(vec![(a, serde_json::json!({"percent": 10}))], &[]);
        assert!(board.take().is_empty());
        board.forget_finished(&[]);
        assert!(lock(&board.finished).is_empty());
    }
}
