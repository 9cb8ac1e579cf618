//! Publisher confirms of one channel, read in one place so that a returned message is
//! matched to its own publish by message id.
//!
//! RabbitMQ sends a mandatory message's return before its ack, and one ack may confirm many
//! messages (`multiple`). lapin hands each waiting return to whichever confirm it completes
//! next, in no particular order: a return for one tenant's unroutable message could fail
//! another tenant's routed one, and leave the unroutable one looking confirmed (decision
//! 0045). Here every pending confirm of the channel is polled together: the returns among
//! all that completed are noted first, by message id, then each publish is answered.

use std::collections::HashSet;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::Poll;

use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
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

struct Pending {
    message_id: String,
    confirm: PublisherConfirm,
    answer: Answer,
}

/// The confirm reader of one channel; it ends once the channel is dropped and every confirm
/// it holds has completed (a closed channel completes them with its error).
#[derive(Clone)]
pub(super) struct Confirms {
    sender: mpsc::UnboundedSender<Pending>,
}

/// Returns noted but not yet claimed by their own confirm, at most: ids are unique per
/// message, so only a message published twice at once can leave one behind.
const MAX_UNCLAIMED: usize = 10_000;

impl Confirms {
    pub(super) fn start() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        tokio::spawn(read(receiver));
        Confirms { sender }
    }

    /// Follows `confirm` of the message with `message_id`; the answer comes once the broker
    /// confirmed it (or the channel failed).
    pub(super) fn track(
        &self,
        message_id: String,
        confirm: PublisherConfirm,
    ) -> oneshot::Receiver<Result<Confirmed, lapin::Error>> {
        let (answer, receiver) = oneshot::channel();
        // A reader that ended drops the answer: the caller sees the channel as gone.
        let _ = self.sender.send(Pending {
            message_id,
            confirm,
            answer,
        });
        receiver
    }
}

async fn read(mut incoming: mpsc::UnboundedReceiver<Pending>) {
    let mut pending: Vec<Pending> = Vec::new();
    let mut returned: HashSet<String> = HashSet::new();
    let mut open = true;
    while open || !pending.is_empty() {
        let completed = poll_fn(|cx| {
            while open {
                match incoming.poll_recv(cx) {
                    Poll::Ready(Some(next)) => pending.push(next),
                    Poll::Ready(None) => open = false,
                    Poll::Pending => break,
                }
            }
            let mut completed = Vec::new();
            let mut i = 0;
            while i < pending.len() {
                match Pin::new(&mut pending[i].confirm).poll(cx) {
                    Poll::Ready(result) => completed.push((pending.swap_remove(i), result)),
                    Poll::Pending => i += 1,
                }
            }
            if completed.is_empty() && (open || !pending.is_empty()) {
                Poll::Pending
            } else {
                Poll::Ready(completed)
            }
        })
        .await;
        // Every return among these first: its own confirm may be one of them.
        for (_, result) in &completed {
            if let Ok(Confirmation::Ack(Some(message)) | Confirmation::Nack(Some(message))) = result
            {
                if let Some(id) = message.delivery.properties.message_id() {
                    returned.insert(id.to_string());
                }
            }
        }
        for (done, result) in completed {
            let answer = result.map(|confirmation| match confirmation {
                Confirmation::Ack(_) if returned.remove(&done.message_id) => Confirmed::Returned,
                Confirmation::Ack(_) => Confirmed::Routed,
                Confirmation::Nack(_) | Confirmation::NotRequested => Confirmed::Nacked,
            });
            let _ = done.answer.send(answer);
        }
        if returned.len() > MAX_UNCLAIMED {
            returned.clear();
        }
    }
}
