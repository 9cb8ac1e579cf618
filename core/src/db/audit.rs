//! The audit log's writes: events appended in lifecycle order, each step checked against
//! the transition table.

use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use super::DbResult;
use crate::lifecycle::{self, TaskState};

/// An audit event to append.
#[derive(Debug, Clone)]
pub(super) struct EventRow {
    pub task_id: Uuid,
    pub task_type: String,
    pub from: TaskState,
    pub to: TaskState,
    pub attempt: i32,
    pub worker_id: Option<String>,
    pub detail: Option<String>,
}

/// Appends audit events in one statement, refusing any step outside the lifecycle.
pub(super) async fn append_events(
    tx: &mut Transaction<'static, Postgres>,
    rows: &[EventRow],
) -> DbResult<()> {
    for row in rows {
        lifecycle::check(row.from, row.to)?;
    }
    let ids: Vec<Uuid> = rows.iter().map(|r| r.task_id).collect();
    let types: Vec<&str> = rows.iter().map(|r| r.task_type.as_str()).collect();
    let froms: Vec<&str> = rows.iter().map(|r| r.from.as_str()).collect();
    let tos: Vec<&str> = rows.iter().map(|r| r.to.as_str()).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempt).collect();
    let workers: Vec<Option<String>> = rows.iter().map(|r| r.worker_id.clone()).collect();
    let details: Vec<Option<String>> = rows
        .iter()
        .map(|r| r.detail.as_deref().map(storable))
        .collect();
    sqlx::query(
        "INSERT INTO task_events (task_id, task_type, from_state, to_state, attempt, worker_id, detail)
         SELECT task_id, task_type, from_state, to_state, attempt, worker_id, detail FROM (
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int[],
                                  $6::text[], $7::text[]) WITH ORDINALITY
                 AS e(task_id, task_type, from_state, to_state, attempt, worker_id, detail, ord)
             ORDER BY ord
         ) ordered",
    )
    .bind(&ids)
    .bind(&types)
    .bind(&froms)
    .bind(&tos)
    .bind(&attempts)
    .bind(&workers)
    .bind(&details)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A path of lifecycle edges as the two text arrays the SQL takes, checked against the table.
pub(super) fn edges(
    path: &[(TaskState, TaskState)],
) -> DbResult<(Vec<&'static str>, Vec<&'static str>)> {
    for &(from, to) in path {
        lifecycle::check(from, to)?;
    }
    Ok(path.iter().map(|(f, t)| (f.as_str(), t.as_str())).unzip())
}

/// Text as PostgreSQL stores it: a NUL character (which a handler's stderr may hold) is
/// refused in `text`, so it is replaced rather than losing the whole write.
pub(super) fn storable(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use TaskState::*;

    #[test]
    fn every_path_written_here_is_in_the_lifecycle() {
        assert!(edges(&[(Ingested, Queued), (Queued, Claimed), (Claimed, Processing)]).is_ok());
        assert!(edges(&[(Queued, Processing)]).is_err());
    }
}
