//! The Helm chart as users run it, from release to release: the previous release's chart
//! (`helm package`d from its commit, its pods running its own binaries) installed on the
//! schema its `conveyorctl migrate` made, with a least-privilege gateway its `conveyorctl
//! grant` made; `helm test`; then `helm upgrade` to this checkout's packaged chart, whose
//! opt-in pre-upgrade Job migrates the schema with the owner's credential before any new pod
//! starts (no pod waits on `SchemaBehind`); `helm test` again, and a user's story (a pool
//! applied, a batch submitted through the chart's gateway and completed, the pool scaled with
//! kubectl) on the upgraded release; then a rotated client token rolls the gateway.
//!
//! A test binary of its own, so that it runs alone (cargo runs test binaries one after
//! another): the previous release's operator takes over the stack's pools (it leads the
//! whole cluster), and would roll other tests' workers. Between stopping the stack's
//! operator and starting it again, every step returns its failure instead of panicking, so
//! that the stack is given back whatever happens.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use conveyor_core::config::DEV_AMQP_URL;
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::testing;
use conveyor_core::TaskState;
use conveyor_e2e_tests::helm::{pool_yaml, repo, run, script_folder, task_type_yaml, tempdir};
use conveyor_e2e_tests::{
    conveyorctl_at, kill_operator, kubectl, kubectl_with, operators_to_myself, start_operator,
};
use sha2::{Digest, Sha256};

