//! Whether this worker takes new tasks: the operator's side of a safe scale-down
//! (decision 0018). The operator chooses the pods to remove and asks each, on its admin
//! port, to stop consuming (`POST /drain`); it removes a pod only once the pod answers that
//! it is idle (`GET /drain`), or its drain grace has passed, and gives a pod it no longer
//! needs to remove its work back (`DELETE /drain`).
//!
//! Draining cancels the worker's consumers; deliveries the broker had already sent still
//! run (nothing is requeued, so no delivery count is spent), and the tasks in flight finish
//! and are acknowledged as usual. A draining worker is not ready.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use conveyor_core::drain::{bearer_matches, DrainState, DRAIN_PATH};
use prometheus::IntGauge;
use tokio::sync::watch;

/// Shared between the consume loop, the handlers and the admin routes.
#[derive(Clone)]
pub struct Intake {
    inner: Arc<Inner>,
}

struct Inner {
    draining: watch::Sender<bool>,
    /// The consumers were cancelled and have ended: no delivery can arrive any more.
    stopped: AtomicBool,
    handling: AtomicUsize,
    gauge: IntGauge,
}

impl Intake {
    pub fn new(gauge: IntGauge) -> Intake {
        gauge.set(0);
        Intake {
            inner: Arc::new(Inner {
                draining: watch::channel(false).0,
                stopped: AtomicBool::new(false),
                handling: AtomicUsize::new(0),
                gauge,
            }),
        }
    }

    pub fn drain(&self) {
        if !self.inner.draining.send_replace(true) {
            tracing::info!("draining: taking no new tasks (chosen for removal)");
        }
        self.inner.gauge.set(1);
    }

    pub fn resume(&self) {
        if self.inner.draining.send_replace(false) {
            tracing::info!("taking tasks again");
        }
        self.inner.gauge.set(0);
    }

    pub fn is_draining(&self) -> bool {
        *self.inner.draining.borrow()
    }

    /// Resolves once a drain is asked for (at once if it is).
    pub async fn drain_requested(&self) {
        let mut seen = self.inner.draining.subscribe();
        let _ = seen.wait_for(|draining| *draining).await;
    }

    /// Resolves once the worker should take tasks again (at once if it should).
    pub async fn resume_requested(&self) {
        let mut seen = self.inner.draining.subscribe();
        let _ = seen.wait_for(|draining| !*draining).await;
    }

    /// Whether the consumers are cancelled and ended (set by the consume loop).
    pub fn set_stopped(&self, stopped: bool) {
        self.inner.stopped.store(stopped, Ordering::SeqCst);
    }

    /// Counts one delivery as in hand until the guard drops.
    pub fn handling(&self) -> Handling {
        self.inner.handling.fetch_add(1, Ordering::SeqCst);
        Handling {
            intake: self.clone(),
        }
    }

    pub fn state(&self) -> DrainState {
        let draining = self.is_draining();
        let in_flight = self.inner.handling.load(Ordering::SeqCst) as u64;
        DrainState {
            draining,
            in_flight,
            idle: draining && self.inner.stopped.load(Ordering::SeqCst) && in_flight == 0,
        }
    }
}

/// One delivery in hand; see [`Intake::handling`].
pub struct Handling {
    intake: Intake,
}

impl Drop for Handling {
    fn drop(&mut self) {
        self.intake.inner.handling.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `GET /drain` (the state), `POST /drain` (stop taking tasks), `DELETE /drain` (take them
/// again); each answers the state after it. With `token`, `POST` and `DELETE` need it as a
/// bearer token (401 without), so that no other pod can pause this one.
pub fn router(intake: Intake, token: Option<String>) -> Router {
    Router::new()
        .route(DRAIN_PATH, get(state).post(drain).delete(resume))
        .with_state(Admin {
            intake,
            token: token.map(Arc::from),
        })
}

#[derive(Clone)]
struct Admin {
    intake: Intake,
    token: Option<Arc<str>>,
}

impl Admin {
    fn admits(&self, headers: &HeaderMap) -> Result<(), (StatusCode, &'static str)> {
        let header = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|h| h.to_str().ok());
        match &self.token {
            Some(token) if !bearer_matches(header, token) => Err((
                StatusCode::UNAUTHORIZED,
                "this worker's admin token is required (the operator has it)",
            )),
            _ => Ok(()),
        }
    }
}

async fn state(State(admin): State<Admin>) -> Json<DrainState> {
    Json(admin.intake.state())
}

async fn drain(
    State(admin): State<Admin>,
    headers: HeaderMap,
) -> Result<Json<DrainState>, (StatusCode, &'static str)> {
    admin.admits(&headers)?;
    admin.intake.drain();
    Ok(Json(admin.intake.state()))
}

async fn resume(
    State(admin): State<Admin>,
    headers: HeaderMap,
) -> Result<Json<DrainState>, (StatusCode, &'static str)> {
    admin.admits(&headers)?;
    admin.intake.resume();
    Ok(Json(admin.intake.state()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_means_drained_stopped_and_empty() {
        let intake = Intake::new(IntGauge::new("g", "g").unwrap());
        let held = intake.handling();
        assert!(!intake.state().idle, "not draining");
        intake.drain();
        intake.set_stopped(true);
        assert_eq!(
            intake.state(),
            DrainState {
                draining: true,
                in_flight: 1,
                idle: false
            }
        );
        drop(held);
        assert!(intake.state().idle);
        intake.resume();
        assert!(!intake.state().idle);
    }
}
