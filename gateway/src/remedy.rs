//! Fixing tasks over the API, so that nobody needs database or broker credentials:
//! `POST /v1/tasks/{id}:cancel` (a task still waiting), `POST /v1/tasks/{id}:retry` (a
//! dead letter) and `POST /v1/tasks:redrive` (a type's dead letters, chosen by labels).
//! Each is audited with the client's name.

use std::sync::Arc;

use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use conveyor_core::amqp::QueueNames;
use conveyor_core::db::{CancelOutcome, TaskFilter};
use conveyor_core::remediation::drop_stale;
use conveyor_core::requeue::{publish_and_commit, RequeueError};
use conveyor_core::task::TaskRecord;
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::TaskState;
use serde::Deserialize;

use crate::auth::Client;
use crate::error::{db_error, DbWork};
use crate::error::{ApiError, ErrorBody};
use crate::find::{self, ListQuery};
use crate::request::{not_found, own_task, parse_json, ChargedBody};
use crate::state::ApiState;
use crate::views::{RedriveAnswer, TaskView};

/// Most dead letters one redrive request sends back; a client repeats it for more.
pub const MAX_REDRIVE: u32 = 1000;

/// `POST /v1/tasks/{id}:cancel` and `:retry`: axum matches whole segments, so the action
/// is split off here.
pub async fn task_action(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
    Path(segment): Path<String>,
) -> Result<Response, ApiError> {
    let (id, action) = segment.split_once(':').ok_or_else(|| {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "POST a task's `:cancel` or `:retry`",
        )
    })?;
    match action {
        "cancel" => cancel_task(&state, &client, id).await,
        "retry" => retry_task(&state, &client, id).await,
        other => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_action",
            format!("a task has no action {other:?}: `:cancel` or `:retry`"),
        )),
    }
}

/// Cancels a task that is still waiting (INGESTED or QUEUED): it becomes CANCELLED and
/// never runs. A task a worker has claimed can no longer be cancelled.
#[utoipa::path(post, path = "/v1/tasks/{id}:cancel", tag = "remedies",
    params(("id" = Uuid, Path, description = "The task's id")),
    responses(
        (status = 200, description = "Cancelled", body = TaskView),
        (status = 404, description = "No such task in the client's namespaces", body = ErrorBody),
        (status = 409, description = "No longer waiting (`not_cancellable`)", body = ErrorBody),
        (status = "4XX", description = "Refused", body = ErrorBody),
        (status = "5XX", description = "The database is unavailable, or the gateway failed: try again", body = ErrorBody),
    ))]
pub async fn cancel_task(
    state: &ApiState,
    client: &Client,
    id: &str,
) -> Result<Response, ApiError> {
    let task = own_task(state, client, id).await?;
    let task = cancel(state, task, &by(client)).await?;
    Ok(Json(TaskView::from(&task)).into_response())
}

/// Sends a DEAD_LETTER task back to work with a fresh retry budget (DEAD_LETTER → QUEUED).
#[utoipa::path(post, path = "/v1/tasks/{id}:retry", tag = "remedies",
    params(("id" = Uuid, Path, description = "The task's id")),
    responses(
        (status = 200, description = "Queued again", body = TaskView),
        (status = 404, description = "No such task in the client's namespaces", body = ErrorBody),
        (status = 409, description = "Not dead-lettered (`not_dead_lettered`)", body = ErrorBody),
        (status = 503, description = "The broker did not confirm; nothing changed", body = ErrorBody),
        (status = "4XX", description = "Refused", body = ErrorBody),
        (status = "5XX", description = "The database is unavailable, or the gateway failed: try again", body = ErrorBody),
    ))]
pub async fn retry_task(state: &ApiState, client: &Client, id: &str) -> Result<Response, ApiError> {
    let task = own_task(state, client, id).await?;
    let task = retry(state, task, &by(client)).await?;
    Ok(Json(TaskView::from(&task)).into_response())
}

