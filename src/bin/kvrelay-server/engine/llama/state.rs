//! llama.cpp's sequence state (format 4 of the pinned build) as the engine reads and writes
//! it: the [`Schema`] of one model's blob (read off a probe export at load), the import blob
//! built from pool blocks, and the export cut back into blocks (the block layout is in the
//! parent module's docs).

use super::SEQ;

/// The sequence-state blob's leading magic number.
const STATE_MAGIC: u32 = 0xaf14_3cd8;

/// The state layout of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LayerLayout {
    pub(super) k_type: i32,
    pub(super) k_row: usize,
    pub(super) v_type: i32,
    pub(super) v_el: usize,
    pub(super) n_embd_v: usize,
}

/// The state blob's layout for this model and build (read off a probe export at load).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    pub(super) n_rot_k: u32,
    pub(super) n_rot_v: u32,
    pub(super) layers: Vec<LayerLayout>,
    pub(super) block_tokens: usize,
}

impl Schema {
    /// KV bytes of one token over every layer.
    pub fn token_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k_row + l.n_embd_v * l.v_el).sum()
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.token_bytes() * self.block_tokens
    }

    fn k_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k_row).sum::<usize>() * self.block_tokens
    }

    /// A state blob of `n` blocks (`blocks`: `n * block_bytes`, block-major, in prefix order)
    /// for llama.cpp to import into an empty sequence: cells at positions `0..n * block_tokens`.
    pub fn build_import(&self, blocks: &[u8], n: usize, out: &mut Vec<u8>) {
        let bt = self.block_tokens;
        let bb = self.block_bytes();
        debug_assert_eq!(blocks.len(), n * bb);
        let cells = n * bt;
        out.clear();
        out.reserve(24 + cells * 12 + 16 + self.layers.len() * 24 + n * bb);
        put_u32(out, STATE_MAGIC);
        put_u32(out, SEQ as u32);
        put_u32(out, 1); // streams
        put_u32(out, cells as u32);
        for p in 0..cells as u32 {
            put_u32(out, p); // position
            put_u32(out, 1); // sequence ids of the cell
            put_u32(out, SEQ as u32);
        }
        put_u32(out, 1); // V transposed (flash attention off)
        put_u32(out, self.layers.len() as u32);
        put_u32(out, self.n_rot_k);
        put_u32(out, self.n_rot_v);
        let mut k_off = 0;
        for l in &self.layers {
            out.extend_from_slice(&l.k_type.to_le_bytes());
            out.extend_from_slice(&(l.k_row as u64).to_le_bytes());
            let run = bt * l.k_row;
            for b in 0..n {
                out.extend_from_slice(&blocks[b * bb + k_off..][..run]);
            }
            k_off += run;
        }
        let mut v_off = self.k_bytes();
        for l in &self.layers {
            out.extend_from_slice(&l.v_type.to_le_bytes());
            put_u32(out, l.v_el as u32);
            put_u32(out, l.n_embd_v as u32);
            let run = bt * l.v_el;
            for j in 0..l.n_embd_v {
                for b in 0..n {
                    out.extend_from_slice(&blocks[b * bb + v_off + j * run..][..run]);
                }
            }
            v_off += l.n_embd_v * run;
        }
    }

    /// Cut blocks `from..to` out of an exported blob of exactly `to * block_tokens` cells at
    /// positions `0..` in cell order, into `out` (block-major, `(to - from) * block_bytes`).
    pub fn cut_blocks(&self, blob: &[u8], from: usize, to: usize, out: &mut Vec<u8>) -> Result<(), String> {
        let bt = self.block_tokens;
        let parsed = parse(blob, Some(to * bt))?;
        if parsed.schema_parts() != (self.n_rot_k, self.n_rot_v, &self.layers[..]) {
            return Err("the exported KV state does not have the layout probed at load".into());
        }
        let cells = to * bt;
        let bb = self.block_bytes();
        out.clear();
        out.resize((to - from) * bb, 0);
        for (i, b) in (from..to).enumerate() {
            let blk = &mut out[i * bb..(i + 1) * bb];
            let mut o = 0;
            for (l, k) in self.layers.iter().zip(&parsed.k) {
                let run = bt * l.k_row;
                blk[o..o + run].copy_from_slice(&k[b * run..][..run]);
                o += run;
            }
            for (l, v) in self.layers.iter().zip(&parsed.v) {
                let run = bt * l.v_el;
                for j in 0..l.n_embd_v {
                    blk[o..o + run].copy_from_slice(&v[j * cells * l.v_el + b * run..][..run]);
                    o += run;
                }
            }
            debug_assert_eq!(o, bb);
        }
        Ok(())
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// A parsed sequence-state blob (one stream).
pub(super) struct Parsed<'a> {
    pub(super) n_rot_k: u32,
    pub(super) n_rot_v: u32,
    pub(super) layers: Vec<LayerLayout>,
    k: Vec<&'a [u8]>,
    v: Vec<&'a [u8]>,
}

