//! What the workers themselves showed over a scenario, read from their /metrics and /proc:
//! degraded mode at work (buffered outcomes, replays, breaker changes) and memory.
//! Counters restart with each worker process, so they are summed per process id.

use std::collections::HashMap;

use conveyor_core::testing::{metric_sum, metrics_page, proc_status_mib};

use crate::system::System;

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Telemetry {
    /// Most outcomes waiting in degraded-mode buffers at once, over all workers.
    pub buffered_max: u64,
    /// Buffered outcomes replayed into the database.
    pub replayed: u64,
    /// Times a worker's database breaker opened, and half-opened (probed).
    pub breaker_opens: u64,
    pub breaker_half_opens: u64,
    /// Largest resident set of any worker process, in MiB.
    pub worker_rss_max_mib: f64,
    /// Largest resident set seen before the fault, for comparison.
    #[serde(skip)]
    pub rss_before_fault_mib: f64,
    #[serde(skip)]
    seen: HashMap<(u32, &'static str), f64>,
}

/// Counters summed over every sample line that starts with the name.
const COUNTERS: [(&str, &str); 3] = [
    ("replayed", "conveyor_replayed_transitions_total"),
    (
        "open",
        "conveyor_database_breaker_transitions_total{to=\"open\"}",
    ),
    (
        "half_open",
        "conveyor_database_breaker_transitions_total{to=\"half_open\"}",
    ),
];

impl Telemetry {
    pub async fn sample(&mut self, system: &System, http: &reqwest::Client) {
        let mut buffered = 0.0;
        for (_, pid, listen) in system.running_workers() {
            if let Some(rss) = proc_status_mib(pid, "VmRSS") {
                self.worker_rss_max_mib = self.worker_rss_max_mib.max(rss);
            }
            let Some(text) = metrics_page(http, listen).await else {
                continue;
            };
            buffered += metric_sum(&text, "conveyor_buffered_transitions");
            for (key, name) in COUNTERS {
                let now = metric_sum(&text, name);
                let before = self.seen.insert((pid, key), now).unwrap_or(0.0);
                let grew = (now - before).max(0.0) as u64;
                match key {
                    "replayed" => self.replayed += grew,
                    "open" => self.breaker_opens += grew,
                    _ => self.breaker_half_opens += grew,
                }
            }
        }
        self.buffered_max = self.buffered_max.max(buffered as u64);
    }

    /// Marks the fault: memory from here on is compared with memory before.
    pub fn fault_starts(&mut self) {
        self.rss_before_fault_mib = self.worker_rss_max_mib;
    }
}

/// Outcomes one worker holds in its buffer now (0 when it does not answer).
pub async fn buffered(http: &reqwest::Client, listen: &str) -> f64 {
    match metrics_page(http, listen).await {
        Some(text) => metric_sum(&text, "conveyor_buffered_transitions"),
        None => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_labelled_samples_by_prefix() {
        let text = "# HELP x\n\
            conveyor_replayed_transitions_total{outcome=\"completed\",task_type=\"a\"} 3\n\
            conveyor_replayed_transitions_total{outcome=\"not_owned\",task_type=\"a\"} 1\n\
            conveyor_buffered_transitions 2\n";
        assert_eq!(metric_sum(text, "conveyor_replayed_transitions_total"), 4.0);
        assert_eq!(metric_sum(text, "conveyor_buffered_transitions"), 2.0);
        assert_eq!(metric_sum(text, "conveyor_missing"), 0.0);
    }

    #[test]
    fn reads_this_process_rss() {
        assert!(proc_status_mib(std::process::id(), "VmRSS").is_some_and(|mib| mib > 0.0));
    }
}
