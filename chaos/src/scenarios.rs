//! The one scenario table: every fault, what system it needs, what load it runs under and
//! how many re-runs it may cause. Adding a scenario is a variant here and its injection in
//! `faults.rs` (on this machine's processes) or `cluster.rs` (through Kubernetes); the run
//! loop (`run.rs`) is the same for both.

use std::time::Duration;

use crate::load::Plan;
use crate::oracle::Verdict;
use crate::system::Options;
use crate::telemetry::Telemetry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// 1. Workers `kill -9`ed mid-task, one after another, and replaced.
    WorkerKill,
    /// 2. A worker SIGSTOPped past the heartbeat timeout, then SIGCONTed: its late results
    ///    are fenced.
    WorkerPause,
    /// 3. A worker's broker link goes silent (no reset): heartbeats notice, tasks re-run.
    WorkerBrokerSilent,
    /// 4. The gateway's broker connection reset while it publishes, three times.
    GatewayBrokerReset,
    /// 5. RabbitMQ `kill -9`ed and restarted.
    RabbitmqKill,
    /// 6. PostgreSQL crashed (`stop -m immediate`) and down for the outage: workers go
    ///    degraded (breaker open, outcomes buffered) and replay when it returns.
    PostgresCrash,
    /// 7. The workers' PostgreSQL link slow (latency), then silent (packets dropped): the
    ///    breaker opens and half-opens, buffers and memory stay bounded.
    PostgresSlow,
    /// 8. A worker killed while its buffer holds outcomes, restarted on the same buffer.
    WorkerKillDegraded,
    /// 9. `pg_terminate_backend` of every gateway and worker session, five times.
    PostgresTerminate,
    /// 9. Worker connections reset right after they send COMMIT, again and again.
    CommitReset,
    /// 10. Poison: tasks that fail every try and tasks that crash their worker every try.
    Poison,
    /// 11. A backlog past maxQueueDepth with no workers: 429 + Retry-After, then drained.
    Backlog,
    /// 11. A RabbitMQ memory alarm: publishers blocked for the outage, then released.
    BrokerAlarm,
    /// 12. In the local cluster: worker pods deleted mid-task (drained, then forced).
    PodDelete,
    /// 12. In the local cluster: the operator killed right after a scale-up was asked for.
    OperatorRestart,
    /// 12. In the local cluster: a rolling update of the WorkerPool.
    RollingUpdate,
    /// 13. Broker-side loss: a rogue consumer hands every delivery it gets back with a
    ///     requeue, so the quorum queue's delivery limit dead-letters tasks that never
    ///     failed into remediation while the database says QUEUED.
    DeliveryLimit,
    /// 13. Broker-side loss: the work queue purged under load, twice.
    QueuePurge,
    /// 13. Broker-side loss: the work queue deleted with everything in it and re-declared.
    QueueDelete,
    /// 13. The gateway killed -9 between recording tasks and publishing them (its broker
    ///     link silent), while some clients do not retry what got no answer.
    GatewayKillUnpublished,
    /// 14. Upkeep: audit partitions made through a month of dates under load.
    PartitionsMonth,
    /// 14. Every worker process killed mid-task and none back for two heartbeat timeouts:
    ///     the gateway alone reaps their tasks.
    WorkersGone,
    /// 14. In the local cluster: every pod's worker killed mid-task (the node died) and the
    ///     WorkerPool scaled to zero before anything replaced them; the gateway's reaper
    ///     re-queues the orphans with no worker anywhere, and they run once the pool is back.
    PoolScaledToZero,
    /// 15. In the local cluster: RabbitMQ stopped under load with an autoscaled pool. The
    ///     TaskType reports RabbitMQUnavailable, the pool's MetricsAvailable goes False and
    ///     its count stays within min/max; both recover once the broker is back.
    BrokerStoppedCluster,
    /// 15. In the local cluster: a node lost under load (its kwok, its pod runner and every
    ///     worker on it killed), three times; the node controller and the eviction take
    ///     over, the pool's pods are replaced on the other nodes, the tasks re-run.
    NodeLoss,
    /// 17. A hostile tenant deletes its own exchange and queues every two seconds while it
    ///     submits to them from eight loops (`hostile.rs`).
    TenantDeletesTopology,
    /// 17. A hostile tenant opens streams on its tasks as fast as it can and lists by state
    ///     and update time from eight loops.
    TenantFloodsStreamsAndLists,
    /// 17. A hostile tenant holds eight repeatable-read transactions open on its own
    ///     database role, one with row locks on its tasks.
    TenantHoldsTransactions,
    /// 17. A hostile tenant sends payloads with NULs, nesting 100,000 deep, bodies past the
    ///     limit, broken JSON and unknown types from eight loops.
    TenantPoisonsPayloads,
    /// 16. Replicated services: the RabbitMQ node that leads the work queue `kill -9`ed
    ///     under load, then started again.
    RabbitmqLeaderKill,
    /// 16. Replicated services: the leading RabbitMQ node paused (SIGSTOP: cut off from the
    ///     other two, which elect a new leader), then resumed; it rejoins.
    RabbitmqNodePause,
    /// 16. Replicated services: each of the three RabbitMQ nodes stopped and started in turn.
    RabbitmqRollingRestart,
    /// 16. Replicated services: the PostgreSQL primary `kill -9`ed, its synchronous standby
    ///     promoted and the database's address moved to it.
    PostgresFailover,
}

