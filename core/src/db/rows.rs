//! Rows as the code sees them: the task columns read back, and their decoding.

use sqlx::postgres::PgRow;
use sqlx::Row;

use super::{DbError, DbResult};
use crate::labels::Labels;
use crate::lifecycle::{self, TaskState};
use crate::task::{TaskEvent, TaskRecord};

pub(super) const TASK_COLUMNS: &str =
    "id, tenant, idempotency_key, task_type, state, attempt, retries, \
                            owner, payload, labels, progress, result, error, created_at, updated_at, suspect";

pub(super) fn parse_state(name: String) -> DbResult<TaskState> {
    name.parse()
        .map_err(|e: lifecycle::UnknownState| DbError::Corrupt(e.to_string()))
}

pub(super) fn task_from_row(row: &PgRow) -> DbResult<TaskRecord> {
    Ok(TaskRecord {
        id: row.try_get("id")?,
        tenant: row.try_get("tenant")?,
        idempotency_key: row.try_get("idempotency_key")?,
        task_type: row.try_get("task_type")?,
        state: parse_state(row.try_get("state")?)?,
        attempt: row.try_get("attempt")?,
        retries: row.try_get("retries")?,
        owner: row.try_get("owner")?,
        payload: row.try_get("payload")?,
        labels: labels_from(row.try_get("labels")?)?,
        progress: row.try_get("progress")?,
        result: row.try_get("result")?,
        error: row.try_get("error")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        suspect: row.try_get("suspect")?,
    })
}

/// Labels as stored: a JSON object of strings (only [`crate::labels::check`]ed maps are
/// ever written).
fn labels_from(value: serde_json::Value) -> DbResult<Labels> {
    serde_json::from_value(value)
        .map_err(|e| DbError::Corrupt(format!("task labels are not a map of strings: {e}")))
}

pub(super) fn event_from_row(row: &PgRow) -> DbResult<TaskEvent> {
    let from: Option<String> = row.try_get("from_state")?;
    Ok(TaskEvent {
        seq: row.try_get("seq")?,
        task_id: row.try_get("task_id")?,
        task_type: row.try_get("task_type")?,
        from_state: from.map(parse_state).transpose()?,
        to_state: parse_state(row.try_get("to_state")?)?,
        attempt: row.try_get("attempt")?,
        worker_id: row.try_get("worker_id")?,
        detail: row.try_get("detail")?,
        at: row.try_get("at")?,
    })
}
