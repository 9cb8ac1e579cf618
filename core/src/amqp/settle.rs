//! Settling a consuming channel's deliveries: acks that come together go out as one
//! `multiple` ack wherever that cannot cover a delivery still in hand.
//!
//! A `multiple` ack of tag t settles every unsettled delivery of the channel up to t, so it
//! is sent only when each tag up to t is known: settled before, or acked in this very round.
//! Delivery tags are the channel's own count from 1, so a tag never seen (a delivery still
//! in the consumer's buffer) stops the run; acks beyond such a gap go out one by one, as
//! they always did. Nothing waits for a gap to fill or for a timer: a round takes what is
//! already queued (the outcomes of one grouped statement arrive together).

use std::collections::BTreeMap;

use futures_util::future::join_all;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::{Channel, ChannelState};
use tokio::sync::{mpsc, oneshot};

/// What becomes of a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Done with: its outcome is durable.
    Ack,
    /// Back to the queue (`requeue`), or down its dead-letter route.
    Nack { requeue: bool },
}

struct Request {
    tag: u64,
    how: Settlement,
    sent: oneshot::Sender<lapin::Result<()>>,
}

/// Settles the deliveries of one consuming channel. Cheap to clone; the task behind it
/// ends when the last clone is dropped.
#[derive(Clone)]
pub struct Settler {
    requests: mpsc::UnboundedSender<Request>,
}

impl Settler {
    /// A settler for `channel`'s deliveries (and only its own: tags are per channel).
    pub fn spawn(channel: Channel) -> Settler {
        let (requests, received) = mpsc::unbounded_channel();
        tokio::spawn(settle_rounds(channel, received));
        Settler { requests }
    }

    /// Settles the delivery with `delivery_tag` on this settler's channel; returns once the
    /// frame that does it was sent (or could not be).
    pub async fn settle(&self, delivery_tag: u64, how: Settlement) -> lapin::Result<()> {
        let (sent, answer) = oneshot::channel();
        let request = Request {
            tag: delivery_tag,
            how,
            sent,
        };
        if self.requests.send(request).is_err() {
            return Err(refused(ChannelState::Closed));
        }
        answer.await.unwrap_or(Err(refused(ChannelState::Closed)))
    }
}

/// The error of a settle that was not sent: the settler is gone (`Closed`), or the tag was
/// settled already (`Error`).
fn refused(state: ChannelState) -> lapin::Error {
    lapin::Error::InvalidChannelState(state)
}

async fn settle_rounds(channel: Channel, mut received: mpsc::UnboundedReceiver<Request>) {
    let mut window = Window::default();
    while let Some(first) = received.recv().await {
        // Let the other deliveries of the same outcome statement, woken with this one,
        // queue theirs: a yield, not a timer, so a lone ack is not held back.
        tokio::task::yield_now().await;
        let mut round = vec![first];
        while let Ok(request) = received.try_recv() {
            round.push(request);
        }
        let mut acks: BTreeMap<u64, oneshot::Sender<lapin::Result<()>>> = BTreeMap::new();
        let mut nacks = Vec::new();
        let mut in_round = std::collections::HashSet::new();
        for request in round {
            // A tag settled twice would make the broker close the channel, and with it
            // every other delivery in hand: refused here instead.
            if window.is_settled(request.tag) || !in_round.insert(request.tag) {
                let _ = request.sent.send(Err(refused(ChannelState::Error)));
                continue;
            }
            match request.how {
                Settlement::Ack => {
                    acks.insert(request.tag, request.sent);
                }
                Settlement::Nack { requeue } => nacks.push((request, requeue)),
            }
        }
        // Nacks go first, one each, so that no `multiple` ack below can cover them.
        let sending = nacks.iter().map(|(request, requeue)| {
            let options = BasicNackOptions {
                requeue: *requeue,
                multiple: false,
            };
            channel.basic_nack(request.tag, options)
        });
        let results = join_all(sending).await;
        for ((request, _), result) in nacks.into_iter().zip(results) {
            window.settled(request.tag);
            let _ = request.sent.send(result);
        }

        let waiting: Vec<u64> = acks.keys().copied().collect();
        let plan = window.plan(&waiting);
        let multiple = async {
            match plan.through {
                Some(tag) => {
                    let options = BasicAckOptions { multiple: true };
                    Some(channel.basic_ack(tag, options).await)
                }
                None => None,
            }
        };
        let singles = join_all(
            plan.singles
                .iter()
                .map(|&tag| channel.basic_ack(tag, BasicAckOptions::default())),
        );
        let (multiple, singles) = tokio::join!(multiple, singles);
        // The plan acks the first waiting tags with the `multiple` ack and the rest alone,
        // in order.
        let covered = waiting.len() - plan.singles.len();
        let by_multiple = multiple
            .into_iter()
            .flat_map(|result| std::iter::repeat_n(result, covered));
        for ((_, sent), result) in acks.into_iter().zip(by_multiple.chain(singles)) {
            let _ = sent.send(result);
        }
    }
}

/// What one round sends for the acks waiting in it.
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    /// One `multiple` ack of this tag settles every waiting ack up to it.
    through: Option<u64>,
    /// Acks sent one by one: beyond a tag not settled yet.
    singles: Vec<u64>,
}

