//! The Helm chart installed as users do: from its `helm package`d archive, on a database
//! an older release left one migration behind, with a least-privilege gateway that cannot
//! migrate. The chart's migration Job brings the schema up before the gateway starts, its
//! operator and gateway run tasks end to end: `helm test` passes and its task's row says
//! COMPLETED, and a user's story (a pool applied, a batch submitted through the chart's
//! gateway and completed, the pool scaled with kubectl) runs on the install.

use conveyor_core::config::DEV_AMQP_URL;
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::testing;
use conveyor_core::TaskState;
use conveyor_e2e_tests::{
    conveyorctl, kill_operator, kubectl, kubectl_with, operators_to_myself, start_operator,
};
use sha2::{Digest, Sha256};

use crate::chart::{repo, run, tempdir};

#[tokio::test]
async fn installed_from_its_package_on_an_older_schema_it_migrates_runs_a_task_and_passes_helm_test(
) {
    // The chart's operator stands in for the stack's while this runs: two would both lead.
    let _operators = operators_to_myself().await;
    let namespace = format!("chart-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let release = "e2e";
    kubectl(&["create", "namespace", &namespace]);
    let token = format!("chart-token-{}", uuid::Uuid::new_v4().simple());
    let digest = hex(&Sha256::digest(token.as_bytes()));
    secret(&namespace, "helm-test-token", "token", &token);
    let ca = "/etc/conveyor/dev-tls/ca.crt";
    let amqp = DEV_AMQP_URL;
    // The database as the release before left it: every migration but the last.
    let (older, last) = one_migration_behind().await;
    let database = older.url.clone();
    // The gateway's own least-privilege role (decision 0015), which cannot migrate, and the
    // owner's credential for the migration Job only.
    let gateway_role = format!(
        "chart_gw_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let granted = conveyorctl(
        &database,
        amqp,
        &[
            "-n",
            &namespace,
            "grant",
            "--component",
            "gateway",
            "--role",
            &gateway_role,
        ],
    );
    kubectl_with(&["apply", "-f", "-"], Some(&granted)).unwrap();
    secret(&namespace, "chart-owner", "database-url", &database);
    let package = package_chart();
    let values = [
        "image.tag=dev".to_owned(),
        "operator.replicas=1".to_owned(),
        "operator.leaseSeconds=5".to_owned(),
        "gateway.replicas=1".to_owned(),
        format!("ca.file={ca}"),
        format!("operator.connections.amqpUrl={amqp}"),
        "operator.connections.managementUrl=https://127.0.0.1:15671".to_owned(),
        "operator.connections.rabbitmqUser=conveyor".to_owned(),
        "operator.connections.rabbitmqPassword=conveyor".to_owned(),
        // The stack operator's key of the workers' admin tokens: the chart's derives the same
        // tokens, so no pool rolls when it takes over, and it may drain the stack's workers.
        format!(
            "operator.connections.adminKey={}",
            conveyor_e2e_tests::stack_admin_key()
        ),
        "gateway.connections.existingSecret=conveyor-gateway-connections".to_owned(),
        "migrations.job=true".to_owned(),
        "migrations.ownerSecret=chart-owner".to_owned(),
        format!("gateway.tokens.list[0]=helm-test@{namespace}=sha256:{digest}"),
        format!("tenants[0].namespace={namespace}"),
        format!("tenants[0].databaseUrl={database}"),
        format!("tenants[0].amqpUrl={amqp}"),
        // The CRDs are the stack's already (not the release's to own).
        "crds.install=false".to_owned(),
        "test.tokenSecret=helm-test-token".to_owned(),
    ];
    let values_file = tempdir("values").join("values.yaml");
    // --set-string would split on commas (the dev URLs have none, but say it once): a file.
    std::fs::write(&values_file, as_yaml(&values)).unwrap();
    let values_file = values_file.to_str().unwrap();

    assert!(kill_operator(), "the stack's operator runs");
    // `helm install` or `helm upgrade` of the release with these values, waiting for it.
    let release_with = |verb: &str, extra: &[&str]| {
        let mut args = vec![verb, release, &package, "-n", &namespace];
        args.extend(["-f", values_file, "--wait", "--timeout=5m"]);
        args.extend(extra);
        run("helm", &args)
    };
    let installed = release_with("install", &[]);
    let outcome = async {
        installed?;
        // From outside: the schema holds the last migration, which only the Job's owner
        // credential could apply (the gateway's role may not).
        let applied: Option<i64> =
            sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
                .fetch_one(older.db.pool())
                .await
                .map_err(|e| e.to_string())?;
        if applied != Some(last) {
            return Err(format!(
                "the schema is at {applied:?}, not {last}: the migration Job did not run"
            ));
        }
        // The local cluster has no Service routing: point the test at the gateway pod.
        let mut gateway_ip = String::new();
        for _ in 0..120 {
            gateway_ip = kubectl(&[
                "-n",
                &namespace,
                "get",
                "pods",
                "-l",
                "app.kubernetes.io/name=conveyor-gateway",
                "-o",
                "jsonpath={.items[0].status.podIP}",
            ]);
            if !gateway_ip.is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
        release_with(
            "upgrade",
            &[&format!("--set=test.gatewayUrl=http://{gateway_ip}:8080")],
        )?;
        let said = run(
            "helm",
            // No --logs: the local runner keeps container logs in .dev/pods, not behind a
            // kubelet API (pod_logs below reads them).
            &["test", release, "-n", &namespace, "--timeout=5m"],
        )?;
        story(
            &namespace,
            &format!("http://{gateway_ip}:8080"),
            &token,
            &database,
        )
        .await?;
        Ok::<_, String>(said)
    }
    .await;
    // Judged from the database too: the test's one task COMPLETED, with a valid history.
    let key = format!("{namespace}.e2e-conveyor-helm-test");
    let completed = if outcome.is_ok() {
        testing::count_in_state(&older.db, &key, TaskState::Completed).await
    } else {
        0
    };
    let logs = pod_logs(&namespace);
    // The TaskTypes go before their queues, or the stack's operator, started again below,
    // declares the queues of types still there (as in `Stack::finish`).
    let _ = kubectl_with(
        &[
            "-n",
            &namespace,
            "delete",
            "tasktypes",
            "--all",
            "--timeout=60s",
        ],
        None,
    );
    let _ = run("helm", &["uninstall", release, "-n", &namespace, "--wait"]);
    let _ = kubectl_with(&["delete", "namespace", &namespace, "--wait=false"], None);
    testing::delete_queues(&key).await;
    testing::delete_queues(&format!("{namespace}.story")).await;
    start_operator();
    forget(older, &gateway_role).await;
    let said = outcome.unwrap_or_else(|err| panic!("{err}\n{logs}"));
    assert!(
        said.contains("Phase:          Succeeded"),
        "helm test said:\n{said}\n{logs}"
    );
    assert_eq!(
        completed, 1,
        "tasks of {key} COMPLETED in the database\n{logs}"
    );
}

/// A user's story through the chart's gateway and operator: a TaskType and a pool of two
/// applied with kubectl, 40 tasks submitted in one batch (no more, no fewer rows than that),
/// all COMPLETED, then the pool scaled to three with `kubectl scale`.
async fn story(namespace: &str, gateway: &str, token: &str, database: &str) -> Result<(), String> {
    let apply =
        |yaml: String| kubectl_with(&["-n", namespace, "apply", "-f", "-"], Some(&yaml)).map(drop);
    apply(crate::task_type_yaml("story", ""))?;
    apply(crate::pool_yaml("story", "story", "  replicas: 2\n"))?;
    let tasks: Vec<serde_json::Value> = (0..40)
        .map(|i| serde_json::json!({"taskType": "story", "payload": {"sleepMs": 50, "n": i}}))
        .collect();
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    // The gateway lists new TaskTypes every few seconds: retried with the same keys.
    let keyed: Vec<serde_json::Value> = tasks
        .into_iter()
        .map(|mut t| {
            t["idempotencyKey"] = serde_json::json!(uuid::Uuid::new_v4());
            t
        })
        .collect();
    loop {
        let answer: serde_json::Value = http
            .post(format!("{gateway}/v1/tasks:batch"))
            .bearer_auth(token)
            .json(&serde_json::json!({"tasks": keyed}))
            .send()
            .await
            .map_err(|e| format!("the chart's gateway: {e}"))?
            .json()
            .await
            .map_err(|e| format!("the chart's gateway answered: {e}"))?;
        let accepted = answer["results"]
            .as_array()
            .map_or(0, |r| r.iter().filter(|t| t["id"].is_string()).count());
        if accepted == keyed.len() {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("the chart's gateway kept refusing: {answer}"));
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    let db = Db::connect(&DbOptions::new(database)).expect("database URL");
    let key = format!("{namespace}.story");
    // Each step has a budget of its own: a slow one does not eat the next one's.
    let completed_by = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let counts = db.state_counts(&key).await.map_err(|e| e.to_string())?;
        let completed = counts
            .iter()
            .find(|(state, _)| *state == TaskState::Completed)
            .map_or(0, |(_, n)| *n);
        let total: i64 = counts.iter().map(|(_, n)| n).sum();
        if completed == 40 && total == 40 {
            break;
        }
        if tokio::time::Instant::now() > completed_by {
            return Err(format!("{key}: {counts:?} after two minutes"));
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    kubectl_with(
        &["-n", namespace, "scale", "workerpool/story", "--replicas=3"],
        None,
    )?;
    let scaled_by = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let ready = kubectl(&[
            "-n",
            namespace,
            "get",
            "deployment",
            "story-worker",
            "-o",
            "jsonpath={.status.readyReplicas}",
        ]);
        if ready.trim() == "3" {
            return Ok(());
        }
        if tokio::time::Instant::now() > scaled_by {
            return Err(format!("the pool has {ready:?} ready workers, not 3"));
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// A fresh database holding every migration but the last, as an older release left it; and
/// the last migration's version.
async fn one_migration_behind() -> (testing::TestDatabase, i64) {
    let older = testing::TestDatabase::create_empty().await;
    let mut migrator = sqlx::migrate::Migrator::new(repo().join("migrations"))
        .await
        .expect("the migrations folder");
    let last = migrator
        .iter()
        .map(|m| m.version)
        .max()
        .expect("migrations");
    migrator.migrations = migrator
        .iter()
        .filter(|m| m.version < last)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    migrator
        .run(older.db.pool())
        .await
        .expect("every migration but the last applies");
    (older, last)
}

/// A Secret `name` in `namespace` holding `key`: `value`.
fn secret(namespace: &str, name: &str, key: &str, value: &str) {
    let literal = format!("--from-literal={key}={value}");
    kubectl(&[
        "-n", namespace, "create", "secret", "generic", name, &literal,
    ]);
}

/// The chart as users get it: `helm package`d, its archive's path.
fn package_chart() -> String {
    let dir = tempdir("chart");
    let said = run(
        "helm",
        &["package", "charts/conveyor", "-d", dir.to_str().unwrap()],
    )
    .unwrap_or_else(|err| panic!("helm package: {err}"));
    let archive = said
        .rsplit("saved it to: ")
        .next()
        .map(|path| path.trim().to_owned())
        .filter(|path| path.ends_with(".tgz"))
        .unwrap_or_else(|| panic!("helm package said: {said}"));
    archive
}

/// The test's database, and the gateway role and broker user it granted (server-wide).
async fn forget(older: testing::TestDatabase, role: &str) {
    older.db.close().await;
    let admin = Db::connect(&DbOptions::new(testing::admin_database_url())).unwrap();
    let name = &older.name;
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(admin.pool())
        .await;
    let _ = sqlx::query(&format!("DROP ROLE IF EXISTS \"{role}\""))
        .execute(admin.pool())
        .await;
    admin.close().await;
    let _ = testing::http_client()
        .delete(format!("{}/api/users/{role}", testing::management_url()))
        .send()
        .await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `a.b=c` settings as a values file.
fn as_yaml(settings: &[String]) -> String {
    let mut root = serde_json::Value::Object(Default::default());
    for setting in settings {
        let (path, value) = setting.split_once('=').unwrap();
        let mut node = &mut root;
        for part in path.split('.') {
            let (name, index) = match part.split_once('[') {
                Some((name, i)) => (
                    name,
                    Some(i.trim_end_matches(']').parse::<usize>().unwrap()),
                ),
                None => (part, None),
            };
            node = &mut node[name];
            if let Some(i) = index {
                if !node.is_array() {
                    *node = serde_json::Value::Array(Vec::new());
                }
                let list = node.as_array_mut().unwrap();
                while list.len() <= i {
                    list.push(serde_json::Value::Object(Default::default()));
                }
                node = &mut list[i];
            }
        }
        *node = match value {
            "true" | "false" => serde_json::json!(value == "true"),
            v if v.chars().all(|c| c.is_ascii_digit()) => {
                serde_json::json!(v.parse::<u64>().unwrap())
            }
            v => serde_json::json!(v),
        };
    }
    serde_json::to_string_pretty(&root).unwrap()
}

/// Where each of the release's pods stands, and its last log lines (for a failure message).
fn pod_logs(namespace: &str) -> String {
    let pods =
        kubectl_with(&["-n", namespace, "get", "pods", "-o", "wide"], None).unwrap_or_default();
    let dir = repo().join(".dev/pods").join(namespace);
    let mut logs = format!("pods:\n{pods}");
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let log = std::fs::read_to_string(entry.path().join("container.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        logs.push_str(&format!(
            "\n--- {}:\n{}",
            entry.file_name().to_string_lossy(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    logs
}
