//! Lists of tasks: filters, label selectors and cursor pages, newest first.
//!
//! Each type is read on its own through `tasks_listed (task_type, id)` (a type's key names
//! its tenant), newest first and stopping at the page size, and the types' pages are merged:
//! a page costs about its size in index entries per type, however many tasks there are.
//! A filter no index serves in id order (most states, update times) would walk a type's
//! whole history to fill a page: such a page reads at most [`SCAN_BOUND`] index entries per
//! type, and may come back short, or empty, with a cursor to go on from (issue 33, item 3).

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

/// Most index entries of one type a page reads when no index serves its filter in id order.
pub const SCAN_BOUND: i64 = 10_000;

/// States whose lists an index holds in id order (`tasks_listed_unhappy`).
const LISTED_STATES: [TaskState; 2] = [TaskState::DeadLetter, TaskState::Cancelled];

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

impl TaskFilter {
    /// Whether a page must bound its scan: a state or update-time filter, or a selector of
    /// absences alone (`!key`, `notin`), which no index serves in id order, would otherwise
    /// read every older task of the type.
    pub fn scans_unbounded(&self) -> bool {
        let requirements = &self.selector.0;
        let absences_only = !requirements.is_empty()
            && !requirements
                .iter()
                .any(|r| matches!(r, Requirement::In { .. }));
        self.updated_after.is_some()
            || self.updated_before.is_some()
            || self.states.iter().any(|s| !LISTED_STATES.contains(s))
            || absences_only
    }
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
        let edge = if filter.scans_unbounded() {
            self.scan_edge(filter).await?
        } else {
            None
        };
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
        if let Some(edge) = edge {
            query.push(" AND t.id >= ");
            query.push_bind(edge);
        }
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
            // Short: either nothing older matches, or the scan stopped at its edge.
            edge
        };
        Ok(TaskPage { tasks, next })
    }

    /// Where a bounded page's scan stops: the highest id at which some type's
    /// [`SCAN_BOUND`] newest entries (within the filter's id range) end, or `None` when no
    /// type has that many. Every type's range from there up holds at most that many.
    async fn scan_edge(&self, filter: &TaskFilter) -> DbResult<Option<Uuid>> {
        // The entry at offset SCAN_BOUND - 1 exists only where a type has that many.
        let mut query = QueryBuilder::<Postgres>::new("SELECT bound.edge FROM unnest(");
        query.push_bind(&filter.types);
        query.push(
            "::text[]) AS ty(name) CROSS JOIN LATERAL (SELECT t.id AS edge FROM tasks t \
             WHERE t.task_type = ty.name",
        );
        push_id_bounds(&mut query, filter);
        query.push(" ORDER BY t.id DESC OFFSET ");
        query.push_bind(SCAN_BOUND - 1);
        query.push(" LIMIT 1) bound ORDER BY bound.edge DESC LIMIT 1");
        let edge: Option<Uuid> = query
            .build_query_scalar()
            .fetch_optional(&self.pool)
            .await?;
        Ok(edge)
    }
}

impl Db {
    /// The rows of `ids` as a list shows them (no payload or result), in no order; an id with
    /// no row is left out. One indexed read however many ids: the gateway's feed of followed
    /// tasks reads all of them together.
    pub async fn listed_tasks(&self, ids: &[Uuid]) -> DbResult<Vec<TaskRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {LIST_COLUMNS} FROM tasks WHERE id = ANY($1)"
        ))
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(task_from_row).collect()
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
    push_id_bounds(query, filter);
    if let Some(after) = filter.created_after {
        query.push(" AND t.created_at >= ");
        query.push_bind(after);
    }
    if let Some(before) = filter.created_before {
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

/// The cursor and the creation times as ranges of ids, which `tasks_listed` serves.
fn push_id_bounds(query: &mut QueryBuilder<'_, Postgres>, filter: &TaskFilter) {
    if let Some(id) = filter.before_id {
        query.push(" AND t.id < ");
        query.push_bind(id);
    }
    let slack = Duration::minutes(CLOCK_SLACK_MINUTES);
    if let Some(after) = filter.created_after {
        query.push(" AND t.id >= ");
        query.push_bind(v7_floor(after - slack));
    }
    if let Some(before) = filter.created_before {
        query.push(" AND t.id < ");
        query.push_bind(v7_floor(before + slack));
    }
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
