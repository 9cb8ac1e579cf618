//! RabbitMQ's management API: policies (settings that may change after a queue exists) and
//! queue depths. Queue declaration itself goes over AMQP (`conveyor_core::amqp`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use conveyor_core::amqp::QueueNames;
use conveyor_core::crd::task_type::QueueDepths;
pub use conveyor_core::policies::{
    shared_policies, task_type_policies, task_type_policy_names, Policy,
};
use conveyor_core::task_type::{NamedTaskType, MAX_RETRY_TIERS};
use conveyor_core::tls::TrustedRoots;

mod error;
mod queues;

pub use error::ManagementError;
pub use queues::{
    consumers_in, depths_in, rates_in, ExchangePage, QueueInfo, QueuePage, Queues, Rates,
    LIST_ATTEMPTS, LIST_PAGE,
};

/// Where the management API is and who talks to it: the same flags for the operator and
/// `conveyorctl grant`.
#[derive(Debug, Clone, clap::Args)]
pub struct ManagementArgs {
    /// RabbitMQ management API base URL.
    #[arg(
        long,
        env = "CONVEYOR_RABBITMQ_MANAGEMENT_URL",
        default_value = "https://127.0.0.1:15671"
    )]
    pub management_url: String,
    #[arg(long, env = "CONVEYOR_RABBITMQ_USER", default_value = "conveyor")]
    pub management_user: String,
    #[arg(
        long,
        env = "CONVEYOR_RABBITMQ_PASSWORD",
        default_value = "conveyor",
        hide_env_values = true
    )]
    pub management_password: conveyor_core::config::Secret<String>,
}

impl ManagementArgs {
    /// A client for `vhost` that trusts `roots` (the binary's --ca-file).
    pub fn api(&self, vhost: &str, roots: &TrustedRoots) -> Result<ManagementApi, ManagementError> {
        ManagementApi::new(
            &self.management_url,
            &self.management_user,
            self.management_password.expose(),
            vhost,
            roots,
        )
    }
}

/// A client of the management API for one vhost.
#[derive(Clone)]
pub struct ManagementApi {
    base: String,
    user: String,
    password: String,
    vhost: String,
    http: reqwest::Client,
    /// Counts every request sent (the operator's `operator_broker_requests_total`).
    sent: Option<prometheus::IntCounter>,
}

impl ManagementApi {
    /// `base` like `https://127.0.0.1:15671`; an HTTPS server is verified against the
    /// public roots and `roots`.
    pub fn new(
        base: &str,
        user: &str,
        password: &str,
        vhost: &str,
        roots: &TrustedRoots,
    ) -> Result<Self, ManagementError> {
        Ok(ManagementApi {
            base: base.trim_end_matches('/').to_owned(),
            user: user.to_owned(),
            password: password.to_owned(),
            vhost: vhost.to_owned(),
            http: roots
                .client_builder()
                .timeout(Duration::from_secs(10))
                .build()
                .map_err(|err| ManagementError::Client(Arc::new(err)))?,
            sent: None,
        })
    }

    /// Counts each request this client sends on `counter`.
    pub fn counted(mut self, counter: prometheus::IntCounter) -> Self {
        self.sent = Some(counter);
        self
    }

    fn unreachable(&self, err: reqwest::Error) -> ManagementError {
        let (url, source) = (self.base.clone(), Arc::new(err));
        if conveyor_core::refused_certificate(source.as_ref()) {
            ManagementError::Certificate { url, source }
        } else {
            ManagementError::Unreachable { url, source }
        }
    }

    fn url(&self, path: &str, name: &str) -> String {
        format!(
            "{}/api/{path}/{}/{}",
            self.base,
            encode(&self.vhost),
            encode(name)
        )
    }

