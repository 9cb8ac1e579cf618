//! Indexes of `tasks` that deletes leave sparse, rebuilt without holding writers (decision
//! 0037). Task ids are UUIDv7, so `tasks_pkey` and `tasks_listed` grow at their right edge
//! only. When expiry deletes a day of settled tasks, a leaf page that keeps one row (a dead
//! letter, a long-open task) is never emptied, so never reused: every such row costs a
//! page in each of those indexes for as long as it stays, and the indexes grew with time
//! while the table's rows did not (make soak). PostgreSQL does not merge sparse pages; a
//! rebuild packs them. `REINDEX CONCURRENTLY` takes only a lock that writers do not
//! conflict with, and waits (without blocking anyone) for older snapshots, so it runs on a
//! connection of its own, never the upkeep's.

use super::{Db, DbResult};

/// An index is rebuilt when its size passes this many times the size of its entries packed
/// as a fresh build packs them. A right-growing index after expiry passes it; an index of
/// random keys (the idempotency keys) settles below twice, and a rebuild would not last.
pub const SPARSE_FACTOR: f64 = 2.5;
/// Smaller indexes are left alone: a rebuild would win back too little to be worth it.
pub const MIN_REBUILD_BYTES: i64 = 1 << 20;

/// `pg_try_advisory_lock` key held while a rebuild runs: gateways take turns.
const REBUILD_LOCK: i64 = 0x636f_6e76_6569_6478; // "conveidx"

const PAGE: f64 = 8192.0;
/// Bytes of a leaf page that hold entries (header and special space off), at the default
/// B-tree fill factor of a fresh build.
const PACKED_PAGE: f64 = (8192.0 - 24.0 - 16.0) * 0.9;

/// The size of one B-tree index of `tasks` (or of its TOAST table, whose chunk ids grow
/// the same way), and the size of its entries packed.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexSize {
    /// As PostgreSQL prints it: schema-qualified outside the search path, quoted if need be.
    pub name: String,
    pub bytes: i64,
    /// What a fresh build would take, estimated from the rows' count and the columns'
    /// average widths (planner statistics); `None` before the table was first analyzed.
    pub packed_bytes: Option<i64>,
}

impl IndexSize {
    /// How full the index is, in percent of a fresh build's fill (100: packed).
    pub fn density_percent(&self) -> Option<i64> {
        let packed = self.packed_bytes?;
        Some((packed * 100 / self.bytes.max(1)).min(100))
    }

    /// Worth a rebuild: big enough, and at least [`SPARSE_FACTOR`] times its packed size.
    pub fn is_sparse(&self) -> bool {
        match self.packed_bytes {
            Some(packed) => {
                self.bytes >= MIN_REBUILD_BYTES && self.bytes as f64 > SPARSE_FACTOR * packed as f64
            }
            None => false,
        }
    }
}

/// An estimate of the bytes a fresh B-tree build takes for `entries` of `key_width` bytes
/// each on average: an 8-byte tuple header and the key, aligned to 8, plus a 4-byte line
/// pointer, per entry; one page more for the metapage and the inner pages.
pub fn packed_btree_bytes(entries: f64, key_width: f64) -> i64 {
    let entry = ((8.0 + key_width) / 8.0).ceil() * 8.0 + 4.0;
    let leaves = (entries.max(0.0) * entry / PACKED_PAGE).ceil();
    ((leaves * 1.01).ceil() + 1.0) as i64 * PAGE as i64
}

