//! `GET /v1/tasks`: a client's tasks, filtered by type, state, labels and time, newest
//! first, a page at a time. A client sees its own tenants' tasks only.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use conveyor_core::db::{TaskFilter, SCAN_BOUND};
use conveyor_core::labels::Selector;
use conveyor_core::TaskState;
use serde::Deserialize;
use uuid::Uuid;

use crate::auth::Client;
use crate::error::{db_error, DbWork};
use crate::error::{ApiError, ErrorBody};
use crate::ingest::resolve;
use crate::state::ApiState;
use crate::views::{TaskPage, TaskSummary};

/// The page size when a client names none, and the most it may name.
pub const DEFAULT_PAGE: u32 = 50;
pub const MAX_PAGE: u32 = 500;

/// The query string of `GET /v1/tasks`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query, rename_all = "camelCase")]
pub struct ListQuery {
    /// A task type's name; every type the client may see when absent.
    #[serde(rename = "type")]
    #[param(rename = "type")]
    pub task_type: Option<String>,
    pub namespace: Option<String>,
    /// States, comma-separated (`DEAD_LETTER,CANCELLED`).
    pub state: Option<String>,
    /// A Kubernetes label selector (`pipeline=vod,tier in (gold,silver),!canary`).
    pub label_selector: Option<String>,
    pub created_after: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    pub updated_after: Option<DateTime<Utc>>,
    pub updated_before: Option<DateTime<Utc>>,
    pub limit: Option<u32>,
    /// `nextCursor` of the page before.
    pub cursor: Option<String>,
}

/// The client's tasks, newest first, a page at a time. Every filter narrows the list; a
/// client sees its own namespaces' tasks only. A filter by a state other than DEAD_LETTER
/// and CANCELLED, by update time, or by absent labels alone (`!key`, `notin`), reads at
/// most 10,000 of each type's tasks per page
/// (within the cursor and creation bounds): its page may hold fewer tasks than `limit`,
/// even none, and still give a `nextCursor` to go on from.
#[utoipa::path(get, path = "/v1/tasks", tag = "tasks",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of tasks", body = TaskPage),
        (status = 400, description = "A malformed filter", body = ErrorBody),
        (status = 404, description = "`type` names no type of the client's", body = ErrorBody),
        (status = "4XX", description = "Refused", body = ErrorBody),
        (status = "5XX", description = "The database is unavailable, or the gateway failed: try again", body = ErrorBody),
    ))]
pub async fn list_tasks(
    State(state): State<Arc<ApiState>>,
    Extension(client): Extension<Client>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_query",
            format!("limit is 1 to {MAX_PAGE}"),
        ));
    }
    let filter = filter(&state, &client, &query)?;
    // Charged what it may read: its page, and where no index serves the filter, a hundredth
    // of the entries its bounded scan may walk in each type.
    let scanned = if filter.scans_unbounded() {
        filter.types.len() as u64 * (SCAN_BOUND as u64 / 100)
    } else {
        0
    };
    state.charge_listing(&client, u64::from(limit) + scanned)?;
    let ingestor = &state.ingestor;
    let page = ingestor
        .db
        .list_tasks(&filter, limit)
        .await
        .map_err(|err| db_error(&ingestor.metrics, &err, DbWork::Read))?;
    Ok(Json(TaskPage {
        tasks: page.tasks.iter().map(TaskSummary::from).collect(),
        next_cursor: page.next.map(|id| id.to_string()),
    })
    .into_response())
}

/// The database filter a client's query means, limited to what the client may see.
pub fn filter(
    state: &ApiState,
    client: &Client,
    query: &ListQuery,
) -> Result<TaskFilter, ApiError> {
    let types = state.ingestor.types.snapshot();
    // Types no TaskType defines any more are listed while they have open tasks (decision
    // 0033): deleting a type hides none of its waiting work.
    let retired = state.ingestor.types.retired();
    let keys: Vec<String> = match &query.task_type {
        Some(name) => {
            let namespace = query.namespace.as_deref();
            match resolve(&types, client, name, namespace) {
                Ok(known) => vec![known.spec.name.clone()],
                Err(unknown) => {
                    let tenant = namespace.or(client.implied_tenant());
                    let found = retired.iter().find(|spec| {
                        Some(spec.tenant.as_str()) == tenant
                            && spec.local_name() == name
                            && client.may_use(&spec.tenant)
                    });
                    vec![found.ok_or(unknown)?.name.clone()]
                }
            }
        }
        None => types
            .values()
            .map(|known| &known.spec)
            .chain(retired.iter())
            .filter(|spec| client.may_use(&spec.tenant))
            .filter(|spec| query.namespace.as_ref().is_none_or(|ns| *ns == spec.tenant))
            .map(|spec| spec.name.clone())
            .collect(),
    };
    let states = match &query.state {
        None => Vec::new(),
        Some(list) => list
            .split(',')
            .map(|name| {
                name.trim().parse::<TaskState>().map_err(|e| {
                    ApiError::bad_request(
                        "invalid_query",
                        format!("state: {e}; states are {}", state_names()),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
    };
    let selector = Selector::parse(query.label_selector.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request("invalid_label_selector", e.to_string()))?;
    let before_id = query
        .cursor
        .as_deref()
        .map(|cursor| {
            Uuid::parse_str(cursor).map_err(|_| {
                ApiError::bad_request("invalid_cursor", "cursor is a page's nextCursor")
            })
        })
        .transpose()?;
    Ok(TaskFilter {
        types: keys,
        tenants: client.tenants().map(<[String]>::to_vec),
        states,
        selector,
        created_after: query.created_after,
        created_before: query.created_before,
        updated_after: query.updated_after,
        updated_before: query.updated_before,
        before_id,
    })
}

fn state_names() -> String {
    TaskState::ALL.map(|s| s.as_str()).join(", ")
}
