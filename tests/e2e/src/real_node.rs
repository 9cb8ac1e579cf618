//! The local cluster's real node (`cluster/real-node.sh`, decision 0029): a kubelet with
//! containerd that runs pods as containers from the images `scripts/images.sh` builds. Pools
//! go there only when they ask ([`placement`]); every other story runs on the simulated
//! nodes. Stories that stop the node take it for themselves ([`exclusive`]); the others
//! share it ([`shared`]). On kind (`make e2e-kind`) the real node is kind's node, named by
//! `CONVEYOR_REAL_NODE` and labelled as the local one is, and [`node_script`] is
//! `CONVEYOR_NODE_SCRIPT` (scripts/kind-node.sh).

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::{kubectl, kubectl_with, repo_root, Stack};

/// The node's name: the local real node's, or kind's node (`CONVEYOR_REAL_NODE`).
pub fn node() -> String {
    std::env::var("CONVEYOR_REAL_NODE").unwrap_or_else(|_| "conveyor-real-node".to_owned())
}
/// Where the node's pods reach PostgreSQL and RabbitMQ (forwarded to this machine's
/// loopback; the dev certificate names this address too).
const SERVICES: &str = "10.231.0.1";
/// Where a worker pod finds the CA (the connection Secret's `ca.crt`, which the operator
/// mounts there).
const POD_CA: &str = "/var/run/conveyor/tls/ca.crt";
const DEV_CA: &str = "/etc/conveyor/dev-tls/ca.crt";

static NODE_LOCK: RwLock<()> = RwLock::const_new(());

/// For a story that runs pods on the node while others may too.
pub async fn shared() -> RwLockReadGuard<'static, ()> {
    NODE_LOCK.read().await
}

/// For a story that stops the node: no other story runs there meanwhile.
pub async fn exclusive() -> RwLockWriteGuard<'static, ()> {
    NODE_LOCK.write().await
}

/// A WorkerPool's `spec.pod` that runs it on the real node, with `more` (lines indented by
/// four spaces) added to it.
pub fn placement(more: &str) -> String {
    format!(
        "  pod:\n    nodeSelector: {{conveyor.dev/node: real}}\n    \
         tolerations: [{{key: conveyor.dev/real-node, operator: Exists, effect: NoSchedule}}]\n{more}"
    )
}

impl Stack {
    /// A namespace whose workers run on the real node: its connection Secret names the
    /// services by the address the node's pods reach them at, with the CA they verify.
    pub async fn on_real_node(prefix: &str) -> Stack {
        let stack = Stack::namespace(prefix).await;
        if crate::on_kind() {
            // Its pods reach the in-cluster services, as every pod on kind does.
            return stack;
        }
        let for_pods = |url: &str| url.replace("127.0.0.1", SERVICES).replace(DEV_CA, POD_CA);
        let secret = kubectl(&[
            "-n",
            &stack.namespace,
            "create",
            "secret",
            "generic",
            "conveyor-connections",
            &format!(
                "--from-literal=database-url={}",
                for_pods(&stack.database_url)
            ),
            &format!("--from-literal=amqp-url={}", for_pods(&stack.amqp_url)),
            &format!("--from-file=ca.crt={DEV_CA}"),
            "--dry-run=client",
            "-o",
            "yaml",
        ]);
        kubectl_with(&["apply", "-f", "-"], Some(&secret))
            .unwrap_or_else(|err| panic!("the real node's connection Secret: {err}"));
        stack
    }

    /// The namespace's pods bound to `node`, whatever their phase.
    pub async fn pods_on(&self, node: &str) -> Vec<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
        pods.list(&on_node)
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    }
}

/// Runs `cluster/real-node.sh` (on kind, `CONVEYOR_NODE_SCRIPT`) with `args`; panics with
/// its output when it fails.
pub fn node_script(args: &[&str]) -> String {
    let script =
        std::env::var("CONVEYOR_NODE_SCRIPT").unwrap_or_else(|_| "cluster/real-node.sh".into());
    let out = Command::new(repo_root().join(&script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{script} runs: {e}"));
    assert!(
        out.status.success(),
        "{script} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The container id (without `containerd://`) of `container` in `pod`.
pub fn container_id(pod: &Pod, container: &str) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == container)?
        .container_id
        .as_deref()?
        .strip_prefix("containerd://")
        .map(str::to_owned)
}

/// Restarts of `container` in `pod`, as the kubelet reports them.
pub fn restarts(pod: &Pod, container: &str) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|all| all.iter().find(|s| s.name == container))
        .map_or(0, |s| s.restart_count)
}

/// Whether the node reports Ready.
pub fn node_ready() -> bool {
    kubectl_with(
        &[
            "get",
            "node",
            &node(),
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
        ],
        None,
    )
    .is_ok_and(|s| s.trim() == "True")
}

/// How long to give the node for anything a kubelet does on its own schedule (a pod
/// started, a probe passed) on a busy machine.
pub const NODE_PATIENCE: Duration = Duration::from_secs(180);
