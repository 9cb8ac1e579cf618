//! HTTP routes of the gateway. Every `/v1` request is admitted first (`crate::admission`):
//! its token checked before its body is read, its client's requests and the gateway's body
//! bytes bounded, its time bounded. What a client sees of a task is its own tenant's only:
//! another tenant's task answers 404 like one that does not exist.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use conveyor_core::task::TaskRecord;
use conveyor_core::trace::TraceContext;
use conveyor_core::TaskState;
use serde::Deserialize;
use tokio::sync::Semaphore;
use tracing::Instrument;
use uuid::Uuid;

pub use crate::admission::{BodyBudget, RequestLimits};
pub(crate) use crate::admission::{BodyCharged, InFlight};
use crate::auth::{Client, TokenSet};
use crate::error::{ApiError, ErrorBody};
use crate::ingest::{db_error, Accepted, Ingestor, Submission};
use crate::views::{BatchAnswer, BatchResults, EventList, EventView, TaskView};

pub struct ApiState {
    pub ingestor: Ingestor,
    pub tokens: Arc<TokenSet>,
    /// The one reader of every followed task's row (`crate::follow`).
    pub feed: Arc<crate::feed::Feed>,
    /// For walks of a remediation queue after a retry or redrive (`crate::remedy`).
    pub amqp_url: String,
    pub max_batch_tasks: usize,
    pub limits: RequestLimits,
    /// Semaphores by client and by namespace: requests in flight and streams open.
    pub in_flight: Mutex<HashMap<String, Arc<Semaphore>>>,
    /// Body bytes being read or held, for [`RequestLimits::max_bytes_in_flight`].
    pub bodies: BodyBudget,
}

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

pub(crate) fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large("request body is larger than the gateway accepts")
        } else {
            ApiError::bad_request("invalid_body", rejection.body_text())
        }
    })
}

pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("request body: {e}")))
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<Uuid>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| Uuid::parse_str(v.trim()).ok())
        .map(Some)
        .ok_or_else(|| {
            ApiError::bad_request("invalid_idempotency_key", "Idempotency-Key must be a UUID")
        })
}

/// Runs a submission to its end even if the client hangs up: hyper drops a handler's future
/// when its connection goes away, and a task recorded but never published (or published
/// but never marked QUEUED) must not depend on the client staying to hear the answer.
async fn submit_detached(
    state: &Arc<ApiState>,
    client: &Client,
    in_flight: InFlight,
    submissions: Vec<Submission>,
    trace: Option<TraceContext>,
) -> Result<Vec<Result<Accepted, ApiError>>, ApiError> {
    let state = state.clone();
    let client = client.clone();
    // The request's span (request and trace ids) goes along: the spawned submission's log
    // lines (a failed publish, a database error) name them too.
    tokio::spawn(
        async move {
            let answers = state.ingestor.submit(&client, submissions, trace).await;
            drop(in_flight);
            answers
        }
        .instrument(tracing::Span::current()),
    )
    .await
    .unwrap_or_else(|join| {
        tracing::error!(error = %join, "submission task failed");
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the submission failed inside the gateway",
        ))
    })
}

/// A task to run. The idempotency key is the `Idempotency-Key` header.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SingleRequest {
    /// The TaskType's name in its namespace.
    task_type: String,
    /// The TaskType's namespace; may be left out by a client of one namespace.
    #[serde(default)]
    namespace: Option<String>,
    /// Checked against the type's schema and size limit.
    payload: serde_json::Value,
    /// Up to 16 Kubernetes-style labels, to find the task by later.
    #[serde(default)]
    #[schema(schema_with = crate::views::labels_schema)]
    labels: conveyor_core::labels::Labels,
}

/// Submits one task. 201 for a new task, 200 with the earlier task for a known key: retry
/// with the same `Idempotency-Key` after any error or no answer, and nothing runs twice
/// for it.
#[utoipa::path(post, path = "/v1/tasks", tag = "tasks",
    request_body = SingleRequest,
    params(("Idempotency-Key" = Option<Uuid>, Header, description = "A UUID; the task id when absent")),
    responses(
        (status = 201, description = "Recorded and queued", body = Accepted),
        (status = 200, description = "The key was used before: the task it made", body = Accepted),
        (status = "4XX", description = "Refused; nothing recorded", body = ErrorBody),
        (status = "5XX", description = "Not recorded, or not known to be: retry with the same key", body = ErrorBody),
    ))]
pub(crate) async fn submit_one(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
    Extension(in_flight): Extension<InFlight>,
    charged: Option<Extension<BodyCharged>>,
    trace: Option<Extension<TraceContext>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = read_body(body)?;
    if charged.is_none() {
        state.charge_bytes(&client, body.len())?;
    }
    let key = idempotency_key(&headers)?;
    let request: SingleRequest = parse_json(&body)?;
    let submission = Submission {
        task_type: request.task_type,
        namespace: request.namespace,
        payload: request.payload,
        labels: request.labels,
        idempotency_key: key,
    };
    let trace = trace.map(|t| t.0);
    let mut answers = submit_detached(&state, &client, in_flight, vec![submission], trace).await?;
    let accepted = answers
        .pop()
        .unwrap_or_else(|| Err(ApiError::bad_request("empty", "no task")))?;
    Ok((accepted.status, Json(accepted)).into_response())
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    tasks: Vec<Submission>,
}

