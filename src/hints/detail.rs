//! Why a hint was found malformed: what and where, never the hint's contents.

use std::fmt;

/// Where in a hint a problem was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Where {
    /// A byte offset in the raw input.
    Byte(usize),
    /// The root object.
    Root,
    /// The action at this position of `actions` (0-based).
    Action(u32),
}

/// The detail of a `malformed` outcome. It names the rule that failed and the place, and never
/// carries bytes of the hint, so it is safe to log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Detail {
    what: &'static str,
    at: Where,
}

impl Detail {
    pub(crate) const fn new(what: &'static str, at: Where) -> Detail {
        Detail { what, at }
    }
    pub(crate) const fn at(what: &'static str, byte: usize) -> Detail {
        Detail { what, at: Where::Byte(byte) }
    }
    /// The rule that failed, e.g. `"duplicate member name in the object"`.
    pub fn what(&self) -> &'static str {
        self.what
    }
    /// Where it failed.
    pub fn place(&self) -> Where {
        self.at
    }
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Where::Byte(b) => write!(f, "{} at byte {}", self.what, b),
            Where::Root => write!(f, "{} in the root object", self.what),
            Where::Action(i) => write!(f, "{} in actions[{}]", self.what, i),
        }
    }
}
