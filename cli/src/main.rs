//! `conveyorctl`: submit, find, follow and fix tasks through the gateway's API; the
//! administrator's commands (grants, migrations, audit queries, the remediation queue)
//! against the broker and the database directly.

mod adopt;
mod gateway;
mod grant;
mod output;
mod redrive;
mod tasks;

use anyhow::{bail, Context};
use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand};
use conveyor_core::amqp::Publisher;
use conveyor_core::config::{AmqpArgs, DatabaseArgs, Secret};
use conveyor_core::db::Db;
use conveyor_core::tls::CaArgs;
use conveyor_operator::rabbitmq::ManagementArgs;
use output::Format;
use uuid::Uuid;

#[derive(Debug, Parser)]
#[command(
    name = "conveyorctl",
    version,
    about = "Command-line client for Conveyor"
)]
struct Cli {
    /// Gateway base URL.
    #[arg(
        long,
        global = true,
        env = "CONVEYOR_GATEWAY_URL",
        default_value = "https://127.0.0.1:8080"
    )]
    gateway: String,
    /// Bearer token for the gateway (never printed).
    #[arg(long, global = true, env = "CONVEYOR_TOKEN", hide_env_values = true)]
    token: Option<Secret<String>>,
    /// The namespace (tenant) of the task type: sent to the gateway, and part of the type's
    /// key (`<namespace>.<type>`) for the commands that go to the database and broker. Leave
    /// it out for task types from a file (tenant `default`).
    #[arg(long, short = 'n', global = true, env = "CONVEYOR_NAMESPACE")]
    namespace: Option<String>,
    /// How read commands print: table, wide (nothing shortened), json or yaml.
    #[arg(long, short = 'o', global = true, value_enum, default_value = "table")]
    output: Format,
    #[command(flatten)]
    ca: CaArgs,
    #[command(subcommand)]
    command: Command,
}

/// The database and broker, for the commands that work on them directly.
pub struct Direct {
    pub db: Db,
    pub amqp_url: String,
    pub publisher: Publisher,
}

impl Direct {
    fn connect(database: &DatabaseArgs, amqp: &AmqpArgs) -> anyhow::Result<Direct> {
        Ok(Direct {
            db: Db::connect(&database.options())?,
            amqp_url: amqp.connection_url(),
            publisher: Publisher::with_channels(
                amqp.connection_url(),
                "conveyorctl",
                amqp.confirm_timeout(),
                amqp.publish_channels.into(),
            ),
        })
    }
}

impl Cli {
    /// --namespace, which this command needs: `what` says what it is for.
    fn namespace(&self, what: &str) -> anyhow::Result<&str> {
        match &self.namespace {
            Some(namespace) => Ok(namespace),
            None => bail!("give --namespace: {what}"),
        }
    }

    /// The database, the broker and its management API, as their administrator: what
    /// `grant` and `revoke` work with.
    fn administer(
        &self,
        database: &DatabaseArgs,
        amqp: &AmqpArgs,
        management: &ManagementArgs,
    ) -> anyhow::Result<(Direct, conveyor_operator::rabbitmq::ManagementApi)> {
        let direct = Direct::connect(database, amqp)?;
        let roots = self.ca.roots()?;
        let api = management.api(&grant::vhost_of(&amqp.connection_url())?, &roots)?;
        Ok((direct, api))
    }

    /// The gateway's API with this invocation's token and CA.
    fn gateway(&self) -> anyhow::Result<gateway::Gateway> {
        Ok(gateway::Gateway {
            http: http(self)?,
            base: self.gateway.trim_end_matches('/').to_owned(),
        })
    }

