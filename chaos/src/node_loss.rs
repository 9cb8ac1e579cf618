//! A Kubernetes node lost under load, three times in one run (the case study's "3 Kubernetes
//! node failures"). A node of the local cluster is its kwok (which renews its lease) and its
//! pod runner (its kubelet): both die at once with every worker process on the node, as
//! when a machine loses power. Then Kubernetes does the rest on its own, and this watches:
//! the node controller marks the node NotReady, the pods on it are evicted once their
//! tolerations run out, their replacements start on the other nodes, and the tasks the dead
//! workers held are reaped and run again (the sidecar sees them run twice: `run.rs` requires
//! it). The node comes back before the next round.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use conveyor_e2e_tests::Stack;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use crate::oracle;

/// Node failures in one run.
pub const ROUNDS: usize = 3;
/// What must follow a node's death within this long: the case study's recovery bound.
const RECOVER_WITHIN: Duration = Duration::from_secs(120);
/// Longest wait for the node to be Ready again after it was restarted: whether it comes back
/// is judged, not how fast (a busy machine took 58 s once, past the 60 s this was).
const BACK_WITHIN: Duration = Duration::from_secs(180);
/// Longest wait for a node to hold a task, so that its death catches work mid-run.
const BUSY_WITHIN: Duration = Duration::from_secs(30);

/// What is seen after a node's death, each step the first time it holds.
const STEPS: [&str; 4] = [
    "NotReady",
    "its workers' tasks reaped",
    "its pods evicted",
    "replacements Ready elsewhere",
];

/// Loses the node whose workers hold the most tasks, [`ROUNDS`] times; returns when the
/// last one died. Each round's timings go to `notes`.
pub async fn inject(
    stack: &Stack,
    pool: &str,
    replicas: usize,
    task_type: &str,
    failures: &mut Vec<String>,
    notes: &mut Vec<String>,
) -> Instant {
    let mut last = Instant::now();
    for round in 1..=ROUNDS {
        match lose_a_node(stack, pool, replicas, task_type, round).await {
            Ok((died, note, missed)) => {
                last = died;
                notes.push(note);
                failures.extend(missed);
            }
            Err(err) => failures.push(format!("round {round}: {err:#}")),
        }
    }
    last
}

