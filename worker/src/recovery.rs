//! The way out of degraded mode: while the breaker is open, probe the database after a
//! cool-down (half-open), replay the buffered outcomes oldest first, and close the breaker
//! once none is left. A failed probe or replay re-opens it with a longer cool-down.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::outcome::Recorder;

const FIRST_COOLDOWN: Duration = Duration::from_secs(1);
/// Short enough that a worker is back within seconds of the database.
const MAX_COOLDOWN: Duration = Duration::from_secs(8);

/// Runs until `stop`.
pub async fn recovery_loop(recorder: Recorder, stop: CancellationToken) {
    let breaker = &recorder.breaker;
    let mut cooldown = FIRST_COOLDOWN;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = breaker.wait_open() => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(cooldown) => {}
        }
        breaker.half_open();
        match recorder.replay().await {
            Ok(replayed) => {
                if replayed > 0 {
                    tracing::info!(replayed, "buffered outcomes replayed");
                }
                cooldown = FIRST_COOLDOWN;
                // An outcome buffered during the replay (which re-opened the breaker) waits
                // for the next round: never close with anything left.
                if recorder.buffer.is_empty() {
                    breaker.close();
                } else {
                    breaker.open("outcomes were buffered during the replay");
                }
            }
            Err(err) => {
                tracing::warn!(
                    error = format!("{err:#}"),
                    ?cooldown,
                    buffered = recorder.buffer.len(),
                    "database still unavailable"
                );
                breaker.open("the probe failed");
                cooldown = (cooldown * 2).min(MAX_COOLDOWN);
            }
        }
    }
}
