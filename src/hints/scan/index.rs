//! The scanner's index of the protocol 0.1 fields: containers open and close (their roles:
//! root, action, payload), member names are read, hashed and checked for duplicates, and the
//! values of the fields SPEC.md names are recorded as spans of the canonical bytes.

use super::*;

/// A member name of an open object: decoded bytes, either in the input (no escapes) or in
/// `Scratch::keybuf` (the key had escapes and was decoded there).
#[derive(Clone, Copy)]
pub(super) struct KeyRef {
    pub(super) in_buf: bool,
    pub(super) start: u32,
    pub(super) len: u32,
    /// [`key_hash`] of the decoded name: equal names have equal hashes, so the duplicate check
    /// compares bytes only where hashes are equal.
    pub(super) hash: u64,
}

/// The 0.1 field a member name fills in an object of `role` (root, action, payload).
#[inline(always)]
pub(super) fn slot_of(role: Role, name: &[u8]) -> Slot {
    match (role, name.len()) {
        (Role::Root, 16) if name == b"protocol_version" => Slot::Pv,
        (Role::Root, 10) if name == b"message_id" => Slot::MsgId,
        (Role::Root, 7) if name == b"actions" => Slot::Actions,
        (Role::Action, 9) if name == b"action_id" => Slot::Id,
        (Role::Action, 11) if name == b"action_type" => Slot::Type,
        (Role::Action, 14) if name == b"action_version" => Slot::Ver,
        (Role::Action, 7) if name == b"payload" => Slot::Payload,
        (Role::Payload, 23) if name == b"source_control_endpoint" => Slot::Endpoint,
        _ => Slot::None,
    }
}

