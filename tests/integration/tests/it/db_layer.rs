//! The Postgres layer on its own: compare-and-set, fencing, reaping, point in time.

use std::time::Duration;

use conveyor_core::db::{CancelOutcome, Fence, Locked, Reap, Recorded};
use conveyor_core::task::{NewTask, Requeue};
use conveyor_core::testing::{unique_type, TestDatabase};
use conveyor_core::TaskState::*;
use uuid::Uuid;

fn new_task(task_type: &str) -> NewTask {
    let id = Uuid::new_v4();
    NewTask {
        id,
        tenant: "default".into(),
        idempotency_key: id,
        task_type: task_type.to_owned(),
        payload: serde_json::json!({"n": 1}),
        labels: Default::default(),
        trace_id: None,
    }
}

/// A fresh database with one task of a new type, QUEUED and claimed by `owner`.
async fn one_claimed_task(owner: &str) -> (conveyor_core::db::Db, String, NewTask) {
    let db = TestDatabase::create().await.db;
    let task_type = unique_type("db");
    let task = new_task(&task_type);
    db.record_tasks(std::slice::from_ref(&task)).await.unwrap();
    db.mark_queued(&[task.id], Locked::Skip).await.unwrap();
    assert!(db.claim(task.id, 0, owner).await.unwrap().won());
    (db, task_type, task)
}

/// A fresh database with three QUEUED tasks of a new type.
async fn three_queued_tasks() -> (conveyor_core::db::Db, String, Vec<Uuid>) {
    let db = TestDatabase::create().await.db;
    let task_type = unique_type("db");
    let tasks: Vec<NewTask> = (0..3).map(|_| new_task(&task_type)).collect();
    db.record_tasks(&tasks).await.unwrap();
    let ids: Vec<Uuid> = tasks.iter().map(|t| t.id).collect();
    db.mark_queued(&ids, Locked::Skip).await.unwrap();
    (db, task_type, ids)
}

#[tokio::test]
async fn claim_is_a_compare_and_set_and_outcomes_are_fenced() {
    let db = TestDatabase::create().await.db;
    let task_type = unique_type("db");
    let task = new_task(&task_type);
    let recorded = db.record_tasks(std::slice::from_ref(&task)).await.unwrap();
    assert!(matches!(recorded[0], Recorded::Created(_)));
    // The same key again is the same task, not a second one.
    let mut again = new_task(&task_type);
    again.idempotency_key = task.idempotency_key;
    let recorded = db.record_tasks(&[again]).await.unwrap();
    assert!(matches!(&recorded[0], Recorded::Existing(t) if t.id == task.id));

    // A claim may win before the gateway marks the task QUEUED; it writes QUEUED itself.
    assert!(db.claim(task.id, 0, "w1").await.unwrap().won());
    assert!(
        !db.claim(task.id, 0, "w2").await.unwrap().won(),
        "second claim must lose"
    );
    db.mark_queued(&[task.id], Locked::Skip).await.unwrap();
    assert_eq!(db.task(task.id).await.unwrap().unwrap().state, Processing);

    assert!(
        !db.complete(task.id, 0, "w2", &serde_json::json!({}))
            .await
            .unwrap(),
        "not the owner"
    );
    assert!(
        !db.complete(task.id, 1, "w1", &serde_json::json!({}))
            .await
            .unwrap(),
        "wrong attempt"
    );
    assert!(db
        .complete(task.id, 0, "w1", &serde_json::json!({"ok": true}))
        .await
        .unwrap());
    assert!(
        !db.complete(task.id, 0, "w1", &serde_json::json!({}))
            .await
            .unwrap(),
        "only once"
    );

    let events = db.events(task.id).await.unwrap();
    let states: Vec<_> = events.iter().map(|e| e.to_state).collect();
    assert_eq!(states, [Ingested, Queued, Claimed, Processing, Completed]);
    assert_eq!(events[4].worker_id.as_deref(), Some("w1"));
}

