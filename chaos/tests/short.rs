//! The short variant of `make chaos` in `make test`: the scenarios that leave the shared
//! services alone, with small counts.

use std::path::Path;
use std::time::Duration;

use conveyor_chaos::scenarios::{self, Scale};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_chaos_loses_nothing_and_does_nothing_twice() {
    let scale = Scale {
        tasks: 200,
        outage: Duration::from_secs(5),
    };
    let logs = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chaos");
    let mut failed = Vec::new();
    for scenario in scenarios::SHORT {
        let row = conveyor_chaos::run::run(scenario, &scale, &logs)
            .await
            .expect("scenario runs");
        eprintln!("{}: {:?}", row.scenario, row.verdict);
        if !row.failures.is_empty() {
            failed.push(format!("{}: {}", row.scenario, row.failures.join("; ")));
        }
    }
    assert!(
        failed.is_empty(),
        "{failed:#?} (logs in {})",
        logs.display()
    );
}