/// One round: the busiest node dies, Kubernetes takes over, the node comes back. Returns
/// when it died, a note of when each step was seen, and the steps missed.
async fn lose_a_node(
    stack: &Stack,
    pool: &str,
    replicas: usize,
    task_type: &str,
    round: usize,
) -> anyhow::Result<(Instant, String, Vec<String>)> {
    let (node, doomed, held) = busiest_node(stack, pool, task_type).await?;
    let died = Instant::now();
    if let Err(err) = power_off(&node) {
        // Half dead is no state to leave a node in.
        let _ = node_up(&node).await;
        return Err(err);
    }
    eprintln!("chaos: node-loss round {round}: {node} lost with {doomed:?} holding {held} tasks");
    // Whatever happens while watching, the node comes back before the round ends.
    let watched = watch(stack, pool, replicas, task_type, &node, &doomed, died).await;
    node_up(&node).await?;
    let seen = watched?;
    let mut missed: Vec<String> = STEPS
        .iter()
        .zip(seen)
        .filter(|(_, at)| at.is_none())
        .map(|(step, _)| format!("round {round}: {step} not seen within {RECOVER_WITHIN:?}"))
        .collect();
    // The machine is back: its kwok and pod runner run again, and the pods evicted from it
    // are deleted for good.
    let back_since = Instant::now();
    while back_since.elapsed() < BACK_WITHIN && node_ready(stack, &node).await? != Some(true) {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let back = died.elapsed().as_secs_f64();
    if node_ready(stack, &node).await? != Some(true) {
        missed.push(format!(
            "round {round}: {node} not Ready again after its restart"
        ));
    }
    let steps: Vec<String> = STEPS
        .iter()
        .zip(seen)
        .filter_map(|(step, at)| Some(format!("{step} {:.0} s", at?)))
        .collect();
    let note = format!(
        "round {round}: {node} lost holding {held} tasks; {}; back {back:.0} s",
        steps.join(", ")
    );
    eprintln!("chaos: node-loss {note}");
    Ok((died, note, missed))
}

/// Each of [`STEPS`] the first time it holds, in seconds after `died`, watched for up to
/// [`RECOVER_WITHIN`].
async fn watch(
    stack: &Stack,
    pool: &str,
    replicas: usize,
    task_type: &str,
    node: &str,
    doomed: &[String],
    died: Instant,
) -> anyhow::Result<[Option<f64>; 4]> {
    let mut seen: [Option<f64>; 4] = [None; 4];
    while died.elapsed() < RECOVER_WITHIN && seen.iter().any(Option::is_none) {
        let pods = stack.pool_pods(pool).await?;
        let now = [
            node_ready(stack, node).await? == Some(false),
            oracle::count_owned_by(&stack.db, task_type, doomed).await? == 0,
            doomed.iter().all(|name| {
                pods.iter()
                    .all(|p| p.metadata.name.as_ref() != Some(name) || deleted(p))
            }),
            pods.iter()
                .filter(|p| !deleted(p) && is_ready(p) && node_of(p) != Some(node))
                .count()
                >= replicas,
        ];
        for (step, holds) in seen.iter_mut().zip(now) {
            if holds && step.is_none() {
                *step = Some(died.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(seen)
}

/// The node whose pool workers hold the most tasks (claimed or running), its pods and that
/// count; waits up to [`BUSY_WITHIN`] for some node to hold one.
async fn busiest_node(
    stack: &Stack,
    pool: &str,
    task_type: &str,
) -> anyhow::Result<(String, Vec<String>, i64)> {
    let since = Instant::now();
    loop {
        let pods = stack.pool_pods(pool).await?;
        let mut best: Option<(String, Vec<String>, i64)> = None;
        let mut nodes: Vec<&str> = pods
            .iter()
            .filter(|p| !deleted(p))
            .filter_map(node_of)
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        for node in nodes {
            let on_it: Vec<String> = pods
                .iter()
                .filter(|p| !deleted(p) && node_of(p) == Some(node))
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            let held = oracle::count_owned_by(&stack.db, task_type, &on_it).await?;
            if best.as_ref().is_none_or(|(_, _, most)| held > *most) {
                best = Some((node.to_owned(), on_it, held));
            }
        }
        match best {
            Some(busiest) if busiest.2 > 0 => return Ok(busiest),
            _ if since.elapsed() > BUSY_WITHIN => {
                anyhow::bail!("no node held a task within {BUSY_WITHIN:?}: nothing to lose")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

fn deleted(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether the node's Ready condition is True (`None` while it reports none).
async fn node_ready(stack: &Stack, node: &str) -> anyhow::Result<Option<bool>> {
    let nodes: Api<Node> = Api::all(stack.client.clone());
    let node = nodes.get(node).await?;
    let ready = node
        .status
        .and_then(|s| s.conditions)
        .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"));
    Ok(ready.map(|c| c.status == "True"))
}

/// The local stack's process directory (scripts/stack.sh's `$DEV`).
fn dev_dir() -> PathBuf {
    std::env::var_os("CONVEYOR_DEV_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.dev"),
        PathBuf::from,
    )
}

fn pid_of(path: PathBuf) -> anyhow::Result<Pid> {
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    Ok(Pid::from_raw(text.trim().parse()?))
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
    // Stopped first, so that it starts nothing between the listing and the kill.
    kill(runner, Signal::SIGSTOP)?;
    let children = children_of(runner);
    kill(runner, Signal::SIGKILL)?;
    for child in children {
        let _ = killpg(child, Signal::SIGKILL);
    }
    kill(kwok, Signal::SIGKILL)?;
    Ok(())
}

/// The processes whose parent is `parent` (from /proc).
fn children_of(parent: Pid) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            // Field 4 of /proc/<pid>/stat, after the parenthesised command name.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let after = stat.rsplit_once(')')?.1;
                    after.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(parent.as_raw())
        })
        .map(Pid::from_raw)
        .collect()
}

/// Starts the node's kwok and pod runner again (`scripts/stack.sh node-up`), and nothing
/// else.
async fn node_up(node: &str) -> anyhow::Result<()> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack.sh");
    let out = tokio::process::Command::new(&script)
        .args(["node-up", node])
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "{} node-up {node}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
