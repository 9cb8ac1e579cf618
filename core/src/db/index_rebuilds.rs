//! Indexes of `tasks` that deletes leave sparse, rebuilt without holding writers (decision
//! 0037). Task ids are UUIDv7, so `tasks_pkey` and `tasks_listed` grow at their right edge
//! only. When expiry deletes a day of settled tasks, a leaf page that keeps one row (a dead
//! letter, a long-open task) is never emptied, so never reused: every such row costs a
//! page in each of those indexes for as long as it stays, and the indexes grew with time
//! while the table's rows did not (make soak). PostgreSQL does not merge sparse pages; a
//! rebuild packs them. `REINDEX CONCURRENTLY` takes only a lock that writers do not
//! conflict with, and waits (without blocking anyone) for older snapshots, so it runs on a
//! connection of its own, never the upkeep's.

use super::{Db, DbError, DbResult};

/// An index is rebuilt when its size passes this many times the size of its entries packed
/// as a fresh build packs them. A right-growing index after expiry passes it; an index of
/// random keys (the idempotency keys) settles below twice, and a rebuild would not last.
const SPARSE_FACTOR: f64 = 2.5;
/// Smaller indexes are left alone: a rebuild would win back too little to be worth it.
const MIN_REBUILD_BYTES: i64 = 1 << 20;

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
    /// widths; `None` before VACUUM or ANALYZE first counted the rows.
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
fn packed_btree_bytes(entries: f64, key_width: f64) -> i64 {
    let entry = ((8.0 + key_width) / 8.0).ceil() * 8.0 + 4.0;
    let leaves = (entries.max(0.0) * entry / PACKED_PAGE).ceil();
    ((leaves * 1.01).ceil() + 1.0) as i64 * PAGE as i64
}

/// What one look at the indexes of `tasks` found and did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct IndexUpkeep {
    /// Every index as measured before any rebuild.
    pub measured: Vec<IndexSize>,
    /// Sparse indexes rebuilt: as they were, and as they are now.
    pub rebuilt: Vec<(IndexSize, IndexSize)>,
    /// Sparse indexes this role may not rebuild (it does not own the table).
    pub denied: Vec<IndexSize>,
    /// Invalid copies a rebuild cut short had left, dropped.
    pub leftovers_dropped: Vec<String>,
}

/// Which tables' indexes are looked at: `tasks` and its TOAST table.
const TASK_TABLES: &str = "(SELECT oid FROM pg_class WHERE oid = 'public.tasks'::regclass
                             UNION ALL
                             SELECT reltoastrelid FROM pg_class WHERE oid = 'public.tasks'::regclass)";

impl Db {
    /// One look at the indexes of `tasks`, on a connection of its own and holding an
    /// advisory lock (gateways take turns; `None` when another process holds it, or when
    /// someone is building an index of `tasks` by hand): drops invalid copies a cut-short
    /// rebuild left (writers keep updating them), measures every B-tree index, and rebuilds
    /// the sparse ones with `REINDEX CONCURRENTLY`: writers go on meanwhile, and a rebuild
    /// waits for older snapshots (a long reader) without holding anyone. Only the table's
    /// owner may drop or rebuild (PostgreSQL 15 has no grant for it): for another role the
    /// sparse indexes come back as `denied`.
    pub async fn upkeep_task_indexes(&self) -> DbResult<Option<IndexUpkeep>> {
        let mut conn = self.rebuilds.acquire().await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(REBUILD_LOCK)
            .fetch_one(&mut *conn)
            .await?;
        if !locked {
            return Ok(None);
        }
        let look = look_holding_the_lock(&mut conn).await;
        release_rebuilds(&mut conn).await;
        look
    }
}