    /// What the type's queues and rows are keyed by (`NamedTaskType::name`).
    fn type_key(&self, task_type: &str) -> String {
        match &self.namespace {
            Some(namespace) => format!("{namespace}.{task_type}"),
            None => task_type.to_owned(),
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Submit one task.
    Submit {
        /// Task type.
        #[arg(long = "type")]
        task_type: String,
        /// JSON payload.
        #[arg(long, default_value = "{}")]
        payload: String,
        /// Idempotency key (UUID); the same key twice gives the same task.
        #[arg(long)]
        idempotency_key: Option<Uuid>,
        /// A label, `key=value`; repeat for more (`-l pipeline=vod -l asset=a17`).
        #[arg(long = "label", short = 'l', value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// List your tasks, newest first: by type, state, labels and age.
    List(tasks::ListArgs),
    /// Show a task's current record.
    Get { id: Uuid },
    /// Show a task's audit timeline.
    Events { id: Uuid },
    /// Wait until tasks settle; fails unless every one COMPLETED.
    Wait {
        #[arg(required = true)]
        ids: Vec<Uuid>,
        /// Longest to wait: `30s`, `10m`, `2h`.
        #[arg(long, default_value = "10m", value_parser = parse_timeout)]
        timeout: std::time::Duration,
    },
    /// Print a task's transitions as they happen, until it settles.
    Watch { id: Uuid },
    /// Send DEAD_LETTER tasks back to work with a fresh retry budget.
    Retry {
        #[arg(required = true)]
        ids: Vec<Uuid>,
    },
    /// Cancel tasks that are still waiting (INGESTED or QUEUED): they never run.
    Cancel {
        #[arg(required = true)]
        ids: Vec<Uuid>,
    },
    /// Send a type's dead letters back to work, those the selector picks, over the API.
    Redrive {
        #[arg(long = "type")]
        task_type: String,
        /// Label selector: only these dead letters.
        #[arg(long, short = 'l')]
        selector: Option<String>,
        /// Most tasks to redrive.
        #[arg(long, default_value_t = 10_000)]
        limit: u64,
    },
    /// Print shell completions: `conveyorctl completions bash > /etc/bash_completion.d/conveyorctl`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Administrators: move a type's remediation queue back to its work queue, straight on
    /// the broker and database (the API's `redrive` works from the rows instead). Drops
    /// copies already superseded.
    RedriveQueue {
        #[arg(long = "type")]
        task_type: String,
        /// Most messages to move.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Who redrives, for the audit log.
        #[arg(long, env = "USER", default_value = "conveyorctl")]
        by: String,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        amqp: AmqpArgs,
    },
    /// Move a task type from before tenancy (queues `conveyor.<type>`, rows of tenant
    /// `default`) into the namespace of its TaskType (--namespace): rows, waiting and
    /// dead-lettered tasks, then the old queues are deleted. Apply the TaskType first.
    Adopt {
        #[arg(long = "type")]
        task_type: String,
        /// Who adopts, for the audit log.
        #[arg(long, env = "USER", default_value = "conveyorctl")]
        by: String,
        /// Tasks read and re-published at a time.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        page_size: i64,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        amqp: AmqpArgs,
    },
    /// Least-privilege credentials for the workers of --namespace: a database role that sees
    /// only its rows and a broker user that reads only its queues. Prints the
    /// `conveyor-connections` Secret for them: `conveyorctl -n NS grant | kubectl apply -f -`.
    /// With --component, the credentials of the gateway or the operator instead, as the
    /// Secret its Deployment reads in --namespace (default conveyor-system).
    Grant {
        /// Name of the Secret printed (default: conveyor-connections, the operator's
        /// --connection-secret; conveyor-<component>-connections with --component).
        #[arg(long)]
        secret: Option<String>,
        /// Credentials for a component that serves every tenant, not a namespace's workers.
        #[arg(long, value_enum, conflicts_with = "worker_ca")]
        component: Option<grant::Component>,
        /// The component's role and user name (default conveyor_gateway or
        /// conveyor_operator): one per Conveyor sharing a database server or broker.
        #[arg(long, requires = "component")]
        role: Option<String>,
        /// PEM CA that signed the database's and broker's certificates, for the pods: put in
        /// the Secret as `ca.crt`, which the operator mounts, and named by the URLs.
        #[arg(long)]
        worker_ca: Option<std::path::PathBuf>,
        #[command(flatten)]
        management: ManagementArgs,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        amqp: AmqpArgs,
    },
    /// Withdraws the credentials `grant` made for --namespace: its database role and its
    /// broker user (the broker disconnects workers still running with them; their database
    /// sessions may do nothing more).
    Revoke {
        #[command(flatten)]
        management: ManagementArgs,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        amqp: AmqpArgs,
    },
    /// Applies the database migrations this build holds, as the tables' owner (the gateway
    /// does it at start unless its role owns nothing: --no-migrate).
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Point in time: the state of tasks at a timestamp, rebuilt from the audit log.
    StateAt {
        /// RFC 3339 timestamp, e.g. 2026-11-29T14:05:00Z.
        #[arg(long)]
        at: DateTime<Utc>,
        /// Every task of this type (prints counts per state).
        #[arg(long = "type", conflicts_with = "id")]
        task_type: Option<String>,
        /// One task.
        #[arg(long)]
        id: Option<Uuid>,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Audit-log retention: drop daily partitions older than --keep-days.
    Retention {
        #[arg(long)]
        keep_days: i32,
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(&cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("conveyorctl: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: &Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Submit {
            task_type,
            payload,
            idempotency_key,
            labels,
        } => {
            let labels: std::collections::BTreeMap<&str, &str> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let payload: serde_json::Value =
                serde_json::from_str(payload).context("--payload is not JSON")?;
            let mut request =
                http(cli)?
                    .post(format!("{}/v1/tasks", cli.gateway))
                    .json(&serde_json::json!({
                        "taskType": task_type,
                        "namespace": cli.namespace,
                        "labels": labels,
                        "payload": payload,
                    }));
            if let Some(key) = idempotency_key {
                request = request.header("Idempotency-Key", key.to_string());
            }
            // The answer as JSON (YAML with -o yaml), as scripts have always read it.
            let body = checked(request.send().await?).await?;
            output::print_data(cli.output, &body)?;
        }
        Command::List(args) => {
            tasks::list(&cli.gateway()?, cli.namespace.as_deref(), args, cli.output).await?
        }
        Command::Get { id } => tasks::get(&cli.gateway()?, *id, cli.output).await?,
        Command::Events { id } => tasks::events(&cli.gateway()?, *id, cli.output).await?,
        Command::Wait { ids, timeout } => {
            tasks::wait(&cli.gateway()?, ids, *timeout, cli.output).await?
        }
        Command::Watch { id } => tasks::watch(&cli.gateway()?, *id, cli.output).await?,
        Command::Retry { ids } => tasks::act(&cli.gateway()?, "retry", ids).await?,
        Command::Cancel { ids } => tasks::act(&cli.gateway()?, "cancel", ids).await?,
        Command::Redrive {
            task_type,
            selector,
            limit,
        } => {
            let namespace = cli.namespace.as_deref();
            tasks::redrive(
                &cli.gateway()?,
                namespace,
                task_type,
                selector.as_deref(),
                *limit,
            )
            .await?
        }
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut command, "conveyorctl", &mut std::io::stdout());
        }
        Command::RedriveQueue {
            task_type,
            limit,
            by,
            database,
            amqp,
        } => {
            let direct = Direct::connect(database, amqp)?;
            let report = redrive::redrive(&direct, &cli.type_key(task_type), *limit, by).await?;
            println!(
                "redriven: {}  returned (still waiting): {}  stale messages dropped: {}  kept parked: {}  \
                 naming another type's task, dropped: {}",
                report.redriven, report.returned, report.stale, report.kept, report.foreign
            );
        }
        Command::Adopt {
            task_type,
            by,
            page_size,
            database,
            amqp,
        } => {
            let namespace = cli.namespace("the namespace of the TaskType that adopts it")?;
            let direct = Direct::connect(database, amqp)?;
            let report = adopt::adopt(&direct, task_type, namespace, by, *page_size).await?;
            println!(
                "rows moved: {}  waiting tasks re-published: {}  dead-lettered tasks parked again: {}",
                report.moved, report.requeued, report.parked
            );
        }
        Command::Grant {
            secret,
            component: Some(component),
            role,
            management,
            database,
            amqp,
            ..
        } => {
            let namespace = cli.namespace.as_deref().unwrap_or("conveyor-system");
            let (direct, api) = cli.administer(database, amqp, management)?;
            let entries = grant::grant_component(
                *component,
                role.as_deref().unwrap_or(component.default_role()),
                &direct,
                &api,
                &management.management_url,
                &database.options().url,
            )
            .await?;
            let secret = secret.as_deref().unwrap_or(component.secret());
            print!("{}", grant::secret_yaml_of(namespace, secret, &entries));
        }
        Command::Grant {
            secret,
            component: None,
            worker_ca,
            management,
            database,
            amqp,
            ..
        } => {
            let namespace = cli.namespace("the namespace whose workers get the credentials")?;
            let (direct, management) = cli.administer(database, amqp, management)?;
            let mut granted =
                grant::grant(&direct, &management, &database.options().url, namespace).await?;
            if let Some(path) = worker_ca {
                let pem = conveyor_core::tls::read_ca(path)?;
                granted = grant::with_pod_ca(granted, pem)?;
            }
            let secret = secret.as_deref().unwrap_or("conveyor-connections");
            print!("{}", grant::secret_yaml(namespace, secret, &granted));
        }
        Command::Revoke {
            management,
            database,
            amqp,
        } => {
            let namespace = cli.namespace("the namespace whose credentials are withdrawn")?;
            let (direct, management) = cli.administer(database, amqp, management)?;
            let existed = grant::revoke(&direct, &management, namespace).await?;
            println!(
                "namespace {namespace}: {}",
                if existed {
                    "database role and broker user removed"
                } else {
                    "no database role (broker user removed if there was one)"
                }
            );
        }
        Command::Migrate { database } => {
            let db = Db::connect(&database.options())?;
            db.migrate()
                .await
                .context("migrating the task database (as the tables' owner)")?;
            println!("the task database holds every migration of this build");
        }
        Command::StateAt {
            at,
            task_type,
            id,
            database,
        } => {
            if task_type.is_none() && id.is_none() {
                bail!("give --type or --id");
            }
            let db = Db::connect(&database.options())?;
            let key = task_type.as_deref().map(|t| cli.type_key(t));
            let states = db.states_at(*at, key.as_deref(), *id).await?;
            if !cli.output.is_table() {
                let tasks: Vec<serde_json::Value> = states
                    .iter()
                    .map(|(id, state, since)| {
                        serde_json::json!({"id": id, "state": state, "since": since})
                    })
                    .collect();
                output::print_data(cli.output, &serde_json::json!({ "at": at, "tasks": tasks }))?;
            } else if id.is_some() {
                for (id, state, since) in &states {
                    println!("{id}  {state}  since {}", since.to_rfc3339());
                }
                if states.is_empty() {
                    println!("the task did not exist at {}", at.to_rfc3339());
                }
            } else {
                let mut counts = std::collections::BTreeMap::new();
                for (_, state, _) in &states {
                    *counts.entry(state.as_str()).or_insert(0u64) += 1;
                }
                println!("{:<14} {:>10}", "STATE", "TASKS");
                for (state, n) in counts {
                    println!("{state:<14} {n:>10}");
                }
            }
        }
        Command::Retention {
            keep_days,
            database,
        } => {
            let db = Db::connect(&database.options())?;
            db.ensure_partitions().await?;
            let dropped = db.drop_partitions(*keep_days).await?;
            println!(
                "dropped {} partition(s): {}",
                dropped.len(),
                dropped.join(", ")
            );
        }
    }
    Ok(())
}

fn http(cli: &Cli) -> anyhow::Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(token) = &cli.token {
        let value = format!("Bearer {}", token.expose());
        let mut value = reqwest::header::HeaderValue::from_str(&value).context("token")?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    Ok(cli
        .ca
        .roots()?
        .client_builder()
        .default_headers(headers)
        .build()?)
}

async fn checked(response: reqwest::Response) -> anyhow::Result<serde_json::Value> {
    let status = response.status();
    let body: serde_json::Value = response
        .json()
        .await
        .context("gateway answer is not JSON")?;
    if !status.is_success() {
        bail!(
            "{status}: {} ({})",
            body["error"]["message"].as_str().unwrap_or("error"),
            body["error"]["code"].as_str().unwrap_or("?")
        );
    }
    Ok(body)
}

/// `key=value` (the gateway checks the key and value themselves).
fn parse_label(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{text:?}: a label is key=value"))
}

/// `30s`, `10m`, `2h`: how long `wait` waits (the units of `list --since`).
fn parse_timeout(text: &str) -> Result<std::time::Duration, String> {
    tasks::parse_age(text)?
        .to_std()
        .map_err(|_| format!("{text:?}: a timeout is not negative"))
}

#[cfg(test)]
mod tests {
    use super::Cli;

    /// The completion scripts name every command and the values of `-o`, for each shell.
    #[test]
    fn completions_name_the_commands_and_output_formats() {
        let mut command = <Cli as clap::CommandFactory>::command();
        command.clone().debug_assert();
        for shell in [clap_complete::Shell::Bash, clap_complete::Shell::Zsh] {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut command, "conveyorctl", &mut script);
            let script = String::from_utf8(script).expect("utf-8");
            for word in [
                "list", "get", "events", "wait", "watch", "retry", "cancel", "redrive",
            ] {
                assert!(script.contains(word), "{shell}: no {word}");
            }
            for format in ["table", "json", "yaml", "wide"] {
                assert!(script.contains(format), "{shell}: no -o {format}");
            }
        }
    }
}
