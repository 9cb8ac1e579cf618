//! Taking tasks in: validate, record, publish with confirms, and only then answer.

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::StatusCode;
use conveyor_core::amqp::{AmqpError, Outgoing, Publisher};
use conveyor_core::db::{Db, IngestWrites, Recorded};
use conveyor_core::labels::{self, Labels};
use conveyor_core::metrics::Metrics;
use conveyor_core::task::{NewTask, Requeue, TaskMessage, TaskRecord};
use conveyor_core::trace::{SpanKind, TraceContext, Tracer};
use conveyor_core::TaskState;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::auth::Client;
use crate::backpressure::DepthMonitor;
use crate::error::{db_error, ApiError, DbWork};
use crate::rate_limit::RateLimiter;
use crate::registry::{KnownType, Registry};

/// One task as a client submits it in a batch.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Submission {
    /// The TaskType's name in its namespace.
    pub task_type: String,
    /// The TaskType's namespace; may be left out by a client of one namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    pub payload: serde_json::Value,
    /// A small string map to find the task by later (`GET /v1/tasks?labelSelector=`).
    #[serde(default)]
    #[schema(schema_with = crate::views::labels_schema)]
    pub labels: Labels,
    /// Batch entries carry their key here; single submissions use the header.
    #[serde(default)]
    pub idempotency_key: Option<Uuid>,
}

/// The answer for an accepted task.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    #[serde(skip)]
    pub status: StatusCode,
    pub id: Uuid,
    #[schema(schema_with = crate::views::task_state_schema)]
    pub state: TaskState,
    pub idempotency_key: Uuid,
}

/// Per-client limits, the same for every client.
#[derive(Debug, Clone)]
pub struct ClientLimits {
    pub per_second: f64,
    pub burst: f64,
    /// Tasks per second all the clients of one namespace may submit together (each gateway
    /// replica counts its own), and their burst.
    pub namespace_per_second: f64,
    pub namespace_burst: f64,
}

pub struct Ingestor {
    pub db: Db,
    /// Inserts and QUEUED updates, group-committed with concurrent requests.
    pub writes: IngestWrites,
    pub publisher: Arc<Publisher>,
    pub types: Arc<Registry>,
    pub limiter: RateLimiter,
    pub client_limits: ClientLimits,
    pub depths: Arc<DepthMonitor>,
    pub metrics: Metrics,
    pub tracer: Tracer,
}

impl Ingestor {
    /// Takes a request's tasks. `Err` refuses the whole request (client rate limit); otherwise
    /// each task has its own answer, in input order.
    /// `trace` is the request's span: the tasks' publish span continues it.
    pub async fn submit(
        &self,
        client: &Client,
        submissions: Vec<Submission>,
        trace: Option<TraceContext>,
    ) -> Result<Vec<Result<Accepted, ApiError>>, ApiError> {
        let limits = &self.client_limits;
        let name = &client.name;
        let n = submissions.len() as f64;
        self.limiter.take_or_refuse(
            &format!("client/{name}"),
            n,
            limits.per_second,
            limits.burst,
            || format!("client {name} is over its rate limit"),
        )?;
        if let Some(namespace) = client.namespace() {
            self.limiter.take_or_refuse(
                &format!("namespace/{namespace}"),
                n,
                limits.namespace_per_second,
                limits.namespace_burst,
                || format!("namespace {namespace} is over its rate limit (over all its clients)"),
            )?;
        }

        let mut answers: Vec<Option<Result<Accepted, ApiError>>> = Vec::new();
        let mut valid: Vec<(usize, NewTask)> = Vec::new();
        for (index, submission) in submissions.into_iter().enumerate() {
            answers.push(None);
            match self.prepare(client, submission) {
                Ok(mut task) => {
                    task.trace_id = trace.map(|t| t.trace_id());
                    valid.push((index, task))
                }
                Err(err) => answers[index] = Some(Err(err)),
            }
        }
        let new_tasks: Vec<NewTask> = valid.iter().map(|(_, t)| t.clone()).collect();
        let recorded = match new_tasks.is_empty() {
            true => Ok(Vec::new()),
            false => self.writes.record(new_tasks.clone()).await,
        };
        match recorded {
            Err(err) => {
                let api = db_error(&self.metrics, &err, DbWork::Record);
                for (index, _) in &valid {
                    answers[*index] = Some(Err(api.clone()));
                }
            }
            Ok(recorded) => {
                let outcomes = self.enqueue(&new_tasks, recorded, trace).await;
                for ((index, _), outcome) in valid.iter().zip(outcomes) {
                    answers[*index] = Some(outcome);
                }
            }
        }
        let answers: Vec<Result<Accepted, ApiError>> = answers.into_iter().flatten().collect();
        Ok(answers)
    }

