//! What the routes share in reading a request: its body, its JSON, its idempotency key,
//! and the task it names (its tenant's only).

use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use conveyor_core::task::TaskRecord;
use conveyor_core::TaskState;
use uuid::Uuid;

use crate::admission::BodyCharged;
use crate::auth::Client;
use crate::error::ApiError;
use crate::error::{db_error, DbWork};
use crate::state::ApiState;

/// A request's body, read within its route's limit and charged against its client's byte
/// rate, unless admission charged its declared length already. The last argument of a
/// handler that reads a body.
pub struct ChargedBody(pub Bytes);

impl FromRequest<Arc<ApiState>> for ChargedBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<ApiState>) -> Result<Self, ApiError> {
        let charged = request.extensions().get::<BodyCharged>().is_some();
        let client = request.extensions().get::<Client>().cloned();
        let body = read_body(Bytes::from_request(request, state).await)?;
        if !charged {
            // Every `/v1` route is admitted, which puts the client there: without one, the
            // route was left out of admission, a fault of the gateway's own.
            let client =
                client.ok_or_else(|| ApiError::internal("the request was not admitted"))?;
            state.charge_bytes(&client, body.len())?;
        }
        Ok(ChargedBody(body))
    }
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

pub(crate) fn idempotency_key(headers: &HeaderMap) -> Result<Option<Uuid>, ApiError> {
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

pub(crate) fn parse_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id).map_err(|_| ApiError::bad_request("invalid_id", "task ids are UUIDs"))
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
            Err(err) => Err(db_error(&ingestor.metrics, &err, DbWork::Read)),
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
        Err(err) => Err(db_error(&ingestor.metrics, &err, DbWork::Read)),
    }
}

pub(crate) fn not_found(id: Uuid) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "task_not_found",
        format!("no task {id}"),
    )
}
