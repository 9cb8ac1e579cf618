//! The audit log's partitions, months on (issue 32): upkeep that never freezes writers,
//! and retention that keeps the history of tasks still open, on the real PostgreSQL.

use std::time::{Duration, Instant};

use chrono::{Days, Utc};
use conveyor_core::db::{Db, Locked, PartitionsOwed};
use conveyor_core::task::NewTask;
use conveyor_core::testing::{unique_type, TestDatabase};
use uuid::Uuid;

use crate::support::{connect_as, days_ago, migrated_before, new_task, set_state};

/// An audit row for `task`, written by the tables' owner at a time of its choosing.
async fn old_event(db: &Db, task: &NewTask, at: chrono::DateTime<Utc>) {
    sqlx::query(
        "INSERT INTO task_events (task_id, task_type, to_state, attempt, detail, at)
         VALUES ($1, $2, 'INGESTED', 0, 'from long ago', $3)",
    )
    .bind(task.id)
    .bind(&task.task_type)
    .bind(at)
    .execute(db.pool())
    .await
    .unwrap();
}

/// Whether some session of this database waits for a lock now.
async fn someone_waits_for_a_lock(db: &Db) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                        WHERE datname = current_database() AND wait_event_type = 'Lock')",
    )
    .fetch_one(db.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn a_long_reader_of_the_audit_log_stalls_neither_writers_nor_partition_upkeep() {
    let db = TestDatabase::create().await.db;
    // Work for upkeep: two old days to drop, and a day ahead to make.
    let today = Utc::now().date_naive();
    db.ensure_partitions_around(0, Some(today - Days::new(40)))
        .await
        .unwrap();
    let ahead = format!("task_events_{}", (today + Days::new(9)).format("%Y%m%d"));
    sqlx::query(&format!("DROP TABLE {ahead}"))
        .execute(db.pool())
        .await
        .unwrap();

    // A long reader of the whole log (a pg_dump, an analytics query): its transaction holds
    // every partition, the default one with them, until the test lets it go.
    let mut reader = db.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL idle_in_transaction_session_timeout = 0")
        .execute(&mut *reader)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM task_events")
        .execute(&mut *reader)
        .await
        .unwrap();

    let upkeep = {
        let db = db.clone();
        tokio::spawn(async move {
            let made = db.ensure_partitions_around(14, None).await.unwrap();
            let dropped = db.drop_partitions_before(30, None).await.unwrap();
            (made, dropped)
        })
    };
    // Writers come once upkeep is at its locks (or done).
    while !upkeep.is_finished() && !someone_waits_for_a_lock(&db).await {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let task_type = unique_type("reader");
    let writes = async {
        for _ in 0..10 {
            let task = new_task(&task_type, Uuid::new_v4());
            db.record_tasks(std::slice::from_ref(&task)).await.unwrap();
            db.mark_queued(&[task.id], Locked::Wait).await.unwrap();
        }
    };
    // The reader stays for as long as this takes, up to a minute: before the fix, upkeep
    // held the log in EXCLUSIVE mode while it waited for the reader, and the writers with it.
    let (_, upkeep) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(writes, upkeep)
    })
    .await
    .expect("writers and upkeep finished while a reader of the log was still open");
    let (made, dropped) = upkeep.unwrap();
    assert!(
        made.is_empty() && dropped.is_empty(),
        "nothing waiting on the reader can be done now: made {made:?}, dropped {dropped:?}"
    );
    let owed = db.partitions_owed(Some(30), None).await.unwrap();
    assert_eq!(
        owed,
        PartitionsOwed {
            days_ahead: 9,
            overdue: 2
        },
        "upkeep says what it still owes"
    );
    reader.commit().await.unwrap();

    // The next pass does it all.
    let made = db.ensure_partitions_around(14, None).await.unwrap();
    assert_eq!(made, [ahead]);
    assert_eq!(db.drop_partitions_before(30, None).await.unwrap().len(), 2);
    let owed = db.partitions_owed(Some(30), None).await.unwrap();
    assert_eq!(
        owed,
        PartitionsOwed {
            days_ahead: 15,
            overdue: 0
        }
    );
}

