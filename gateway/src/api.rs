//! HTTP routes of the gateway.

use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::auth::Tokens;
use crate::error::ApiError;
use crate::ingest::{db_error, Accepted, Ingestor, Submission};

pub struct ApiState {
    pub ingestor: Ingestor,
    pub tokens: Tokens,
    pub max_batch_tasks: usize,
}

pub fn router(state: Arc<ApiState>, max_body_bytes: usize, max_batch_bytes: usize) -> Router {
    Router::new()
        .route(
            "/v1/tasks",
            post(submit_one).layer(DefaultBodyLimit::max(max_body_bytes)),
        )
        .route(
            "/v1/tasks:batch",
            post(submit_batch).layer(DefaultBodyLimit::max(max_batch_bytes)),
        )
        .route("/v1/tasks/{id}", get(get_task))
        .route("/v1/tasks/{id}/events", get(get_events))
        .with_state(state)
}

fn authenticate<'a>(state: &'a ApiState, headers: &HeaderMap) -> Result<&'a str, ApiError> {
    let header = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    state
        .tokens
        .client(header)
        .ok_or_else(ApiError::unauthorized)
}

fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large("request body is larger than the gateway accepts")
        } else {
            ApiError::bad_request("invalid_body", rejection.body_text())
        }
    })
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
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
    client: &str,
    submissions: Vec<Submission>,
) -> Result<Vec<Result<Accepted, ApiError>>, ApiError> {
    let state = state.clone();
    let client = client.to_owned();
    tokio::spawn(async move { state.ingestor.submit(&client, submissions).await })
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

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SingleRequest {
    task_type: String,
    payload: serde_json::Value,
}

async fn submit_one(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let client = authenticate(&state, &headers)?;
    let body = read_body(body)?;
    let key = idempotency_key(&headers)?;
    let request: SingleRequest = parse_json(&body)?;
    let submission = Submission {
        task_type: request.task_type,
        payload: request.payload,
        idempotency_key: key,
    };
    let mut answers = submit_detached(&state, client, vec![submission]).await?;
    let accepted = answers
        .pop()
        .unwrap_or_else(|| Err(ApiError::bad_request("empty", "no task")))?;
    Ok((accepted.status, Json(accepted)).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchRequest {
    tasks: Vec<Submission>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum BatchAnswer {
    Accepted {
        status: u16,
        #[serde(flatten)]
        task: Accepted,
    },
    Refused {
        status: u16,
        error: ApiError,
    },
}

async fn submit_batch(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let client = authenticate(&state, &headers)?;
    let body = read_body(body)?;
    let request: BatchRequest = parse_json(&body)?;
    if request.tasks.is_empty() || request.tasks.len() > state.max_batch_tasks {
        return Err(ApiError::bad_request(
            "invalid_batch",
            format!("a batch holds 1 to {} tasks", state.max_batch_tasks),
        ));
    }
    let answers = submit_detached(&state, client, request.tasks).await?;
    let results: Vec<BatchAnswer> = answers
        .into_iter()
        .map(|answer| match answer {
            Ok(task) => BatchAnswer::Accepted {
                status: task.status.as_u16(),
                task,
            },
            Err(error) => BatchAnswer::Refused {
                status: error.status.as_u16(),
                error,
            },
        })
        .collect();
    Ok(Json(serde_json::json!({ "results": results })).into_response())
}

fn parse_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id).map_err(|_| ApiError::bad_request("invalid_id", "task ids are UUIDs"))
}

async fn get_task(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    authenticate(&state, &headers)?;
    let id = parse_id(&id)?;
    let ingestor = &state.ingestor;
    match ingestor.db.task(id).await {
        Ok(Some(task)) => Ok(Json(task).into_response()),
        Ok(None) => Err(not_found(id)),
        Err(err) => Err(db_error(&ingestor.metrics, &err)),
    }
}

async fn get_events(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    authenticate(&state, &headers)?;
    let id = parse_id(&id)?;
    let ingestor = &state.ingestor;
    match ingestor.db.events(id).await {
        Ok(events) if events.is_empty() => Err(not_found(id)),
        Ok(events) => Ok(Json(serde_json::json!({ "events": events })).into_response()),
        Err(err) => Err(db_error(&ingestor.metrics, &err)),
    }
}

fn not_found(id: Uuid) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "task_not_found",
        format!("no task {id}"),
    )
}
