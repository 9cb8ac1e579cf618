//! The Helm chart (charts/conveyor): it lints, renders what the apiserver accepts (the
//! Prometheus operator's CRDs applied, so the monitors are checked against their schemas),
//! the kustomize manifests rendered from it have not drifted, and installed on the local
//! cluster its operator and gateway run tasks end to end: `helm test` passes and its task's
//! row says COMPLETED, and a user's story (a pool applied, a batch submitted through the
//! chart's gateway and completed, the pool scaled with kubectl) runs on the chart's install.

use std::path::{Path, PathBuf};
use std::process::Command;

use conveyor_core::config::{DEV_AMQP_URL, DEV_DATABASE_URL};
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::testing;
use conveyor_core::TaskState;
use conveyor_e2e_tests::{
    kill_operator, kubectl, kubectl_with, operators_to_myself, start_operator,
};
use sha2::{Digest, Sha256};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs a command in the repository; Err holds its output when it fails.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("{program} runs (make test puts helm on PATH): {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{program} {}: {text}", args.join(" ")))
    }
}

/// Values that satisfy every required setting (connections, tokens, the test's token).
const REQUIRED: &[&str] = &[
    "--set=operator.connections.existingSecret=ops",
    "--set=gateway.connections.existingSecret=gw",
    "--set=gateway.tokens.existingSecret=tokens",
    "--set=test.tokenSecret=token",
];

#[test]
fn the_chart_lints_and_renders_what_the_apiserver_accepts_and_the_manifests_do_not_drift() {
    let mut lint = vec!["lint", "--strict", "charts/conveyor"];
    lint.extend(REQUIRED);
    run("helm", &lint).unwrap();
    // Missing settings are refused with the value to set, not rendered half-way.
    let err = run("helm", &["template", "x", "charts/conveyor"]).unwrap_err();
    assert!(
        err.contains("operator.connections: set existingSecret"),
        "{err}"
    );

    // The directory is the script's standard output; a cold cache also says on standard
    // error what Go downloads while it generates them (seen on a fresh machine).
    let generated = Command::new("cluster/monitoring-crds.sh")
        .current_dir(repo())
        .output()
        .expect("cluster/monitoring-crds.sh runs");
    assert!(
        generated.status.success(),
        "cluster/monitoring-crds.sh: {}",
        String::from_utf8_lossy(&generated.stderr)
    );
    let crds = String::from_utf8_lossy(&generated.stdout).into_owned();
    let crds = Path::new(crds.lines().last().expect("a directory").trim());
    for kind in ["servicemonitors", "podmonitors", "prometheusrules"] {
        let file = crds.join(format!("monitoring.coreos.com_{kind}.yaml"));
        kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            file.to_str().unwrap(),
        ]);
    }
    let _ = kubectl_with(&["create", "namespace", "conveyor-system"], None);
    let mut template = vec![
        "template",
        "conveyor",
        "charts/conveyor",
        "--namespace=conveyor-system",
        "--set=monitoring.serviceMonitors=true",
        "--set=monitoring.podMonitor=true",
        "--set=monitoring.prometheusRule=true",
        "--set=monitoring.dashboards=true",
        "--set=tenants[0].namespace=conveyor-system",
        "--set=tenants[0].databaseUrl=postgres://x",
        "--set=tenants[0].amqpUrl=amqps://x",
        r#"--set-json=networkPolicies.workerMetricsFrom=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#,
    ];
    template.extend(REQUIRED);
    let rendered = run("helm", &template).unwrap();
    // The other ways in: a RabbitmqCluster's default-user Secret, a private CA from a Secret,
    // HTTPS at the gateway, a tenant with its CA, no NetworkPolicies, scoped to a namespace.
    let other = vec![
        "template",
        "conveyor",
        "charts/conveyor",
        "--namespace=conveyor-system",
        "--set=operator.connections.rabbitmqDefaultUserSecret=rabbitmq-default-user",
        "--set=operator.connections.amqpHost=rabbitmq.conveyor-system.svc",
        "--set=operator.connections.managementUrl=https://rabbitmq.conveyor-system.svc:15671",
        "--set=ca.secretName=conveyor-ca",
        "--set=gateway.tlsSecretName=conveyor-gateway-tls",
        "--set=gateway.connections.databaseUrl=postgres://x",
        "--set=gateway.connections.amqpUrl=amqps://x",
        "--set=gateway.tokens.list[0]=ci@video=sha256:00",
        "--set=test.tokenSecret=token",
        "--set=tenants[0].namespace=conveyor-system",
        "--set=tenants[0].databaseUrl=postgres://x",
        "--set=tenants[0].amqpUrl=amqps://x",
        "--set=tenants[0].caCrt=PEM",
        "--set=networkPolicies.enabled=false",
        "--set=gateway.retention.archiveClaimName=conveyor-archive",
        "--set=gateway.retention.taskDays=7",
        "--set=watchNamespaces={conveyor-system}",
    ];
    let other_rendered = run("helm", &other).unwrap();
    for line in [
        "--task-retention-days=7",
        "--task-archive-dir=/var/lib/conveyor/archive",
        "persistentVolumeClaim: {claimName: \"conveyor-archive\"}",
    ] {
        assert!(
            other_rendered.contains(line),
            "the gateway's task archive goes to the claim named: no {line:?} in\n{other_rendered}"
        );
    }
    // Scoped: both components are told their namespaces (the Roles are rendered for them).
    assert_eq!(
        other_rendered
            .matches("- name: CONVEYOR_WATCH_NAMESPACES\n              value: \"conveyor-system\"")
            .count(),
        2,
        "the scoped render tells the operator and the gateway their scope:\n{other_rendered}"
    );
    assert!(
        other_rendered.contains("https://conveyor-gateway.conveyor-system.svc:80"),
        "helm test must speak HTTPS to a gateway that serves it:\n{other_rendered}"
    );
    for (what, manifests) in [
        ("chart", &rendered),
        ("chart's other settings", &other_rendered),
    ] {
        kubectl_with(
            &[
                "apply",
                "--dry-run=server",
                "--server-side",
                "--force-conflicts",
                "--field-manager=e2e-chart",
                "-f",
                "-",
            ],
            Some(manifests),
        )
        .unwrap_or_else(|err| panic!("the apiserver refused the rendered {what}: {err}"));
    }

    let fresh = tempdir("render");
    run("scripts/render-manifests.sh", &[fresh.to_str().unwrap()]).unwrap();
    for file in [
        "base/rbac.yaml",
        "base/conveyor.yaml",
        "observability/monitors.yaml",
        "observability/prometheusrule.yaml",
        "observability/dashboards.yaml",
    ] {
        let committed = std::fs::read_to_string(repo().join("manifests").join(file)).unwrap();
        let now = std::fs::read_to_string(fresh.join(file)).unwrap();
        assert!(
            committed == now,
            "manifests/{file} drifted from the chart: run scripts/render-manifests.sh"
        );
    }
    let _ = std::fs::remove_dir_all(fresh);
}