/// Every scenario on the single services and the local cluster (`make chaos`).
pub const ALL: [Scenario; 29] = [
    Scenario::WorkerKill,
    Scenario::WorkerPause,
    Scenario::WorkerBrokerSilent,
    Scenario::GatewayBrokerReset,
    Scenario::RabbitmqKill,
    Scenario::PostgresCrash,
    Scenario::PostgresSlow,
    Scenario::WorkerKillDegraded,
    Scenario::PostgresTerminate,
    Scenario::CommitReset,
    Scenario::Poison,
    Scenario::Backlog,
    Scenario::BrokerAlarm,
    Scenario::PodDelete,
    Scenario::OperatorRestart,
    Scenario::RollingUpdate,
    Scenario::DeliveryLimit,
    Scenario::QueuePurge,
    Scenario::QueueDelete,
    Scenario::GatewayKillUnpublished,
    Scenario::PartitionsMonth,
    Scenario::WorkersGone,
    Scenario::PoolScaledToZero,
    Scenario::BrokerStoppedCluster,
    Scenario::NodeLoss,
    Scenario::TenantDeletesTopology,
    Scenario::TenantFloodsStreamsAndLists,
    Scenario::TenantHoldsTransactions,
    Scenario::TenantPoisonsPayloads,
];

/// The cluster-scale scenarios, on the replicated services (`make chaos-cluster`).
pub const REPLICATED: [Scenario; 4] = [
    Scenario::RabbitmqLeaderKill,
    Scenario::RabbitmqNodePause,
    Scenario::RabbitmqRollingRestart,
    Scenario::PostgresFailover,
];

/// Those that leave the shared RabbitMQ and PostgreSQL alone (fit to run in `make test`);
/// two of them lose messages on the broker side.
pub const SHORT: [Scenario; 9] = [
    Scenario::DeliveryLimit,
    Scenario::QueuePurge,
    Scenario::WorkerKill,
    Scenario::WorkerPause,
    Scenario::WorkerKillDegraded,
    Scenario::PostgresTerminate,
    Scenario::CommitReset,
    Scenario::Poison,
    Scenario::Backlog,
];

