//! The operator's error, one variant per step, with a stable category for metrics and
//! Event reasons.

use conveyor_core::amqp::AmqpError;

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
}

impl Error {
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubernetesApi",
            Error::Management(err) => err.category(),
            // A configuration problem is not an outage.
            Error::Amqp(AmqpError::Mismatch { .. }) => "QueueArgumentsMismatch",
            Error::Amqp(AmqpError::Tls(_)) => "TLSSettings",
            Error::Amqp(_) => "RabbitMQUnavailable",
            Error::Build(err) => err.category(),
            Error::InvalidSpec(_) => "InvalidSpec",
            Error::Timeout(..) => "RabbitMQUnavailable",
        }
    }
}

impl From<kube::Error> for Error {
    fn from(err: kube::Error) -> Self {
        Error::Kube(err)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
