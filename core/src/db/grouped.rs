//! The hot path's statements, group-committed ([`crate::batch`]): a worker's concurrent
//! deliveries share one claim statement and one completion statement, a gateway's
//! concurrent requests one insert (their QUEUED marks follow off the answer path:
//! [`super::queued_marks`]). Each caller still gets its own answer, and only after the
//! statement that made it durable committed.
//!
//! A statement that fails for a reason other than unavailability (a value the database
//! refuses, say) is run again for each input alone, so that one caller's bad input fails
//! only that caller.

use std::future::Future;
use std::time::Duration;

use super::claims::{Claim, Claimed, Completion};
use super::ingest::Recorded;
use super::queued_marks::{QueuedMarks, SETTLE};
use super::{Db, DbError, DbResult};
use crate::batch::{Batcher, Unanswered};
use crate::metrics::Metrics;
use crate::task::NewTask;

/// Flushers per statement: one, so that everything that arrives while its statement runs
/// makes up the next batch. Two (one running while the next forms) halved the batches, and
/// a statement costs PostgreSQL about as much CPU as several rows do: one flusher gave
/// 10-30 % more tasks/s in every phase of `make bench` (decision 0020).
const FLUSHERS: usize = 1;
/// Most deliveries in one claim or completion statement.
const MAX_TASKS: usize = 256;
/// Most requests in one insert (a request is up to a whole batch of tasks).
const MAX_REQUESTS: usize = 64;

/// A worker's claims and completions.
#[derive(Clone)]
pub struct OwnerWrites {
    claims: Batcher<Claim, DbResult<Claimed>>,
    completions: Batcher<Completion, DbResult<bool>>,
}

/// A gateway's inserts and QUEUED marks.
#[derive(Clone)]
pub struct IngestWrites {
    records: Batcher<Vec<NewTask>, DbResult<Vec<Recorded>>>,
    /// Confirmed tasks whose QUEUED mark is written a moment after the answer.
    pub queued: QueuedMarks,
}

impl Db {
    /// Group-committed claims (as `worker`) and completions. Needs a Tokio runtime.
    ///
    /// `max_wait`: how long a claim or completion may wait for its statement before it is
    /// not run at all. A caller that times its calls (the worker's breaker) and relies on
    /// the server's statement timeout to keep a timed-out call from committing later sets it
    /// to the difference between the two.
    pub fn owner_writes(&self, worker: &str, max_wait: Option<Duration>) -> OwnerWrites {
        let (db, worker) = (self.clone(), worker.to_owned());
        let claims = Batcher::spawn(FLUSHERS, MAX_TASKS, max_wait, move |claims: Vec<Claim>| {
            let (db, worker) = (db.clone(), worker.clone());
            each_or_alone(claims, move |batch| {
                let (db, worker) = (db.clone(), worker.clone());
                async move { db.claim_all(&batch, &worker).await }
            })
        });
        let db = self.clone();
        let completions = Batcher::spawn(
            FLUSHERS,
            MAX_TASKS,
            max_wait,
            move |done: Vec<Completion>| {
                let db = db.clone();
                each_or_alone(done, move |batch| {
                    let db = db.clone();
                    async move { db.complete_all(&batch).await }
                })
            },
        );
        OwnerWrites {
            claims,
            completions,
        }
    }

    /// Group-committed inserts, and the QUEUED marks that follow them (errors counted in
    /// `metrics`). Needs a Tokio runtime.
    pub fn ingest_writes(&self, metrics: &Metrics) -> IngestWrites {
        let db = self.clone();
        // No wait limit: a submission runs to its end even if its client hung up.
        let records = Batcher::spawn(
            FLUSHERS,
            MAX_REQUESTS,
            None,
            move |requests: Vec<Vec<NewTask>>| {
                let db = db.clone();
                each_or_alone(requests, move |batch| {
                    let db = db.clone();
                    async move { record_requests(&db, batch).await }
                })
            },
        );
        let queued = QueuedMarks::spawn(self.clone(), metrics.clone(), SETTLE);
        IngestWrites { records, queued }
    }
}

/// Several requests' tasks in one insert, the answers split back per request.
async fn record_requests(db: &Db, requests: Vec<Vec<NewTask>>) -> DbResult<Vec<Vec<Recorded>>> {
    let sizes: Vec<usize> = requests.iter().map(Vec::len).collect();
    let mut recorded = db.record_tasks(&requests.concat()).await?.into_iter();
    Ok(sizes
        .into_iter()
        .map(|n| recorded.by_ref().take(n).collect())
        .collect())
}

impl OwnerWrites {
    pub async fn claim(&self, claim: Claim) -> DbResult<Claimed> {
        self.claims.call(claim).await.unwrap_or_else(unanswered)
    }

    pub async fn complete(&self, completion: Completion) -> DbResult<bool> {
        self.completions
            .call(completion)
            .await
            .unwrap_or_else(unanswered)
    }
}

impl IngestWrites {
    /// [`Db::record_tasks`], sharing the statement with concurrent requests.
    pub async fn record(&self, tasks: Vec<NewTask>) -> DbResult<Vec<Recorded>> {
        self.records.call(tasks).await.unwrap_or_else(unanswered)
    }
}

fn unanswered<T>(why: Unanswered) -> DbResult<T> {
    Err(match why {
        Unanswered::Stopped => DbError::Stopped,
        // Not run: nothing was written, as after a statement the server gave up on.
        Unanswered::Expired(waited) => DbError::TimedOut(waited),
    })
}

/// Runs `run` over all `inputs` in one go; if that fails for a reason other than
/// unavailability, over each input alone. Unavailable, every caller gets the error (and a
/// worker's breaker counts it once per caller: one failed statement of three or more
/// deliveries opens it, and its recovery closes it again after a ping). It is not tried
/// again here: a second statement could commit after its callers' deadlines.
async fn each_or_alone<I, O, F, Fut>(inputs: Vec<I>, run: F) -> Vec<DbResult<O>>
where
    I: Clone,
    F: Fn(Vec<I>) -> Fut,
    Fut: Future<Output = DbResult<Vec<O>>>,
{
    let n = inputs.len();
    let all = |outputs: DbResult<Vec<O>>| match outputs {
        Ok(outputs) if outputs.len() == n => Ok(outputs),
        Ok(outputs) => Err(DbError::Corrupt(format!(
            "{} answers to {n} inputs",
            outputs.len()
        ))),
        Err(err) => Err(err),
    };
    let err = match all(run(inputs.clone()).await) {
        Ok(outputs) => return outputs.into_iter().map(Ok).collect(),
        Err(err) => err,
    };
    if n == 1 {
        return vec![Err(err)];
    }
    if err.is_unavailable() {
        return err.share(n).into_iter().map(Err).collect();
    }
    let mut answers = Vec::with_capacity(n);
    for input in inputs {
        let answer = run(vec![input]).await.and_then(|mut outputs| {
            outputs
                .pop()
                .ok_or_else(|| DbError::Corrupt("no answer to one input".to_owned()))
        });
        answers.push(answer);
    }
    answers
}
