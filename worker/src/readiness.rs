//! What the worker's `/readyz` answers: not ready while draining, while it cannot see the
//! tasks it is sent, while its database breaker is open, or when the database does not
//! answer. Each reason says what is wrong.

use std::sync::Arc;

use conveyor_core::admin;

use crate::breaker;
use crate::intake::Intake;
use crate::outcome::Recorder;
use crate::unseen::Unseen;

pub fn check(recorder: Recorder, intake: Intake, unseen: Unseen) -> admin::ReadinessCheck {
    Arc::new(move || {
        let recorder = recorder.clone();
        let draining = intake.is_draining();
        let unseen = unseen.problem();
        Box::pin(async move {
            if draining {
                return Err("draining: chosen for removal, taking no new tasks".to_owned());
            }
            if let Some(problem) = unseen {
                return Err(problem);
            }
            if !matches!(recorder.breaker.state(), breaker::State::Closed { .. }) {
                return Err(format!(
                    "database circuit breaker open, {} outcomes buffered",
                    recorder.buffer.len()
                ));
            }
            recorder
                .db
                .ping()
                .await
                .map_err(|e| format!("database: {e}"))
        })
    })
}