impl Parsed<'_> {
    fn schema_parts(&self) -> (u32, u32, &[LayerLayout]) {
        (self.n_rot_k, self.n_rot_v, &self.layers)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("the KV state blob ends early".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
}

/// Parse a single-sequence state blob of format 4, checking that it holds `cells` cells (when
/// given) at positions `0..` in cell order, V transposed, and nothing after the last layer.
pub(super) fn parse(blob: &[u8], cells: Option<usize>) -> Result<Parsed<'_>, String> {
    let mut r = Reader(blob);
    if r.u32()? != STATE_MAGIC {
        return Err("the KV state blob has an unknown magic number (another llama.cpp build?)".into());
    }
    let _seq = r.u32()?;
    if r.u32()? != 1 {
        return Err("the KV state has more than one stream (kv_unified must be on)".into());
    }
    let c = r.u32()? as usize;
    if let Some(want) = cells {
        if c != want {
            return Err(format!("the KV state holds {c} cells, expected {want}"));
        }
    }
    for p in 0..c {
        let pos = r.u32()?;
        let n_seq = r.u32()?;
        let _seq = r.u32()?;
        if pos as usize != p || n_seq != 1 {
            return Err(format!("KV cell {p} holds position {pos} ({n_seq} sequences): not a fresh prefix"));
        }
    }
    if r.u32()? != 1 {
        return Err("the KV state's V is not transposed (flash attention must be off)".into());
    }
    let n_layer = r.u32()? as usize;
    let n_rot_k = r.u32()?;
    let n_rot_v = r.u32()?;
    if n_layer == 0 || n_layer > 4096 {
        return Err(format!("the KV state names {n_layer} layers"));
    }
    let mut layers = Vec::with_capacity(n_layer);
    let mut k = Vec::with_capacity(n_layer);
    for _ in 0..n_layer {
        let k_type = r.u32()? as i32;
        let k_row = usize::try_from(r.u64()?).map_err(|_| "a K row size overflows")?;
        k.push(r.take(c.checked_mul(k_row).ok_or("a K size overflows")?)?);
        layers.push(LayerLayout { k_type, k_row, v_type: 0, v_el: 0, n_embd_v: 0 });
    }
    let mut v = Vec::with_capacity(n_layer);
    for l in layers.iter_mut() {
        l.v_type = r.u32()? as i32;
        l.v_el = r.u32()? as usize;
        l.n_embd_v = r.u32()? as usize;
        let n = c.checked_mul(l.v_el).and_then(|x| x.checked_mul(l.n_embd_v)).ok_or("a V size overflows")?;
        v.push(r.take(n)?);
    }
    if !r.0.is_empty() {
        return Err(format!(
            "{} bytes follow the KV state's last layer (a layout this build does not know)",
            r.0.len()
        ));
    }
    Ok(Parsed { n_rot_k, n_rot_v, layers, k, v })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> Schema {
        let l = LayerLayout { k_type: 1, k_row: 8, v_type: 1, v_el: 2, n_embd_v: 4 };
        Schema { n_rot_k: 4, n_rot_v: 4, layers: vec![l, l, l], block_tokens: 2 }
    }

    #[test]
    fn import_blob_and_export_cut_are_inverse() {
        let s = schema();
        let n = 3;
        let blocks: Vec<u8> = (0..n * s.block_bytes()).map(|i| (i * 7 + 3) as u8).collect();
        let mut blob = Vec::new();
        s.build_import(&blocks, n, &mut blob);
        let parsed = parse(&blob, Some(n * 2)).unwrap();
        assert_eq!(parsed.schema_parts(), (4, 4, &s.layers[..]));
        let mut cut = Vec::new();
        s.cut_blocks(&blob, 0, n, &mut cut).unwrap();
        assert_eq!(cut, blocks);
        s.cut_blocks(&blob, 1, n, &mut cut).unwrap();
        assert_eq!(cut, blocks[s.block_bytes()..]);
        // a blob of a different length, cell count or layout is refused
        assert!(s.cut_blocks(&blob[..blob.len() - 1], 0, n, &mut cut).is_err());
        assert!(s.cut_blocks(&blob, 0, n - 1, &mut cut).is_err());
        let mut other = schema();
        other.n_rot_k = 8;
        assert!(other.cut_blocks(&blob, 0, n, &mut cut).is_err());
    }

    #[test]
    fn v_is_cut_as_transposed_runs() {
        let s = schema();
        // two blocks; in the blob, layer 0's V row j holds cells 0..4: block 0's two cells
        // then block 1's
        let mut blocks = vec![0u8; 2 * s.block_bytes()];
        let kb = s.k_bytes();
        blocks[s.block_bytes() + kb..s.block_bytes() + kb + 4].copy_from_slice(&[9, 9, 8, 8]);
        let mut blob = Vec::new();
        s.build_import(&blocks, 2, &mut blob);
        let parsed = parse(&blob, Some(4)).unwrap();
        // row 0 of layer 0's V: cell 2 and 3 (block 1) are 9,9 and 8,8
        assert_eq!(&parsed.v[0][..8], &[0, 0, 0, 0, 9, 9, 8, 8]);
    }
}
