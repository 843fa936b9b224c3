//! The KV block checksum (`kvrelay::checksum`) against the corruptions SPEC section 8 names:
//! random two-bit flips at the same bit position in different words (which cancelled in the
//! old keyed sum), whole-word swaps, zeroed runs, and any change within one word.

use kvrelay::checksum::{kv_checksum, kv_checksum_finish, kv_checksum_terms};
use proptest::prelude::*;

fn block(seed: u64, words: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..words * 8)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn two_flips_at_the_same_bit_in_different_words(seed: u64, words in 2usize..512, a: usize, b: usize, bit in 0u32..64) {
        let mut data = block(seed, words);
        let (a, b) = (a % words, b % words);
        prop_assume!(a != b);
        let want = kv_checksum(&data);
        for w in [a, b] {
            let at = w * 8 + (bit / 8) as usize;
            data[at] ^= 1 << (bit % 8);
        }
        prop_assert_ne!(kv_checksum(&data), want);
    }

    #[test]
    fn two_flips_of_bit_63(seed: u64, words in 2usize..512, a: usize, b: usize) {
        let mut data = block(seed, words);
        let (a, b) = (a % words, b % words);
        prop_assume!(a != b);
        let want = kv_checksum(&data);
        data[a * 8 + 7] ^= 0x80;
        data[b * 8 + 7] ^= 0x80;
        prop_assert_ne!(kv_checksum(&data), want);
    }

    #[test]
    fn swapped_words(seed: u64, words in 2usize..512, a: usize, b: usize) {
        let mut data = block(seed, words);
        let (a, b) = (a % words, b % words);
        prop_assume!(data[a * 8..a * 8 + 8] != data[b * 8..b * 8 + 8]);
        let want = kv_checksum(&data);
        for k in 0..8 {
            data.swap(a * 8 + k, b * 8 + k);
        }
        prop_assert_ne!(kv_checksum(&data), want);
    }

    #[test]
    fn zeroed_runs(seed: u64, words in 1usize..512, start: usize, len in 1usize..64) {
        let mut data = block(seed, words);
        let start = start % words;
        let end = (start + len).min(words);
        prop_assume!(data[start * 8..end * 8].iter().any(|&b| b != 0));
        let want = kv_checksum(&data);
        data[start * 8..end * 8].fill(0);
        prop_assert_ne!(kv_checksum(&data), want);
    }

    #[test]
    fn any_change_within_one_word(seed: u64, words in 1usize..512, w: usize, mask in 1u64..) {
        let mut data = block(seed, words);
        let w = w % words;
        let want = kv_checksum(&data);
        let old = u64::from_le_bytes(data[w * 8..w * 8 + 8].try_into().unwrap());
        data[w * 8..w * 8 + 8].copy_from_slice(&(old ^ mask).to_le_bytes());
        prop_assert_ne!(kv_checksum(&data), want);
    }

    #[test]
    fn summed_in_pieces_where_they_lie(seed: u64, words in 2usize..512, cut: usize) {
        let data = block(seed, words);
        let cut = 1 + cut % (words - 1);
        let (a, b) = data.split_at(cut * 8);
        let sum = kv_checksum_terms(b, cut as u64).wrapping_add(kv_checksum_terms(a, 0));
        prop_assert_eq!(kv_checksum_finish(sum, data.len() as u64), kv_checksum(&data));
    }
}

/// The checksum this one replaced let two flips of one bit in two words cancel (this shows the
/// property test above can fail: the same inputs against the old sum collide).
#[test]
fn the_old_keyed_sum_missed_what_the_new_one_catches() {
    const K1: u64 = 0x9E37_79B9_7F4A_7C15;
    const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    let old = |b: &[u8]| -> u64 {
        b.chunks(8)
            .enumerate()
            .map(|(i, w)| (u64::from_le_bytes(w.try_into().unwrap()) ^ (i as u64).wrapping_mul(K1)).wrapping_mul(K2))
            .fold(0u64, u64::wrapping_add)
    };
    let mut data = block(7, 64);
    let (o, n) = (old(&data), kv_checksum(&data));
    data[3 * 8 + 7] ^= 0x80;
    data[9 * 8 + 7] ^= 0x80;
    assert_eq!(old(&data), o, "two flips of bit 63 cancel in the old sum");
    assert_ne!(kv_checksum(&data), n);
}
