//! The report's tables of the `tasks` indexes and of the operator over time.

use std::fmt::Write as _;

use super::Run;
use crate::fleet::Operator;

impl Run {
    /// Each index of `tasks` at the first sample and the last, its largest, and how often
    /// it shrank by a third or more from one sample to the next (a rebuild).
    pub(super) fn index_table(&self, md: &mut String) {
        let Some(last) = self.samples.last() else {
            return;
        };
        let _ = writeln!(md, "## The indexes of `tasks`\n");
        let _ = writeln!(
            md,
            "| index | MiB when first seen | MiB at {:.0} s | largest MiB | shrank by a third or more |",
            last.elapsed_s
        );
        let _ = writeln!(md, "|---|---|---|---|---|");
        for (name, end) in &last.database.tasks_indexes {
            let sizes: Vec<f64> = self
                .samples
                .iter()
                .filter_map(|s| s.database.tasks_indexes.get(name).copied())
                .collect();
            let start = sizes.first().copied().unwrap_or(0.0);
            let largest = sizes.iter().copied().fold(0.0, f64::max);
            let shrank = sizes
                .windows(2)
                .filter(|pair| pair[1] <= pair[0] * 2.0 / 3.0)
                .count();
            let _ = writeln!(
                md,
                "| {name} | {start:.2} | {end:.2} | {largest:.2} | {shrank} |"
            );
        }
        let _ = writeln!(md);
    }

    /// The operator over time: its population, memory, and requests per minute.
    pub(super) fn operator_table(&self, md: &mut String) {
        let sampled: Vec<(f64, &Operator)> = self
            .samples
            .iter()
            .filter_map(|s| Some((s.elapsed_s, s.operator.as_ref()?)))
            .collect();
        if sampled.is_empty() {
            let _ = writeln!(
                md,
                "## Operator\n\nNot in this run (the local stack did not run).\n"
            );
            return;
        }
        let _ = writeln!(md, "## Operator\n");
        let _ = writeln!(md, "Its memory from `/proc`, its reconciles and broker requests from its /metrics (a restart resets them: that window shows none), its own requests to the kube-apiserver from the apiserver's audit log, and the apiserver's count of requests on TaskTypes, WorkerPools and Deployments (every client's).\n");
        let _ = writeln!(md, "| s | namespaces (a TaskType and a WorkerPool each) | RSS MiB | reconciles/min | broker requests/min | its apiserver requests/min | all clients' requests/min on those resources |");
        let _ = writeln!(md, "|---|---|---|---|---|---|---|");
        let mut last: Option<(f64, &Operator)> = None;
        for (at, op) in sampled {
            let rate = |now: f64, then: f64, (t0, _): (f64, &Operator)| {
                let minutes = (at - t0) / 60.0;
                if now >= then && minutes > 0.0 {
                    format!("{:.0}", (now - then) / minutes)
                } else {
                    "-".to_owned()
                }
            };
            let (reconciles, broker, own, apiserver) = match last {
                Some(prev) => (
                    rate(op.reconciles, prev.1.reconciles, prev),
                    rate(op.broker_requests, prev.1.broker_requests, prev),
                    rate(
                        op.own_apiserver_requests,
                        prev.1.own_apiserver_requests,
                        prev,
                    ),
                    rate(op.apiserver_requests, prev.1.apiserver_requests, prev),
                ),
                None => (
                    "-".to_owned(),
                    "-".to_owned(),
                    "-".to_owned(),
                    "-".to_owned(),
                ),
            };
            let _ = writeln!(
                md,
                "| {at:.0} | {} | {:.1} | {reconciles} | {broker} | {own} | {apiserver} |",
                op.namespaces, op.rss_mib
            );
            last = Some((at, op));
        }
        let _ = writeln!(md);
    }
}
