//! The publishing side: the runtime's queue drained into batches, each published on the PUB
//! socket and kept for replay, and the batches' msgpack encoding.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};

use super::{now, Counters, Event, Kept, BATCH_BYTES, BATCH_EVENTS, IDLE_BATCH, REPLAY_KEEP_BYTES};

/// What the publishing thread needs of its publisher.
pub(super) struct PublishSide {
    pub(super) topic: String,
    pub(super) block_size: usize,
    pub(super) medium: String,
    pub(super) counters: Arc<Counters>,
}

/// Drain the queue into batches and publish them until the publisher is dropped (then what
/// was queued is sent first); an idle publisher sends an empty batch every [`IDLE_BATCH`].
pub(super) fn publish_loop(ev: &PublishSide, s: zmq::Socket, rx: Receiver<Event>, kept: &Mutex<Kept>) {
    let (_, mut seq) = now();
    let mut batch = Vec::with_capacity(BATCH_EVENTS);
    loop {
        batch.clear();
        match rx.recv_timeout(IDLE_BATCH) {
            Ok(first) => batch.push(first),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let mut bytes = batch.first().map_or(0, encoded_estimate);
        while !batch.is_empty() && batch.len() < BATCH_EVENTS && bytes < BATCH_BYTES {
            match rx.try_recv() {
                Ok(e) => {
                    bytes += encoded_estimate(&e);
                    batch.push(e);
                }
                Err(_) => break,
            }
        }
        let (ts, _) = now();
        let payload: Arc<[u8]> = encode_batch(ts, &batch, ev.block_size, Some(&ev.medium), 0).into();
        if s.send_multipart([ev.topic.as_bytes(), &seq.to_be_bytes()[..], &payload[..]], 0).is_err() {
            ev.counters.send_errors.fetch_add(1, Ordering::Relaxed);
        }
        // counted before it can be replayed: a batch a replay returns is always counted
        ev.counters.published.fetch_add(batch.len() as u64, Ordering::Relaxed);
        ev.counters.batches.fetch_add(1, Ordering::Relaxed);
        kept.lock().unwrap_or_else(|e| e.into_inner()).push(seq, payload, REPLAY_KEEP_BYTES);
        seq += 1;
    }
}

/// A generous estimate of an event's msgpack encoding (a token id is at most 5 bytes).
fn encoded_estimate(e: &Event) -> usize {
    match e {
        Event::Stored { tokens, .. } => 48 + 5 * tokens.len(),
        Event::Removed(_) | Event::Cleared => 32,
    }
}

/// The msgpack payload of one batch: `[ts, [event, ...], dp_rank]`.
pub fn encode_batch(ts: f64, events: &[Event], block_size: usize, medium: Option<&str>, dp_rank: u32) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_f64, write_nil, write_str, write_uint};
    let mut b = Vec::with_capacity(16 + events.len() * 64);
    // writes into a Vec cannot fail
    let _ = write_array_len(&mut b, 3);
    let _ = write_f64(&mut b, ts);
    let _ = write_array_len(&mut b, events.len() as u32);
    let medium_of = |b: &mut Vec<u8>| match medium {
        Some(m) => drop(write_str(b, m)),
        None => drop(write_nil(b)),
    };
    for e in events {
        match e {
            Event::Stored { name, parent, tokens } => {
                let _ = write_array_len(&mut b, 7);
                let _ = write_str(&mut b, "BlockStored");
                let _ = write_array_len(&mut b, 1);
                let _ = write_uint(&mut b, *name);
                match parent {
                    Some(p) => drop(write_uint(&mut b, *p)),
                    None => drop(write_nil(&mut b)),
                }
                let _ = write_array_len(&mut b, tokens.len() as u32);
                for &t in tokens {
                    let _ = write_uint(&mut b, t.into());
                }
                let _ = write_uint(&mut b, block_size as u64);
                let _ = write_nil(&mut b);
                medium_of(&mut b);
            }
            Event::Removed(name) => {
                let _ = write_array_len(&mut b, 3);
                let _ = write_str(&mut b, "BlockRemoved");
                let _ = write_array_len(&mut b, 1);
                let _ = write_uint(&mut b, *name);
                medium_of(&mut b);
            }
            Event::Cleared => {
                let _ = write_array_len(&mut b, 1);
                let _ = write_str(&mut b, "AllBlocksCleared");
            }
        }
    }
    let _ = write_uint(&mut b, dp_rank.into());
    b
}
