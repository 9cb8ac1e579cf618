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
            Error::Amqp(AmqpError::Mismatch { .. }) => reasons::QUEUE_ARGUMENTS_MISMATCH,
            Error::Amqp(AmqpError::Tls(_)) => reasons::TLS_SETTINGS,
            Error::Amqp(AmqpError::LoginRefused(_)) => reasons::RABBITMQ_REFUSED,
            Error::Amqp(_) => reasons::RABBITMQ_UNAVAILABLE,
            Error::Build(err) => err.category(),
            Error::InvalidSpec(_) => reasons::INVALID_SPEC,
            Error::Timeout(..) | Error::BrokerDown { .. } => reasons::RABBITMQ_UNAVAILABLE,
            Error::ReconcileTimeout(_) => reasons::RECONCILE_TIMEOUT,
        }
    }
}

impl From<kube::Error> for Error {
    fn from(err: kube::Error) -> Self {
        Error::Kube(err)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
