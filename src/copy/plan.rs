//! Checks shared by every engine: ids in range, no duplicate destinations, staging large
//! enough. Allocation-free: the duplicate check uses a bitmap reserved at setup.

use super::layout::KvLayout;
use super::CopyError;

/// Per-engine scratch for the checks.
#[derive(Debug)]
pub(crate) struct Checker {
    seen: Vec<u64>,
}

impl Checker {
    pub(crate) fn new(layout: &KvLayout) -> Checker {
        Checker { seen: vec![0; (layout.num_blocks() as usize).div_ceil(64)] }
    }

    /// Check a call. `unique` refuses repeated ids (scatter: two writes to one block would
    /// race; gather may read a block twice).
    pub(crate) fn check(
        &mut self,
        layout: &KvLayout,
        ids: &[u32],
        staging_len: u64,
        unique: bool,
    ) -> Result<(), CopyError> {
        let need = layout.staging_bytes(ids.len());
        if staging_len < need {
            return Err(CopyError::StagingTooSmall { needed: need, got: staging_len });
        }
        for (i, &id) in ids.iter().enumerate() {
            if id >= layout.num_blocks() {
                return Err(CopyError::BlockOutOfRange { position: i, id, num_blocks: layout.num_blocks() });
            }
        }
        if unique {
            let mut dup = None;
            for (i, &id) in ids.iter().enumerate() {
                let (w, b) = ((id / 64) as usize, id % 64);
                if self.seen[w] & (1 << b) != 0 {
                    dup = Some((i, id));
                    break;
                }
                self.seen[w] |= 1 << b;
            }
            for &id in ids {
                self.seen[(id / 64) as usize] = 0;
            }
            if let Some((position, id)) = dup {
                return Err(CopyError::DuplicateBlock { position, id });
            }
        }
        Ok(())
    }
}
