//! Replay: the kept batches, and the ROUTER socket's thread that sends a peer every kept batch
//! from the sequence number it asks for, paced by what the peer's queue takes (the module docs
//! of [`crate::events`], "Replay").

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Counters, END_SEQ, REPLAY_CURSORS, REPLAY_STALL};

/// How often the replay thread offers the next batches to peers whose queue was full.
const REPLAY_PACE: Duration = Duration::from_millis(5);
/// Batches sent to one peer before the next peer's turn.
const REPLAY_TURN: usize = 64;
/// Replay requests read before the replays in progress go on.
const REQUESTS_A_TURN: usize = 64;

/// Replayable batches: `(seq, payload)` in order, at most [`REPLAY_KEEP_BYTES`] of payloads.
#[derive(Default)]
pub(super) struct Kept {
    batches: VecDeque<(u64, Arc<[u8]>)>,
    bytes: usize,
}

impl Kept {
    pub(super) fn push(&mut self, seq: u64, payload: Arc<[u8]>, keep_bytes: usize) {
        self.bytes += payload.len();
        self.batches.push_back((seq, payload));
        while self.bytes > keep_bytes && self.batches.len() > 1 {
            let (_, old) = self.batches.pop_front().expect("more than one batch");
            self.bytes -= old.len();
        }
    }

    /// The first kept batch numbered `from` or later (a cheap clone of its payload).
    fn first_from(&self, from: u64) -> Option<(u64, Arc<[u8]>)> {
        let at = self.batches.partition_point(|(s, _)| *s < from);
        self.batches.get(at).cloned()
    }
}

/// A replay in progress: the peer's routing id and the next batch it is due.
struct Cursor {
    id: Vec<u8>,
    next: u64,
    /// When the peer last took a batch (or asked).
    progressed: Instant,
}

/// What a turn of sending did to a replay.
enum Turn {
    /// The end marker went out: the replay is complete.
    Done,
    /// The peer's queue is full (or the turn ended): go on later.
    Later,
    /// The peer is gone (its connection closed).
    Gone,
}

/// Send `c`'s peer what its queue takes, up to [`REPLAY_TURN`] batches, then the end marker once
/// no kept batch is left.
fn turn(s: &zmq::Socket, c: &mut Cursor, kept: &Mutex<Kept>, counters: &Counters) -> Turn {
    for _ in 0..REPLAY_TURN {
        let next = kept.lock().unwrap_or_else(|e| e.into_inner()).first_from(c.next);
        let sent = match &next {
            Some((seq, payload)) => {
                s.send_multipart([&c.id[..], b"", &seq.to_be_bytes()[..], &payload[..]], zmq::DONTWAIT)
            }
            None => s.send_multipart([&c.id[..], b"", &END_SEQ[..], b""], zmq::DONTWAIT),
        };
        match (sent, next) {
            (Ok(()), Some((seq, _))) => {
                counters.replay_batches.fetch_add(1, Ordering::Relaxed);
                c.next = seq + 1;
                c.progressed = Instant::now();
            }
            (Ok(()), None) => return Turn::Done,
            (Err(zmq::Error::EAGAIN | zmq::Error::EINTR), _) => return Turn::Later,
            // EHOSTUNREACH: the routing id is no longer connected
            (Err(_), _) => return Turn::Gone,
        }
    }
    Turn::Later
}

/// Answer replay requests until `stop` is signalled or the socket fails: each replay goes on,
/// paced by its peer's queue, until its end marker went out, its peer left, or its peer took
/// nothing for [`REPLAY_STALL`] (cut, counted).
pub(super) fn replay_loop(s: zmq::Socket, stop: zmq::Socket, kept: &Mutex<Kept>, counters: &Counters) {
    let mut cursors: VecDeque<Cursor> = VecDeque::with_capacity(REPLAY_CURSORS);
    let cut = |n: u64| {
        counters.replays_cut.fetch_add(n, Ordering::Relaxed);
    };
    loop {
        let mut items = [s.as_poll_item(zmq::POLLIN), stop.as_poll_item(zmq::POLLIN)];
        let wait = if cursors.is_empty() { -1 } else { REPLAY_PACE.as_millis() as i64 };
        match zmq::poll(&mut items, wait) {
            Ok(_) if items[1].is_readable() => return,
            Ok(_) | Err(zmq::Error::EINTR) => {}
            Err(_) => return,
        }
        for _ in 0..REQUESTS_A_TURN {
            let msg = match s.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => break,
                Err(_) => return,
            };
            let Some(start) = replay_start(&msg) else { continue };
            counters.replays.fetch_add(1, Ordering::Relaxed);
            let id = msg.into_iter().next().expect("a replay request has a routing id");
            // a peer that asks again starts over from its new start
            if let Some(at) = cursors.iter().position(|c| c.id == id) {
                cursors.remove(at);
                cut(1);
            } else if cursors.len() == REPLAY_CURSORS {
                // the replay whose peer took nothing for longest gives way
                let idle = (0..cursors.len()).min_by_key(|&i| cursors[i].progressed).expect("a full set");
                cursors.remove(idle);
                cut(1);
            }
            cursors.push_back(Cursor { id, next: start, progressed: Instant::now() });
        }
        let now = Instant::now();
        cursors.retain_mut(|c| match turn(&s, c, kept, counters) {
            Turn::Done | Turn::Gone => false,
            Turn::Later if now.duration_since(c.progressed) > REPLAY_STALL => {
                cut(1);
                false
            }
            Turn::Later => true,
        });
    }
}

/// The start sequence number of a replay request `[id, b"", seq BE]` (anything else: `None`).
pub fn replay_start(msg: &[Vec<u8>]) -> Option<u64> {
    match msg {
        [_id, empty, seq] if empty.is_empty() && seq.len() == 8 => {
            Some(u64::from_be_bytes(seq[..].try_into().expect("8 bytes")))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sequence numbers a replay from `from` walks through.
    fn walk(k: &Kept, mut from: u64) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some((seq, _)) = k.first_from(from) {
            out.push(seq);
            from = seq + 1;
        }
        out
    }

    #[test]
    fn replay_keeps_the_newest_bytes_and_answers_from_a_sequence_number() {
        let mut k = Kept::default();
        for seq in 10..20u64 {
            k.push(seq, vec![0u8; 100].into(), 350);
        }
        assert_eq!(walk(&k, 0), [17, 18, 19], "the oldest batches went first");
        assert_eq!(k.bytes, 300);
        assert_eq!(walk(&k, 19), [19]);
        assert!(walk(&k, 20).is_empty());
        // one batch larger than the budget is still kept (the newest)
        k.push(20, vec![0u8; 1000].into(), 350);
        assert_eq!(walk(&k, 0), [20]);
    }
}