/// Waits for the rebuilds' advisory lock, for a migration: its `ALTER TABLE` queued behind
/// a rebuild (which may wait minutes for a long reader) would hold every writer queued
/// behind it in turn, while waiting on an advisory lock holds nobody.
pub(super) async fn hold_rebuilds(conn: &mut sqlx::PgConnection) -> DbResult<()> {
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(REBUILD_LOCK)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Lets go of what [`hold_rebuilds`] took (a connection that broke lost it already).
pub(super) async fn release_rebuilds(conn: &mut sqlx::PgConnection) {
    let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(REBUILD_LOCK)
        .execute(&mut *conn)
        .await;
}

async fn look_holding_the_lock(conn: &mut sqlx::PgConnection) -> DbResult<Option<IndexUpkeep>> {
    // Someone's own CREATE INDEX or REINDEX on the table: its unfinished copy is not ours.
    let building: bool = sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT FROM pg_stat_progress_create_index WHERE relid IN {TASK_TABLES})"
    ))
    .fetch_one(&mut *conn)
    .await?;
    if building {
        return Ok(None);
    }
    let mut look = IndexUpkeep::default();
    // REINDEX CONCURRENTLY builds `<name>_ccnew` beside the index and renames the old one
    // `<name>_ccold` before dropping it; cut short, either is left invalid.
    let leftovers: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT i.oid::regclass::text FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
          WHERE x.indrelid IN {TASK_TABLES} AND NOT x.indisvalid
            AND i.relname ~ '_cc(new|old)[0-9]*$'"
    ))
    .fetch_all(&mut *conn)
    .await?;
    for leftover in leftovers {
        // The name is PostgreSQL's own rendering of an index it listed.
        let dropped = sqlx::query(&format!("DROP INDEX CONCURRENTLY IF EXISTS {leftover}"))
            .execute(&mut *conn)
            .await
            .map_err(DbError::from);
        match dropped {
            Ok(_) => look.leftovers_dropped.push(leftover),
            Err(err) if err.is_permission_denied() => {}
            Err(err) => return Err(err),
        }
    }
    look.measured = index_sizes(&mut *conn).await?;
    let mut rebuilt = Vec::new();
    for index in look.measured.iter().filter(|index| index.is_sparse()) {
        let done = sqlx::query(&format!("REINDEX INDEX CONCURRENTLY {}", index.name))
            .execute(&mut *conn)
            .await
            .map_err(DbError::from);
        match done {
            Ok(_) => rebuilt.push(index.clone()),
            Err(err) if err.is_permission_denied() => look.denied.push(index.clone()),
            Err(err) => return Err(err),
        }
    }
    // Measured again once, after the last rebuild.
    if !rebuilt.is_empty() {
        let now = index_sizes(&mut *conn).await?;
        look.rebuilt = rebuilt
            .into_iter()
            .filter_map(|before| {
                let after = now.iter().find(|now| now.name == before.name)?.clone();
                Some((before, after))
            })
            .collect();
    }
    Ok(Some(look))
}

/// The indexes' sizes, and what each would take packed: the row count (`reltuples`: the
/// index's own for a partial index, kept by VACUUM; the table's otherwise, which ANALYZE
/// keeps too; -1 before either ran) times the width of its key columns: a fixed-width
/// type's length, a variable-width column's average over the first 1,000 rows (sampled,
/// not from `pg_stats`, which hides a table under row-level security from its readers).
async fn index_sizes(conn: &mut sqlx::PgConnection) -> DbResult<Vec<IndexSize>> {
    let indexes: Vec<(String, i64, f64, bool, Vec<i16>)> = sqlx::query_as(&format!(
        "SELECT i.oid::regclass::text, pg_relation_size(i.oid),
                (CASE WHEN x.indpred IS NULL THEN t.reltuples ELSE i.reltuples END)::float8,
                t.relkind = 't',
                ARRAY(SELECT unnest(x.indkey::int2[])) -- key and INCLUDE columns, from 1
           FROM pg_index x
           JOIN pg_class i ON i.oid = x.indexrelid
           JOIN pg_class t ON t.oid = x.indrelid
           JOIN pg_am am ON am.oid = i.relam
          WHERE x.indrelid IN {TASK_TABLES}
            AND am.amname = 'btree' AND x.indisvalid AND x.indexprs IS NULL
          ORDER BY 1"
    ))
    .fetch_all(&mut *conn)
    .await?;
    let columns: Vec<(i16, String, i16)> = sqlx::query_as(
        "SELECT a.attnum, quote_ident(a.attname), ty.typlen
           FROM pg_attribute a JOIN pg_type ty ON ty.oid = a.atttypid
          WHERE a.attrelid = 'public.tasks'::regclass AND a.attnum > 0 AND NOT a.attisdropped
          ORDER BY a.attnum",
    )
    .fetch_all(&mut *conn)
    .await?;
    let keyed: std::collections::BTreeSet<i16> = indexes
        .iter()
        .filter(|index| !index.3)
        .flat_map(|index| index.4.iter().copied())
        .collect();
    let variable: Vec<&(i16, String, i16)> = columns
        .iter()
        .filter(|(num, _, len)| *len < 0 && keyed.contains(num))
        .collect();
    let mut widths: std::collections::HashMap<i16, f64> = columns
        .iter()
        .filter(|(_, _, len)| *len > 0)
        .map(|(num, _, len)| (*num, f64::from(*len)))
        .collect();
    if !variable.is_empty() {
        // Names quoted by quote_ident(), of the table's own columns.
        let averages = variable
            .iter()
            .map(|(_, name, _)| format!("coalesce(avg(pg_column_size({name})), 0)::float8"))
            .collect::<Vec<_>>()
            .join(", ");
        let row = sqlx::query(&format!(
            "SELECT {averages} FROM (SELECT * FROM public.tasks LIMIT 1000) AS sample"
        ))
        .fetch_one(&mut *conn)
        .await?;
        for (i, (num, _, _)) in variable.iter().enumerate() {
            widths.insert(*num, sqlx::Row::try_get::<f64, _>(&row, i)?);
        }
    }
    Ok(indexes
        .into_iter()
        .map(|(name, bytes, entries, toast, keys)| {
            // A TOAST index: chunk_id (oid) and chunk_seq (int4).
            let width = match toast {
                true => Some(8.0),
                false => keys.iter().map(|key| widths.get(key).copied()).sum(),
            };
            IndexSize {
                name,
                bytes,
                packed_bytes: width
                    .filter(|_| entries >= 0.0)
                    .map(|width| packed_btree_bytes(entries, width)),
            }
        })
        .collect())
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