#[tokio::test]
async fn the_previous_release_upgrades_to_this_chart_with_its_migration_job_and_passes_helm_test() {
    let previous = PreviousRelease::get();
    let _operators = operators_to_myself().await;
    let namespace = format!("chart-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let release = "e2e";
    kubectl(&["create", "namespace", &namespace]);
    let token = format!("chart-token-{}", uuid::Uuid::new_v4().simple());
    let digest = hex(&Sha256::digest(token.as_bytes()));
    secret(&namespace, "helm-test-token", "token", &token);
    let ca = "/etc/conveyor/dev-tls/ca.crt";
    let amqp = DEV_AMQP_URL;
    // The database as the previous release's users made it: its own `conveyorctl migrate`,
    // one migration or more behind this checkout.
    let database = testing::TestDatabase::create_empty().await;
    previous.conveyorctl(&database.url, amqp, &["migrate"]);
    let before = schema_version(&database.db).await.unwrap();
    let last = last_migration();
    assert!(
        before.is_some_and(|v| v < last),
        "the previous release's schema ({before:?}) is behind this checkout's ({last})"
    );
    // The gateway's own least-privilege role (decision 0015), granted by the previous
    // release; it cannot migrate. The owner's credential is for the migration Job only.
    let gateway_role = format!(
        "chart_gw_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let granted = previous.conveyorctl(
        &database.url,
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
    secret(&namespace, "chart-owner", "database-url", &database.url);
    // The same values for both charts: the previous one has no schema, and ignores what it
    // does not know yet (the migration Job, the admin key).
    let values = [
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
        format!("tenants[0].databaseUrl={}", database.url),
        format!("tenants[0].amqpUrl={amqp}"),
        // The CRDs are the stack's already (not the release's to own).
        "crds.install=false".to_owned(),
        "test.tokenSecret=helm-test-token".to_owned(),
    ];
    let values_file = tempdir("values").join("values.yaml");
    // --set-string would split on commas (the dev URLs have none, but say it once): a file.
    std::fs::write(&values_file, as_yaml(&values)).unwrap();
    let values_file = values_file.to_str().unwrap();
    let this_chart = package_chart(&repo().join("charts/conveyor"));
    let previous_chart = package_chart(&previous.chart);

    assert!(kill_operator(), "the stack's operator runs");
    // `helm install` or `helm upgrade` of the release from `chart`, its pods running the
    // image tagged `tag`, waiting for them.
    let release_with = |verb: &str, chart: &str, tag: &str, extra: &[&str]| {
        let tag = format!("--set=image.tag={tag}");
        let mut args = vec![verb, release, chart, "-n", &namespace];
        args.extend(["-f", values_file, &tag, "--wait", "--timeout=5m"]);
        args.extend(extra);
        run("helm", &args)
    };
    // helm test, once the test pod's URL names the release's gateway pod (the local
    // cluster has no Service routing; the pod's address changes when the gateway rolls).
    let helm_test = |chart: &str, tag: &str| {
        let url = format!("--set=test.gatewayUrl={}", gateway_url(&namespace)?);
        release_with("upgrade", chart, tag, &[&url])?;
        // No --logs: the local runner keeps container logs in .dev/pods, not behind a
        // kubelet API (pod_logs below reads them).
        let said = run("helm", &["test", release, "-n", &namespace, "--timeout=5m"])?;
        match said.contains("Phase:          Succeeded") {
            true => Ok(said),
            false => Err(format!("helm test of {chart} said:\n{said}")),
        }
    };
    let outcome = async {
        release_with("install", &previous_chart, &previous.version, &[])?;
        // From outside: the release's gateway says it is the previous version (its API
        // description), on the previous schema, which this checkout's gateway would refuse.
        served_version(&namespace, &previous.version).await?;
        helm_test(&previous_chart, &previous.version)?;
        let at_install = schema_version(&database.db).await?;
        if at_install != before {
            return Err(format!(
                "the schema moved from {before:?} to {at_install:?} before the upgrade"
            ));
        }
        release_with("upgrade", &this_chart, "dev", &[])?;
        // The schema holds this checkout's last migration, which only the Job's owner
        // credential could apply (the gateway's role may not).
        let upgraded = schema_version(&database.db).await?;
        if upgraded != Some(last) {
            return Err(format!(
                "the schema is at {upgraded:?}, not {last}: the migration Job did not run"
            ));
        }
        helm_test(&this_chart, "dev")?;
        served_version(&namespace, env!("CARGO_PKG_VERSION")).await?;
        story(&namespace, &gateway_url(&namespace)?, &token, &database.url).await?;
        // A rotated client token: the chart's tokens Secret changes, its checksum annotation
        // rolls the gateway, and the new pod takes the new token and refuses the old one.
        let before = gateway_pods(&namespace)?;
        let rotated = format!("chart-token-{}", uuid::Uuid::new_v4().simple());
        let rotated_digest = hex(&Sha256::digest(rotated.as_bytes()));
        let set =
            format!("--set=gateway.tokens.list[0]=helm-test@{namespace}=sha256:{rotated_digest}");
        release_with("upgrade", &this_chart, "dev", &[&set])?;
        let gateway = gateway_url(&namespace)?;
        let after = gateway_pods(&namespace)?;
        if after.iter().any(|pod| before.contains(pod)) {
            return Err(format!(
                "the gateway did not roll when its tokens changed: pods {before:?}, then {after:?}"
            ));
        }
        for (which, token, expected) in [("rotated", &rotated, 404), ("old", &token, 401)] {
            let status = reqwest::Client::new()
                .get(format!("{gateway}/v1/tasks/{}", uuid::Uuid::new_v4()))
                .bearer_auth(token)
                .send()
                .await
                .map_err(|e| format!("the rolled gateway: {e}"))?
                .status();
            if status.as_u16() != expected {
                return Err(format!(
                    "the {which} token got {status} from the rolled gateway, not {expected}"
                ));
            }
        }
        Ok(())
    }
    .await;
    // Judged from the database too: each helm test's task COMPLETED, with a valid history.
    let key = format!("{namespace}.e2e-conveyor-helm-test");
    let completed = if outcome.is_ok() {
        testing::count_in_state(&database.db, &key, TaskState::Completed).await
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
    forget(database, &gateway_role).await;
    outcome.unwrap_or_else(|err| panic!("{err}\n{logs}"));
    assert_eq!(
        completed, 2,
        "tasks of {key} COMPLETED in the database (one per helm test)\n{logs}"
    );
}

/// The release before this checkout's, as `scripts/previous-release.sh` keeps it: its
/// version (its pods' image tag), chart folder and binaries. Built once per machine.
struct PreviousRelease {
    version: String,
    chart: PathBuf,
    bin: PathBuf,
}

impl PreviousRelease {
    fn get() -> Self {
        let dir = script_folder("scripts/previous-release.sh");
        let version = dir.file_name().unwrap().to_string_lossy().into_owned();
        PreviousRelease {
            version,
            chart: dir.join("chart"),
            bin: dir.join("bin"),
        }
    }

    /// The previous release's `conveyorctl`, as its users ran it.
    fn conveyorctl(&self, database_url: &str, amqp_url: &str, args: &[&str]) -> String {
        conveyorctl_at(&self.bin.join("conveyorctl"), database_url, amqp_url, args)
    }
}

/// The release's gateway pod's address, once it has one (the local cluster has no Service
/// routing).
fn gateway_url(namespace: &str) -> Result<String, String> {
    for _ in 0..120 {
        // One gateway replica: while an old pod ends beside the new one, wait.
        if let [ip] = running_gateways(namespace, "{.status.podIP}")?.as_slice() {
            return Ok(format!("http://{ip}:8080"));
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    Err(format!("{namespace} has no single running gateway pod"))
}

/// The uids of the release's running gateway pods.
fn gateway_pods(namespace: &str) -> Result<Vec<String>, String> {
    running_gateways(namespace, "{.metadata.uid}")
}

/// `field` (a JSONPath of one pod) of each of the release's running gateway pods.
fn running_gateways(namespace: &str, field: &str) -> Result<Vec<String>, String> {
    let jsonpath = format!("jsonpath={{range .items[*]}}{field}{{\"\\n\"}}{{end}}");
    let values = kubectl_with(
        &[
            "-n",
            namespace,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=conveyor-gateway",
            "--field-selector=status.phase=Running",
            "-o",
            &jsonpath,
        ],
        None,
    )?;
    Ok(values.split_whitespace().map(str::to_owned).collect())
}

/// The highest migration applied to the database, read from outside the release.
async fn schema_version(db: &Db) -> Result<Option<i64>, String> {
    sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
        .fetch_one(db.pool())
        .await
        .map_err(|e| format!("the migrations table: {e}"))
}

/// Fails unless the release's gateway describes itself as `version` (`/openapi.json`,
/// which every release serves without a token).
async fn served_version(namespace: &str, version: &str) -> Result<(), String> {
    let url = format!("{}/openapi.json", gateway_url(namespace)?);
    let description: serde_json::Value = reqwest::get(&url)
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| format!("{url}: {e}"))?
        .json()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    match description["info"]["version"].as_str() {
        Some(served) if served == version => Ok(()),
        served => Err(format!(
            "the gateway serves version {served:?}, not {version}"
        )),
    }
}

/// This checkout's last migration.
fn last_migration() -> i64 {
    std::fs::read_dir(repo().join("migrations"))
        .unwrap()
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().to_string_lossy().into_owned();
            name.split('_').next()?.parse().ok()
        })
        .max()
        .expect("migrations")
}

/// A user's story through the chart's gateway and operator: a TaskType and a pool of two
/// applied with kubectl, 40 tasks submitted in one batch (no more, no fewer rows than that),
/// all COMPLETED, then the pool scaled to three with `kubectl scale`.
async fn story(namespace: &str, gateway: &str, token: &str, database: &str) -> Result<(), String> {
    let apply =
        |yaml: String| kubectl_with(&["-n", namespace, "apply", "-f", "-"], Some(&yaml)).map(drop);
    apply(task_type_yaml("story", ""))?;
    apply(pool_yaml("story", "story", "  replicas: 2\n"))?;
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
    let db = Db::connect(&DbOptions::new(database)).map_err(|e| format!("{database}: {e}"))?;
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
        // Not found yet is not ready yet.
        let ready = kubectl_with(
            &[
                "-n",
                namespace,
                "get",
                "deployment",
                "story-worker",
                "-o",
                "jsonpath={.status.readyReplicas}",
            ],
            None,
        )
        .unwrap_or_default();
        if ready.trim() == "3" {
            return Ok(());
        }
        if tokio::time::Instant::now() > scaled_by {
            return Err(format!("the pool has {ready:?} ready workers, not 3"));
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// A Secret `name` in `namespace` holding `key`: `value`.
fn secret(namespace: &str, name: &str, key: &str, value: &str) {
    let literal = format!("--from-literal={key}={value}");
    kubectl(&[
        "-n", namespace, "create", "secret", "generic", name, &literal,
    ]);
}

/// A chart as users get it: `helm package`d, its archive's path.
fn package_chart(chart: &Path) -> String {
    let dir = tempdir("chart");
    let said = run(
        "helm",
        &[
            "package",
            chart.to_str().unwrap(),
            "-d",
            dir.to_str().unwrap(),
        ],
    )
    .unwrap_or_else(|err| panic!("helm package: {err}"));
    said.rsplit("saved it to: ")
        .next()
        .map(|path| path.trim().to_owned())
        .filter(|path| path.ends_with(".tgz"))
        .unwrap_or_else(|| panic!("helm package said: {said}"))
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
