//! The task routes: submit one or a batch, read a task and its audit timeline.

use std::sync::Arc;

use axum::extract::{Extension, Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use conveyor_core::trace::TraceContext;
use serde::Deserialize;
use tracing::Instrument;

use crate::admission::InFlight;
use crate::auth::Client;
use crate::error::{db_error, DbWork};
use crate::error::{ApiError, ErrorBody};
use crate::ingest::{Accepted, Submission};
use crate::request::{idempotency_key, own_task, parse_json, ChargedBody};
use crate::state::ApiState;
use crate::views::{BatchAnswer, BatchResults, EventList, EventView, TaskView};

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
        Err(ApiError::internal(
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
    trace: Option<Extension<TraceContext>>,
    headers: HeaderMap,
    ChargedBody(body): ChargedBody,
) -> Result<Response, ApiError> {
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
    // The ingestor answers every submission: none at all is the gateway's own fault.
    let accepted = answers.pop().unwrap_or_else(|| {
        tracing::error!("a submission got no answer from the ingestor");
        Err(ApiError::internal(
            "the submission got no answer inside the gateway",
        ))
    })?;
    Ok((accepted.status, Json(accepted)).into_response())
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    tasks: Vec<Submission>,
}

/// Submits up to `--max-batch-tasks` tasks (1,000 by default); each gets its own answer, in order.
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
    trace: Option<Extension<TraceContext>>,
    ChargedBody(body): ChargedBody,
) -> Result<Response, ApiError> {
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
        Err(err) => Err(db_error(&ingestor.metrics, &err, DbWork::Read)),
    }
}
