//! Group commit: concurrent callers of one statement share one execution of it.
//!
//! A caller hands its input in and waits for its own answer. A flusher takes the first input
//! waiting and every other one already waiting (up to a maximum), runs the statement once
//! for all of them and answers each. No timer: at low load a batch is one input and goes at
//! once; under load the inputs that arrive while a statement runs make up the next batch.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, Mutex};

struct Job<I, O> {
    input: I,
    answer: oneshot::Sender<O>,
    queued: Instant,
}

/// Why a call got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unanswered {
    /// The flushers are gone (the runtime is shutting down).
    Stopped,
    /// It waited longer than the batcher's `max_wait` and was not run.
    Expired(Duration),
}

/// Inputs waiting for a flusher, shared by all of them.
type Waiting<I, O> = Arc<Mutex<mpsc::Receiver<Job<I, O>>>>;

/// A handle to a group-committed statement (cheap to clone; the flushers stop when the
/// last handle is dropped).
pub struct Batcher<I, O> {
    jobs: mpsc::Sender<Job<I, O>>,
    max_wait: Duration,
}

impl<I, O> Clone for Batcher<I, O> {
    fn clone(&self) -> Self {
        Batcher {
            jobs: self.jobs.clone(),
            max_wait: self.max_wait,
        }
    }
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// Starts `flushers` tasks that each run `run` over up to `max` waiting inputs; `run`
    /// answers every input, in order. More than one flusher keeps a statement going while
    /// the next batch forms.
    ///
    /// An input that waited longer than `max_wait` for a flusher is not run (its caller
    /// gets [`Unanswered::Expired`]): a caller whose own deadline counts the wait must be able
    /// to rely on nothing being written for it once that deadline passed.
    pub fn spawn<F, Fut>(flushers: usize, max: usize, max_wait: Option<Duration>, run: F) -> Self
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<O>> + Send + 'static,
    {
        let max = max.max(1);
        let (jobs, waiting) = mpsc::channel(max * flushers.max(1) * 2);
        let waiting: Waiting<I, O> = Arc::new(Mutex::new(waiting));
        let run = Arc::new(run);
        for _ in 0..flushers.max(1) {
            tokio::spawn(flush(waiting.clone(), max, max_wait, run.clone()));
        }
        Batcher {
            jobs,
            max_wait: max_wait.unwrap_or(Duration::MAX),
        }
    }

    /// Runs `input` with whatever else is waiting.
    pub async fn call(&self, input: I) -> Result<O, Unanswered> {
        let (answer, wait) = oneshot::channel();
        let job = Job {
            input,
            answer,
            queued: Instant::now(),
        };
        self.jobs.send(job).await.map_err(|_| Unanswered::Stopped)?;
        wait.await.map_err(|_| Unanswered::Expired(self.max_wait))
    }
}

async fn flush<I, O, F, Fut>(
    waiting: Waiting<I, O>,
    max: usize,
    max_wait: Option<Duration>,
    run: Arc<F>,
) where
    F: Fn(Vec<I>) -> Fut,
    Fut: Future<Output = Vec<O>>,
{
    loop {
        let jobs = {
            let mut waiting = waiting.lock().await;
            let Some(first) = waiting.recv().await else {
                return;
            };
            let mut jobs = vec![first];
            while jobs.len() < max {
                match waiting.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
            jobs
        };
        // A caller that gave up (its call timed out), or that waited too long to still be
        // sure of its deadline, is not written for: its write must not land behind its back.
        // Dropping its answer tells it so.
        let fresh = |job: &Job<I, O>| max_wait.is_none_or(|wait| job.queued.elapsed() <= wait);
        let (inputs, answers): (Vec<I>, Vec<oneshot::Sender<O>>) = jobs
            .into_iter()
            .filter(|job| !job.answer.is_closed() && fresh(job))
            .map(|job| (job.input, job.answer))
            .unzip();
        if inputs.is_empty() {
            continue;
        }
        let outputs = run(inputs).await;
        for (answer, output) in answers.into_iter().zip(outputs) {
            let _ = answer.send(output);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn callers_waiting_together_share_a_run_and_get_their_own_answers() {
        let runs = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = runs.clone();
        let batcher = Batcher::spawn(1, 100, None, move |inputs: Vec<u32>| {
            let seen = seen.clone();
            async move {
                seen.lock().expect("lock").push(inputs.len());
                // Slow enough that the other callers queue up behind the first run.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                inputs.into_iter().map(|i| i * 10).collect::<Vec<u32>>()
            }
        });
        let calls = (0..20).map(|i| {
            let batcher = batcher.clone();
            async move { batcher.call(i).await }
        });
        let answers = futures_util::future::join_all(calls).await;
        assert_eq!(
            answers,
            (0..20).map(|i| Ok(i * 10)).collect::<Vec<_>>(),
            "each caller gets the answer to its own input"
        );
        let runs = runs.lock().expect("lock").clone();
        assert_eq!(runs.iter().sum::<usize>(), 20);
        assert!(
            runs.len() < 20,
            "callers waiting together shared a run: {runs:?}"
        );
    }

    #[tokio::test]
    async fn a_caller_that_gave_up_is_not_run() {
        let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = ran.clone();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let wait = gate.clone();
        let batcher = Batcher::spawn(1, 100, None, move |inputs: Vec<u32>| {
            let (seen, wait) = (seen.clone(), wait.clone());
            async move {
                seen.lock().expect("lock").extend(inputs.iter().copied());
                if inputs.contains(&1) {
                    // The first run holds the flusher until the test lets it go.
                    let _ = wait.acquire().await;
                }
                inputs
            }
        });
        let first = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.call(1).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // Queued behind the first run, then abandoned.
        let abandoned =
            tokio::time::timeout(std::time::Duration::from_millis(50), batcher.call(2)).await;
        assert!(abandoned.is_err());
        gate.add_permits(1);
        assert_eq!(first.await.expect("join"), Ok(1));
        assert_eq!(batcher.call(3).await, Ok(3));
        assert_eq!(*ran.lock().expect("lock"), vec![1, 3]);
    }

    #[tokio::test]
    async fn an_input_that_waited_past_the_limit_is_not_run() {
        let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = ran.clone();
        let limit = std::time::Duration::from_millis(20);
        let batcher = Batcher::spawn(1, 100, Some(limit), move |inputs: Vec<u32>| {
            let seen = seen.clone();
            async move {
                seen.lock().expect("lock").extend(inputs.iter().copied());
                // Longer than the limit: whatever queues behind this run expires.
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                inputs
            }
        });
        let first = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.call(1).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        assert_eq!(batcher.call(2).await, Err(Unanswered::Expired(limit)));
        assert_eq!(first.await.expect("join"), Ok(1));
        assert_eq!(*ran.lock().expect("lock"), vec![1]);
    }
}
