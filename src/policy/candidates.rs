//! Candidate collection (SPEC.md section 5): no I/O, no global counters.

use super::caps::{Capabilities, FamilySet};
use crate::hints::{Action, Snapshot};

/// The action type that can become a candidate.
pub const KV_FETCH: &str = "kv.fetch";

/// A supported `kv.fetch` action: its position in the envelope and the families supporting it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Position in the snapshot's `actions` (producer order).
    pub action_index: usize,
    /// Every family supporting the action's `(type, version)`; unordered.
    pub families: FamilySet,
}

/// Per-collection counts; each action is counted at most once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CandidateCounts {
    /// Actions whose type no family lists at all.
    pub unknown_type: u32,
    /// `kv.fetch` actions whose type some family lists but whose version none supports.
    pub no_matching_version: u32,
}

/// The candidates of one request. Shares the admitted snapshot (no copy).
#[derive(Clone, Debug)]
pub struct Candidates {
    snapshot: Snapshot,
    list: Vec<Candidate>,
    counts: CandidateCounts,
}

impl Candidates {
    /// The candidates in producer order.
    pub fn list(&self) -> &[Candidate] {
        &self.list
    }
    /// The counts of this collection.
    pub fn counts(&self) -> CandidateCounts {
        self.counts
    }
    /// The snapshot the candidates point into.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }
    /// The action of a candidate.
    pub fn action(&self, c: &Candidate) -> Action<'_> {
        self.snapshot.action(c.action_index).expect("candidates index their own snapshot")
    }
}

/// Classify one action: `Some(families)` for a candidate, and the counts it adds.
#[inline]
fn classify(a: &Action<'_>, caps: &Capabilities, counts: &mut CandidateCounts) -> Option<FamilySet> {
    let (typed, exact) = caps.support_of(a.action_type(), a.version());
    if typed.is_empty() {
        counts.unknown_type += 1;
        return None;
    }
    if a.action_type() != KV_FETCH {
        return None;
    }
    if exact.is_empty() {
        counts.no_matching_version += 1;
        return None;
    }
    Some(exact)
}

/// Call `f` with every candidate, in producer order; returns the counts. Allocates nothing.
pub fn for_each_candidate(snapshot: &Snapshot, caps: &Capabilities, mut f: impl FnMut(Candidate)) -> CandidateCounts {
    let mut counts = CandidateCounts::default();
    for a in snapshot.actions() {
        if let Some(families) = classify(&a, caps, &mut counts) {
            f(Candidate { action_index: a.index(), families });
        }
    }
    counts
}

/// Collect into a caller-owned vector (cleared first): no allocation once it has capacity.
pub fn collect_candidates_into(snapshot: &Snapshot, caps: &Capabilities, out: &mut Vec<Candidate>) -> CandidateCounts {
    out.clear();
    for_each_candidate(snapshot, caps, |c| out.push(c))
}

/// Collect the candidates of `snapshot` under `caps`: every supported `kv.fetch` action in
/// producer order, each once with all its supporting families. Empty capabilities or no match
/// give no candidates. Allocates only the list (exactly once, sized by a first counting pass,
/// and not at all when there are no candidates).
pub fn collect_candidates(snapshot: &Snapshot, caps: &Capabilities) -> Candidates {
    let mut scratch = CandidateCounts::default();
    let n = snapshot.actions().filter(|a| classify(a, caps, &mut scratch).is_some()).count();
    let mut list = Vec::with_capacity(n);
    let counts = collect_candidates_into(snapshot, caps, &mut list);
    Candidates { snapshot: snapshot.clone(), list, counts }
}

/// The first candidate only (what orchestration uses): stops at the first match, allocates
/// nothing.
pub fn first_candidate(snapshot: &Snapshot, caps: &Capabilities) -> Option<Candidate> {
    let mut counts = CandidateCounts::default();
    snapshot
        .actions()
        .find_map(|a| classify(&a, caps, &mut counts).map(|families| Candidate { action_index: a.index(), families }))
}
