//! What the run loop and the faults sample while a scenario runs.

use std::time::{Duration, Instant};

use conveyor_core::db::Db;

use crate::oracle::Throughput;
use crate::system::System;
use crate::telemetry::Telemetry;

/// How often throughput and telemetry are sampled: fine enough to tell a 0.3 s recovery
/// from a 3 s one.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Samples taken all through a scenario: throughput (for the recovery time) and what the
/// workers report.
#[derive(Default)]
pub struct Observer {
    throughput: Throughput,
    pub telemetry: Telemetry,
    pub http: reqwest::Client,
}

impl Observer {
    pub async fn sample(&mut self, db: &Db, task_type: &str) {
        self.throughput.sample(db, task_type).await;
    }

    /// Throughput, and the workers' own metrics.
    pub async fn sample_system(&mut self, system: &System) {
        self.throughput.sample(&system.db, &system.task_type).await;
        self.telemetry.sample(system, &self.http).await;
    }

    /// See [`Throughput::recovery`].
    pub fn recovery(&self, fault: Instant, healed: Instant) -> f64 {
        self.throughput.recovery(fault, healed)
    }
}

/// Runs `work` to its end, calling `sample` every [`SAMPLE_EVERY`] meanwhile (never cutting a
/// sample short: `work` waits for it), so that a fault that takes minutes leaves no gap in
/// the throughput the recovery time is read from.
pub async fn sampling<T>(
    work: impl std::future::Future<Output = T>,
    mut sample: impl AsyncFnMut(),
) -> T {
    let mut work = std::pin::pin!(work);
    loop {
        tokio::select! {
            done = &mut work => return done,
            () = tokio::time::sleep(SAMPLE_EVERY) => sample().await,
        }
    }
}