/// Every scenario, of both runs.
pub fn known() -> impl Iterator<Item = Scenario> {
    ALL.into_iter().chain(REPLICATED)
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::WorkerKill => "worker-kill",
            Scenario::WorkerPause => "worker-pause",
            Scenario::WorkerBrokerSilent => "worker-broker-silent",
            Scenario::GatewayBrokerReset => "gateway-broker-reset",
            Scenario::RabbitmqKill => "rabbitmq-kill",
            Scenario::PostgresCrash => "postgres-crash",
            Scenario::PostgresSlow => "postgres-slow",
            Scenario::WorkerKillDegraded => "worker-kill-degraded",
            Scenario::PostgresTerminate => "postgres-terminate",
            Scenario::CommitReset => "commit-reset",
            Scenario::Poison => "poison",
            Scenario::Backlog => "backlog",
            Scenario::BrokerAlarm => "broker-alarm",
            Scenario::PodDelete => "pod-delete",
            Scenario::OperatorRestart => "operator-restart",
            Scenario::RollingUpdate => "rolling-update",
            Scenario::DeliveryLimit => "delivery-limit",
            Scenario::QueuePurge => "queue-purge",
            Scenario::QueueDelete => "queue-delete",
            Scenario::GatewayKillUnpublished => "gateway-kill-unpublished",
            Scenario::PartitionsMonth => "partitions-month",
            Scenario::WorkersGone => "workers-gone",
            Scenario::PoolScaledToZero => "pool-scaled-to-zero",
            Scenario::BrokerStoppedCluster => "rabbitmq-stopped-cluster",
            Scenario::NodeLoss => "node-loss",
            Scenario::RabbitmqLeaderKill => "rabbitmq-leader-kill",
            Scenario::RabbitmqNodePause => "rabbitmq-node-pause",
            Scenario::RabbitmqRollingRestart => "rabbitmq-rolling-restart",
            Scenario::PostgresFailover => "postgres-failover",
            Scenario::TenantDeletesTopology => "tenant-deletes-topology",
            Scenario::TenantFloodsStreamsAndLists => "tenant-floods-streams-and-lists",
            Scenario::TenantHoldsTransactions => "tenant-holds-transactions",
            Scenario::TenantPoisonsPayloads => "tenant-poisons-payloads",
        }
    }

    pub fn parse(name: &str) -> Option<Scenario> {
        ALL.into_iter().chain(REPLICATED).find(|s| s.name() == name)
    }

    pub fn options(self) -> Options {
        let defaults = Options::default();
        match self {
            Scenario::WorkerBrokerSilent => Options {
                worker_broker_proxy: true,
                ..defaults
            },
            Scenario::GatewayBrokerReset | Scenario::GatewayKillUnpublished => Options {
                gateway_broker_proxy: true,
                ..defaults
            },
            Scenario::PostgresSlow | Scenario::WorkerKillDegraded | Scenario::CommitReset => {
                Options {
                    worker_database_proxy: true,
                    ..defaults
                }
            }
            Scenario::Poison => Options {
                workers: 2,
                ..defaults
            },
            Scenario::Backlog => Options {
                max_queue_depth: BACKLOG_MAX_DEPTH,
                start_workers: false,
                ..defaults
            },
            _ if self.replicated() => Options {
                replicated: true,
                ..defaults
            },
            _ if crate::hostile::is_hostile(self) => Options {
                hostile_tenant: true,
                ..defaults
            },
            _ => defaults,
        }
    }

    pub fn plan(self, scale: &Scale) -> Plan {
        let plan = Plan {
            tasks: scale.tasks,
            over: Duration::from_secs_f64((scale.tasks as f64 / 100.0).clamp(3.0, 20.0)),
            batch: crate::load::BATCH,
            sleep_ms: 100,
            poison_error_every: None,
            poison_crash: 0,
            flaky_every: None,
            give_up_after: Duration::from_secs(90) + scale.outage,
            forget_unanswered_every: None,
        };
        match self {
            Scenario::Poison => Plan {
                poison_error_every: Some(50),
                poison_crash: 2,
                ..plan
            },
            // Failures go through re-queue transactions: COMMITs to reset.
            Scenario::CommitReset => Plan {
                flaky_every: Some(3),
                ..plan
            },
            // Longer tasks: more of them in flight when the link goes or the pod dies.
            Scenario::PostgresSlow
            | Scenario::WorkerKillDegraded
            | Scenario::PodDelete
            | Scenario::WorkersGone
            | Scenario::PoolScaledToZero => Plan {
                sleep_ms: 400,
                ..plan
            },
            Scenario::GatewayKillUnpublished => Plan {
                forget_unanswered_every: Some(3),
                ..plan
            },
            // Three node losses take a minute or two each (NotReady, eviction, replacement,
            // the node back): the load runs through all of them.
            // Tasks of 2 s, so that each node holds several when it dies.
            // At least 2,500 tasks whatever the run's size (the issue asks 2,000).
            Scenario::NodeLoss => Plan {
                tasks: scale.tasks.max(2500),
                over: Duration::from_secs(300),
                sleep_ms: 2000,
                ..plan
            },
            // Long enough that the load still runs when the fault is over (a rolling restart
            // takes three nodes' restarts), with tasks long enough to be caught mid-run.
            Scenario::RabbitmqRollingRestart => Plan {
                over: Duration::from_secs(75),
                sleep_ms: 200,
                ..plan
            },
            _ if self.replicated() => Plan {
                over: Duration::from_secs(45),
                sleep_ms: 200,
                ..plan
            },
            // A steady calm load (33 requests of two tasks a second: a p99 of 500 or more
            // requests per window, not of its slowest one; the client waits for each answer,
            // so slower answers leave it twice its pause) before, through and after the
            // hostile tenant's window (`HOSTILE_WINDOW`, from a third of the way in).
            _ if crate::hostile::is_hostile(self) => Plan {
                tasks: scale.tasks.max(1500) * 2,
                over: Duration::from_secs(45),
                batch: 2,
                sleep_ms: 50,
                ..plan
            },
            _ => plan,
        }
    }
}

