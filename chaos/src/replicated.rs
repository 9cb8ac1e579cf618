//! The replicated services of the cluster-scale scenarios (`scripts/cluster-services.sh`): a
//! three-node RabbitMQ cluster and a PostgreSQL primary with a synchronous standby, reached
//! the way a user's processes reach them. The broker by every node's URL (the clients move
//! to a node that answers); the database by one address that moves to whichever node is the
//! primary, as CloudNativePG's `-rw` Service, Patroni's leader endpoint or a managed
//! service's DNS name do. Here that address is a forwarder the suite points at the promoted
//! standby, playing the HA manager's part.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use conveyor_core::testing::{self, proxy::Proxy, Services};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The RabbitMQ nodes, `conveyor-N@localhost`.
pub const NODES: [u8; 3] = [1, 2, 3];

fn amqp_url(node: u8) -> String {
    format!(
        "amqps://conveyor:conveyor@127.0.0.1:{}/%2f?cacertfile={}",
        5680 + u16::from(node),
        testing::DEV_CA
    )
}

fn management_url(node: u8) -> String {
    format!(
        "https://conveyor:conveyor@127.0.0.1:{}",
        15680 + u16::from(node)
    )
}

/// The node number of `conveyor-N@localhost`.
fn node_of(name: &str) -> Option<u8> {
    name.strip_prefix("conveyor-")?
        .split('@')
        .next()?
        .parse()
        .ok()
}

pub struct Replicated {
    /// The database's moving address: forwards to the primary of the moment.
    pub rw: Proxy,
    /// The services as the system under test gets them (the database through `rw`).
    pub services: Services,
    http: reqwest::Client,
}

impl Replicated {
    /// Brings the topology up (idempotent: a node that is down is started, a standby that
    /// does not stream is re-made) and points the moving address at the primary.
    pub async fn up() -> anyhow::Result<Replicated> {
        script(&["up"]).await?;
        let primary = pg_primary().await?.context("the pair has no primary")?;
        let rw = Proxy::start(format!("127.0.0.1:{primary}").parse()?).await;
        let services = Services {
            admin_database_url: format!(
                "postgres://conveyor:conveyor@127.0.0.1:{}/postgres\
                 ?sslmode=verify-full&sslrootcert={}",
                rw.port,
                testing::DEV_CA
            ),
            amqp_url: NODES.map(amqp_url).join(","),
            management_url: management_url(1),
        };
        Ok(Replicated {
            rw,
            services,
            http: testing::http_client(),
        })
    }

    /// `queue`'s quorum: its leader's node, and how many of its members are online. `None`
    /// while no node answers or the queue has no leader.
    pub async fn quorum(&self, queue: &str) -> Option<(u8, usize)> {
        let body = self.management(&format!("/api/queues/%2f/{queue}")).await?;
        let leader = body["leader"].as_str().and_then(node_of)?;
        let online = body["online"].as_array().map_or(0, Vec::len);
        Some((leader, online))
    }

    /// How many connections of the system under test (not the suite's own) node `node`
    /// holds.
    pub async fn connections_on(&self, node: u8) -> Option<usize> {
        let name = format!("conveyor-{node}@localhost");
        let body = self.management("/api/connections").await?;
        let on_it = body.as_array()?.iter().filter(|c| {
            let client = c["client_properties"]["connection_name"]
                .as_str()
                .unwrap_or("");
            c["node"] == name.as_str() && !client.starts_with("conveyor-chaos")
        });
        Some(on_it.count())
    }

    /// What the first node whose management API answers says to `GET path`.
    async fn management(&self, path: &str) -> Option<serde_json::Value> {
        for node in NODES {
            let url = format!("{}{path}", management_url(node));
            // Bounded: a paused node accepts the request and never answers it.
            let request = self.http.get(&url).timeout(Duration::from_secs(2));
            let Ok(answer) = request.send().await else {
                continue;
            };
            if let Ok(body) = answer.json::<serde_json::Value>().await {
                return Some(body);
            }
        }
        None
    }

    /// Sends `signal` to node `node`'s Erlang VM (SIGKILL: the machine gone; SIGSTOP: cut
    /// off, as its peers see it, until SIGCONT).
    pub async fn signal_node(&self, node: u8, signal: Signal) -> anyhow::Result<()> {
        let pid: i32 = script(&["rabbit-pid", &node.to_string()])
            .await?
            .trim()
            .parse()
            .context("the node's pid file")?;
        kill(Pid::from_raw(pid), signal).with_context(|| format!("{signal} node {node}"))
    }

    /// Starts node `node` again (it rejoins the cluster from its own data).
    pub async fn start_node(&self, node: u8) -> anyhow::Result<()> {
        script(&["rabbit-start", &node.to_string()]).await.map(drop)
    }

    /// Stops node `node` cleanly (as a rolling restart does).
    pub async fn stop_node(&self, node: u8) -> anyhow::Result<()> {
        script(&["rabbit-stop", &node.to_string()]).await.map(drop)
    }

    /// kill -9 of every process of the PostgreSQL node on `port`.
    pub async fn kill_database(&self, port: u16) -> anyhow::Result<()> {
        script(&["pg-kill", &port.to_string()]).await.map(drop)
    }

    /// Promotes the standby on `port` and moves the database's address to it.
    pub async fn fail_over_to(&self, port: u16) -> anyhow::Result<()> {
        script(&["pg-promote", &port.to_string()]).await?;
        self.rw.point_to(format!("127.0.0.1:{port}").parse()?);
        Ok(())
    }
}

/// The port of the PostgreSQL node that is the primary, if one is.
pub async fn pg_primary() -> anyhow::Result<Option<u16>> {
    let out = script(&["pg-primary"]).await?;
    Ok(out.trim().parse().ok())
}

/// The port of the standby of the current primary.
pub async fn pg_standby() -> anyhow::Result<u16> {
    script(&["pg-standby"])
        .await?
        .trim()
        .parse()
        .context("the pair has no standby")
}

/// The longest a call of the services script may take (`up` may re-make a standby).
const SCRIPT_WITHIN: Duration = Duration::from_secs(300);

/// Runs `scripts/cluster-services.sh` with `args`; its standard output.
async fn script(args: &[&str]) -> anyhow::Result<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster-services.sh");
    let run = tokio::process::Command::new(&path)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(SCRIPT_WITHIN, run)
        .await
        .with_context(|| {
            format!(
                "{} {} took over {SCRIPT_WITHIN:?}",
                path.display(),
                args.join(" ")
            )
        })?
        .with_context(|| format!("run {}", path.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} {} failed: {}",
        path.display(),
        args.join(" "),
        out.status
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_and_addresses() {
        assert_eq!(node_of("conveyor-2@localhost"), Some(2));
        assert_eq!(node_of("rabbit@localhost"), None);
        assert!(amqp_url(3).contains("127.0.0.1:5683/"));
        assert!(management_url(1).ends_with(":15681"));
    }
}
