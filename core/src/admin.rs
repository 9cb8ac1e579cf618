//! `/healthz`, `/readyz` and `/metrics`, shared by every long-running binary.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use prometheus::{Encoder, Registry, TextEncoder};

/// Answers whether the process can do its work now; `Err` carries the reason.
pub type ReadinessCheck =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

#[derive(Clone)]
struct AdminState {
    registry: Registry,
    ready: ReadinessCheck,
}

/// Routes for the admin endpoints; merge them into a service's router or serve them alone.
pub fn router(registry: Registry, ready: ReadinessCheck) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .with_state(AdminState { registry, ready })
}

/// The text exposition format of a registry.
pub fn render(registry: &Registry) -> String {
    let mut out = Vec::new();
    // Encoding into a Vec cannot fail for well-formed metrics.
    let _ = TextEncoder::new().encode(&registry.gather(), &mut out);
    String::from_utf8(out).unwrap_or_default()
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
        render(&state.registry),
    )
}
