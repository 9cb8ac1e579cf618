//! `--require-tls`: a process that refuses to start with a plaintext or unverified link, so
//! that a production install cannot fall back to one by a wrong URL (issue 33, item 7).

use clap::Args;

/// The switch, shared by every binary that opens links.
#[derive(Debug, Clone, Copy, Default, Args)]
pub struct RequireTls {
    /// Refuse to start when a link is not TLS with a verified certificate: PostgreSQL
    /// without `sslmode=verify-full` or `verify-ca`, `amqp://` instead of `amqps://`, an
    /// `http://` management API, or (the gateway) an API served without TLS.
    #[arg(long = "require-tls", env = "CONVEYOR_REQUIRE_TLS")]
    pub require_tls: bool,
}

/// One link a process opens (or serves), by what it is for.
#[derive(Debug, Clone, Copy)]
pub enum Link<'a> {
    Database(&'a str),
    Broker(&'a str),
    Management(&'a str),
    /// The gateway's API listener: whether it serves TLS.
    Served {
        tls: bool,
    },
}

impl RequireTls {
    /// With the switch on, every link of `links` that is plaintext or unverified, said so
    /// that the setting to change is plain; `Ok` with it off.
    pub fn check(&self, links: &[Link<'_>]) -> Result<(), String> {
        if !self.require_tls {
            return Ok(());
        }
        let refused: Vec<String> = links.iter().filter_map(|link| refusal(*link)).collect();
        if refused.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "--require-tls refuses: {} (the URLs are not shown: they hold passwords)",
                refused.join("; ")
            ))
        }
    }
}

fn refusal(link: Link<'_>) -> Option<String> {
    match link {
        Link::Database(url) => (!crate::db::verifies_server(url))
            .then(|| "the database URL lacks sslmode=verify-full (or verify-ca)".to_owned()),
        // Several nodes are separated by commas.
        Link::Broker(urls) => urls
            .split(',')
            .any(|url| !url.trim().starts_with("amqps://"))
            .then(|| "a broker URL is not amqps://".to_owned()),
        Link::Management(url) => (!url.starts_with("https://"))
            .then(|| "the RabbitMQ management URL is not https://".to_owned()),
        Link::Served { tls } => (!tls).then(|| {
            "the API is served without TLS (give --tls-cert-file and --tls-key-file)".to_owned()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_plaintext_link_is_named_and_verified_ones_pass() {
        let on = RequireTls { require_tls: true };
        let good = [
            Link::Database("postgres://u:p@db/x?sslmode=verify-full&sslrootcert=/ca"),
            Link::Broker("amqps://u:p@mq:5671/%2f"),
            Link::Management("https://mq:15671"),
            Link::Served { tls: true },
        ];
        assert_eq!(on.check(&good), Ok(()));
        let bad = [
            Link::Database("postgres://u:secret@db/x?sslmode=require"),
            Link::Broker("amqp://u:secret@mq:5672/%2f"),
            Link::Management("http://mq:15672"),
            Link::Served { tls: false },
        ];
        let err = on.check(&bad).unwrap_err();
        for part in ["sslmode", "amqps", "management", "served without TLS"] {
            assert!(err.contains(part), "{err}");
        }
        assert!(!err.contains("secret"), "no password in the message: {err}");
        assert_eq!(RequireTls::default().check(&bad), Ok(()), "off by default");
    }
}