/// A cheap hash of a member name: its length, first and last eight bytes (fewer when shorter).
/// Names that differ only in the middle collide; the duplicate check then compares bytes, so a
/// collision costs time, never a wrong answer.
#[inline(always)]
pub(super) fn key_hash(b: &[u8]) -> u64 {
    let n = b.len();
    let (head, tail) = if n >= 8 {
        let w = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        (w(0), w(n - 8))
    } else if n >= 4 {
        let w = |i: usize| u64::from(u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes")));
        (w(0), w(n - 4))
    } else if n > 0 {
        (u64::from(b[0]) | u64::from(b[n / 2]) << 8 | u64::from(b[n - 1]) << 16, 0)
    } else {
        (0, 0)
    };
    (head.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ tail.rotate_left(29) ^ n as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Role {
    Other,
    Root,
    ActionsArr,
    Action,
    /// The `payload` object of an action.
    Payload,
    BatchList,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Slot {
    None,
    Pv,
    MsgId,
    Actions,
    Id,
    Type,
    Ver,
    Payload,
    /// The payload's `source_control_endpoint` member.
    Endpoint,
    /// An element of an action array (recorded through `Scratch::actions`).
    ActionElem,
    /// An element of a batched aligned list (recorded as a raw input span).
    BatchElem,
}

/// An open container, an element of `Scratch::stack`; `Scanner::top` points at the innermost
/// one, so that every token reaches its container's state with one load instead of through
/// the stack's length (and nothing copies a frame that was just written, which would stall on
/// store forwarding).
#[derive(Clone, Copy)]
pub(super) struct Frame {
    pub(super) is_obj: bool,
    pub(super) role: Role,
    pub(super) slot: Slot,
    pub(super) keys_start: u32,
    /// canonical start of the member value being read (when `slot` records it)
    pub(super) vstart: u32,
    /// raw start of the member value being read (when `slot` records it)
    pub(super) vraw: u32,
    /// raw offset of the opening bracket, for error details
    pub(super) open: u32,
    /// number of elements begun so far (the root `actions` array only)
    pub(super) n: u32,
    /// Objects: one bit per member-name hash seen (its top seven bits). A name whose bit is
    /// already set makes the object `suspect`; only suspect objects run the duplicate check
    /// when they close (an object without a repeated bit has no repeated name).
    pub(super) bloom: u128,
    pub(super) suspect: bool,
}

impl Scanner<'_, '_> {
    #[inline(always)]
    pub(super) fn record(&mut self, kind: Kind) {
        let end = self.canon32(self.pos);
        let top = self.cur();
        let (slot, vstart, vraw) = (top.slot, top.vstart, top.vraw);
        let f = Field { kind, start: vstart, end, escaped: kind == Kind::String && self.last_escaped };
        match slot {
            Slot::None | Slot::ActionElem => {}
            Slot::Pv => {
                self.res.pv = f;
                if kind == Kind::String {
                    let raw = &self.inp[vraw as usize..self.pos];
                    self.res.pv_is_01 = raw == b"\"0.1\""
                        || (raw.contains(&b'\\') && {
                            let at = self.sc.keybuf.len();
                            decode_string(&raw[1..raw.len() - 1], &mut self.sc.keybuf);
                            let eq = &self.sc.keybuf[at..] == b"0.1";
                            self.sc.keybuf.truncate(at);
                            eq
                        });
                }
            }
            Slot::MsgId => self.res.msgid = f,
            Slot::Actions => self.res.actions = f,
            Slot::Id | Slot::Type | Slot::Ver | Slot::Payload | Slot::Endpoint => {
                let a = self.sc.actions.last_mut().expect("an open action");
                match slot {
                    Slot::Id => a.id = f,
                    Slot::Type => a.ty = f,
                    Slot::Ver => a.ver = f,
                    Slot::Payload => a.payload = f,
                    _ => a.endpoint = f,
                }
            }
            Slot::BatchElem => self.sc.elems.push((vraw as usize, self.pos)),
        }
    }

    #[inline(always)]
    pub(super) fn open(&mut self, is_obj: bool) -> Result<(), Detail> {
        if self.sc.stack.len() >= self.max_depth {
            return Err(Detail::at("nesting deeper than max_depth", self.pos));
        }
        let role = if !self.nested() {
            match (self.mode, is_obj) {
                (Mode::Envelope, true) => Role::Root,
                (Mode::BatchList, false) => Role::BatchList,
                _ => Role::Other,
            }
        } else {
            match (self.cur().slot, is_obj) {
                (Slot::Actions, false) => Role::ActionsArr,
                (Slot::ActionElem, true) => Role::Action,
                (Slot::Payload, true) => Role::Payload,
                _ => Role::Other,
            }
        };
        if role == Role::Action {
            let start = self.canon32(self.pos);
            self.sc.actions.push(ActionRec { start, ..ActionRec::default() });
        }
        let keys_start = self.sc.keys.len() as u32;
        self.sc.stack.push(Frame {
            is_obj,
            role,
            slot: Slot::None,
            keys_start,
            vstart: 0,
            vraw: 0,
            open: self.pos as u32,
            n: 0,
            bloom: 0,
            suspect: false,
        });
        self.set_top();
        self.pos += 1;
        Ok(())
    }

    /// The closer has been consumed (`self.pos` is just past it).
    #[inline(always)]
    pub(super) fn close(&mut self) -> Result<(), Detail> {
        // the fields it needs, read in place (no copy of the frame)
        let (is_obj, role, ks, suspect, open) = {
            let f = self.cur();
            (f.is_obj, f.role, f.keys_start as usize, f.suspect, f.open as usize)
        };
        self.sc.stack.truncate(self.sc.stack.len() - 1);
        self.set_top();
        if is_obj {
            if suspect && self.mode == Mode::Envelope {
                self.check_duplicates(ks, open)?;
            }
            self.sc.keys.truncate(ks);
        }
        if role == Role::Action {
            let end = self.canon32(self.pos);
            self.sc.actions.last_mut().expect("an open action").end = end;
        }
        self.finish_value(if is_obj { Kind::Object } else { Kind::Array });
        Ok(())
    }

    #[inline(never)]
    pub(super) fn check_duplicates(&mut self, ks: usize, open: usize) -> Result<(), Detail> {
        let inp = self.inp;
        let Scratch { keys, keybuf, .. } = &mut *self.sc;
        let bytes = |k: &KeyRef| -> &[u8] {
            let (s, e) = (k.start as usize, (k.start + k.len) as usize);
            if k.in_buf {
                &keybuf[s..e]
            } else {
                &inp[s..e]
            }
        };
        let ks_slice = &mut keys[ks..];
        let dup = if ks_slice.len() <= 16 {
            // pairwise on the hashes (at most 120 integer compares), bytes only on a match
            let mut dup = false;
            'outer: for i in 1..ks_slice.len() {
                let h = ks_slice[i].hash;
                for j in 0..i {
                    if ks_slice[j].hash == h && bytes(&ks_slice[i]) == bytes(&ks_slice[j]) {
                        dup = true;
                        break 'outer;
                    }
                }
            }
            dup
        } else {
            // by hash, then bytes: equal names end up adjacent, and a flood of colliding hashes
            // still costs O(k log k) comparisons
            ks_slice.sort_unstable_by(|a, b| a.hash.cmp(&b.hash).then_with(|| bytes(a).cmp(bytes(b))));
            ks_slice.windows(2).any(|w| w[0].hash == w[1].hash && bytes(&w[0]) == bytes(&w[1]))
        };
        if dup {
            return Err(Detail::at("duplicate member name in the object", open));
        }
        Ok(())
    }

    /// A member name and the colon after it; `c` is the byte at `self.pos` (whitespace before
    /// it already skipped). The whitespace before the value is left to the value's own
    /// [`Scanner::sig`].
    #[inline(always)]
    pub(super) fn member_key(&mut self, c: Option<u8>) -> Result<(), Detail> {
        if c != Some(b'"') {
            return Err(Detail::at("expected a member name string", self.pos));
        }
        let start = self.pos + 1;
        let had_escape = self.string()?;
        let end = self.pos - 1;
        let key = if had_escape {
            let at = self.sc.keybuf.len();
            decode_string(&self.inp[start..end], &mut self.sc.keybuf);
            let hash = key_hash(&self.sc.keybuf[at..]);
            KeyRef { in_buf: true, start: at as u32, len: (self.sc.keybuf.len() - at) as u32, hash }
        } else {
            KeyRef {
                in_buf: false,
                start: start as u32,
                len: (end - start) as u32,
                hash: key_hash(&self.inp[start..end]),
            }
        };
        let name: &[u8] = if key.in_buf {
            &self.sc.keybuf[key.start as usize..(key.start + key.len) as usize]
        } else {
            &self.inp[start..end]
        };
        let slot = match self.cur().role {
            Role::Other => Slot::None,
            role => slot_of(role, name),
        };
        let top = self.cur_mut();
        let bit = 1u128 << (key.hash >> 57);
        top.suspect |= top.bloom & bit != 0;
        top.bloom |= bit;
        top.slot = slot;
        self.sc.keys.push(key);
        if self.sig() != Some(b':') {
            return Err(Detail::at("expected ':' after a member name", self.pos));
        }
        self.pos += 1;
        Ok(())
    }
}