/// Who asked, as the audit log's detail names them.
fn by(client: &Client) -> String {
    format!("client {}", client.name)
}

async fn cancel(state: &ApiState, task: TaskRecord, by: &str) -> Result<TaskRecord, ApiError> {
    let ingestor = &state.ingestor;
    let outcome = ingestor
        .db
        .cancel(task.id, by)
        .await
        .map_err(|err| db_error(&ingestor.metrics, &err, DbWork::Change))?;
    match outcome {
        CancelOutcome::Now => reread(state, task).await,
        CancelOutcome::NotFound => Err(not_found(task.id)),
        CancelOutcome::TooLate(now) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_cancellable",
            format!(
                "task {} is {now}: only a task still waiting (INGESTED or QUEUED) can be \
                 cancelled",
                task.id
            ),
        )),
    }
}

async fn retry(state: &ApiState, task: TaskRecord, by: &str) -> Result<TaskRecord, ApiError> {
    if task.state != TaskState::DeadLetter {
        return Err(not_dead_lettered(&task));
    }
    if !send_back(state, &task, &format!("retried by {by}")).await? {
        // It moved on between the read and the lock (another retry, a redrive).
        let now = reread(state, task).await?;
        return Err(not_dead_lettered(&now));
    }
    tidy_remediation(state, &task.task_type);
    reread(state, task).await
}

fn not_dead_lettered(task: &TaskRecord) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "not_dead_lettered",
        format!(
            "task {} is {}: only a DEAD_LETTER task can be retried",
            task.id, task.state
        ),
    )
}

/// DEAD_LETTER → QUEUED with a fresh retry budget, published before it commits (decision
/// 0002), audited with `detail`. `false` when the task was no longer dead-lettered at its
/// attempt.
async fn send_back(state: &ApiState, task: &TaskRecord, detail: &str) -> Result<bool, ApiError> {
    let ingestor = &state.ingestor;
    let pending = ingestor
        .db
        .begin_retry(task.id, task.attempt, &task.task_type, detail)
        .await
        .map_err(|err| db_error(&ingestor.metrics, &err, DbWork::Change))?;
    let Some(pending) = pending else {
        return Ok(false);
    };
    // The main queue only: neither backoff nor retry tiers apply.
    let spec = NamedTaskType::named(&task.task_type);

    publish_and_commit(&ingestor.publisher, pending, &spec)
        .await
        .map_err(|err| {
            tracing::warn!(task = %task.id, error = %conveyor_core::with_causes(&err), "retry not sent");
            match &err {
                RequeueError::Publish(amqp) => ApiError::not_published(
                    &task.task_type,
                    amqp,
                    &format!("task {} was not sent back to work; nothing changed", task.id),
                ),
                // Published, not recorded: the row is still DEAD_LETTER, and the copy sent is
                // dropped by the worker that takes it (its row says it is not queued).
                RequeueError::Commit(_) => ApiError::unavailable(
                    "database_unavailable",
                    format!("the retry of task {} could not be recorded; it is still dead-lettered, retry later", task.id),
                ),
            }
        })?;
    Ok(true)
}

/// After tasks of `task_type` were sent back from the database, their parked copies in the
/// remediation queue are stale: dropped by a walk in the background, so that the queue's
/// depth (and `ConveyorRemediationBacklog`) counts only what still waits for a human. The
/// walk never drops a message its row does not show superseded.
fn tidy_remediation(state: &ApiState, task_type: &str) {
    let queue = QueueNames::of(task_type).remediation;
    let (url, db) = (state.amqp_url.clone(), state.ingestor.db.clone());
    tokio::spawn(async move {
        match drop_stale(
            &url,
            &db,
            &queue,
            MAX_REDRIVE as usize,
            "conveyor-gateway/remediation",
        )
        .await
        {
            Ok(tidied) => tracing::info!(
                queue,
                dropped = tidied.dropped,
                kept = tidied.kept,
                "stale remediation copies dropped"
            ),
            Err(err) => tracing::warn!(queue, error = %conveyor_core::with_causes(&err),
                "remediation queue not tidied; `conveyorctl redrive-queue` drops its stale copies"),
        }
    });
}

