//! Faults of the replicated services (`replicated.rs`), on this machine's processes: a
//! RabbitMQ node lost, cut off or restarted under load, and a PostgreSQL primary replaced
//! by its standby. The system under test rides them out through its clients alone: every
//! node's address for the broker, one moving address for the database.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use conveyor_core::amqp::QueueNames;
use nix::sys::signal::Signal;

use crate::observe::{self, Observer, SAMPLE_EVERY};
use crate::replicated::{self, NODES};
use crate::scenarios::{Scale, Scenario};
use crate::system::System;

/// Longest wait for the cluster to heal (a leader elected, a node back with its members).
const HEAL_WITHIN: Duration = Duration::from_secs(120);
/// How long the HA manager takes to notice a dead primary and promote the standby
/// (CloudNativePG and Patroni take seconds: probes, then a leader key's expiry).
const PROMOTE_AFTER: Duration = Duration::from_secs(5);

/// Injects `scenario`'s fault; returns the moment the recovery time counts from (the fault
/// itself: nothing here waits for a human to heal anything) and what went wrong.
pub async fn inject(
    scenario: Scenario,
    system: &System,
    scale: &Scale,
    observer: &mut Observer,
    notes: &mut Vec<String>,
) -> anyhow::Result<(Instant, Vec<String>)> {
    let replicated = system
        .replicated
        .as_ref()
        .context("this scenario runs against the replicated services")?;
    let queue = QueueNames::of(&system.task_type).main;
    let mut failures = Vec::new();
    if scenario != Scenario::PostgresFailover {
        // The work queue has a member on every node before anything is broken.
        let whole = until(observer, system, HEAL_WITHIN, || async {
            replicated
                .quorum(&queue)
                .await
                .is_some_and(|(_, online)| online == NODES.len())
        })
        .await;
        if !whole {
            failures.push(format!(
                "the work queue never had {} members online before the fault",
                NODES.len()
            ));
        }
    }
    let mut from = Instant::now();
    match scenario {
        Scenario::RabbitmqLeaderKill | Scenario::RabbitmqNodePause => {
            let kill = scenario == Scenario::RabbitmqLeaderKill;
            let (signal, what) = match kill {
                true => (Signal::SIGKILL, "died"),
                false => (Signal::SIGSTOP, "was cut off"),
            };
            let (leader, _) = replicated
                .quorum(&queue)
                .await
                .context("the work queue's leader")?;
            let clients = replicated.connections_on(leader).await;
            replicated.signal_node(leader, signal).await?;
            eprintln!("chaos: node {leader}, the work queue's leader, {what}");
            // Clients start at a random node: say whether any had to move.
            notes.push(match clients {
                Some(n) => format!("{n} client connections were on node {leader}"),
                None => format!("client connections on node {leader} unknown"),
            });
            let elected = until(observer, system, HEAL_WITHIN, || async {
                replicated
                    .quorum(&queue)
                    .await
                    .is_some_and(|(now, _)| now != leader)
            })
            .await;
            report_election(elected, from, leader, what, &mut failures, notes);
            if kill {
                observe_for(observer, system, Duration::from_secs(5)).await;
                while_sampling(observer, system, replicated.start_node(leader)).await?;
            } else {
                // Cut off past the peers' tick time either way, so that they count it gone.
                observe_for(observer, system, scale.outage.max(Duration::from_secs(20))).await;
                replicated.signal_node(leader, Signal::SIGCONT).await?;
            }
            failures.extend(rejoined(observer, system, &queue, leader).await);
        }
        Scenario::RabbitmqRollingRestart => {
            let mut stops = Vec::new();
            for node in NODES {
                from = Instant::now();
                stops.push((node, from));
                eprintln!("chaos: restarting node {node}");
                while_sampling(observer, system, replicated.stop_node(node)).await?;
                while_sampling(observer, system, replicated.start_node(node)).await?;
                failures.extend(rejoined(observer, system, &queue, node).await);
            }
            // The last node's recovery is the report's; the earlier ones' are notes.
            for (node, stopped) in &stops[..stops.len() - 1] {
                let seconds = observer.recovery(*stopped, *stopped);
                notes.push(format!("recovery after node {node}'s stop {seconds:.1} s"));
            }
        }
        Scenario::PostgresFailover => {
            let primary = replicated::pg_primary()
                .await?
                .context("the pair's primary")?;
            let standby = replicated::pg_standby().await?;
            replicated.kill_database(primary).await?;
            eprintln!("chaos: killed the primary on {primary}; promoting {standby}");
            observe_for(observer, system, PROMOTE_AFTER).await;
            while_sampling(observer, system, replicated.fail_over_to(standby)).await?;
        }
        _ => anyhow::bail!(
            "{} runs on the single services (faults.rs)",
            scenario.name()
        ),
    }
    Ok((from, failures))
}

/// Says how long the quorum took to elect a leader elsewhere, or that it did not.
fn report_election(
    elected: bool,
    fault: Instant,
    leader: u8,
    what: &str,
    failures: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    if elected {
        let note = format!(
            "a new leader seen {:.1} s after node {leader} {what}",
            fault.elapsed().as_secs_f64()
        );
        eprintln!("chaos: {note}");
        notes.push(note);
    } else {
        failures.push(format!("no new leader after node {leader} {what}"));
    }
}

/// Waits (sampling) until node `node` is back and `queue` has all its members online.
async fn rejoined(
    observer: &mut Observer,
    system: &System,
    queue: &str,
    node: u8,
) -> Option<String> {
    let replicated = system.replicated.as_ref()?;
    let whole = until(observer, system, HEAL_WITHIN, || async {
        replicated
            .quorum(queue)
            .await
            .is_some_and(|(_, online)| online == NODES.len())
    })
    .await;
    (!whole).then(|| format!("node {node} did not rejoin the work queue's quorum"))
}

/// Samples until `check` holds (checked every sample) or `within` passes; whether it held.
async fn until<F, Fut>(observer: &mut Observer, system: &System, within: Duration, check: F) -> bool
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        observer.sample_system(system).await;
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    false
}

/// Runs `work` (a script that takes seconds) while sampling.
async fn while_sampling<T>(
    observer: &mut Observer,
    system: &System,
    work: impl Future<Output = T>,
) -> T {
    observe::sampling(work, async || observer.sample_system(system).await).await
}

/// Samples for `how_long`.
async fn observe_for(observer: &mut Observer, system: &System, how_long: Duration) {
    until(observer, system, how_long, || async { false }).await;
}
