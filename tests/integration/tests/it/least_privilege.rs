//! `conveyorctl grant`: a namespace's workers get credentials that reach only its own queues
//! and rows (issue 11, decision 0013), on the real PostgreSQL and RabbitMQ.

use std::time::Duration;

use conveyor_core::amqp;
use conveyor_core::db::{Claimed, Db, DbOptions};
use conveyor_core::task_type::{NamedTaskType, TaskTypeSpec};
use conveyor_core::testing;
use conveyor_core::TaskState;
use conveyor_gateway::auth::Tokens;
use conveyor_gateway::TaskTypeSource;
use conveyor_worker::handler::Handler;
use lapin::options::BasicNackOptions;
use serde_json::json;

use crate::support::{queue, Harness, TOKEN};

/// The value of `key:` in the Secret `conveyorctl grant` printed.
fn secret_value(yaml: &str, key: &str) -> String {
    yaml.lines()
        .find_map(|line| line.trim().strip_prefix(&format!("{key}: ")))
        .unwrap_or_else(|| panic!("no {key} in\n{yaml}"))
        .to_owned()
}

#[tokio::test]
async fn a_namespaces_worker_credentials_reach_only_its_own_queues_and_rows() {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let (mine, theirs) = (format!("lp-a-{suffix}"), format!("lp-b-{suffix}"));
    let name = testing::unique_type("transcode");
    let types = [&mine, &theirs]
        .map(|ns| NamedTaskType::in_namespace(ns, &name, TaskTypeSpec::default()))
        .to_vec();
    let (my_key, their_key) = (types[0].name.clone(), types[1].name.clone());
    let mut harness = Harness::start_with(types, |config| {
        config.tokens = Tokens::parse_pairs(&format!("tests@*={TOKEN}")).unwrap();
    })
    .await;
    let submit = |ns: &str| {
        let request = harness
            .http
            .post(format!("{}/v1/tasks", harness.gateway_url))
            .bearer_auth(TOKEN)
            .json(&json!({"taskType": name, "namespace": ns, "payload": {}}));
        async move {
            let body: serde_json::Value = request.send().await.unwrap().json().await.unwrap();
            body["id"].as_str().unwrap().parse::<uuid::Uuid>().unwrap()
        }
    };
    let (my_task, their_task) = (submit(&mine).await, submit(&theirs).await);

    let secret = harness.conveyorctl(&["grant", "-n", &mine]);
    assert!(secret.contains("kind: Secret") && secret.contains(&format!("namespace: {mine}")));
    let database_url = secret_value(&secret, "database-url");
    let amqp_url = secret_value(&secret, "amqp-url");
    assert!(
        database_url.contains(&format!("conveyor-{mine}:")),
        "{database_url}"
    );

    // Rows: only its own are there for it; it cannot make or remove tasks.
    let db = Db::connect(&DbOptions::new(&database_url)).unwrap();
    assert!(db.task(my_task).await.unwrap().is_some());
    assert!(
        db.task(their_task).await.unwrap().is_none(),
        "another namespace's row"
    );
    assert_eq!(
        db.claim(their_task, 0, "intruder").await.unwrap(),
        Claimed::Unseen
    );
    let refused = sqlx::query("DELETE FROM tasks").execute(db.pool()).await;
    assert!(refused.is_err(), "a worker's role deleted tasks");
    // The partition functions run as their owner: only the gateway's role may call them.
    let refused = sqlx::query("SELECT conveyor_drop_event_partitions(0)")
        .execute(db.pool())
        .await;
    assert!(refused.is_err(), "a worker's role dropped audit partitions");
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM task_events WHERE task_id = $1")
        .bind(their_task)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(events, 0, "another namespace's audit rows");

    // Queues: its own it may read; another namespace's it may not.
    let conn = amqp::connect(&amqp_url, "least-privilege-test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let own = amqp::get_one(&channel, &queue(&my_key).main).await.unwrap();
    let nack = BasicNackOptions {
        requeue: true,
        ..Default::default()
    };
    own.expect("its own task's message")
        .acker
        .nack(nack)
        .await
        .unwrap();
    let other = conn.create_channel().await.unwrap();
    assert!(
        amqp::get_one(&other, &queue(&their_key).main)
            .await
            .is_err(),
        "read another namespace's queue"
    );
    // Nor can it put a message into one: not through the default exchange, nor through
    // the other type's exchange (before, the default exchange let it).
    for exchange in ["", queue(&their_key).exchange()] {
        let channel = conn.create_channel().await.unwrap();
        channel.confirm_select(Default::default()).await.unwrap();
        let published = async {
            channel
                .basic_publish(
                    exchange,
                    &queue(&their_key).main,
                    Default::default(),
                    b"{}",
                    Default::default(),
                )
                .await?
                .await
        }
        .await;
        assert!(
            matches!(&published, Err(lapin::Error::ProtocolError(e)) if e.get_id() == 403),
            "published into another namespace's queue through {exchange:?}: {published:?}"
        );
    }
    let _ = conn.close(200, "done").await;

    // A worker of the namespace (its pool consumes its namespace's types) runs its task
    // with these credentials alone.
    let mut config = harness.worker_config(&[&my_key], Handler::Noop, 2);
    config.database = DbOptions::new(&database_url);
    config.amqp_url = amqp_url.clone();
    config.declare_queues = false; // as the operator's pods run
    let worker = harness.start_configured(config);
    harness
        .wait_for_state(&my_key, TaskState::Completed, 1, Duration::from_secs(60))
        .await;
    assert_eq!(
        harness.db.task(their_task).await.unwrap().unwrap().state,
        TaskState::Queued
    );

    // `revoke` withdraws both: the credentials stop working.
    harness.take_worker(&worker).stop().await;
    db.close().await;
    let revoked = harness.conveyorctl(&["revoke", "-n", &mine]);
    assert!(revoked.contains("removed"), "{revoked}");
    let gone = Db::connect(&DbOptions::new(&database_url)).unwrap();
    assert!(gone.ping().await.is_err(), "the revoked role still logs in");
    assert!(
        amqp::connect(&amqp_url, "least-privilege-revoked")
            .await
            .is_err(),
        "the revoked broker user still connects"
    );
    let policies: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_policies WHERE $1 = ANY(roles::text[])")
            .bind(format!("conveyor-{mine}"))
            .fetch_one(harness.db.pool())
            .await
            .unwrap();
    assert_eq!(policies, 0);
    harness.shutdown().await;
}

/// The exec handler's environment is scrubbed, but a handler runs as its worker's user and
/// could read the worker's own environment (the database and broker URLs, with passwords)
/// in `/proc/<worker>/environ`, unless the worker is not dumpable. Run as another user than
/// root, who reads every process's environment.
#[tokio::test]
async fn a_handler_cannot_read_its_workers_environment() {
    let uid = std::process::Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        eprintln!("skipped: needs root to run the worker as another user");
        return;
    }
    let spec = crate::support::test_type("environ");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let dir = std::env::temp_dir().join(format!("conveyor-environ-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(dir.join("buffers")).unwrap();
    let script = dir.join("peek.sh");
    // The handler's parent is the worker: can it read the worker's environment?
    std::fs::write(
        &script,
        "#!/bin/sh\nif grep -q CONVEYOR_DATABASE_URL /proc/$PPID/environ 2>/dev/null; \
         then echo '{\"read\": true}'; else echo '{\"read\": false}'; fi\n",
    )
    .unwrap();
    let open = |path: &std::path::Path, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    open(&dir, 0o755);
    open(&dir.join("buffers"), 0o777);
    open(&script, 0o755);
    let script = script.display().to_string();
    let mut worker = harness
        .worker_command(
            &[
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
            ],
            "environ",
            &[&name],
            &["--handler", "exec", "--", &script],
        )
        .env("CONVEYOR_BUFFER_DIR", dir.join("buffers"))
        .spawn()
        .expect("start conveyor-worker as nobody");
    let id = harness.submit_ok(&name, json!({})).await;
    harness
        .wait_for_state(&name, TaskState::Completed, 1, Duration::from_secs(60))
        .await;
    let task = harness.db.task(id).await.unwrap().expect("the task");
    let _ = worker.kill();
    let _ = worker.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        task.result,
        Some(json!({"read": false})),
        "{:?}",
        task.result
    );
    harness.shutdown().await;
}

/// The gateway's and the operator's own credentials (`conveyorctl grant --component`,
/// decision 0015): a gateway running as its role migrates nothing, serves submissions and
/// runs its upkeep (probes, audit partitions), but its role cannot change or delete audit
/// rows, delete tasks, change the schema, or make roles, and its broker user cannot use the
/// management API; the operator's user sets policies and declares only `conveyor.` queues.
#[tokio::test]
async fn the_gateway_and_operator_run_with_credentials_that_cannot_rewrite_history() {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let spec = crate::support::test_type("component");
    let name = spec.name.clone();
    let mut harness = Harness::start(vec![spec]).await;
    let role = format!("conveyor_gw_{suffix}");
    let secret = harness.conveyorctl(&["grant", "--component", "gateway", "--role", &role]);
    assert!(
        secret.contains("name: conveyor-gateway-connections")
            && secret.contains("namespace: conveyor-system"),
        "{secret}"
    );
    let database_url = secret_value(&secret, "database-url");
    let amqp_url = secret_value(&secret, "amqp-url");

    // A gateway with these credentials alone, asked to migrate as the manifests' does.
    let mut config = harness.gateway_config();
    config.database = DbOptions::new(&database_url);
    config.amqp_url = amqp_url.clone();
    config.migrate = true;
    config.upkeep = Some(crate::self_healing::fast_upkeep());
    // And a type nobody has declared yet: its queues are this gateway's to make.
    let fresh = crate::support::test_type("component-new");
    if let TaskTypeSource::File(types) = &mut config.task_types {
        types.insert(fresh.name.clone(), fresh.clone());
    }
    let (gateway_url, _) = harness.start_gateway(config).await;
    let accepted = harness
        .http
        .post(format!("{gateway_url}/v1/tasks"))
        .bearer_auth(TOKEN)
        .json(&json!({"taskType": fresh.name, "payload": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(accepted.status(), 201, "a task of the type it declared");
    let submitted: serde_json::Value = harness
        .http
        .post(format!("{gateway_url}/v1/tasks"))
        .bearer_auth(TOKEN)
        .json(&json!({"taskType": name, "payload": {}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id: uuid::Uuid = submitted["id"].as_str().unwrap().parse().unwrap();
    // Its sweeper probes the queue of a task that waits (no worker yet).
    testing::wait_until(
        "a probe sent by the gateway",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM queue_probes")
                .fetch_one(harness.db.pool())
                .await
                .unwrap()
                > 0
        },
    )
    .await;
    harness.start_worker(&[&name], Handler::Noop, 2);
    harness
        .wait_for_state(&name, TaskState::Completed, 1, Duration::from_secs(60))
        .await;
    crate::support::assert_valid_chain(&harness.events(id).await);

    let db = Db::connect(&DbOptions::new(&database_url)).unwrap();
    assert!(
        db.task(id).await.unwrap().is_some(),
        "it reads every tenant's rows"
    );
    // Upkeep makes the partitions it needs through the owner's function: the one two weeks
    // ahead, dropped by the owner, is there again once the gateway's role asked for it
    // (this call or the gateway's own upkeep, both as that role).
    let ahead = format!(
        "task_events_{}",
        (chrono::Utc::now().date_naive() + chrono::Days::new(14)).format("%Y%m%d")
    );
    sqlx::query(&format!("DROP TABLE IF EXISTS {ahead}"))
        .execute(harness.db.pool())
        .await
        .unwrap();
    db.ensure_partitions_around(14, None)
        .await
        .expect("upkeep makes audit partitions through the owner's function");
    let there: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&ahead)
        .fetch_one(harness.db.pool())
        .await
        .unwrap();
    assert!(there, "{ahead} made again");
    // No more than that: neither another date nor a flood of partitions.
    let later = chrono::Utc::now().date_naive() + chrono::Days::new(400);
    for (days_ahead, today) in [(14, Some(later)), (100_000, None)] {
        let err = db
            .ensure_partitions_around(days_ahead, today)
            .await
            .expect_err("the gateway's role chose the partitions' dates");
        assert!(err.is_permission_denied(), "{err:?}");
    }
    // Retention through the owner's function, but never of today's partition or later.
    db.drop_partitions(30)
        .await
        .expect("retention as configured");
    for (keep_days, today) in [
        (0, None),
        (
            30,
            Some(chrono::Utc::now().date_naive() + chrono::Days::new(400)),
        ),
    ] {
        let err = db
            .drop_partitions_before(keep_days, today)
            .await
            .expect_err("the gateway's role dropped partitions of today or later");
        assert!(err.is_permission_denied(), "{err:?}");
    }
    for refused in [
        "DELETE FROM task_events",
        "UPDATE task_events SET detail = 'rewritten'",
        "DELETE FROM tasks",
        "DROP TABLE queue_probes",
        "ALTER TABLE tasks DISABLE ROW LEVEL SECURITY",
        "CREATE ROLE intruder LOGIN",
    ] {
        let err = sqlx::query(refused)
            .execute(db.pool())
            .await
            .expect_err(refused);
        assert!(
            err.to_string().contains("permission denied") || err.to_string().contains("must be"),
            "{refused}: {err}"
        );
    }
    db.close().await;
    let broker_user = |url: &str| {
        let url = reqwest::Url::parse(url).unwrap();
        (
            url.username().to_owned(),
            url.password().unwrap().to_owned(),
        )
    };
    let (user, password) = broker_user(&amqp_url);
    let management = testing::MANAGEMENT_API;
    let overview = harness
        .http
        .get(format!("{management}/api/overview"))
        .basic_auth(&user, Some(&password))
        .send()
        .await
        .unwrap();
    assert_eq!(
        overview.status(),
        401,
        "the gateway's user in the management API"
    );

    // The operator's user: policies and `conveyor.` queues, nothing else.
    let operator_user = format!("conveyor_op_{suffix}");
    let secret =
        harness.conveyorctl(&["grant", "--component", "operator", "--role", &operator_user]);
    assert!(
        secret.contains("name: conveyor-operator-connections"),
        "{secret}"
    );
    let password = secret_value(&secret, "rabbitmq-password");
    assert_eq!(secret_value(&secret, "rabbitmq-user"), operator_user);
    // The key of the workers' admin tokens (issue 33, item 2): random, long.
    assert_eq!(secret_value(&secret, "admin-key").len(), 64, "{secret}");
    let policy = format!("{management}/api/policies/%2f/conveyor-lp-{suffix}");
    let put = harness
        .http
        .put(&policy)
        .basic_auth(&operator_user, Some(&password))
        .json(&json!({"pattern": format!(r"^conveyor\.lp-{suffix}$"),
                      "definition": {"max-length": 1}, "apply-to": "queues"}))
        .send()
        .await
        .unwrap();
    assert!(
        put.status().is_success(),
        "the operator sets a policy: {}",
        put.status()
    );
    let deleted = harness
        .http
        .delete(&policy)
        .basic_auth(&operator_user, Some(&password))
        .send()
        .await
        .unwrap();
    assert!(
        deleted.status().is_success(),
        "and deletes it: {}",
        deleted.status()
    );
    let users = harness
        .http
        .get(format!("{management}/api/users"))
        .basic_auth(&operator_user, Some(&password))
        .send()
        .await
        .unwrap();
    assert!(
        !users.status().is_success(),
        "the operator's user listed users"
    );
    let conn = amqp::connect(
        &secret_value(&secret, "amqp-url"),
        "least-privilege-operator",
    )
    .await
    .unwrap();
    let declare = |queue: String| {
        let conn = &conn;
        async move {
            let channel = conn.create_channel().await.unwrap();
            let options = lapin::options::QueueDeclareOptions {
                auto_delete: true,
                ..Default::default()
            };
            channel
                .queue_declare(&queue, options, Default::default())
                .await
                .map(drop)
        }
    };
    declare(format!("conveyor.lp-{suffix}.q"))
        .await
        .expect("a conveyor. queue");
    // A whole type: queues whose dead-letter exchange is the default one, and bindings.
    let operated = NamedTaskType::named(testing::unique_type("lp-operated"));
    let channel = conn.create_channel().await.unwrap();
    amqp::declare_task_type(&channel, &operated)
        .await
        .expect("the operator's user declares a type's queues and exchange");
    assert!(
        declare(format!("other-{suffix}")).await.is_err(),
        "the operator's user declared a queue outside conveyor."
    );
    let _ = conn.close(200, "done").await;

    // Leave no role, user, policy or queue behind (the gateway stopped first: its sessions).
    let owner = harness.db.clone();
    harness.shutdown().await;
    testing::delete_queues(&fresh.name).await;
    testing::delete_queues(&operated.name).await;
    let functions = "conveyor_ensure_event_partitions(integer, date), \
                     conveyor_drop_event_partitions(integer, date)";
    for statement in [
        format!("DROP POLICY \"{role}\" ON tasks"),
        format!("DROP POLICY \"{role}\" ON task_events"),
        format!("DROP POLICY \"{role}\" ON task_events_kept"),
        format!("DROP POLICY \"{role}\" ON queue_probes"),
        format!(
            "REVOKE ALL ON tasks, task_events, task_events_kept, queue_probes, _sqlx_migrations \
             FROM \"{role}\""
        ),
        format!("REVOKE ALL ON SEQUENCE task_events_seq_seq FROM \"{role}\""),
        format!("REVOKE ALL ON FUNCTION {functions} FROM \"{role}\""),
        format!("REVOKE ALL ON SCHEMA public FROM \"{role}\""),
        format!("DROP ROLE \"{role}\""),
    ] {
        sqlx::query(&statement)
            .execute(owner.pool())
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    let admin = testing::http_client();
    for user in [&user, &operator_user] {
        let _ = admin
            .delete(format!("{}/api/users/{user}", testing::management_url()))
            .send()
            .await;
    }
}

/// A pool given another namespace's database Secret cannot see its own tasks. Before, each
/// delivery looked like a copy already claimed: acked and dropped, silently (issue 32).
#[tokio::test]
async fn a_worker_that_cannot_see_its_tasks_drops_nothing_and_says_why() {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let (mine, theirs) = (format!("blind-a-{suffix}"), format!("blind-b-{suffix}"));
    let name = testing::unique_type("thumbnail");
    let types: Vec<NamedTaskType> = [&mine, &theirs]
        .map(|ns| {
            // Redeliveries enough that the broker's delivery limit keeps the message in
            // the work queue while the test looks (past it, on a slow machine, the message
            // goes to remediation and the gateway's sweeper re-publishes the task).
            let spec = TaskTypeSpec {
                max_retries: 20,
                ..TaskTypeSpec::default()
            };
            NamedTaskType::in_namespace(ns, &name, spec)
        })
        .to_vec();
    let my_key = types[0].name.clone();
    let mut harness = Harness::start_with(types, |config| {
        config.tokens = Tokens::parse_pairs(&format!("tests@*={TOKEN}")).unwrap();
        config.upkeep = Some(crate::self_healing::fast_upkeep());
    })
    .await;

    // The other namespace's Secret, mounted by mistake in a pool of this one.
    let secret = harness.conveyorctl(&["grant", "-n", &theirs]);
    let mut config = harness.worker_config(&[&my_key], Handler::Noop, 2);
    config.database = DbOptions::new(secret_value(&secret, "database-url"));
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let listen = admin.local_addr().unwrap();
    let blind = harness.start_serving(config, Some(admin));

    let response = harness
        .http
        .post(format!("{}/v1/tasks", harness.gateway_url))
        .bearer_auth(TOKEN)
        .json(&json!({"taskType": name, "namespace": mine, "payload": {}}))
        .send()
        .await
        .unwrap();
    let body: serde_json::Value = response.json().await.unwrap();
    let id: uuid::Uuid = body["id"].as_str().unwrap().parse().unwrap();

    // It says why it is not ready, and counts it.
    let http = testing::http_client();
    testing::wait_until(
        "the worker reports the task it cannot see",
        Duration::from_secs(30),
        || async {
            let Ok(response) = http.get(format!("http://{listen}/readyz")).send().await else {
                return false;
            };
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            status == reqwest::StatusCode::SERVICE_UNAVAILABLE
                && text.contains(&id.to_string())
                && text.contains("another namespace")
        },
    )
    .await;
    let errors = harness
        .worker_metrics(&blind)
        .errors
        .with_label_values(&["worker", "task_not_visible"])
        .get();
    assert!(errors >= 1, "task_not_visible counted {errors} times");
    let task = harness.db.task(id).await.unwrap().unwrap();
    assert!(
        matches!(task.state, TaskState::Ingested | TaskState::Queued) && task.owner.is_none(),
        "{task:?}"
    );

    // Its message is still there for a worker that can see the row.
    harness.take_worker(&blind).stop().await;
    harness.start_worker(&[&my_key], Handler::Noop, 2);
    harness
        .wait_for_state(&my_key, TaskState::Completed, 1, Duration::from_secs(30))
        .await;
    harness.shutdown().await;
}
