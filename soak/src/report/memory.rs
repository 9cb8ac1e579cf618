//! Where the services' memory went, so that a growth in the table of what held can be
//! placed: PostgreSQL's processes and their memory each, RabbitMQ's own categories, over
//! the same windows as their rows in that table.

use std::fmt::Write as _;

use super::{mean, Run, Sample, POSTGRES_ASIDE};

/// RabbitMQ's categories shown: those that changed most.
const CATEGORIES_SHOWN: usize = 6;

impl Run {
    pub(super) fn memory_parts_table(&self, md: &mut String) {
        let sampled = |s: &&Sample| s.memory_parts.postgresql_processes > 0;
        let (first, last) = self.quarters();
        let (first, last): (Vec<&Sample>, Vec<&Sample>) = (
            first.into_iter().filter(sampled).collect(),
            last.into_iter().filter(sampled).collect(),
        );
        let _ = writeln!(md, "## Where the services' memory went\n");
        if first.is_empty() || last.is_empty() {
            let _ = writeln!(md, "Not sampled in this run.\n");
            return;
        }
        let _ = writeln!(md, "Means of the first quarter and the last, over the same windows as in the table of what held (RabbitMQ's after the fleet stopped growing). PostgreSQL: its processes (a backend per open connection, beside its own few), whose connections they are (`application_name`: the process and its pool), and each one's memory, shared buffers aside. RabbitMQ: its own breakdown by category (`rabbitmq-diagnostics memory_breakdown`), the {CATEGORIES_SHOWN} that changed most.\n");
        let _ = writeln!(md, "| part | first quarter | last quarter | change |");
        let _ = writeln!(md, "|---|---|---|---|");
        let processes =
            |s: &[&Sample]| mean(s.iter().map(|s| s.memory_parts.postgresql_processes as f64));
        change_row(
            md,
            "PostgreSQL processes",
            "",
            processes(&first),
            processes(&last),
        );
        // Whose connections those processes serve, the ones that changed most first.
        let mut clients: Vec<&String> = first
            .iter()
            .chain(&last)
            .flat_map(|s| s.memory_parts.postgresql_connections.keys())
            .collect();
        clients.sort();
        clients.dedup();
        let connections = |s: &[&Sample], client: &str| {
            mean(s.iter().map(|s| {
                let open = s.memory_parts.postgresql_connections.get(client);
                open.copied().unwrap_or(0) as f64
            }))
        };
        let mut clients: Vec<(&String, f64, f64)> = clients
            .into_iter()
            .map(|c| (c, connections(&first, c), connections(&last, c)))
            .collect();
        clients.sort_by(|a, b| (b.2 - b.1).abs().total_cmp(&(a.2 - a.1).abs()));
        for (client, early, late) in clients {
            change_row(
                md,
                &format!("PostgreSQL connections of `{client}`"),
                "",
                early,
                late,
            );
        }
        let each = |s: &[&Sample]| {
            mean(s.iter().filter_map(|s| {
                let aside = s.memory_mib.get(POSTGRES_ASIDE)?;
                Some(aside / s.memory_parts.postgresql_processes as f64)
            }))
        };
        change_row(
            md,
            "PostgreSQL, MiB per process (shared buffers aside)",
            " MiB",
            each(&first),
            each(&last),
        );
        let (first, last) = self.steady_quarters();
        let category = |s: &[&Sample], name: &str| {
            mean(
                s.iter()
                    .filter_map(|s| s.memory_parts.rabbitmq_mib.get(name).copied()),
            )
        };
        let mut names: Vec<&String> = first
            .iter()
            .chain(&last)
            .flat_map(|s| s.memory_parts.rabbitmq_mib.keys())
            .collect();
        names.sort();
        names.dedup();
        let mut changes: Vec<(&String, f64, f64)> = names
            .into_iter()
            .map(|name| (name, category(&first, name), category(&last, name)))
            .collect();
        if changes.is_empty() {
            let _ = writeln!(md, "| RabbitMQ | not measured (fewer than eight samples after the fleet held, or no breakdown) | | |");
        }
        changes.sort_by(|a, b| (b.2 - b.1).abs().total_cmp(&(a.2 - a.1).abs()));
        for (name, early, late) in changes.into_iter().take(CATEGORIES_SHOWN) {
            change_row(md, &format!("RabbitMQ `{name}`"), " MiB", early, late);
        }
        let _ = writeln!(md);
    }
}

fn change_row(md: &mut String, what: &str, unit: &str, first: f64, last: f64) {
    let percent = if first > 0.0 {
        format!(" ({:+.0} %)", (last - first) / first * 100.0)
    } else {
        String::new()
    };
    let _ = writeln!(
        md,
        "| {what} | {first:.1}{unit} | {last:.1}{unit} | {:+.1}{unit}{percent} |",
        last - first
    );
}