impl Db {
    /// Every valid B-tree index of `tasks` and of its TOAST table, with its size and its
    /// packed size.
    pub async fn task_index_sizes(&self) -> DbResult<Vec<IndexSize>> {
        // A partial index holds only some rows: its own count (kept by VACUUM and ANALYZE)
        // then; the table's otherwise, which ANALYZE keeps current too. -1: never counted.
        let rows: Vec<(String, i64, f64, Option<f64>)> = sqlx::query_as(
            "SELECT i.oid::regclass::text, pg_relation_size(i.oid),
                    (CASE WHEN x.indpred IS NULL THEN t.reltuples ELSE i.reltuples END)::float8,
                    CASE WHEN t.relkind = 't' THEN 8::float8 -- chunk_id oid, chunk_seq int4
                    ELSE (SELECT sum(s.avg_width)::float8
                            FROM pg_attribute a
                            JOIN pg_stats s ON s.schemaname = 'public' AND s.tablename = 'tasks'
                                           AND s.attname = a.attname
                           WHERE a.attrelid = i.oid AND a.attnum > 0) END
               FROM pg_index x
               JOIN pg_class i ON i.oid = x.indexrelid
               JOIN pg_class t ON t.oid = x.indrelid
               JOIN pg_am am ON am.oid = i.relam
              WHERE x.indrelid IN (SELECT oid FROM pg_class WHERE oid = 'public.tasks'::regclass
                                   UNION ALL
                                   SELECT reltoastrelid FROM pg_class WHERE oid = 'public.tasks'::regclass)
                AND am.amname = 'btree' AND x.indisvalid AND x.indexprs IS NULL
              ORDER BY 1",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(name, bytes, entries, width)| IndexSize {
                name,
                bytes,
                packed_bytes: width
                    .filter(|_| entries >= 0.0)
                    .map(|width| packed_btree_bytes(entries, width)),
            })
            .collect())
    }

    /// Rebuilds the index `name` of `tasks` with `REINDEX CONCURRENTLY`, on a connection of
    /// its own: writers go on meanwhile, and the rebuild waits for older snapshots (a long
    /// reader) without holding anyone. First drops what a rebuild cut short left behind (an
    /// invalid copy, which writers would otherwise keep updating). Returns `false` when
    /// another process is rebuilding now. Only the table's owner may (PostgreSQL 15 has no
    /// grant for it): for any other role this is a permission error.
    pub async fn rebuild_task_index(&self, name: &str) -> DbResult<bool> {
        let mut conn = self.rebuilds.acquire().await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(REBUILD_LOCK)
            .fetch_one(&mut *conn)
            .await?;
        if !locked {
            return Ok(false);
        }
        let rebuilt = rebuild_holding_the_lock(&mut conn, name).await;
        // Unlocked whatever happened (a connection that broke lost it with its session).
        let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(REBUILD_LOCK)
            .execute(&mut *conn)
            .await;
        rebuilt.map(|()| true)
    }
}

async fn rebuild_holding_the_lock(conn: &mut sqlx::PgConnection, name: &str) -> DbResult<()> {
    // REINDEX CONCURRENTLY builds `<name>_ccnew` (then `_ccnew1`, ...) beside the index and
    // leaves it invalid when cancelled; nobody else is rebuilding (the advisory lock).
    let leftovers: Vec<String> = sqlx::query_scalar(
        "SELECT i.oid::regclass::text FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
          WHERE x.indrelid IN (SELECT oid FROM pg_class WHERE oid = 'public.tasks'::regclass
                               UNION ALL
                               SELECT reltoastrelid FROM pg_class WHERE oid = 'public.tasks'::regclass)
            AND NOT x.indisvalid AND i.relname ~ '_ccnew[0-9]*$'",
    )
    .fetch_all(&mut *conn)
    .await?;
    for leftover in leftovers {
        sqlx::query(&format!("DROP INDEX CONCURRENTLY IF EXISTS {leftover}"))
            .execute(&mut *conn)
            .await?;
    }
    // Only an index of tasks or of its TOAST table, named as `task_index_sizes` names it
    // (PostgreSQL's own quoting), so the name put into the statement is one it printed.
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM pg_index x
                         WHERE x.indexrelid::regclass::text = $1
                           AND x.indrelid IN (SELECT oid FROM pg_class WHERE oid = 'public.tasks'::regclass
                                              UNION ALL
                                              SELECT reltoastrelid FROM pg_class WHERE oid = 'public.tasks'::regclass))",
    )
    .bind(name)
    .fetch_one(&mut *conn)
    .await?;
    if exists {
        sqlx::query(&format!("REINDEX INDEX CONCURRENTLY {name}"))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_uuid_index_takes_about_a_page_per_262_entries() {
        // uuid: 8 + 16 = 24 bytes, + 4 = 28 a entry; 7,336 bytes a page hold 262.
        let bytes = packed_btree_bytes(262_000.0, 16.0);
        let pages = bytes / 8192;
        assert!((1000..=1020).contains(&pages), "{pages}");
        // An empty index is its metapage.
        assert_eq!(packed_btree_bytes(0.0, 16.0), 8192);
    }

    #[test]
    fn sparse_means_big_and_two_and_a_half_times_its_packed_size() {
        let index = |bytes, packed| IndexSize {
            name: "tasks_pkey".into(),
            bytes,
            packed_bytes: packed,
        };
        assert!(index(4 << 20, Some(1 << 20)).is_sparse());
        assert!(
            !index(2 << 20, Some(1 << 20)).is_sparse(),
            "twice is normal"
        );
        assert!(index(3 << 20, Some(1 << 20)).is_sparse());
        assert!(
            !index(900 << 10, Some(8192)).is_sparse(),
            "too small to matter"
        );
        assert!(!index(64 << 20, None).is_sparse(), "no statistics yet");
        assert_eq!(index(4 << 20, Some(1 << 20)).density_percent(), Some(25));
        assert_eq!(index(1 << 20, Some(2 << 20)).density_percent(), Some(100));
    }
}
