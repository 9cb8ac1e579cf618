//! Distributed traces of a task's way through Conveyor, in OpenTelemetry's model: the gateway
//! opens a trace (or continues the client's `traceparent`), its W3C trace context travels
//! with the task message (the `traceparent` AMQP header, and the message body), the worker's
//! span and its handler's span continue it, and exec and http handlers get it as
//! `TRACEPARENT` and a `traceparent` header. Spans go to an OTLP/HTTP collector (JSON
//! encoding, `POST <endpoint>/v1/traces`) when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and
//! nowhere otherwise. Decision 0023 says why this is a small module rather than the
//! OpenTelemetry SDK crates.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// A W3C trace context (`traceparent`): which trace, which span in it, and whether the
/// caller records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceContext {
    /// A new trace's first span.
    pub fn root() -> Self {
        let random = uuid::Uuid::new_v4();
        let mut trace_id = [0; 16];
        trace_id.copy_from_slice(random.as_bytes());
        TraceContext {
            trace_id,
            span_id: new_span_id(),
            sampled: true,
        }
    }

    /// A new span in the same trace.
    pub fn child(&self) -> Self {
        TraceContext {
            span_id: new_span_id(),
            ..*self
        }
    }

    /// `00-<trace id>-<span id>-<flags>`; `None` for anything else (a malformed header starts
    /// a new trace rather than failing a request).
    pub fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        // Later versions may append fields; version ff is invalid.
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let trace_id: [u8; 16] = unhex(trace)?.try_into().ok()?;
        let span_id: [u8; 8] = unhex(span)?.try_into().ok()?;
        let flags = unhex(flags)?;
        if trace_id == [0; 16] || span_id == [0; 8] || flags.len() != 1 {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            sampled: flags[0] & 1 == 1,
        })
    }

    pub fn header(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            u8::from(self.sampled)
        )
    }

    pub fn trace_id(&self) -> String {
        hex(&self.trace_id)
    }
}

fn new_span_id() -> [u8; 8] {
    let random = uuid::Uuid::new_v4();
    let mut id = [0; 8];
    id.copy_from_slice(&random.as_bytes()[..8]);
    id
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2)
        || !text
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

/// OpenTelemetry's span kinds (the numbers are OTLP's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Producer = 4,
    Consumer = 5,
}

/// A span under way; `end` records it.
#[must_use = "a span is recorded when it ends"]
pub struct Span {
    pub context: TraceContext,
    parent: Option<[u8; 8]>,
    name: String,
    kind: SpanKind,
    start: SystemTime,
    attributes: Vec<(&'static str, String)>,
    tracer: Tracer,
}

impl Span {
    pub fn set(&mut self, key: &'static str, value: impl ToString) {
        self.attributes.push((key, value.to_string()));
    }

    /// Ends the span, as failed with `error` when there is one.
    pub fn end(self, error: Option<&str>) {
        let Some(exporter) = &self.tracer.exporter else {
            return;
        };
        if !self.context.sampled {
            return;
        }
        let nanos = |t: SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
                .to_string()
        };
        let mut attributes: Vec<Value> = self
            .attributes
            .iter()
            .map(|(k, v)| json!({"key": k, "value": {"stringValue": v}}))
            .collect();
        let status = match error {
            Some(message) => {
                attributes.push(json!({"key": "error.message", "value": {"stringValue": message}}));
                json!({"code": 2, "message": message})
            }
            None => json!({"code": 1}),
        };
        let mut span = json!({
            "traceId": hex(&self.context.trace_id),
            "spanId": hex(&self.context.span_id),
            "name": self.name,
            "kind": self.kind as u8,
            "startTimeUnixNano": nanos(self.start),
            "endTimeUnixNano": nanos(SystemTime::now()),
            "attributes": attributes,
            "status": status,
        });
        if let Some(parent) = self.parent {
            span["parentSpanId"] = json!(hex(&parent));
        }
        exporter.keep(span);
    }
}