    async fn send(
        &self,
        what: String,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, ManagementError> {
        if let Some(sent) = &self.sent {
            sent.inc();
        }
        let response = request
            .basic_auth(&self.user, Some(&self.password))
            .send()
            .await
            .map_err(|err| self.unreachable(err))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = response.text().await.unwrap_or_default();
        Err(ManagementError::Refused {
            what,
            status: status.as_u16(),
            body,
        })
    }

    /// Creates or replaces a policy (idempotent).
    pub async fn put_policy(&self, policy: &Policy) -> Result<(), ManagementError> {
        let url = self.url("policies", &policy.name);
        self.send(
            format!("policy {}", policy.name),
            self.http.put(url).json(policy),
        )
        .await
        .map(drop)
    }

    /// Puts a policy unless the broker has it as it is: a write makes RabbitMQ re-match
    /// every queue of the vhost (seconds with thousands), a read does not. True if written.
    pub async fn ensure_policy(&self, policy: &Policy) -> Result<bool, ManagementError> {
        let url = self.url("policies", &policy.name);
        let current = match self
            .send(format!("policy {}", policy.name), self.http.get(url))
            .await
        {
            Ok(response) => response.json::<serde_json::Value>().await.ok(),
            Err(ManagementError::Refused { status: 404, .. }) => None,
            Err(err) => return Err(err),
        };
        let wanted = serde_json::to_value(policy).unwrap_or_default();
        let same = current.is_some_and(|current| {
            ["pattern", "apply-to", "priority", "definition"]
                .iter()
                .all(|key| current[key] == wanted[key])
        });
        if same {
            return Ok(false);
        }
        self.put_policy(policy).await.map(|()| true)
    }

    /// A type's policies: the shared ones, and its own where its settings differ; an own
    /// policy left from other settings (or an older operator) goes, as a shared one then
    /// applies.
    pub async fn put_task_type_policies(
        &self,
        spec: &NamedTaskType,
    ) -> Result<(), ManagementError> {
        let own = task_type_policies(spec);
        for policy in shared_policies().iter().chain(&own) {
            self.ensure_policy(policy).await?;
        }
        for name in task_type_policy_names(spec) {
            if !own.iter().any(|p| p.name == name) {
                // A missing policy answers 404 at once; only an existing one costs a re-match.
                self.delete_policy(&name).await?;
            }
        }
        Ok(())
    }

    /// Creates a broker user or gives it a new password. `tags` name what it may do in the
    /// management API: none (`""`) keeps it out; `policymaker` lets it set policies.
    pub async fn put_user(
        &self,
        user: &str,
        password: &str,
        tags: &str,
    ) -> Result<(), ManagementError> {
        let url = format!("{}/api/users/{}", self.base, encode(user));
        let body = serde_json::json!({ "password": password, "tags": tags });
        self.send(format!("user {user}"), self.http.put(url).json(&body))
            .await
            .map(drop)
    }

    /// Deletes a broker user (its connections are closed by the broker); a missing one is
    /// fine.
    pub async fn delete_user(&self, user: &str) -> Result<(), ManagementError> {
        let url = format!("{}/api/users/{}", self.base, encode(user));
        match self
            .send(format!("delete user {user}"), self.http.delete(url))
            .await
        {
            Err(ManagementError::Refused { status: 404, .. }) | Ok(_) => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// What `user` may do in this vhost: regular expressions over resource names for
    /// configure (declare, delete), write (publish to an exchange) and read (consume).
    pub async fn put_permissions(
        &self,
        user: &str,
        configure: &str,
        write: &str,
        read: &str,
    ) -> Result<(), ManagementError> {
        let url = format!(
            "{}/api/permissions/{}/{}",
            self.base,
            encode(&self.vhost),
            encode(user)
        );
        let body = serde_json::json!({ "configure": configure, "write": write, "read": read });
        self.send(
            format!("permissions of {user}"),
            self.http.put(url).json(&body),
        )
        .await
        .map(drop)
    }

    /// Deletes a policy; a missing one is fine.
    pub async fn delete_policy(&self, name: &str) -> Result<(), ManagementError> {
        self.delete("policies", name).await
    }

    /// Deletes a queue and its messages; a missing one is fine.
    pub async fn delete_queue(&self, queue: &str) -> Result<(), ManagementError> {
        self.delete("queues", queue).await
    }

    /// Deletes an exchange; a missing one is fine.
    pub async fn delete_exchange(&self, exchange: &str) -> Result<(), ManagementError> {
        self.delete("exchanges", exchange).await
    }

    /// Deletes a queue only while it holds no messages: `false` when it holds some and
    /// stays. A missing one counts as deleted. Quorum queues refuse `if-empty`, so this reads
    /// the count first: a message published in between is lost with the queue, and the
    /// sweeper re-publishes its task (decision 0011).
    pub async fn delete_queue_if_empty(&self, queue: &str) -> Result<bool, ManagementError> {
        match self.queue(queue).await {
            // Unknown counts as not empty: the queue stays until a count says otherwise.
            Ok(info) if info.messages.is_none_or(|m| m > 0) => Ok(false),
            Ok(_) => self.delete_queue(queue).await.map(|()| true),
            Err(ManagementError::Refused { status: 404, .. }) => Ok(true),
            Err(err) => Err(err),
        }
    }

    async fn delete(&self, kind: &str, name: &str) -> Result<(), ManagementError> {
        let request = self.http.delete(self.url(kind, name));
        match self.send(format!("delete {kind} {name}"), request).await {
            Err(ManagementError::Refused { status: 404, .. }) | Ok(_) => Ok(()),
            Err(err) => Err(err),
        }
    }

    async fn queue(&self, queue: &str) -> Result<QueueInfo, ManagementError> {
        let url = self.url("queues", queue);
        let response = self
            .send(format!("queue {queue}"), self.http.get(url))
            .await?;
        response.json().await.map_err(|err| self.unreachable(err))
    }

    /// The policy definition RabbitMQ applies to a queue now.
    pub async fn effective_policy(
        &self,
        queue: &str,
    ) -> Result<serde_json::Value, ManagementError> {
        Ok(self
            .queue(queue)
            .await?
            .effective_policy_definition
            .unwrap_or_default())
    }

    /// Every queue of the vhost, with only the counters the operator reads: what the shared
    /// poller ([`crate::broker_stats`]) fetches instead of four requests per type per
    /// reconcile. Page by page ([`LIST_PAGE`] queues each): one answer for ten thousand types
    /// would be tens of megabytes, built at once by the broker and held at once here.
    ///
    /// The broker slices its sorted list afresh for each page, so a queue created or deleted
    /// meanwhile shifts the rest: one could fall between two pages and read as missing (which
    /// declares its type again), or the last page could go (400). Such a list is read again
    /// from the first page, up to [`LIST_ATTEMPTS`] times; then the last one read is kept.
    pub async fn list_queues(&self) -> Result<Queues, ManagementError> {
        let mut attempt = 1;
        loop {
            match self.list_queues_once().await {
                Ok((queues, true)) => return Ok(queues),
                Ok((queues, false)) if attempt >= LIST_ATTEMPTS => return Ok(queues),
                Err(ManagementError::Refused { status: 400, .. }) if attempt < LIST_ATTEMPTS => {}
                Err(err) => return Err(err),
                Ok(_) => {}
            }
            attempt += 1;
        }
    }

    /// One pass over the pages; whether every page counted the same queues.
    async fn list_queues_once(&self) -> Result<(Queues, bool), ManagementError> {
        let mut queues = Queues::new();
        let mut total = None;
        let mut steady = true;
        let mut page = 1;
        loop {
            let url = format!(
                "{}/api/queues/{}?page={page}&page_size={LIST_PAGE}&columns=name,messages,\
                 messages_ready,messages_unacknowledged,consumers,\
                 message_stats.ack_details.rate,message_stats.publish_details.rate",
                self.base,
                encode(&self.vhost)
            );
            let answer: QueuePage = self
                .send(format!("page {page} of the queue list"), self.http.get(url))
                .await?
                .json()
                .await
                .map_err(|err| self.unreachable(err))?;
            steady &= *total.get_or_insert(answer.total_count) == answer.total_count;
            queues.extend(answer.items.into_iter().map(|q| (q.name.clone(), q)));
            if page >= answer.page_count {
                return Ok((queues, steady));
            }
            page += 1;
        }
    }

    /// The names of the vhost's exchanges, page by page. Names only: a missing type
    /// exchange is declared again ([`crate::broker_stats`]); nothing else is read.
    pub async fn list_exchange_names(&self) -> Result<HashSet<String>, ManagementError> {
        let mut names = HashSet::new();
        let mut page = 1;
        loop {
            let url = format!(
                "{}/api/exchanges/{}?page={page}&page_size={LIST_PAGE}&columns=name",
                self.base,
                encode(&self.vhost)
            );
            let answer: ExchangePage = self
                .send(
                    format!("page {page} of the exchange list"),
                    self.http.get(url),
                )
                .await?
                .json()
                .await
                .map_err(|err| self.unreachable(err))?;
            names.extend(answer.items.into_iter().map(|e| e.name));
            if page >= answer.page_count {
                return Ok(names);
            }
            page += 1;
        }
    }

    /// Messages in each of a task type's queues, read now (one request per queue).
    pub async fn depths(&self, spec: &NamedTaskType) -> Result<QueueDepths, ManagementError> {
        let mut queues = Queues::new();
        for queue in QueueNames::of(&spec.name).all(MAX_RETRY_TIERS) {
            match self.queue(&queue).await {
                Ok(info) => {
                    queues.insert(queue, info);
                }
                Err(ManagementError::Refused { status: 404, .. }) => {}
                Err(err) => return Err(err),
            }
        }
        depths_in(&queues, spec)
    }
}

/// Percent-encoding for a path segment (vhost `/` is `%2F`).
fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_encoded_for_urls() {
        assert_eq!(encode("/"), "%2F");
    }
}
