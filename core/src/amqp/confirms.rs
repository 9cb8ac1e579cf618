//! The publishes of one confirm-mode channel, sent and confirmed in one place, so that a
//! returned message is matched to its own publish by message id.
//!
//! RabbitMQ sends a mandatory message's return before its ack, and one ack may confirm many
//! messages (`multiple`). lapin hands each waiting return to whichever confirm it completes
//! next, in no particular order: a return for one tenant's unroutable message could fail
//! another tenant's routed one, and leave the unroutable one looking confirmed (decision
//! 0045). So one task per channel sends every publish and holds every confirm: no confirm of
//! the channel exists outside it, and none is dropped by a caller that stopped waiting.
//! It notes every return it sees by message id, and answers nothing while a noted return's
//! own message has not completed: lapin completes the confirms of one ack one by one,
//! handing out the waiting returns as it goes, so until that message is done another
//! return may still sit on a confirm not seen yet. Once none is outstanding, a message is
//! returned exactly when a return carried its id.

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
pub(super) struct LastConfirm {
    origin: Instant,
    /// Milliseconds after `origin`; [`NEVER`] before the first.
    millis: AtomicU64,
}

const NEVER: u64 = u64::MAX;

impl Default for LastConfirm {
    fn default() -> Self {
        LastConfirm {
            origin: Instant::now(),
            millis: AtomicU64::new(NEVER),
        }
    }
}

impl LastConfirm {
    fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    fn touch(&self) {
        self.millis.store(self.now(), Ordering::Relaxed);
    }

    /// Whether a confirm completed in the last `window` (never, before the first).
    pub(super) fn within(&self, window: std::time::Duration) -> bool {
        match self.millis.load(Ordering::Relaxed) {
            NEVER => false,
            at => self.now().saturating_sub(at) < window.as_millis() as u64,
        }
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

type Completed = (InFlight, lapin::Result<Confirmation>);

/// Everything one channel's task holds.
struct State {
    channel: Channel,
    incoming: mpsc::UnboundedReceiver<(Message, Answer)>,
    open: bool,
    sending: Vec<(InFlight, Sending)>,
    pending: Vec<(InFlight, PublisherConfirm)>,
    /// Completed, not answered yet (see [`State::settled`]).
    held: Vec<Completed>,
    /// Returns noted by message id, not yet claimed by their own message.
    returned: HashMap<String, u32>,
}

impl State {
    fn busy(&self) -> bool {
        self.open || !self.sending.is_empty() || !self.pending.is_empty() || !self.held.is_empty()
    }

    /// Whether a message is on its way out or waiting for its confirm.
    fn in_flight(&self, id: &str) -> bool {
        self.sending.iter().any(|(f, _)| f.message_id == id)
            || self.pending.iter().any(|(f, _)| f.message_id == id)
    }

    /// Whether every noted return's own message has completed: only then can no other
    /// return still wait on a confirm not seen yet, and the held answers are final.
    fn settled(&self) -> bool {
        !self.returned.keys().any(|id| self.in_flight(id))
    }

    /// Takes new messages, moves the sent ones to `pending`, and the confirms that completed
    /// to `held`; whether anything moved.
    fn pass(&mut self, cx: &mut Context<'_>) -> bool {
        let mut moved = false;
        while self.open {
            match self.incoming.poll_recv(cx) {
                // A caller that stopped waiting (its request timed out) is told nothing, and
                // its message is not sent.
                Poll::Ready(Some((_, answer))) if answer.is_closed() => moved = true,
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
                        Err(err) => self.held.push((flight, Err(err))),
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
                    let result = self.note_return(&flight, result);
                    self.held.push((flight, result));
                    moved = true;
                }
                Poll::Pending => i += 1,
            }
        }
        moved
    }

    /// Notes the return the confirm of `flight` carries, by its message's id (only of a
    /// message this task holds, `flight`'s own included: any other is stale), and gives the
    /// confirm back without it.
    fn note_return(
        &mut self,
        flight: &InFlight,
        result: lapin::Result<Confirmation>,
    ) -> lapin::Result<Confirmation> {
        let (acked, message) = match result? {
            Confirmation::Ack(message) => (true, message),
            Confirmation::Nack(message) => (false, message),
            Confirmation::NotRequested => return Ok(Confirmation::NotRequested),
        };
        if let Some(id) = message.and_then(|m| m.delivery.properties.message_id().clone()) {
            let id = id.to_string();
            let held = self.held.iter().any(|(f, _)| f.message_id == id);
            if id == flight.message_id || held || self.in_flight(&id) {
                *self.returned.entry(id).or_default() += 1;
            }
        }
        Ok(if acked {
            Confirmation::Ack(None)
        } else {
            Confirmation::Nack(None)
        })
    }

    /// Once [`State::settled`], answers every held message: returned when a noted return
    /// carried its id.
    fn answer_settled(&mut self) {
        if self.held.is_empty() || !self.settled() {
            return;
        }
        for (flight, result) in std::mem::take(&mut self.held) {
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
        held: Vec::new(),
        returned: HashMap::new(),
    };
    poll_fn(|cx| {
        let before = state.held.len();
        // Until nothing moves: a confirm that completed before one seen here is seen too.
        while state.pass(cx) {}
        if state.held.len() > before {
            last.touch();
        }
        state.answer_settled();
        // Everything outstanding registered this task's waker in the passes.
        if state.busy() {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
}