/// Starts spans and hands the finished ones to the exporter; cheap to clone. Disabled (the
/// default) it still makes trace contexts, so they travel on, but records nothing.
#[derive(Clone, Default)]
pub struct Tracer {
    exporter: Option<Arc<Exporter>>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.exporter {
            Some(exporter) => write!(f, "Tracer(OTLP {})", exporter.url),
            None => f.write_str("Tracer(disabled)"),
        }
    }
}

impl Tracer {
    pub fn disabled() -> Self {
        Tracer::default()
    }

    /// Exports to the OTLP/HTTP collector at `endpoint` (e.g. `http://collector:4318`) as
    /// `service`, flushing every [`FLUSH_EVERY`] from a task of its own.
    pub fn otlp(endpoint: &str, service: &str) -> Self {
        let exporter = Arc::new(Exporter {
            url: format!("{}/v1/traces", endpoint.trim_end_matches('/')),
            service: service.to_owned(),
            spans: Mutex::new(Vec::new()),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
        });
        tokio::spawn(exporter.clone().flush_forever());
        Tracer {
            exporter: Some(exporter),
        }
    }

    /// A span continuing `parent` (the caller's span), or the first of a new trace.
    pub fn start(
        &self,
        name: impl Into<String>,
        kind: SpanKind,
        parent: Option<&TraceContext>,
    ) -> Span {
        let (context, parent) = match parent {
            Some(parent) => (parent.child(), Some(parent.span_id)),
            None => (TraceContext::root(), None),
        };
        Span {
            context,
            parent,
            name: name.into(),
            kind,
            start: SystemTime::now(),
            attributes: Vec::new(),
            tracer: self.clone(),
        }
    }

    /// Sends what is waiting now (tests, and shutdown).
    pub async fn flush(&self) {
        if let Some(exporter) = &self.exporter {
            exporter.flush().await;
        }
    }
}

/// How often finished spans are sent.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// Spans kept while the collector does not answer; the oldest go first beyond this.
const MAX_WAITING: usize = 10_000;

struct Exporter {
    url: String,
    service: String,
    spans: Mutex<Vec<Value>>,
    http: reqwest::Client,
}

impl Exporter {
    fn keep(&self, span: Value) {
        let mut spans = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        if spans.len() >= MAX_WAITING {
            spans.remove(0);
        }
        spans.push(span);
    }

    async fn flush_forever(self: Arc<Self>) {
        loop {
            tokio::time::sleep(FLUSH_EVERY).await;
            self.flush().await;
        }
    }

    async fn flush(&self) {
        let spans = std::mem::take(&mut *self.spans.lock().unwrap_or_else(|p| p.into_inner()));
        if spans.is_empty() {
            return;
        }
        let body = json!({"resourceSpans": [{
            "resource": {"attributes": [
                {"key": "service.name", "value": {"stringValue": self.service}}
            ]},
            "scopeSpans": [{"scope": {"name": "conveyor"}, "spans": spans}],
        }]});
        let sent = self.http.post(&self.url).json(&body).send().await;
        match sent {
            Ok(answer) if answer.status().is_success() => {}
            // Traces are best effort: a collector that is away costs its spans, not tasks.
            Ok(answer) => {
                tracing::debug!(status = %answer.status(), "the OTLP collector refused spans")
            }
            Err(err) => tracing::debug!(error = %err, "cannot reach the OTLP collector"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips_and_a_malformed_one_is_refused() {
        let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = TraceContext::parse(header).unwrap();
        assert_eq!(context.header(), header);
        assert_eq!(context.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let child = context.child();
        assert_eq!(child.trace_id, context.trace_id);
        assert_ne!(child.span_id, context.span_id);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
        let root = TraceContext::root();
        assert_eq!(TraceContext::parse(&root.header()), Some(root));
    }
}