async fn reread(state: &ApiState, task: TaskRecord) -> Result<TaskRecord, ApiError> {
    let ingestor = &state.ingestor;
    match ingestor.db.task(task.id).await {
        Ok(Some(now)) => Ok(now),
        Ok(None) => Err(not_found(task.id)),
        Err(err) => Err(db_error(&ingestor.metrics, &err, DbWork::Read)),
    }
}

/// Which dead letters to send back to work.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RedriveRequest {
    task_type: String,
    #[serde(default)]
    namespace: Option<String>,
    /// Only the dead letters whose labels match (Kubernetes syntax).
    #[serde(default)]
    label_selector: Option<String>,
    /// At most this many (1 to 1000, the default); `more` in the answer says if any remain.
    #[serde(default)]
    limit: Option<u32>,
}

/// `POST /v1/tasks:redrive`: up to `limit` of a type's dead letters (those matching the
/// selector) back to work, newest first, each as `:retry` does it.
#[utoipa::path(post, path = "/v1/tasks:redrive", tag = "remedies",
    request_body = RedriveRequest,
    responses(
        (status = 200, description = "What was sent back", body = RedriveAnswer),
        (status = 404, description = "No such type in the client's namespaces", body = ErrorBody),
        (status = "4XX", description = "Refused", body = ErrorBody),
        (status = "5XX", description = "Nothing was sent back", body = ErrorBody),
    ))]
pub async fn redrive(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
    ChargedBody(body): ChargedBody,
) -> Result<Response, ApiError> {
    let request: RedriveRequest = parse_json(&body)?;
    let limit = request.limit.unwrap_or(MAX_REDRIVE);
    if !(1..=MAX_REDRIVE).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_redrive",
            format!("limit is 1 to {MAX_REDRIVE}"),
        ));
    }
    let query = ListQuery {
        task_type: Some(request.task_type),
        namespace: request.namespace,
        label_selector: request.label_selector,
        ..ListQuery::default()
    };
    let mut filter = TaskFilter {
        states: vec![TaskState::DeadLetter],
        ..find::filter(&state, &client, &query)?
    };
    let detail = format!("redriven by {}", by(&client));
    let (mut redriven, mut skipped) = (0u32, 0u32);
    let task_type = filter.types.first().cloned().unwrap_or_default();
    let more = loop {
        let want = (limit - redriven).min(100);
        let page = state
            .ingestor
            .db
            .list_tasks(&filter, want)
            .await
            .map_err(|err| db_error(&state.ingestor.metrics, &err, DbWork::Read))?;
        for task in &page.tasks {
            match send_back(&state, task, &detail).await {
                Ok(true) => redriven += 1,
                Ok(false) => skipped += 1,
                // What was sent back stays sent back; the answer says how far it got.
                Err(err) if redriven > 0 => {
                    tidy_remediation(&state, &task_type);
                    tracing::warn!(redriven, error = %err.message, "redrive stopped early");
                    return Ok(redrive_answer(redriven, skipped, true, Some(err)));
                }
                Err(err) => return Err(err),
            }
        }
        match page.next {
            Some(next) if redriven < limit => filter.before_id = Some(next),
            next => break next.is_some(),
        }
    };
    if redriven > 0 {
        tidy_remediation(&state, &task_type);
    }
    Ok(redrive_answer(redriven, skipped, more, None))
}

fn redrive_answer(redriven: u32, skipped: u32, more: bool, error: Option<ApiError>) -> Response {
    Json(RedriveAnswer {
        redriven,
        skipped,
        more,
        error,
    })
    .into_response()
}
