//! `GET /v1/task-types`: each of the client's task types at a glance (backlog, rate,
//! dead letters). Backlog and rate come from the gateway's own queue readings, so a page
//! load costs the broker nothing and the database one count over the dead letters.

use std::sync::Arc;

use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::auth::Client;
use crate::error::{db_error, DbWork};
use crate::error::{ApiError, ErrorBody};
use crate::state::ApiState;
use crate::views::{TypeOverview, TypeOverviews};

#[utoipa::path(get, path = "/v1/task-types", tag = "tasks",
    responses(
        (status = 200, description = "The client's task types", body = TypeOverviews),
        (status = "4XX", description = "Refused", body = ErrorBody),
        (status = "5XX", description = "The database is unavailable", body = ErrorBody),
    ))]
pub async fn task_types(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
) -> Result<Response, ApiError> {
    let ingestor = &state.ingestor;
    let known = ingestor.types.snapshot();
    let mut specs: Vec<_> = known
        .values()
        .map(|k| &k.spec)
        .filter(|spec| client.may_use(&spec.tenant))
        .collect();
    specs.sort_by(|a, b| (&a.tenant, a.local_name()).cmp(&(&b.tenant, b.local_name())));
    let keys: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let dead = ingestor
        .db
        .dead_letter_counts(&keys)
        .await
        .map_err(|err| db_error(&ingestor.metrics, &err, DbWork::Read))?;
    let task_types = specs
        .into_iter()
        .map(|spec| {
            let reading = ingestor.depths.backlog(&spec.name);
            TypeOverview {
                name: spec.local_name().to_owned(),
                namespace: spec.tenant.clone(),
                backlog: reading.map(|(depth, _)| depth),
                taken_per_second: reading.map(|(_, rate)| (rate * 100.0).round() / 100.0),
                dead_letters: dead.get(&spec.name).copied().unwrap_or(0),
                max_queue_depth: spec.max_queue_depth,
                max_retries: spec.max_retries,
            }
        })
        .collect();
    Ok(Json(TypeOverviews { task_types }).into_response())
}