#[tokio::test]
async fn retention_keeps_the_history_of_a_task_still_open_until_it_settles() {
    let db = TestDatabase::create().await.db;
    let today = Utc::now().date_naive();
    db.ensure_partitions_around(0, Some(today - Days::new(40)))
        .await
        .unwrap();
    let task_type = unique_type("parked");
    let parked = new_task(&task_type, Uuid::new_v4());
    let done = new_task(&task_type, Uuid::new_v4());
    db.record_tasks(&[parked.clone(), done.clone()])
        .await
        .unwrap();
    for task in [&parked, &done] {
        old_event(&db, task, days_ago(40)).await;
    }
    // One dead letter parked for 40 days, one task long completed.
    set_state(&db, parked.id, "DEAD_LETTER").await;
    set_state(&db, done.id, "COMPLETED").await;
    let before = db.events(parked.id).await.unwrap();
    assert_eq!(before.len(), 2);

    let dropped = db.drop_partitions_before(30, None).await.unwrap();
    assert_eq!(dropped.len(), 2, "{dropped:?}");
    assert_eq!(
        db.events(parked.id).await.unwrap(),
        before,
        "the open task's whole history is kept"
    );
    let done_events = db.events(done.id).await.unwrap();
    assert!(
        done_events.iter().all(|e| e.at > days_ago(31)),
        "the settled task's old day went with its partition: {done_events:?}"
    );
    // The kept rows stay where they are: upkeep makes no partition for a dropped day.
    db.ensure_partitions_around(14, None).await.unwrap();
    assert_eq!(db.events(parked.id).await.unwrap(), before);
    let old_day = format!("task_events_{}", (today - Days::new(40)).format("%Y%m%d"));
    let remade: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(&old_day)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(remade, None, "a dropped day came back");

    // Once the dead letter is settled, its old history goes at the next pass.
    set_state(&db, parked.id, "CANCELLED").await;
    db.drop_partitions_before(30, None).await.unwrap();
    let left = db.events(parked.id).await.unwrap();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].at > days_ago(31));
}

/// A DROP holds the whole log until its statement ends, so retention drops one day per
/// call, oldest first, and stops at the first day it cannot drop now (before, a pass went
/// on past it: every day after the first drop was dropped with all writers held out, and
/// a newer day dropped before an older one was remade by the next rescue).
#[tokio::test]
async fn retention_drops_days_oldest_first_and_stops_at_one_a_reader_holds() {
    let db = TestDatabase::create().await.db;
    let today = Utc::now().date_naive();
    // Days 45 to 42 ago, past a 30-day retention.
    db.ensure_partitions_around(2, Some(today - Days::new(44)))
        .await
        .unwrap();
    let day = |n: u64| format!("task_events_{}", (today - Days::new(n)).format("%Y%m%d"));
    let mut reader = db.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL idle_in_transaction_session_timeout = 0")
        .execute(&mut *reader)
        .await
        .unwrap();
    sqlx::query(&format!("SELECT count(*) FROM {}", day(44)))
        .execute(&mut *reader)
        .await
        .unwrap();

    let dropped = db.drop_partitions_before(30, None).await.unwrap();
    assert_eq!(
        dropped,
        [day(45)],
        "the days after the held one wait for it"
    );
    reader.commit().await.unwrap();
    let dropped = db.drop_partitions_before(30, None).await.unwrap();
    assert_eq!(dropped, [day(44), day(43), day(42)]);
}

/// Rows of one open task, however many: a tenant's role may append audit rows to its own
/// tasks without limit (never choosing their time), and a dead letter stays open for ever.
/// Written here by the owner, on a day past the retention, as the days would have passed.
async fn flood(db: &Db, task: &NewTask, rows: i64, at: chrono::DateTime<Utc>) {
    sqlx::query(
        "INSERT INTO task_events (task_id, task_type, to_state, attempt, detail, at)
         SELECT $1, $2, 'DEAD_LETTER', 0, 'row ' || i, $3 + i * interval '1 microsecond'
         FROM generate_series(1, $4) AS i",
    )
    .bind(task.id)
    .bind(&task.task_type)
    .bind(at)
    .bind(rows)
    .execute(db.pool())
    .await
    .unwrap();
}

/// Retention copied an open task's old events aside, dropped the day, and inserted them
/// back into the log while the DROP still held it in ACCESS EXCLUSIVE: every writer of
/// every tenant waited for as long as the insert of however many rows one tenant had
/// written. The copy is made before the lock now, and the lock covers only the DROP. Judged
/// against the drop's own time in the same run: before, the longest write waited about
/// half of it (the insert back); now a few milliseconds of seconds.
#[tokio::test]
async fn a_flood_of_audit_rows_on_one_open_task_does_not_hold_writers_at_the_days_drop() {
    let db = TestDatabase::create().await.db;
    let today = Utc::now().date_naive();
    db.ensure_partitions_around(0, Some(today - Days::new(40)))
        .await
        .unwrap();
    let task_type = unique_type("flood");
    let parked = new_task(&task_type, Uuid::new_v4());
    db.record_tasks(std::slice::from_ref(&parked))
        .await
        .unwrap();
    set_state(&db, parked.id, "DEAD_LETTER").await;
    const ROWS: i64 = 600_000;
    flood(&db, &parked, ROWS, days_ago(40)).await;

    // Writers of another type, one transition after another, for as long as the drop runs.
    let stop = tokio_util::sync::CancellationToken::new();
    let writers = {
        let (db, stop) = (db.clone(), stop.clone());
        let task_type = unique_type("bystander");
        tokio::spawn(async move {
            let mut longest = Duration::ZERO;
            while !stop.is_cancelled() {
                let task = new_task(&task_type, Uuid::new_v4());
                let started = Instant::now();
                db.record_tasks(std::slice::from_ref(&task)).await.unwrap();
                db.mark_queued(&[task.id], Locked::Wait).await.unwrap();
                longest = longest.max(started.elapsed());
            }
            longest
        })
    };
    // A drop whose lock is not granted in 100 ms (a writer slowed on a busy machine) is
    // undone and tried again, as upkeep does a minute later.
    let started = Instant::now();
    let mut dropped = Vec::new();
    for _ in 0..20 {
        dropped.extend(db.drop_partitions_before(30, None).await.unwrap());
        if dropped.len() == 2 {
            break;
        }
    }
    let drop_took = started.elapsed();
    stop.cancel();
    let longest_write = writers.await.unwrap();

    assert_eq!(dropped.len(), 2, "{dropped:?}");
    assert_eq!(
        db.events(parked.id).await.unwrap().len() as i64,
        ROWS + 1,
        "the open task's whole history is kept (the flood and its INGESTED)"
    );
    println!("drop took {drop_took:?}; the longest write waited {longest_write:?}");
    assert!(
        longest_write < drop_took / 4,
        "a write waited {longest_write:?} while the drop took {drop_took:?}: the drop held \
         the log while it wrote the open task's rows"
    );
}