impl Scenario {
    /// Goes through Kubernetes (the stack of `scripts/stack.sh up`): `cluster.rs`.
    pub fn in_cluster(self) -> bool {
        matches!(
            self,
            Scenario::PodDelete
                | Scenario::OperatorRestart
                | Scenario::RollingUpdate
                | Scenario::PoolScaledToZero
                | Scenario::BrokerStoppedCluster
                | Scenario::NodeLoss
        )
    }

    /// Runs against the replicated services (`replicated.rs`, faults in `failover.rs`).
    pub fn replicated(self) -> bool {
        REPLICATED.contains(&self)
    }

    /// How many times the fault can catch tasks mid-run: re-runs are bounded by this many
    /// times the effects under way in the fault window. `None` where a fault recurs for as
    /// long as it lasts (poison, resets at every COMMIT, a slow link), or where a crash
    /// restart's back-off makes the count vary.
    /// Whether the fault keeps every worker's heartbeats from the database past the
    /// heartbeat timeout while the gateway's reaper still reaches it.
    pub fn silences_heartbeats(self) -> bool {
        matches!(
            self,
            Scenario::WorkerKillDegraded | Scenario::PostgresFailover
        )
    }

    pub fn rounds(self) -> Option<usize> {
        match self {
            Scenario::WorkerKill | Scenario::PodDelete | Scenario::RabbitmqRollingRestart => {
                Some(3)
            }
            Scenario::NodeLoss => Some(crate::node_loss::ROUNDS),
            Scenario::PostgresTerminate => Some(5),
            Scenario::Poison | Scenario::CommitReset | Scenario::PostgresSlow => None,
            _ => Some(1),
        }
    }
}

/// The backlog scenario's `maxQueueDepth`.
pub const BACKLOG_MAX_DEPTH: u64 = 100;

/// How big a run is.
#[derive(Debug, Clone)]
pub struct Scale {
    /// Tasks per scenario.
    pub tasks: usize,
    /// How long a service stays down (PostgreSQL crash, silent links).
    pub outage: Duration,
}

/// The result of one scenario.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub scenario: &'static str,
    #[serde(flatten)]
    pub verdict: Verdict,
    pub failures: Vec<String>,
    #[serde(flatten)]
    pub telemetry: Telemetry,
    /// What the fault saw on its way (timings of a failover, of a lost node's steps).
    pub notes: Vec<String>,
}