fn tempdir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("conveyor-{what}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn installed_with_helm_it_runs_a_task_end_to_end_and_passes_helm_test() {
    // The chart's operator stands in for the stack's while this runs: two would both lead.
    let _operators = operators_to_myself().await;
    let namespace = format!("chart-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let release = "e2e";
    kubectl(&["create", "namespace", &namespace]);
    let token = format!("chart-token-{}", uuid::Uuid::new_v4().simple());
    let digest = hex(&Sha256::digest(token.as_bytes()));
    kubectl(&[
        "-n",
        &namespace,
        "create",
        "secret",
        "generic",
        "helm-test-token",
        &format!("--from-literal=token={token}"),
    ]);
    let ca = "/etc/conveyor/dev-tls/ca.crt";
    let (database, amqp) = (DEV_DATABASE_URL, DEV_AMQP_URL);
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
        format!("gateway.connections.databaseUrl={database}"),
        format!("gateway.connections.amqpUrl={amqp}"),
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
        let mut args = vec![verb, release, "charts/conveyor", "-n", &namespace];
        args.extend(["-f", values_file, "--wait", "--timeout=5m"]);
        args.extend(extra);
        run("helm", &args)
    };
    let installed = release_with("install", &[]);
    let outcome = async {
        installed?;
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
        story(&namespace, &format!("http://{gateway_ip}:8080"), &token).await?;
        Ok::<_, String>(said)
    }
    .await;
    // Judged from the database too: the test's one task COMPLETED, with a valid history.
    let key = format!("{namespace}.e2e-conveyor-helm-test");
    let completed = if outcome.is_ok() {
        let db = Db::connect(&DbOptions::new(DEV_DATABASE_URL)).expect("database URL");
        testing::count_in_state(&db, &key, TaskState::Completed).await
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
async fn story(namespace: &str, gateway: &str, token: &str) -> Result<(), String> {
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
    let db = Db::connect(&DbOptions::new(DEV_DATABASE_URL)).expect("database URL");
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
