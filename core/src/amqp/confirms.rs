//! The publishes of one confirm-mode channel, sent and confirmed in one place, so that a
//! returned message is matched to its own publish by message id.
//!
//! RabbitMQ sends a mandatory message's return before its ack, and one ack may confirm many
//! messages (`multiple`). lapin hands each waiting return to whichever confirm it completes
//! next, in no particular order: a return for one tenant's unroutable message could fail
//! another tenant's routed one, and leave the unroutable one looking confirmed (decision
//! 0045). So one task per channel sends every publish and holds every confirm: no confirm of
//! the channel exists outside it, and none is dropped by a caller that stopped waiting.
//! Before it answers, it looks at everything again until nothing new has completed: a
//! confirm that took another message's return completed before that message's own, so it is
//! seen, and its return noted by id, before that message is answered.

use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use lapin::options::BasicPublishOptions;
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::{BasicProperties, Channel};
use tokio::sync::{mpsc, oneshot};

/// What the broker said about one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Confirmed {
    /// Taken, and routed to a queue.
    Routed,
    /// Taken but routed nowhere (no such queue): returned.
    Returned,
    /// Refused (a full queue that rejects publishes, say).
    Nacked,
}

type Answer = oneshot::Sender<Result<Confirmed, lapin::Error>>;

/// One message to send: `mandatory`, through `exchange` with `routing_key`.
pub(super) struct Message {
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

type Sending = Pin<Box<dyn Future<Output = lapin::Result<PublisherConfirm>> + Send>>;

/// A message on its way out, or out and waiting for its confirm.
struct InFlight {
    message_id: String,
    answer: Answer,
}

/// The sender of one channel; its task ends once the channel's handle is dropped and every
/// confirm it holds has completed (a closed channel completes them with its error).
#[derive(Clone)]
pub(super) struct Confirms {
    sender: mpsc::UnboundedSender<(Message, Answer)>,
}

/// When any confirm last completed, shared by a link's channels: a confirm that times out
/// while others keep completing is one slow queue, not a hung connection.
#[derive(Default)]
pub(super) struct LastConfirm {
    origin: std::sync::OnceLock<Instant>,
    millis: AtomicU64,
}

impl LastConfirm {
    fn now(&self) -> u64 {
        self.origin.get_or_init(Instant::now).elapsed().as_millis() as u64
    }

    fn touch(&self) {
        self.millis.store(self.now(), Ordering::Relaxed);
    }

    /// Whether a confirm completed in the last `window`.
    pub(super) fn within(&self, window: std::time::Duration) -> bool {
        self.now()
            .saturating_sub(self.millis.load(Ordering::Relaxed))
            < window.as_millis() as u64
    }
}

impl Confirms {
    pub(super) fn start(channel: Channel, last: Arc<LastConfirm>) -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        tokio::spawn(run(channel, receiver, last));
        Confirms { sender }
    }

    /// Sends `message`; the answer comes once the broker confirmed it (or the channel
    /// failed). The message id names it in a return: it must be unique per message.
    pub(super) fn publish(
        &self,
        message: Message,
    ) -> oneshot::Receiver<Result<Confirmed, lapin::Error>> {
        let (answer, receiver) = oneshot::channel();
        // A task that ended drops the answer: the caller sees the channel as gone.
        let _ = self.sender.send((message, answer));
        receiver
    }
}

/// Everything one channel's task holds.
struct State {
    channel: Channel,
    incoming: mpsc::UnboundedReceiver<(Message, Answer)>,
    open: bool,
    sending: Vec<(InFlight, Sending)>,
    pending: Vec<(InFlight, PublisherConfirm)>,
    /// Returns noted by message id, not yet claimed by their own confirm.
    returned: HashMap<String, u32>,
}

impl State {
    fn busy(&self) -> bool {
        self.open || !self.sending.is_empty() || !self.pending.is_empty()
    }

    /// Takes new messages, moves the sent ones to `pending`, and adds the confirms that
    /// completed to `completed`; whether anything moved.
    fn pass(
        &mut self,
        cx: &mut Context<'_>,
        completed: &mut Vec<(InFlight, lapin::Result<Confirmation>)>,
    ) -> bool {
        let mut moved = false;
        while self.open {
            match self.incoming.poll_recv(cx) {
                Poll::Ready(Some((message, answer))) => {
                    let message_id = message
                        .properties
                        .message_id()
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default();
                    let channel = self.channel.clone();
                    let send: Sending = Box::pin(async move {
                        let options = BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        };
                        channel
                            .basic_publish(
                                &message.exchange,
                                &message.routing_key,
                                options,
                                &message.body,
                                message.properties,
                            )
                            .await
                    });
                    self.sending.push((InFlight { message_id, answer }, send));
                    moved = true;
                }
                Poll::Ready(None) => self.open = false,
                Poll::Pending => break,
            }
        }
        let mut i = 0;
        while i < self.sending.len() {
            match self.sending[i].1.as_mut().poll(cx) {
                Poll::Ready(sent) => {
                    let (flight, _) = self.sending.swap_remove(i);
                    match sent {
                        Ok(confirm) => self.pending.push((flight, confirm)),
                        Err(err) => completed.push((flight, Err(err))),
                    }
                    moved = true;
                }
                Poll::Pending => i += 1,
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            match Pin::new(&mut self.pending[i].1).poll(cx) {
                Poll::Ready(result) => {
                    let (flight, _) = self.pending.swap_remove(i);
                    completed.push((flight, result));
                    moved = true;
                }
                Poll::Pending => i += 1,
            }
        }
        moved
    }

    /// Notes every return among `completed`, then answers each.
    fn answer(&mut self, completed: Vec<(InFlight, lapin::Result<Confirmation>)>) {
        for (_, result) in &completed {
            if let Ok(Confirmation::Ack(Some(message)) | Confirmation::Nack(Some(message))) = result
            {
                if let Some(id) = message.delivery.properties.message_id() {
                    *self.returned.entry(id.to_string()).or_default() += 1;
                }
            }
        }
        for (flight, result) in completed {
            let returned = match self.returned.get_mut(&flight.message_id) {
                Some(count) => {
                    *count -= 1;
                    if *count == 0 {
                        self.returned.remove(&flight.message_id);
                    }
                    true
                }
                None => false,
            };
            let answer = result.map(|confirmation| match confirmation {
                Confirmation::Ack(_) if returned => Confirmed::Returned,
                Confirmation::Ack(_) => Confirmed::Routed,
                Confirmation::Nack(_) | Confirmation::NotRequested => Confirmed::Nacked,
            });
            let _ = flight.answer.send(answer);
        }
    }
}

async fn run(
    channel: Channel,
    incoming: mpsc::UnboundedReceiver<(Message, Answer)>,
    last: Arc<LastConfirm>,
) {
    let mut state = State {
        channel,
        incoming,
        open: true,
        sending: Vec::new(),
        pending: Vec::new(),
        returned: HashMap::new(),
    };
    while state.busy() {
        let completed = poll_fn(|cx| {
            let mut completed = Vec::new();
            // Until nothing moves: a confirm that completed before one seen here is seen too.
            while state.pass(cx, &mut completed) {}
            if completed.is_empty() && state.busy() {
                Poll::Pending
            } else {
                Poll::Ready(completed)
            }
        })
        .await;
        if !completed.is_empty() {
            last.touch();
        }
        state.answer(completed);
    }
}