/// The channel's delivery tags (1, 2, 3, … in the order the broker sent them) that are
/// settled on the wire. Kept as runs: the gaps are the deliveries in hand (at most the
/// prefetch), so the map stays that small however long one of them runs.
#[derive(Debug, Default)]
struct Window {
    /// Every tag up to this one is settled.
    settled_through: u64,
    /// Runs of tags above `settled_through` settled one by one: first → last.
    settled_above: BTreeMap<u64, u64>,
}

impl Window {
    fn is_settled(&self, tag: u64) -> bool {
        tag <= self.settled_through
            || self
                .settled_above
                .range(..=tag)
                .next_back()
                .is_some_and(|(_, &last)| tag <= last)
    }

    /// A tag settled on its own.
    fn settled(&mut self, tag: u64) {
        if self.is_settled(tag) {
            return;
        }
        let mut first = tag;
        let mut last = tag;
        // Join the run that ends right below, and the one that starts right above.
        if let Some((&start, &end)) = self.settled_above.range(..tag).next_back() {
            if end + 1 == tag {
                self.settled_above.remove(&start);
                first = start;
            }
        }
        if let Some(end) = self.settled_above.remove(&(tag + 1)) {
            last = end;
        }
        self.settled_above.insert(first, last);
        self.advance();
    }

    /// Takes the run that starts right after `settled_through` into it.
    fn advance(&mut self) {
        if let Some(last) = self.settled_above.remove(&(self.settled_through + 1)) {
            self.settled_through = last;
        }
    }

    /// Plans the acks of `waiting` (ascending, none settled), and counts them settled: the
    /// longest run of tags from the settled ones on, each settled or waiting, ends in one
    /// `multiple` ack; the rest go alone.
    fn plan(&mut self, waiting: &[u64]) -> Plan {
        let mut next = 0;
        let mut through = None;
        loop {
            self.advance();
            let tag = self.settled_through + 1;
            if waiting.get(next) == Some(&tag) {
                self.settled_through = tag;
                through = Some(tag);
                next += 1;
            } else {
                break;
            }
        }
        let singles = waiting[next..].to_vec();
        for &tag in &singles {
            self.settled(tag);
        }
        Plan { through, singles }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_from_the_settled_tags_on_is_one_multiple_ack() {
        let mut window = Window::default();
        let plan = window.plan(&[1, 2, 3]);
        assert_eq!(
            plan,
            Plan {
                through: Some(3),
                singles: vec![]
            }
        );
        assert_eq!(window.settled_through, 3);
    }

    #[test]
    fn acks_beyond_a_tag_still_in_hand_go_alone() {
        let mut window = Window::default();
        // Tag 2 is still being processed (or not even seen yet).
        let plan = window.plan(&[1, 3, 4]);
        assert_eq!(
            plan,
            Plan {
                through: Some(1),
                singles: vec![3, 4]
            }
        );
        // Once 2 is acked, the run reaches 4 without acking 3 and 4 again.
        let plan = window.plan(&[2]);
        assert_eq!(
            plan,
            Plan {
                through: Some(2),
                singles: vec![]
            }
        );
        assert_eq!(window.settled_through, 4);
        assert!(window.settled_above.is_empty());
    }

    #[test]
    fn a_nacked_tag_inside_a_run_is_passed_over_and_never_acked() {
        let mut window = Window::default();
        window.settled(2); // nacked before this round
        let plan = window.plan(&[1, 3]);
        // Ack 3 with `multiple` covers 1 (waiting) and 2 (nacked on the wire already).
        assert_eq!(
            plan,
            Plan {
                through: Some(3),
                singles: vec![]
            }
        );
    }

    #[test]
    fn a_multiple_ack_never_reaches_past_the_last_waiting_ack() {
        let mut window = Window::default();
        window.settled(2);
        window.settled(3);
        let plan = window.plan(&[1]);
        // 1 acked; 2 and 3 were nacked, so the run ends at the waiting tag 1.
        assert_eq!(
            plan,
            Plan {
                through: Some(1),
                singles: vec![]
            }
        );
        assert_eq!(window.settled_through, 3);
    }

    #[test]
    fn tags_settled_out_of_order_are_kept_as_runs() {
        let mut window = Window::default();
        for tag in [3, 5, 4, 8, 7] {
            window.settled(tag);
        }
        assert_eq!(window.settled_above, BTreeMap::from([(3, 5), (7, 8)]));
        assert!(window.is_settled(4) && window.is_settled(8));
        assert!(!window.is_settled(1) && !window.is_settled(6) && !window.is_settled(9));
        window.settled(6);
        assert_eq!(window.settled_above, BTreeMap::from([(3, 8)]));
        window.settled(1);
        assert_eq!(window.settled_through, 1);
        let plan = window.plan(&[2, 9]);
        assert_eq!(
            plan,
            Plan {
                through: Some(9),
                singles: vec![]
            }
        );
        assert_eq!(window.settled_through, 9);
        assert!(window.settled_above.is_empty());
    }

    #[test]
    fn nothing_waiting_plans_nothing() {
        let mut window = Window::default();
        assert_eq!(
            window.plan(&[]),
            Plan {
                through: None,
                singles: vec![]
            }
        );
    }
}
