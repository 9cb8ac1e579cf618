//! Lists of tasks: filters, label selectors and cursor pages, newest first.
//!
//! Each type is read on its own through `tasks_listed (task_type, id)` (a type's key names
//! its tenant), newest first and stopping at the page size, and the types' pages are merged:
//! a page costs about its size in index entries per type, however many tasks there are.

use chrono::{DateTime, Duration, Utc};
use sqlx::{Postgres, QueryBuilder};
use uuid::Uuid;

use super::requeue::state_literals;
use super::rows::task_from_row;
use super::{Db, DbResult};
use crate::labels::{Requirement, Selector};
use crate::lifecycle::TaskState;
use crate::task::TaskRecord;

/// The task columns without the payload and result, which can be large and which a list
/// does not show (their places hold nulls, so rows decode as usual).
const LIST_COLUMNS: &str = "id, tenant, idempotency_key, task_type, state, attempt, retries, \
     owner, 'null'::jsonb AS payload, labels, progress, NULL::jsonb AS result, error, \
     created_at, updated_at, suspect";

/// Ids are UUIDv7 made by the gateway's clock, `created_at` by the database's: a time bound
/// on ids is widened by this much so that clock skew cannot hide a task.
pub(super) const CLOCK_SLACK_MINUTES: i64 = 5;

/// Which tasks to list. Everything left empty or `None` is not filtered on.
#[derive(Debug, Clone, Default)]
pub struct TaskFilter {
    /// The type keys to look in: the caller's types, or the one asked for. Empty lists
    /// nothing.
    pub types: Vec<String>,
    /// The tenants the caller may see; `None` for a caller who may see every tenant.
    pub tenants: Option<Vec<String>>,
    pub states: Vec<TaskState>,
    pub selector: Selector,
    pub created_after: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    pub updated_after: Option<DateTime<Utc>>,
    pub updated_before: Option<DateTime<Utc>>,
    /// The cursor: only tasks older than this one (ids are time-ordered).
    pub before_id: Option<Uuid>,
}

/// One page of a list.
#[derive(Debug, Clone)]
pub struct TaskPage {
    pub tasks: Vec<TaskRecord>,
    /// The cursor of the next page, when there is one.
    pub next: Option<Uuid>,
}

/// The smallest UUIDv7 of millisecond `at` (its random bits zero): every id made at or
/// after `at` sorts at or above it.
pub(super) fn v7_floor(at: DateTime<Utc>) -> Uuid {
    let millis = at.timestamp_millis().max(0) as u64;
    let mut bytes = [0u8; 16];
    bytes[..6].copy_from_slice(&millis.to_be_bytes()[2..]);
    bytes[6] = 0x70;
    bytes[8] = 0x80;
    Uuid::from_bytes(bytes)
}

impl Db {
    /// Up to `limit` tasks matching `filter`, newest first, and the cursor of the next page;
    /// without their payloads and results (`payload` is null).
    pub async fn list_tasks(&self, filter: &TaskFilter, limit: u32) -> DbResult<TaskPage> {
        if filter.types.is_empty() || limit == 0 {
            return Ok(TaskPage {
                tasks: Vec::new(),
                next: None,
            });
        }
        // One more than asked: whether it comes back says whether a next page exists.
        let fetch = i64::from(limit) + 1;
        let mut query =
            QueryBuilder::<Postgres>::new(format!("SELECT {LIST_COLUMNS} FROM unnest("));
        query.push_bind(&filter.types);
        query.push(format!(
            "::text[]) AS ty(name) CROSS JOIN LATERAL (SELECT {LIST_COLUMNS} FROM tasks t \
             WHERE t.task_type = ty.name"
        ));
        push_filters(&mut query, filter);
        query.push(" ORDER BY t.id DESC LIMIT ");
        query.push_bind(fetch);
        query.push(") page ORDER BY id DESC LIMIT ");
        query.push_bind(fetch);
        let rows = query.build().fetch_all(&self.pool).await?;
        let mut tasks = rows
            .iter()
            .map(task_from_row)
            .collect::<DbResult<Vec<_>>>()?;
        let next = if tasks.len() > limit as usize {
            tasks.truncate(limit as usize);
            tasks.last().map(|t| t.id)
        } else {
            None
        };
        Ok(TaskPage { tasks, next })
    }
}

fn push_filters(query: &mut QueryBuilder<'_, Postgres>, filter: &TaskFilter) {
    if let Some(tenants) = &filter.tenants {
        query.push(" AND t.tenant = ANY(");
        query.push_bind(tenants.clone());
        query.push(")");
    }
    if !filter.states.is_empty() {
        // Literals, not binds: the planner then sees that a list of dead letters is what
        // `tasks_listed_unhappy` holds.
        query.push(format!(
            " AND t.state IN ({})",
            state_literals(&filter.states)
        ));
    }
    if let Some(id) = filter.before_id {
        query.push(" AND t.id < ");
        query.push_bind(id);
    }
    let slack = Duration::minutes(CLOCK_SLACK_MINUTES);
    if let Some(after) = filter.created_after {
        query.push(" AND t.id >= ");
        query.push_bind(v7_floor(after - slack));
        query.push(" AND t.created_at >= ");
        query.push_bind(after);
    }
    if let Some(before) = filter.created_before {
        query.push(" AND t.id < ");
        query.push_bind(v7_floor(before + slack));
        query.push(" AND t.created_at < ");
        query.push_bind(before);
    }
    if let Some(after) = filter.updated_after {
        query.push(" AND t.updated_at >= ");
        query.push_bind(after);
    }
    if let Some(before) = filter.updated_before {
        query.push(" AND t.updated_at < ");
        query.push_bind(before);
    }
    push_selector(query, &filter.selector);
}

/// The selector as SQL over `t.labels`, in the forms the GIN index `tasks_labels` serves.
fn push_selector(query: &mut QueryBuilder<'_, Postgres>, selector: &Selector) {
    let mut positive = false;
    for requirement in &selector.0 {
        match requirement {
            Requirement::In { key, values } if values.is_empty() => {
                positive = true;
                query.push(" AND t.labels ? ");
                query.push_bind(key.clone());
            }
            Requirement::In { key, values } => {
                positive = true;
                query.push(" AND (");
                for (i, value) in values.iter().enumerate() {
                    if i > 0 {
                        query.push(" OR ");
                    }
                    query.push("t.labels @> ");
                    query.push_bind(serde_json::json!({ key: value }));
                }
                query.push(")");
            }
            Requirement::NotIn { key, values } if values.is_empty() => {
                query.push(" AND NOT t.labels ? ");
                query.push_bind(key.clone());
            }
            Requirement::NotIn { key, values } => {
                query.push(" AND coalesce(t.labels ->> ");
                query.push_bind(key.clone());
                query.push(" <> ALL(");
                query.push_bind(values.clone());
                query.push("), true)");
            }
        }
    }
    if positive {
        // Implies the partial index's predicate, so the planner may use it.
        query.push(" AND t.labels <> '{}'");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v7_floor_sorts_below_every_id_made_at_or_after_its_time() {
        let at = Utc::now();
        let floor = v7_floor(at);
        assert_eq!(floor.get_version_num(), 7);
        let later = Uuid::now_v7();
        assert!(floor <= later, "{floor} > {later}");
        assert!(v7_floor(at + Duration::seconds(1)) > later);
    }
}