#[tokio::test]
async fn silent_owners_are_reaped_once_and_then_fenced() {
    let (db, task_type, task) = one_claimed_task("silent").await;
    let timeout = Duration::from_millis(300);
    // Fresh by a margin no slow machine eats up.
    assert!(
        db.begin_reap(&reap(&task_type, Duration::from_secs(60), "r"))
            .await
            .unwrap()
            .is_none(),
        "fresh"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;

    let pending = db
        .begin_reap(&reap(&task_type, timeout, "r1"))
        .await
        .unwrap()
        .unwrap();
    // A second reaper skips the locked row instead of waiting or double-handling it.
    assert!(db
        .begin_reap(&reap(&task_type, timeout, "r2"))
        .await
        .unwrap()
        .is_none());
    assert_eq!(pending.tasks.len(), 1);
    assert_eq!(pending.tasks[0].route, Requeue::Retry);
    assert_eq!(pending.tasks[0].message.attempt, 1);
    pending.commit().await.unwrap();

    // The old owner's late result is refused; the stale attempt-0 message cannot claim.
    assert!(!db
        .complete(task.id, 0, "silent", &serde_json::json!({}))
        .await
        .unwrap());
    assert!(!db.claim(task.id, 0, "w2").await.unwrap().won());
    assert!(db.claim(task.id, 1, "w2").await.unwrap().won());
    let record = db.task(task.id).await.unwrap().unwrap();
    assert_eq!((record.attempt, record.retries), (1, 1));
}

/// Regression (chaos suite, worker-pause): the re-queued message can be delivered before the
/// re-queue commits; its claim must wait for the commit and win, not drop the message.
#[tokio::test]
async fn a_claim_racing_an_uncommitted_requeue_waits_for_it_and_wins() {
    let (db, task_type, task) = one_claimed_task("paused").await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let pending = db
        .begin_reap(&reap(&task_type, Duration::from_millis(300), "reaper"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(pending.tasks[0].message.attempt, 1);

    // The attempt-1 message is out; the reaper has not committed yet.
    let claim = tokio::spawn({
        let db = db.clone();
        async move { db.claim(task.id, 1, "fast").await.unwrap().won() }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !claim.is_finished(),
        "the claim waits for the re-queue's commit"
    );
    pending.commit().await.unwrap();
    assert!(claim.await.unwrap(), "the claim wins after the commit");
    let record = db.task(task.id).await.unwrap().unwrap();
    assert_eq!((record.state, record.attempt), (Processing, 1));
    assert_eq!(record.owner.as_deref(), Some("fast"));
}

/// Regression (chaos suite, poison): tasks that die beside others on a crashed worker keep
/// their retries and come back as suspects (to run alone); a task that died alone uses one.
#[tokio::test]
async fn reaped_tasks_use_a_retry_only_when_they_ran_alone() {
    let (db, task_type, ids) = three_queued_tasks().await;
    for (id, owner) in ids.iter().zip(["crowded", "crowded", "lonely"]) {
        assert!(db.claim(*id, 0, owner).await.unwrap().won());
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let pending = db
        .begin_reap(&reap(&task_type, Duration::from_millis(300), "reaper"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(pending.tasks.len(), 3);
    assert!(pending.tasks.iter().all(|t| t.message.suspect));
    pending.commit().await.unwrap();
    for (id, used) in ids.iter().zip([0, 0, 1]) {
        let record = db.task(*id).await.unwrap().unwrap();
        assert_eq!((record.retries, record.suspect), (used, true), "{id}");
    }
}

#[tokio::test]
async fn a_rolled_back_requeue_leaves_the_task_to_the_reaper() {
    let db = TestDatabase::create().await.db;
    let task_type = unique_type("db");
    let task = new_task(&task_type);
    db.record_tasks(std::slice::from_ref(&task)).await.unwrap();
    assert!(db.claim(task.id, 0, "w1").await.unwrap().won());
    let pending = db
        .begin_failure(&fence(task.id, 0, "w1"), "boom", 3)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(pending.tasks[0].route, Requeue::Retry);
    drop(pending); // the publish failed: roll back
    let record = db.task(task.id).await.unwrap().unwrap();
    assert_eq!((record.state, record.attempt), (Processing, 0));
    assert_eq!(
        db.events(task.id).await.unwrap().len(),
        4,
        "no FAILED event was kept"
    );
}

#[tokio::test]
async fn point_in_time_state_comes_from_the_audit_log() {
    let (db, task_type, ids) = three_queued_tasks().await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let queued_at = chrono::Utc::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(db.claim(ids[0], 0, "w").await.unwrap().won());
    assert!(db
        .complete(ids[0], 0, "w", &serde_json::json!({}))
        .await
        .unwrap());

    let then = db
        .states_at(queued_at, Some(&task_type), None)
        .await
        .unwrap();
    assert_eq!(then.len(), 3);
    assert!(then.iter().all(|(_, state, _)| *state == Queued));
    let now = db
        .states_at(chrono::Utc::now(), Some(&task_type), None)
        .await
        .unwrap();
    assert_eq!(now.iter().filter(|(_, s, _)| *s == Completed).count(), 1);
    // Every task at once: the whole log's pass, which holds this type's three too.
    let all = db.states_at(queued_at, None, None).await.unwrap();
    for id in &ids {
        assert!(
            all.iter().any(|(t, s, _)| t == id && *s == Queued),
            "{id} missing"
        );
    }
    let one = db.states_at(queued_at, None, Some(ids[0])).await.unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].1, Queued);
    let before = queued_at - chrono::Duration::hours(1);
    assert!(db
        .states_at(before, Some(&task_type), None)
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn audit_log_partitions_exist_ahead_and_retention_drops_old_days() {
    let db = TestDatabase::create().await.db;
    let partitions: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'task_events'::regclass ORDER BY 1",
    )
    .fetch_all(db.pool())
    .await
    .unwrap();
    // yesterday..today+14, plus the default partition
    assert_eq!(
        partitions.len(),
        conveyor_core::db::PARTITION_DAYS_AHEAD as usize + 3,
        "{partitions:?}"
    );
    // Simulate an old day and check that retention drops it and nothing else.
    sqlx::query(
        "CREATE TABLE task_events_20200101 PARTITION OF task_events
         FOR VALUES FROM ('2020-01-01 00:00Z') TO ('2020-01-02 00:00Z')",
    )
    .execute(db.pool())
    .await
    .unwrap();
    assert_eq!(
        db.drop_partitions(30).await.unwrap(),
        ["task_events_20200101"]
    );
    db.ensure_partitions().await.unwrap();
}

/// Rows in the default partition, and rows in the whole audit log.
async fn audit_rows(db: &conveyor_core::db::Db) -> (i64, i64) {
    let default: i64 = sqlx::query_scalar("SELECT count(*) FROM task_events_default")
        .fetch_one(db.pool())
        .await
        .unwrap();
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM task_events")
        .fetch_one(db.pool())
        .await
        .unwrap();
    (default, all)
}

#[tokio::test]
async fn weeks_without_partition_upkeep_lose_no_row_and_the_next_start_succeeds() {
    use chrono::{Days, NaiveTime};
    let db = TestDatabase::create().await.db;
    let start = chrono::Utc::now().date_naive();
    let ahead = conveyor_core::db::PARTITION_DAYS_AHEAD;
    let mut written = 0;
    let mut rescued_some = false;
    // Eight weeks; upkeep runs only every third week, so the weeks between outrun the
    // partitions made ahead and their rows land in the default partition.
    for week in 0..8u64 {
        let today = start + Days::new(7 * week);
        for day in 0..7u64 {
            let at = (today + Days::new(day)).and_time(NaiveTime::from_hms_opt(12, 0, 0).unwrap());
            sqlx::query(
                "INSERT INTO task_events (task_id, task_type, to_state, attempt, at)
                 VALUES (gen_random_uuid(), 'weeks', 'INGESTED', 0, $1)",
            )
            .bind(at.and_utc())
            .execute(db.pool())
            .await
            .unwrap();
            written += 1;
        }
        if week % 3 != 0 {
            continue;
        }
        let (in_default, _) = audit_rows(&db).await;
        rescued_some |= in_default > 0;
        // The start on that day: partitions around it, and the default partition's rows
        // moved into theirs. (Before the fix this failed with "updated partition constraint
        // for default partition would be violated" once a day's rows sat in the default.)
        db.ensure_partitions_around(ahead, Some(today))
            .await
            .unwrap();
        db.migrate().await.unwrap();
        let (in_default, all) = audit_rows(&db).await;
        assert_eq!(
            in_default, 0,
            "week {week}: rows left in the default partition"
        );
        assert_eq!(all, written, "week {week}: every row kept");
    }
    assert!(
        rescued_some,
        "the test must put rows in the default partition"
    );
    // Retention as of the last day drops whole days only, older than the cutoff.
    let last = start + Days::new(7 * 7);
    let dropped = db.drop_partitions_before(30, Some(last)).await.unwrap();
    assert!(!dropped.is_empty());
    let cutoff = (last - Days::new(30)).and_time(NaiveTime::MIN).and_utc();
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM task_events WHERE at >= $1")
        .bind(cutoff)
        .fetch_one(db.pool())
        .await
        .unwrap();
    let (_, all) = audit_rows(&db).await;
    assert_eq!(all, kept, "only days before the cutoff were dropped");
}

#[tokio::test]
async fn a_claim_the_worker_gave_up_on_does_not_commit_later() {
    let owner_db = TestDatabase::create().await;
    let db = owner_db.db.clone();
    let task_type = unique_type("late");
    let task = new_task(&task_type);
    db.record_tasks(std::slice::from_ref(&task)).await.unwrap();
    db.mark_queued(&[task.id], Locked::Skip).await.unwrap();
    // Something holds the row (a slow re-queue, a vacuum, a lock queue) for 3 s.
    let mut blocker = db.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM tasks WHERE id = $1 FOR UPDATE")
        .bind(task.id)
        .execute(&mut *blocker)
        .await
        .unwrap();
    // A worker's connection, whose database calls time out after 1 s.
    let call_timeout = Duration::from_secs(1);
    let worker_db = conveyor_core::db::Db::connect(&conveyor_worker::database_options(
        &conveyor_core::db::DbOptions::new(&owner_db.url),
        call_timeout,
    ))
    .unwrap();
    let claim = worker_db.claim(task.id, 0, "impatient-worker");
    let gave_up = tokio::time::timeout(call_timeout, claim).await;
    match gave_up {
        // The server gave up first: a failure to retry (the breaker counts it), not a
        // refusal to quarantine.
        Ok(Err(err)) => assert!(err.is_unavailable() && !err.is_permanent(), "{err:?}"),
        Ok(Ok(claimed)) => panic!("the claim returned {claimed:?} while the row was locked"),
        Err(_) => {} // the worker gave up first
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    blocker.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let record = db.task(task.id).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.owner),
        (Queued, None),
        "a claim committed after its worker gave up on it"
    );
}

#[tokio::test]
async fn a_heartbeat_for_an_older_attempt_does_not_keep_a_newer_claim_alive() {
    let (db, task_type, task) = one_claimed_task("beater").await;
    // Attempt 0 was reaped and re-queued; the same worker then claimed attempt 1.
    let timeout = Duration::from_millis(200);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // (The re-queue's message does not matter here: the claim below takes attempt 1.)
    let pending = db
        .begin_reap(&reap(&task_type, timeout, "r"))
        .await
        .unwrap();
    pending.expect("reaped").commit().await.unwrap();
    assert!(db.claim(task.id, 1, "beater").await.unwrap().won());
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Only the stale attempt is beaten: the claim of attempt 1 is not renewed.
    let renewed = db.heartbeat(&[fence(task.id, 0, "beater")]).await.unwrap();
    assert_eq!(renewed, 0, "a beat for attempt 0 renewed attempt 1");
    assert_eq!(
        db.heartbeat(&[fence(task.id, 1, "beater")]).await.unwrap(),
        1
    );
}

#[tokio::test]
async fn a_partition_rescue_beside_live_writers_loses_no_row_and_leaves_none_behind() {
    use chrono::Days;
    let db = TestDatabase::create().await.db;
    // Days beyond the partitions made ahead: their rows land in the default partition.
    let far = chrono::Utc::now() + Days::new(40);
    let writer = {
        let db = db.clone();
        tokio::spawn(async move {
            let mut written = 0i64;
            for i in 0..400 {
                let at = far + Days::new(i % 5);
                sqlx::query(
                    "INSERT INTO task_events (task_id, task_type, to_state, attempt, at)
                     VALUES (gen_random_uuid(), 'rescue', 'INGESTED', 0, $1)",
                )
                .bind(at)
                .execute(db.pool())
                .await
                .unwrap();
                written += 1;
            }
            written
        })
    };
    // Upkeep passes racing the writer, as several gateways would.
    let mut made = Vec::new();
    while !writer.is_finished() {
        made.extend(db.ensure_partitions_around(14, None).await.unwrap());
    }
    let written = writer.await.unwrap();
    made.extend(db.ensure_partitions_around(14, None).await.unwrap());
    let (in_default, all) = audit_rows(&db).await;
    assert_eq!(all, written, "every row kept");
    assert_eq!(in_default, 0, "rows left in the default partition");
    assert!(made.len() >= 5, "the far days got partitions: {made:?}");
}

fn fence(id: Uuid, attempt: i32, owner: &str) -> Fence {
    Fence {
        id,
        attempt,
        owner: owner.to_owned(),
    }
}

/// A reap of `task_type`'s tasks silent for `timeout`, three retries, ten at once.
fn reap<'a>(task_type: &'a str, timeout: Duration, reaper: &'a str) -> Reap<'a> {
    Reap {
        task_type,
        timeout,
        max_retries: 3,
        reaper,
        limit: 10,
    }
}

#[tokio::test]
async fn namespaces_granted_and_revoked_at_the_same_time_all_succeed() {
    // Parallel `conveyorctl grant`s and revokes (e2e tests starting and finishing at once)
    // once ended in "deadlock detected": they lock the same tables and catalogs in
    // different orders.
    let db = TestDatabase::create().await.db;
    let first: Vec<String> = (0..6).map(|_| unique_type("grant")).collect();
    let grant = |tenant: String| {
        let db = db.clone();
        async move {
            let role = conveyor_core::db::TenantRole::new(&tenant).unwrap();
            db.grant_tenant(&role).await.map(drop)
        }
    };
    for result in futures_util::future::join_all(first.iter().cloned().map(grant)).await {
        result.unwrap();
    }
    for _ in 0..5 {
        let second: Vec<String> = (0..6).map(|_| unique_type("grant")).collect();
        let revokes = first.iter().map(|tenant| {
            let db = db.clone();
            let tenant = tenant.clone();
            async move { db.revoke_tenant(&tenant).await.map(drop) }
        });
        let grants = second.iter().cloned().map(grant);
        let (revoked, granted) = tokio::join!(
            futures_util::future::join_all(revokes),
            futures_util::future::join_all(grants)
        );
        for result in revoked.into_iter().chain(granted) {
            result.unwrap();
        }
        for tenant in &second {
            let role = conveyor_core::db::TenantRole::new(tenant).unwrap();
            db.grant_tenant(&role).await.unwrap();
        }
        for tenant in &second {
            db.revoke_tenant(tenant).await.unwrap();
        }
    }
}

#[tokio::test]
async fn an_ingested_task_is_cancelled_and_neither_its_queued_mark_nor_a_claim_revives_it() {
    let db = TestDatabase::create().await.db;
    let task = new_task(&unique_type("db"));
    db.record_tasks(std::slice::from_ref(&task)).await.unwrap();
    // Cancelled before its QUEUED mark (decision 0020: the mark follows the answer).
    assert!(matches!(
        db.cancel(task.id, "client tests").await.unwrap(),
        CancelOutcome::Now
    ));
    db.mark_queued(&[task.id], Locked::Wait).await.unwrap();
    assert!(!db.claim(task.id, 0, "worker-a").await.unwrap().won());
    assert!(matches!(
        db.cancel(task.id, "client tests").await.unwrap(),
        CancelOutcome::TooLate(Cancelled)
    ));
    let record = db.task(task.id).await.unwrap().unwrap();
    assert_eq!((record.state, record.owner), (Cancelled, None));
    let events = db.events(task.id).await.unwrap();
    conveyor_core::testing::assert_valid_chain(&events);
    let steps: Vec<_> = events.iter().map(|e| (e.from_state, e.to_state)).collect();
    assert_eq!(steps, [(None, Ingested), (Some(Ingested), Cancelled)]);
    assert_eq!(
        events[1].detail.as_deref(),
        Some("cancelled by client tests")
    );
}

#[tokio::test]
async fn a_cancel_racing_a_claim_leaves_each_task_claimed_or_cancelled_never_both() {
    let db = TestDatabase::create().await.db;
    let task_type = unique_type("db");
    let tasks: Vec<NewTask> = (0..60).map(|_| new_task(&task_type)).collect();
    db.record_tasks(&tasks).await.unwrap();
    // Half waiting for their QUEUED mark, half marked: a claim takes either.
    let marked: Vec<Uuid> = tasks.iter().step_by(2).map(|t| t.id).collect();
    db.mark_queued(&marked, Locked::Skip).await.unwrap();
    let races = tasks.iter().map(|task| {
        let (db, id) = (db.clone(), task.id);
        async move {
            let claim = db.claim(id, 0, "worker-a");
            let cancel = db.cancel(id, "client tests");
            let (claimed, cancelled) = tokio::join!(claim, cancel);
            (id, claimed.unwrap().won(), cancelled.unwrap())
        }
    });
    let mut wins = (0, 0);
    for (id, claimed, cancelled) in futures_util::future::join_all(races).await {
        let record = db.task(id).await.unwrap().unwrap();
        match (claimed, cancelled) {
            (true, CancelOutcome::TooLate(_)) => {
                wins.0 += 1;
                assert_eq!(record.state, Processing, "{id}");
            }
            (false, CancelOutcome::Now) => {
                wins.1 += 1;
                assert_eq!((record.state, record.owner), (Cancelled, None), "{id}");
            }
            other => panic!("{id}: claimed and cancel answered {other:?}"),
        }
        let events = db.events(id).await.unwrap();
        conveyor_core::testing::assert_valid_chain(&events);
        let ends = events.iter().filter(|e| e.to_state == Cancelled).count();
        assert_eq!(ends, usize::from(!claimed), "{id}: {events:?}");
    }
    println!("claims won {}, cancels won {}", wins.0, wins.1);
}

#[tokio::test]
async fn a_progress_report_waits_for_a_locked_row_instead_of_being_lost() {
    let (db, _, task) = one_claimed_task("worker-a").await;
    // A heartbeat or a completion holds the row for a moment.
    let mut holder = db.pool().begin().await.unwrap();
    sqlx::query("SELECT id FROM tasks WHERE id = $1 FOR UPDATE")
        .bind(task.id)
        .execute(&mut *holder)
        .await
        .unwrap();
    let writer = db.clone();
    let fence = Fence {
        id: task.id,
        attempt: 0,
        owner: "worker-a".into(),
    };
    let report = tokio::spawn(async move {
        writer
            .report_progress(&[(fence, serde_json::json!({"percent": 40}))])
            .await
    });
    conveyor_core::testing::wait_until(
        "the report to wait for the row lock",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(db.pool())
            .await
            .unwrap();
            waiting > 0 || report.is_finished()
        },
    )
    .await;
    holder.commit().await.unwrap();
    assert_eq!(
        report.await.unwrap().unwrap(),
        1,
        "stored once the row was free"
    );
    let stored = db.task(task.id).await.unwrap().unwrap().progress;
    assert_eq!(stored, Some(serde_json::json!({"percent": 40})));
}
