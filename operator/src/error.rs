//! The operator's error, one variant per step, with a stable category for metrics and
//! Event reasons.

use conveyor_core::amqp::AmqpError;
use conveyor_core::crd::status::reasons;

use crate::build::BuildError;
use crate::rabbitmq::ManagementError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API call failed")]
    Kube(#[source] kube::Error),
    #[error(transparent)]
    Management(#[from] ManagementError),
    #[error("declaring queues failed")]
    Amqp(#[source] AmqpError),
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The apiserver refused the Deployment built from the pool (422 Invalid): something in
    /// its pod template the CRD's rules do not check, say a volume with two sources.
    #[error("the apiserver refused the pool's Deployment: {}", refusal(.0))]
    DeploymentRefused(#[source] kube::Error),
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
    #[error("RabbitMQ did not answer within {1:?} while {0}")]
    Timeout(&'static str, std::time::Duration),
    /// A declaration moments ago found the broker out; this one did not try.
    #[error("RabbitMQ was out {ago:?} ago ({cause}); declaring again shortly")]
    BrokerDown {
        ago: std::time::Duration,
        cause: String,
    },
    #[error("the reconcile did not finish within {0:?}")]
    ReconcileTimeout(std::time::Duration),
}

impl Error {
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube(_) => reasons::KUBERNETES_API,
            Error::Management(err) => err.category(),
            // A configuration problem is not an outage.
            Error::Amqp(err) => amqp_category(err),
            Error::Build(err) => err.category(),
            Error::DeploymentRefused(_) => reasons::INVALID_POD_TEMPLATE,
            Error::InvalidSpec(_) => reasons::INVALID_SPEC,
            Error::Timeout(..) | Error::BrokerDown { .. } => reasons::RABBITMQ_UNAVAILABLE,
            Error::ReconcileTimeout(_) => reasons::RECONCILE_TIMEOUT,
        }
    }
}

/// Every AMQP failure by its cause: only the broker being out or slow counts as
/// unavailable; settings and refusals are named as such (no catch-all, so a new variant
/// needs its own decision).
fn amqp_category(err: &AmqpError) -> &'static str {
    match err {
        AmqpError::Unavailable(_)
        | AmqpError::ConnectTimeout(_)
        | AmqpError::ConfirmTimeout(_)
        | AmqpError::DeclareTimeout(_) => reasons::RABBITMQ_UNAVAILABLE,
        AmqpError::Mismatch { .. } => reasons::QUEUE_ARGUMENTS_MISMATCH,
        AmqpError::Tls(_) | AmqpError::Certificate(_) => reasons::TLS_SETTINGS,
        AmqpError::NoUrl => reasons::RABBITMQ_SETTINGS,
        AmqpError::LoginRefused(_) | AmqpError::Nacked => reasons::RABBITMQ_REFUSED,
        AmqpError::NoQueue { .. } => reasons::QUEUE_MISSING,
        AmqpError::Encode(_) => reasons::RABBITMQ_CLIENT,
    }
}

/// The apiserver's own words for a refusal (which field, and why).
fn refusal(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(status) => status.message.clone(),
        other => other.to_string(),
    }
}

impl From<kube::Error> for Error {
    fn from(err: kube::Error) -> Self {
        Error::Kube(err)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_error_is_not_reported_as_an_outage() {
        let category = |err| Error::Amqp(err).category();
        assert_eq!(category(AmqpError::NoUrl), reasons::RABBITMQ_SETTINGS);
        assert_eq!(
            category(AmqpError::Tls("bad cacertfile".into())),
            reasons::TLS_SETTINGS
        );
        assert_eq!(category(AmqpError::Nacked), reasons::RABBITMQ_REFUSED);
        assert_eq!(
            category(AmqpError::NoQueue { queue: "q".into() }),
            reasons::QUEUE_MISSING
        );
        assert_eq!(
            category(AmqpError::ConnectTimeout(std::time::Duration::from_secs(5))),
            reasons::RABBITMQ_UNAVAILABLE
        );
    }
}
