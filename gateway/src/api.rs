//! HTTP routes of the gateway. Every `/v1` request is admitted first (`crate::admission`):
//! its token checked before its body is read, its client's requests and the gateway's body
//! bytes bounded, its time bounded. What a client sees of a task is its own tenant's only:
//! another tenant's task answers 404 like one that does not exist. No module but the crate
//! root imports this one: it is the top of the gateway's module tree (`scripts/module-edges.sh
//! gateway`).

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

pub use crate::limits::{BodyBudget, RequestLimits};
pub use crate::state::ApiState;
use crate::tasks::{get_events, get_task, submit_batch, submit_one};

pub fn router(state: Arc<ApiState>, max_body_bytes: usize, max_batch_bytes: usize) -> Router {
    Router::new()
        .route(
            "/v1/tasks",
            get(crate::find::list_tasks)
                .post(submit_one)
                .layer(DefaultBodyLimit::max(max_body_bytes)),
        )
        .route(
            "/v1/tasks:batch",
            post(submit_batch).layer(DefaultBodyLimit::max(max_batch_bytes)),
        )
        .route(
            "/v1/tasks:redrive",
            post(crate::remedy::redrive).layer(DefaultBodyLimit::max(max_body_bytes)),
        )
        .route(
            "/v1/tasks/{id}",
            get(get_task).post(crate::remedy::task_action),
        )
        .route("/v1/tasks/{id}/events", get(get_events))
        .route("/v1/tasks/{id}/stream", get(crate::follow::stream_task))
        .route("/v1/task-types", get(crate::overview::task_types))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            crate::admission::admit,
        ))
        // After the layer: the API's description needs no token.
        .route("/openapi.json", get(openapi_json))
        .merge(crate::console::router())
        // Outermost, so that refusals (401, 429, 413) are timed and logged too.
        .layer(middleware::from_fn_with_state(
            crate::access::Observe {
                metrics: state.ingestor.metrics.clone(),
                tracer: state.ingestor.tracer.clone(),
            },
            crate::access::observe,
        ))
        .with_state(state)
}

async fn openapi_json() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        crate::openapi::json(),
    )
        .into_response()
}
