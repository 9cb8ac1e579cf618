//! `/healthz`, `/readyz` and `/metrics`, shared by every long-running binary.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;

/// Answers whether the process can do its work now; `Err` carries the reason.
pub type ReadinessCheck =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

#[derive(Clone)]
struct AdminState {
    metrics: Metrics,
    ready: ReadinessCheck,
}

/// Routes for the admin endpoints; merge them into a service's router or serve them alone.
pub fn router(metrics: Metrics, ready: ReadinessCheck) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .with_state(AdminState { metrics, ready })
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    match (state.ready)().await {
        Ok(()) => (StatusCode::OK, "ready".to_owned()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
    }
}

async fn render_metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}
