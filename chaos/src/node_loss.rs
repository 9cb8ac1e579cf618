//! A Kubernetes node lost under load, three times in one run (the case study's "3 Kubernetes
//! node failures"). A node of the local cluster is its kwok (which renews its lease) and its
//! pod runner (its kubelet): both die at once with every worker process on the node, as
//! when a machine loses power. Then Kubernetes does the rest on its own, and this watches:
//! the node controller marks the node NotReady, the pods on it are evicted once their
//! tolerations run out, their replacements start on the other nodes, and the tasks the dead
//! workers held are reaped and run again. The node comes back before the next round.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use conveyor_e2e_tests::Stack;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use crate::oracle;

/// Node failures in one run.
pub const ROUNDS: usize = 3;
/// Longest wait for each step Kubernetes takes on its own (NotReady after the node monitor
/// grace period, eviction after the 30 s tolerations, replacements started).
const STEP_WITHIN: Duration = Duration::from_secs(180);

/// Loses a node hosting the pool's pods, [`ROUNDS`] times; returns when the last one died.
pub async fn inject(
    stack: &Stack,
    pool: &str,
    replicas: usize,
    task_type: &str,
    failures: &mut Vec<String>,
) -> Instant {
    let mut last = Instant::now();
    for round in 1..=ROUNDS {
        let pods: Vec<Pod> = pool_pods(stack, pool)
            .await
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && is_ready(p))
            .collect();
        let node: Option<String> = pods.iter().find_map(|p| p.spec.as_ref()?.node_name.clone());
        let Some(node) = node else {
            failures.push(format!(
                "round {round}: no pod of the pool runs on any node"
            ));
            continue;
        };
        let doomed: Vec<String> = pods
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node))
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        last = Instant::now();
        if let Err(err) = power_off(&node) {
            failures.push(format!("round {round}: cannot stop node {node}: {err:#}"));
            continue;
        }
        let held = oracle::count_owned_by(&stack.db, task_type, &doomed).await;
        eprintln!(
            "chaos: node-loss round {round}: {node} lost with pods {doomed:?} holding {held} tasks"
        );
        let mut step = |what: &str, done: bool| {
            match done {
                true => eprintln!(
                    "chaos: node-loss round {round}: {what} {:.0} s after the node died",
                    last.elapsed().as_secs_f64()
                ),
                false => failures.push(format!(
                    "round {round}: {what} not seen within {STEP_WITHIN:?}"
                )),
            }
            done
        };
        let not_ready = until(|| async { node_ready(stack, &node).await == Some(false) }).await;
        step("NotReady", not_ready);
        let reaped =
            until(|| async { oracle::count_owned_by(&stack.db, task_type, &doomed).await == 0 })
                .await;
        step("its workers' tasks reaped", reaped);
        let evicted = until(|| async {
            let now = pool_pods(stack, pool).await;
            doomed.iter().all(|name| {
                now.iter().all(|p| {
                    p.metadata.name.as_ref() != Some(name)
                        || p.metadata.deletion_timestamp.is_some()
                })
            })
        })
        .await;
        step("its pods evicted", evicted);
        let replaced =
            until(|| async { ready_elsewhere(stack, pool, &node).await >= replicas }).await;
        step("replacements ready on the other nodes", replaced);
        // The machine back: its kwok and pod runner start again (scripts/stack.sh up starts
        // what is not running); the pods evicted from it are deleted for good.
        let back = run_stack_up().await.is_ok()
            && until(|| async { node_ready(stack, &node).await == Some(true) }).await;
        step("back Ready", back);
    }
    last
}

/// The pool's pods that are not being deleted and are Ready on nodes other than `lost`.
async fn ready_elsewhere(stack: &Stack, pool: &str, lost: &str) -> usize {
    pool_pods(stack, pool)
        .await
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && is_ready(p))
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(lost))
        .count()
}

async fn pool_pods(stack: &Stack, pool: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(stack.client.clone(), &stack.namespace);
    let selector = format!("conveyor.dev/pool={pool}");
    pods.list(&ListParams::default().labels(&selector))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether the node's Ready condition is True (`None` when unreadable).
async fn node_ready(stack: &Stack, node: &str) -> Option<bool> {
    let nodes: Api<Node> = Api::all(stack.client.clone());
    let node = nodes.get(node).await.ok()?;
    let ready = node
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == "Ready")?;
    Some(ready.status == "True")
}

/// Checks `done` every second until it holds or [`STEP_WITHIN`] passes.
async fn until<F, Fut>(done: F) -> bool
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + STEP_WITHIN;
    while Instant::now() < deadline {
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    false
}

/// The local stack's process directory (scripts/stack.sh's `$DEV`).
fn dev_dir() -> PathBuf {
    std::env::var_os("CONVEYOR_DEV_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.dev"),
        PathBuf::from,
    )
}

fn pid_of(path: PathBuf) -> anyhow::Result<i32> {
    let text =
        std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(text.trim().parse()?)
}

/// kill -9 of the node's pod runner, of every process it started (each pod's process
/// group), and of the node's kwok: nothing on the node runs, nothing renews its lease.
fn power_off(node: &str) -> anyhow::Result<()> {
    let dev = dev_dir();
    let runner = match node.strip_prefix("conveyor-node-") {
        Some(n) => format!("pod-runner-{n}"),
        None => "pod-runner".to_owned(),
    };
    let runner = pid_of(dev.join(format!("{runner}.pid")))?;
    let kwok = pid_of(dev.join(format!("cluster/kwok-{node}.pid")))?;
    // The runner first, so that it restarts nothing; then what it ran.
    let children = children_of(runner);
    kill(Pid::from_raw(runner), Signal::SIGKILL)?;
    for child in children {
        let _ = killpg(Pid::from_raw(child), Signal::SIGKILL);
    }
    kill(Pid::from_raw(kwok), Signal::SIGKILL)?;
    Ok(())
}

/// The processes whose parent is `pid` (from /proc).
fn children_of(pid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|child| {
            // Field 4 of /proc/<pid>/stat, after the parenthesised command name.
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|stat| {
                    let after = stat.rsplit_once(')')?.1;
                    after.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// `scripts/stack.sh up`, which starts the lost node's kwok and pod runner again.
async fn run_stack_up() -> anyhow::Result<()> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack.sh");
    let out = tokio::process::Command::new(&script)
        .arg("up")
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "{} up: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