    /// Checks one submission against its task type; bad input never reaches the database.
    fn prepare(&self, client: &Client, submission: Submission) -> Result<NewTask, ApiError> {
        let types = self.types.snapshot();
        let resolved = resolve(
            &types,
            client,
            &submission.task_type,
            submission.namespace.as_deref(),
        );
        let outcome = resolved
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|&known| self.check(client, known, &submission).map(|()| known));
        let known = match outcome {
            Ok(known) => known,
            Err(err) => {
                // Unknown types are labelled together so that clients cannot blow up label
                // cardinality.
                let label = resolved.map_or("unknown", |k| k.spec.name.as_str());
                self.metrics
                    .submissions
                    .with_label_values(&[label, err.code])
                    .inc();
                return Err(err);
            }
        };
        // Time-ordered: new rows go to the right edge of the id indexes, not all over them.
        let id = Uuid::now_v7();
        Ok(NewTask {
            id,
            tenant: known.spec.tenant.clone(),
            idempotency_key: submission.idempotency_key.unwrap_or(id),
            task_type: known.spec.name.clone(),
            payload: submission.payload,
            labels: submission.labels,
            trace_id: None,
        })
    }

    fn check(
        &self,
        client: &Client,
        known: &KnownType,
        submission: &Submission,
    ) -> Result<(), ApiError> {
        let spec = &known.spec;
        let shown = spec.local_name();
        labels::check(&submission.labels)
            .map_err(|e| ApiError::bad_request("invalid_labels", e.to_string()))?;
        let size = serde_json::to_vec(&submission.payload)
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        if size > spec.max_payload_bytes {
            return Err(ApiError::too_large(format!(
                "payload is {size} bytes; task type {shown} accepts at most {}",
                spec.max_payload_bytes
            )));
        }
        if let Some(at) = conveyor_core::jsonb::nul_at(&submission.payload) {
            let at = if at.is_empty() { "/".to_owned() } else { at };
            return Err(ApiError {
                path: Some(at.clone()),
                ..ApiError::bad_request(
                    "invalid_payload",
                    format!(
                        "payload holds a NUL character (\\u0000) at {at}, which the task \
                         database cannot store"
                    ),
                )
            });
        }
        if let Some(validator) = &known.validator {
            if let Err(error) = validator.validate(&submission.payload) {
                let path = error.instance_path.to_string();
                let at = if path.is_empty() { "/" } else { &path };
                return Err(ApiError {
                    path: Some(at.to_owned()),
                    ..ApiError::bad_request(
                        "invalid_payload",
                        format!("payload does not match the {shown} schema at {at}: {error}"),
                    )
                });
            }
        }
        if let Some(wait) = self.depths.over_limit(&spec.name, spec.max_queue_depth) {
            return Err(ApiError::too_many(
                "queue_full",
                format!(
                    "queue of {shown} holds more than {} tasks; retry later",
                    spec.max_queue_depth
                ),
                wait,
            ));
        }
        // Last, so that invalid submissions use none of it; each client has a bucket of
        // its own, so that one client cannot spend everyone's rate.
        if let Some(rate) = &spec.rate_limit {
            let burst = rate.burst.unwrap_or(rate.per_second).max(1.0);
            let bucket = format!("type/{}/client/{}", spec.name, client.name);
            self.limiter
                .try_take(&bucket, 1.0, rate.per_second, burst)
                .map_err(|wait| {
                    ApiError::too_many(
                        "rate_limited",
                        format!("task type {shown} is over its rate limit for this client"),
                        wait,
                    )
                })?;
        }
        Ok(())
    }

    /// Publishes what is not known to be queued yet and answers per task.
    async fn enqueue(
        &self,
        submitted: &[NewTask],
        recorded: Vec<Recorded>,
        trace: Option<TraceContext>,
    ) -> Vec<Result<Accepted, ApiError>> {
        // New tasks, and earlier ones whose publish was never confirmed (a client retrying
        // after a 503; not one whose confirm this gateway holds, its mark still waiting):
        // the worker's compare-and-set makes a second copy harmless.
        let to_publish: Vec<&TaskRecord> = recorded
            .iter()
            .map(Recorded::task)
            .filter(|t| t.state == TaskState::Ingested && !self.writes.queued.is_pending(t.id))
            .collect();
        // The broker hop is a span of its own; the workers' spans continue it.
        let mut publish = trace.filter(|_| !to_publish.is_empty()).map(|t| {
            self.tracer
                .start("conveyor.publish", SpanKind::Producer, Some(&t))
        });
        let traceparent = publish.as_ref().map(|s| s.context.header());
        let outgoing: Vec<Outgoing> = to_publish
            .iter()
            .map(|task| Outgoing {
                message: TaskMessage {
                    traceparent: traceparent.clone(),
                    ..task.message()
                },
                route: Requeue::Main,
                delay: None,
                retry_tier: 0,
            })
            .collect();
        let results = self.publisher.publish(&outgoing).await;
        if let Some(mut span) = publish.take() {
            span.set("messaging.system", "rabbitmq");
            span.set("messaging.batch.message_count", outgoing.len());
            let failed = results.iter().filter(|r| r.is_err()).count();
            span.end((failed > 0).then_some("some publishes were not confirmed"));
        }
        let mut publish_errors: HashMap<Uuid, AmqpError> = HashMap::new();
        let mut confirmed = Vec::new();
        for (task, result) in to_publish.iter().zip(results) {
            match result {
                Ok(()) => confirmed.push(task.id),
                Err(err) => {
                    publish_errors.insert(task.id, err);
                }
            }
        }
        // The broker holds the task durably now; its QUEUED mark follows off the answer
        // path (a claim that comes first writes it instead), so the answer is true at once.
        self.writes.queued.confirmed(confirmed);
        submitted
            .iter()
            .zip(recorded)
            .map(|(new, recorded)| {
                let created = matches!(recorded, Recorded::Created(_));
                let task = recorded.task();
                let answer = self.answer(new, task, created, publish_errors.remove(&task.id));
                let outcome = match &answer {
                    Ok(_) if created => "created",
                    Ok(_) => "existing",
                    Err(err) => err.code,
                };
                self.metrics
                    .submissions
                    .with_label_values(&[task.task_type.as_str(), outcome])
                    .inc();
                if created && answer.is_ok() {
                    self.depths.published(&task.task_type, 1);
                    self.metrics
                        .record_path(&task.task_type, &[TaskState::Ingested, TaskState::Queued]);
                }
                answer
            })
            .collect()
    }

    fn answer(
        &self,
        submitted: &NewTask,
        task: &TaskRecord,
        created: bool,
        publish_error: Option<AmqpError>,
    ) -> Result<Accepted, ApiError> {
        if !created && (task.task_type != submitted.task_type || task.payload != submitted.payload)
        {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_key_reused",
                format!(
                    "idempotency key {} belongs to task {} with a different type or payload",
                    task.idempotency_key, task.id
                ),
            ));
        }
        if let Some(err) = publish_error {
            self.metrics
                .errors
                .with_label_values(&["broker", err.category()])
                .inc();
            tracing::warn!(task = %task.id, error = %err, "publish failed");
            return Err(ApiError::not_published(
                &submitted.task_type,
                &err,
                "retry with the same Idempotency-Key",
            ));
        }
        let state = if task.state == TaskState::Ingested {
            TaskState::Queued
        } else {
            task.state
        };
        Ok(Accepted {
            status: if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            },
            id: task.id,
            state,
            idempotency_key: task.idempotency_key,
        })
    }
}

/// The type a submission names, in the tenant it names (or the one its client implies). A type
/// of a tenant the client does not belong to is as unknown as one that does not exist.
pub fn resolve<'a>(
    types: &'a crate::registry::Known,
    client: &Client,
    task_type: &str,
    namespace: Option<&str>,
) -> Result<&'a KnownType, ApiError> {
    let tenant = match (namespace, client.implied_tenant()) {
        (Some(namespace), _) => namespace,
        (None, Some(only)) => only,
        (None, None) => {
            return Err(ApiError::bad_request(
                "namespace_required",
                "this client belongs to several namespaces: say which in \"namespace\"",
            ))
        }
    };
    let entry = (tenant.to_owned(), task_type.to_owned());
    types
        .get(&entry)
        .map(Arc::as_ref)
        .filter(|_| client.may_use(tenant))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_task_type",
                format!("task type {task_type:?} is not defined"),
            )
        })
}