/// The migration that made `task_events_kept` gave the roles that existed the same rule on
/// it as on the log. Its first version copied a tenant policy's text, which names the log
/// (`task_events.task_id`), and failed on every database with a tenant: the gateway of an
/// upgraded installation could not start. Migrated here from the version before, with a
/// tenant granted as that version granted it.
#[tokio::test]
async fn an_upgrade_gives_existing_tenants_their_own_kept_history_and_no_one_elses() {
    let test = migrated_before(20261206000001).await;
    let db = &test.db;
    let tenant = format!("up-{}", &Uuid::new_v4().simple().to_string()[..8]);
    let role = format!("conveyor-{tenant}");
    for statement in [
        format!("CREATE ROLE \"{role}\" LOGIN PASSWORD 'upgrade'"),
        format!("GRANT USAGE ON SCHEMA public TO \"{role}\""),
        format!("GRANT SELECT ON tasks, task_events TO \"{role}\""),
        format!("CREATE POLICY \"{role}\" ON tasks TO \"{role}\" USING (tenant = '{tenant}')"),
        format!(
            "CREATE POLICY \"{role}\" ON task_events TO \"{role}\"
             USING (EXISTS (SELECT 1 FROM tasks t WHERE t.id = task_id))"
        ),
    ] {
        sqlx::query(&statement).execute(db.pool()).await.unwrap();
    }

    let migrated = db.migrate().await;
    // The role goes whatever happened (roles outlive the test's database).
    let mine = NewTask {
        tenant: tenant.clone(),
        ..new_task(&format!("{tenant}.transcode"), Uuid::new_v4())
    };
    let theirs = new_task(&unique_type("other"), Uuid::new_v4());
    if migrated.is_ok() {
        db.record_tasks(&[mine.clone(), theirs.clone()])
            .await
            .unwrap();
        for task in [&mine, &theirs] {
            sqlx::query(
                "INSERT INTO task_events_kept (task_id, task_type, to_state, attempt, at)
                 VALUES ($1, $2, 'DEAD_LETTER', 0, $3)",
            )
            .bind(task.id)
            .bind(&task.task_type)
            .bind(days_ago(40))
            .execute(db.pool())
            .await
            .unwrap();
        }
    }
    let as_tenant = connect_as(&test, &role, "upgrade");
    let seen = if migrated.is_ok() {
        Some((
            as_tenant.events(mine.id).await.map(|e| e.len()),
            as_tenant.events(theirs.id).await.map(|e| e.len()),
        ))
    } else {
        None
    };
    as_tenant.close().await;
    // Its grants go first, on whichever tables there are.
    for statement in [
        format!("DROP POLICY IF EXISTS \"{role}\" ON tasks"),
        format!("DROP POLICY IF EXISTS \"{role}\" ON task_events"),
        format!("DROP POLICY IF EXISTS \"{role}\" ON task_events_kept"),
        format!("REVOKE ALL ON tasks, task_events FROM \"{role}\""),
        format!("REVOKE ALL ON task_events_kept FROM \"{role}\""),
        format!("REVOKE ALL ON SCHEMA public FROM \"{role}\""),
    ] {
        let _ = sqlx::query(&statement).execute(db.pool()).await;
    }
    sqlx::query(&format!("DROP ROLE \"{role}\""))
        .execute(db.pool())
        .await
        .unwrap();

    migrated.expect("the migration applies over a tenant's role");
    let (mine_seen, theirs_seen) = seen.unwrap();
    // Its own task: the INGESTED row in the log and the kept one; the other's: nothing.
    assert_eq!(mine_seen.unwrap(), 2);
    assert_eq!(theirs_seen.unwrap(), 0);
}
