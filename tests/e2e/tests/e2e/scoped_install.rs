//! A namespace-scoped install (decision 0048): the chart's `watchNamespaces` grants the
//! operator and the gateway Roles in the listed namespaces only, and the processes, run as
//! those accounts, serve those namespaces and never see another.

use std::process::{Child, Command};
use std::time::Duration;

use conveyor_core::testing;
use conveyor_core::TaskState;
use conveyor_e2e_tests::{
    kill_operator, kubeconfig_as, kubectl, kubectl_with, operator_process, operators_to_myself,
    repo_root, start_operator, Stack,
};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::{pool_yaml, task_type_yaml, MINUTE};
use conveyor_e2e_tests::helm::run;

const RELEASE: &str = "scoped";

#[tokio::test]
async fn a_namespace_scoped_install_serves_its_namespaces_and_cannot_reach_others() {
    // The stack's operator, cluster-wide, would reconcile the other namespace's pool too.
    let _operators = operators_to_myself().await;
    let mut inside = Stack::namespace("scoped-in").await;
    let mut outside = Stack::namespace("scoped-out").await;
    let home = testing::unique_type("scoped-sys");
    kubectl(&["create", "namespace", &home]);

    // The chart's grants for a scope of two namespaces (the tenant's and the release's own,
    // as helm test needs): a Role in each, no ClusterRole.
    let scope = format!("{},{home}", inside.namespace);
    let grants = rendered_grants(&home, &scope);
    assert!(
        !grants.contains("kind: ClusterRole"),
        "a scoped install grants nothing cluster-wide:\n{grants}"
    );
    kubectl_with(&["apply", "-f", "-"], Some(&grants))
        .unwrap_or_else(|err| panic!("applying the chart's grants: {err}\n{grants}"));
    // What the apiserver lets those accounts do, asked from outside.
    let operator = format!("system:serviceaccount:{home}:{RELEASE}-conveyor-operator");
    let gateway = format!("system:serviceaccount:{home}:{RELEASE}-conveyor-gateway");
    for (account, verb, resource) in [
        (&operator, "create", "deployments.apps"),
        (&operator, "patch", "pods"),
        (&operator, "watch", "workerpools.conveyor.dev"),
        (&gateway, "watch", "clienttokens.conveyor.dev"),
    ] {
        assert!(
            may(account, verb, resource, &inside.namespace),
            "{account} {verb} {resource} in its namespace"
        );
        assert!(
            !may(account, verb, resource, &outside.namespace),
            "{account} {verb} {resource} elsewhere"
        );
        assert!(
            !may(account, verb, resource, "--all-namespaces"),
            "{account} {verb} {resource} cluster-wide"
        );
    }

    // From here on, only the scoped operator reconciles: what it does not see stays as applied.
    assert!(kill_operator(), "the stack's operator runs");
    // A TaskType, a pool and a client token in each namespace.
    let (mut types, mut tokens) = (Vec::new(), Vec::new());
    for stack in [&mut inside, &mut outside] {
        let task_type = stack.task_type("scoped");
        stack.apply(&task_type_yaml(&task_type, ""));
        stack.apply(&pool_yaml("scoped", &task_type, "  replicas: 2\n"));
        let token = format!("scoped-{}", uuid::Uuid::new_v4().simple());
        let digest: String = Sha256::digest(token.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        stack.apply(&format!(
            "apiVersion: conveyor.dev/v1alpha1\nkind: ClientToken\nmetadata: {{name: scoped}}\n\
             spec: {{tokenSha256: \"{digest}\"}}\n"
        ));
        types.push(task_type);
        tokens.push(token);
    }

    // And a TaskType in the release's own namespace, the scope's second.
    let home_type = testing::unique_type("scoped-home");
    kubectl_with(
        &["apply", "-n", &home, "-f", "-"],
        Some(&task_type_yaml(&home_type, "")),
    )
    .unwrap();
    let (operator_admin, gateway_api, gateway_admin) = (free(), free(), free());
    let mut processes = vec![
        operator_process(
            "scoped-operator",
            &operator_admin,
            &kubeconfig_as(&home, &format!("{RELEASE}-conveyor-operator")),
            // No admin key: it makes one, in a Secret of its namespace.
            &[
                ("POD_NAMESPACE", &home),
                ("CONVEYOR_WATCH_NAMESPACES", &scope),
                ("CONVEYOR_ADMIN_KEY", ""),
            ],
        ),
        gateway_process(
            &kubeconfig_as(&home, &format!("{RELEASE}-conveyor-gateway")),
            &gateway_api,
            &gateway_admin,
            &scope,
        ),
    ];
    let outcome = story(
        &inside,
        &outside,
        &types,
        &tokens,
        &format!("http://{gateway_api}"),
    )
    .await;
    let outcome = match outcome {
        Ok(()) => scaled_down_and_home_declared(&inside, &home, &home_type).await,
        failed => failed,
    };
    let outcome = outcome.and_then(|()| workers_hold_a_token(&inside, &home));
    for process in &mut processes {
        let _ = process.kill();
        let _ = process.wait();
    }
    start_operator();
    let logs = ["operator-scoped-operator.log", "gateway-scoped.log"]
        .map(|file| {
            let log =
                std::fs::read_to_string(repo_root().join(".dev").join(file)).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            format!(
                "--- {file}:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )
        })
        .join("\n");
    let _ = kubectl_with(&["delete", "namespace", &home, "--wait=false"], None);
    testing::delete_queues(&format!("{home}.{home_type}")).await;
    inside.finish().await;
    outside.finish().await;
    if let Err(err) = outcome {
        panic!("{err}\n{logs}");
    }
    for log in ["operator-scoped-operator.log", "gateway-scoped.log"] {
        let text = std::fs::read_to_string(repo_root().join(".dev").join(log)).unwrap();
        assert!(
            !text.contains("forbidden"),
            "a scoped process asked the apiserver for what its Roles do not grant:\n{logs}"
        );
    }
}

/// The scoped operator runs the inside pool and the gateway takes the inside tenant's task,
/// which COMPLETES; nothing happens outside: no Deployment, no status, its token unknown.
async fn story(
    inside: &Stack,
    outside: &Stack,
    types: &[String],
    tokens: &[String],
    gateway: &str,
) -> Result<(), String> {
    let http = reqwest::Client::new();
    let submit = |task_type: &str, token: &str| {
        let request = http
            .post(format!("{gateway}/v1/tasks"))
            .bearer_auth(token)
            .json(&json!({"taskType": task_type, "payload": {"sleepMs": 10}}));
        async move {
            match request.send().await {
                Ok(answer) => (
                    answer.status().as_u16(),
                    answer.text().await.unwrap_or_default(),
                ),
                Err(err) => (0, err.to_string()),
            }
        }
    };
    // The gateway takes the TaskType in once it has listed it (and its queues are declared).
    let mut answer = (0, String::new());
    let deadline = tokio::time::Instant::now() + 2 * MINUTE;
    while answer.0 != 201 {
        if tokio::time::Instant::now() > deadline {
            return Err(format!("the scoped gateway kept answering {answer:?}"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        answer = submit(&types[0], &tokens[0]).await;
    }
    // Run by the pool only the scoped operator can have made.
    let deadline = tokio::time::Instant::now() + 3 * MINUTE;
    while inside.count(&types[0], TaskState::Completed).await != 1 {
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "the inside task did not complete: {}",
                inside.picture()
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Outside: the gateway never loaded its ClientToken, nor its TaskType.
    let (status, body) = submit(&types[1], &tokens[1]).await;
    if status != 401 {
        return Err(format!("the outside token: {status} {body}, not 401"));
    }
    let (status, body) = submit(&types[1], &tokens[0]).await;
    if status != 404 {
        return Err(format!(
            "the outside type with the inside token: {status} {body}, not 404"
        ));
    }
    // The inside pool's Deployment exists and its TaskType has a status: by then the
    // operator, had it seen the outside objects, would have done the same there.
    let status_of = |stack: &Stack, task_type: &str| {
        stack.kubectl(&[
            "get",
            "tasktype",
            task_type,
            "-o",
            "jsonpath={.status.conditions}",
        ])
    };
    if status_of(inside, &types[0]).is_empty() {
        return Err("the inside TaskType has no status".to_owned());
    }
    if inside.deployment_replicas("scoped").await.is_none() {
        return Err("the inside pool has no Deployment".to_owned());
    }
    let outside_status = status_of(outside, &types[1]);
    if !outside_status.is_empty() {
        return Err(format!(
            "the outside TaskType was reconciled: {outside_status}"
        ));
    }
    if let Some(replicas) = outside.deployment_replicas("scoped").await {
        return Err(format!(
            "the outside pool got a Deployment ({replicas} replicas)"
        ));
    }
    if outside.count(&types[1], TaskState::Queued).await != 0 {
        return Err("a task was recorded for the outside type".to_owned());
    }
    Ok(())
}

/// Under its Roles the scoped operator scales the inside pool down (choosing a pod, patching
/// it, draining its worker) and declares the TaskType of its scope's second namespace.
async fn scaled_down_and_home_declared(
    inside: &Stack,
    home: &str,
    home_type: &str,
) -> Result<(), String> {
    inside.kubectl(&["scale", "workerpool/scoped", "--replicas=1"]);
    let deadline = tokio::time::Instant::now() + 3 * MINUTE;
    loop {
        let running = inside.running_pods("scoped").await.len();
        let replicas = inside.deployment_replicas("scoped").await;
        let declared = kubectl_with(
            &[
                "-n",
                home,
                "get",
                "tasktype",
                home_type,
                "-o",
                "jsonpath={.status.conditions}",
            ],
            None,
        )
        .unwrap_or_default();
        if running == 1 && replicas == Some(1) && !declared.is_empty() {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "after 3 minutes: {running} running inside, replicas {replicas:?}, home's \
                 TaskType status {declared:?}\n{}",
                inside.picture()
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Given no admin key, the operator made one in its namespace, and the pool's workers got
/// their token from it: their `/drain` is not open (the scale-down above drained with it).
fn workers_hold_a_token(inside: &Stack, home: &str) -> Result<(), String> {
    let made = kubectl_with(
        &[
            "-n",
            home,
            "get",
            "secret",
            "conveyor-operator-admin-key",
            "-o",
            "jsonpath={.data.admin-key}",
        ],
        None,
    )?;
    if made.trim().is_empty() {
        return Err(format!("no admin key made in {home}"));
    }
    let env = inside.kubectl(&[
        "get",
        "deployment",
        "scoped-worker",
        "-o",
        "jsonpath={.spec.template.spec.containers[?(@.name==\"worker\")].env[*].name}",
    ]);
    match env
        .split_whitespace()
        .any(|name| name == "CONVEYOR_ADMIN_TOKEN")
    {
        true => Ok(()),
        false => Err(format!("the workers have no admin token: {env}")),
    }
}

/// The chart's ServiceAccounts, Roles and bindings (and any ClusterRole it would render) for a
/// release in `home` watching `scope`.
fn rendered_grants(home: &str, scope: &str) -> String {
    let rendered = run(
        "helm",
        &[
            "template",
            RELEASE,
            "charts/conveyor",
            "-n",
            home,
            &format!("--set=watchNamespaces={{{scope}}}"),
            "--set=operator.connections.existingSecret=unused",
            "--set=gateway.connections.existingSecret=unused",
            "--set=gateway.tokens.existingSecret=unused",
            "--set=test.enabled=false",
            "--set=crds.install=false",
        ],
    )
    .unwrap_or_else(|err| panic!("helm template: {err}"));
    let kinds = [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ClusterRole",
        "ClusterRoleBinding",
    ];
    rendered
        .split("\n---")
        .filter(|doc| {
            kinds
                .iter()
                .any(|k| doc.contains(&format!("\nkind: {k}\n")))
        })
        .map(|doc| format!("---{doc}\n"))
        .collect()
}

/// A loopback address no one listens on now.
fn free() -> String {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap().to_string()
}

/// Whether the apiserver lets `account` `verb` `resource` in `namespace`
/// (`--all-namespaces` for the cluster).
fn may(account: &str, verb: &str, resource: &str, namespace: &str) -> bool {
    let scope = match namespace {
        "--all-namespaces" => vec!["--all-namespaces".to_owned()],
        _ => vec!["-n".to_owned(), namespace.to_owned()],
    };
    let out = Command::new("kubectl")
        .args(["auth", "can-i", verb, resource, "--as", account])
        .args(&scope)
        .output()
        .expect("kubectl runs");
    String::from_utf8_lossy(&out.stdout).trim() == "yes"
}

/// A gateway acting as the account of `kubeconfig`, serving plain HTTP on `api`, following
/// the TaskTypes and ClientTokens of `scope` only (no upkeep: the stack's gateway has it).
fn gateway_process(kubeconfig: &std::path::Path, api: &str, admin: &str, scope: &str) -> Child {
    let log = std::fs::File::create(repo_root().join(".dev/gateway-scoped.log")).unwrap();
    Command::new(testing::binary("conveyor-gateway"))
        .args(["--listen", api, "--admin-listen", admin])
        .args([
            "--task-types-from-cluster",
            "--task-types-refresh-seconds",
            "1",
        ])
        .args(["--watch-namespaces", scope, "--no-upkeep", "--no-migrate"])
        .env("KUBECONFIG", kubeconfig)
        .env("CONVEYOR_CA_FILE", testing::DEV_CA)
        .env_remove("CONVEYOR_GATEWAY_TOKENS")
        .env_remove("CONVEYOR_GATEWAY_TOKENS_FILE")
        .current_dir(repo_root())
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start a conveyor-gateway")
}