/// Submits up to `maxBatchTasks` tasks in one request; each gets its own answer, in order.
#[utoipa::path(post, path = "/v1/tasks:batch", tag = "tasks",
    request_body = BatchRequest,
    responses(
        (status = 200, description = "One answer per task", body = BatchResults),
        (status = "4XX", description = "The whole request refused", body = ErrorBody),
        (status = "5XX", description = "The gateway failed", body = ErrorBody),
    ))]
pub(crate) async fn submit_batch(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
    Extension(in_flight): Extension<InFlight>,
    charged: Option<Extension<BodyCharged>>,
    trace: Option<Extension<TraceContext>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = read_body(body)?;
    if charged.is_none() {
        state.charge_bytes(&client, body.len())?;
    }
    let request: BatchRequest = parse_json(&body)?;
    if request.tasks.is_empty() || request.tasks.len() > state.max_batch_tasks {
        return Err(ApiError::bad_request(
            "invalid_batch",
            format!("a batch holds 1 to {} tasks", state.max_batch_tasks),
        ));
    }
    let answers = submit_detached(
        &state,
        &client,
        in_flight,
        request.tasks,
        trace.map(|t| t.0),
    )
    .await?;
    let results: Vec<BatchAnswer> = answers
        .into_iter()
        .map(|answer| match answer {
            Ok(task) => BatchAnswer::Accepted {
                status: task.status.as_u16(),
                id: task.id,
                state: task.state,
                idempotency_key: task.idempotency_key,
            },
            Err(error) => BatchAnswer::Refused {
                status: error.status.as_u16(),
                error,
            },
        })
        .collect();
    Ok(Json(BatchResults { results }).into_response())
}

pub(crate) fn parse_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id).map_err(|_| ApiError::bad_request("invalid_id", "task ids are UUIDs"))
}

/// A task, with its payload and result.
#[utoipa::path(get, path = "/v1/tasks/{id}", tag = "tasks",
    params(("id" = Uuid, Path, description = "The task's id")),
    responses(
        (status = 200, description = "The task", body = TaskView),
        (status = 404, description = "No such task in the client's namespaces", body = ErrorBody),
        (status = "4XX", description = "Refused", body = ErrorBody),
        (status = "5XX", description = "The database is unavailable, or the gateway failed: try again", body = ErrorBody),
    ))]
pub(crate) async fn get_task(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let task = own_task(&state, &client, &id).await?;
    Ok(Json(TaskView::from(&task)).into_response())
}

/// A task's audit timeline: every state it passed through, oldest first.
#[utoipa::path(get, path = "/v1/tasks/{id}/events", tag = "tasks",
    params(("id" = Uuid, Path, description = "The task's id")),
    responses(
        (status = 200, description = "The timeline", body = EventList),
        (status = 404, description = "No such task in the client's namespaces", body = ErrorBody),
        (status = "4XX", description = "Refused", body = ErrorBody),
        (status = "5XX", description = "The database is unavailable, or the gateway failed: try again", body = ErrorBody),
    ))]
pub(crate) async fn get_events(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let task = own_task(&state, &client, &id).await?;
    let ingestor = &state.ingestor;
    match ingestor.db.events(task.id).await {
        Ok(events) => {
            let events = events
                .iter()
                .map(|e| EventView::of(e, &task.tenant))
                .collect();
            Ok(Json(EventList { events }).into_response())
        }
        Err(err) => Err(db_error(&ingestor.metrics, &err)),
    }
}

/// The task `id` if it is one of the client's tenants': any other answers 404, as a task
/// that does not exist does, so that ids say nothing across tenants.
pub(crate) async fn own_task(
    state: &ApiState,
    client: &Client,
    id: &str,
) -> Result<TaskRecord, ApiError> {
    let id = parse_id(id)?;
    let ingestor = &state.ingestor;
    let read = || async {
        match ingestor.db.task(id).await {
            Ok(Some(task)) if client.may_use(&task.tenant) => Ok(task),
            Ok(_) => Err(not_found(id)),
            Err(err) => Err(db_error(&ingestor.metrics, &err)),
        }
    };
    let task = read().await?;
    if task.state != TaskState::Ingested {
        return Ok(task);
    }
    // If this gateway answered for it and its QUEUED mark is not written yet, write it, so
    // that the read shows what the answer said.
    match ingestor.writes.queued.settle(id).await {
        Ok(false) => Ok(task),
        Ok(true) => read().await,
        Err(err) => Err(db_error(&ingestor.metrics, &err)),
    }
}

pub(crate) fn not_found(id: Uuid) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "task_not_found",
        format!("no task {id}"),
    )
}
