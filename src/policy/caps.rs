//! Capability snapshots: which backend families support which `(action_type, action_version)`.

use std::fmt;

/// Most families one capability snapshot can hold (family sets are 64-bit masks).
pub const MAX_FAMILIES: usize = 64;

/// A backend family: a private integration key of this process (never a wire field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FamilyId(pub(crate) u8);

impl FamilyId {
    /// Position of the family in its capability snapshot (0-based, registration order).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// An unordered set of families.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct FamilySet(pub(crate) u64);

impl FamilySet {
    /// The empty set.
    pub const EMPTY: FamilySet = FamilySet(0);
    /// Whether `f` is in the set.
    pub fn contains(self, f: FamilyId) -> bool {
        self.0 & (1 << f.0) != 0
    }
    /// Number of families.
    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }
    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// The families, in index order.
    pub fn iter(self) -> impl Iterator<Item = FamilyId> {
        (0..64u8).filter(move |i| self.0 & (1 << i) != 0).map(FamilyId)
    }
    /// The raw mask: bit i set for family index i (the C ABI's representation).
    pub fn bits(self) -> u64 {
        self.0
    }
    pub(crate) fn insert(&mut self, f: FamilyId) {
        self.0 |= 1 << f.0;
    }
}

impl fmt::Debug for FamilySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter().map(|x| x.0)).finish()
    }
}

#[derive(Debug, Clone)]
struct Family {
    name: String,
    pairs: Vec<(String, String)>,
}

/// An immutable capability snapshot, fixed for a request. Build it with
/// [`CapabilitiesBuilder`]; share it (e.g. in an `Arc`) across requests.
#[derive(Debug, Clone, Default)]
pub struct Capabilities {
    families: Vec<Family>,
}

/// Why a capability snapshot could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CapabilitiesError {
    /// More than [`MAX_FAMILIES`] families.
    TooManyFamilies,
    /// An empty family name, action type or version.
    Empty,
}

impl fmt::Display for CapabilitiesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapabilitiesError::TooManyFamilies => write!(f, "more than {MAX_FAMILIES} backend families"),
            CapabilitiesError::Empty => f.write_str("empty family name, action type or action version"),
        }
    }
}
impl std::error::Error for CapabilitiesError {}

/// Builder of [`Capabilities`]. Families are identified by name; adding a pair to a name seen
/// before extends that family.
#[derive(Debug, Default)]
pub struct CapabilitiesBuilder {
    caps: Capabilities,
    error: Option<CapabilitiesError>,
}

impl CapabilitiesBuilder {
    /// Declare that `family` supports `(action_type, action_version)`.
    pub fn support(mut self, family: &str, action_type: &str, action_version: &str) -> Self {
        self.add(family, action_type, action_version);
        self
    }

    /// Declare a family with no supported pair yet (it still counts as a family).
    pub fn family(mut self, family: &str) -> Self {
        self.family_index(family);
        self
    }

    fn family_index(&mut self, family: &str) -> Option<usize> {
        if family.is_empty() {
            self.error.get_or_insert(CapabilitiesError::Empty);
            return None;
        }
        if let Some(i) = self.caps.families.iter().position(|f| f.name == family) {
            return Some(i);
        }
        if self.caps.families.len() == MAX_FAMILIES {
            self.error.get_or_insert(CapabilitiesError::TooManyFamilies);
            return None;
        }
        self.caps.families.push(Family { name: family.to_string(), pairs: Vec::new() });
        Some(self.caps.families.len() - 1)
    }

    /// As [`CapabilitiesBuilder::support`], by reference.
    pub fn add(&mut self, family: &str, action_type: &str, action_version: &str) {
        if action_type.is_empty() || action_version.is_empty() {
            self.error.get_or_insert(CapabilitiesError::Empty);
            return;
        }
        if let Some(i) = self.family_index(family) {
            let pairs = &mut self.caps.families[i].pairs;
            if !pairs.iter().any(|(t, v)| t == action_type && v == action_version) {
                pairs.push((action_type.to_string(), action_version.to_string()));
            }
        }
    }

    /// Freeze.
    pub fn build(self) -> Result<Capabilities, CapabilitiesError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.caps),
        }
    }
}

impl Capabilities {
    /// A builder.
    pub fn builder() -> CapabilitiesBuilder {
        CapabilitiesBuilder::default()
    }

    /// Number of families.
    pub fn family_count(&self) -> usize {
        self.families.len()
    }

    /// The family called `name`.
    pub fn family(&self, name: &str) -> Option<FamilyId> {
        self.families.iter().position(|f| f.name == name).map(|i| FamilyId(i as u8))
    }

    /// The name of a family of this snapshot.
    pub fn family_name(&self, f: FamilyId) -> &str {
        &self.families[f.index()].name
    }

    /// `(families listing action_type at all, families supporting the exact pair)`.
    /// Strings match exactly.
    pub(crate) fn support_of(&self, action_type: &str, action_version: &str) -> (FamilySet, FamilySet) {
        let (mut typed, mut exact) = (FamilySet::EMPTY, FamilySet::EMPTY);
        for (i, fam) in self.families.iter().enumerate() {
            let id = FamilyId(i as u8);
            for (t, v) in &fam.pairs {
                if t == action_type {
                    typed.insert(id);
                    if v == action_version {
                        exact.insert(id);
                    }
                }
            }
        }
        (typed, exact)
    }
}
