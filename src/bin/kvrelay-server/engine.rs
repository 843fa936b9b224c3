//! The reference engine: small, deterministic and honest about reuse.
//!
//! - **Tokenizer.** A prompt's UTF-8 bytes are cut into 4-byte pieces; each piece is one token,
//!   its id the piece read as a little-endian `u32` (the last piece zero-padded). Deterministic,
//!   reversible, about as many characters per token as a real BPE vocabulary. Token-id prompts
//!   (`[1, 2, 3]`) are taken as given. Chat messages are rendered with a fixed template first:
//!   `<|ROLE|>\nCONTENT\n` per message, then `<|assistant|>\n`.
//! - **Block names** (SPEC section 8): `name(i) = XXH3-64(seed, name(i-1) or 0 as u64 LE,
//!   lora_id as u64 LE, [cache_salt length as u64 LE, cache_salt bytes if i == 0], tokens of
//!   block i as u32 LE)`, seed [`NAME_SEED`]. Only full blocks are named.
//! - **KV.** Token `p`'s KV is a pure function of its prefix: `h(p) = XXH3-64(token_p as u32
//!   LE, seed h(p-1))` (`h(-1) = MODEL_SEED`), and the bytes of each (layer, K/V) head slice are a
//!   splitmix64 stream seeded by `h(p)` and the slice number. A block holds, for each layer and
//!   K/V, `block_tokens` slices of `kv_heads * head_dim * dtype_bytes` bytes. Prefill writes
//!   them through the copy engine (scatter from staging), so its work grows with the tokens and
//!   the KV bytes; a modeled compute rate (`--prefill-tokens-per-s`) then stretches each
//!   prefill to the time a real model would take, so time-to-first-token comparisons mean
//!   something.
//! - **Generation** reads every KV byte of the prompt back through the copy engine (gather) and
//!   hashes it; output token `j` is `XXH3-64(digest, j, token j-1)` mapped onto a fixed word
//!   list. Reused KV that differs by one bit from what a cold prefill writes gives a different
//!   answer.
//!
//! **The seam.** [`Engine`] is what the server talks to: a [`Model`] (tokenizer, chat template,
//! block naming over its own token ids, the identity the KV fingerprint carries) and the KV
//! backend over the pool and the reuse cache (which named blocks are held, run a request from
//! its held prefix, export the blocks a prefill completed into the pool the KV agent serves,
//! import fetched ones, which the transfer layer committed to the same cache). The reference
//! model above is one implementation; llama.cpp (module `llama`, feature `llama`) is the
//! second.

use std::sync::Arc;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

use crate::abi::AbiError;
use crate::cache::{BlockCache, Lease, NeverFits};

#[cfg(feature = "llama")]
pub mod llama;
mod store;
pub use store::{chunk_blocks, KvStore};

/// Seed of the reference model's block names (the library's base seed; part of the layout
/// fingerprint's naming scheme).
pub const NAME_SEED: u64 = kvrelay::names::NAME_SEED;
/// Seed of the reference model's KV function.
pub const MODEL_SEED: u64 = 0x6d6f_6465_6c2d_7631;

/// The KV shape and block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Layers.
    pub layers: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head size.
    pub head_dim: usize,
    /// Bytes per element.
    pub dtype_bytes: usize,
}

impl Shape {
    /// Bytes of one token's K or V in one layer.
    pub fn slice_bytes(&self) -> usize {
        self.kv_heads * self.head_dim * self.dtype_bytes
    }
    /// Bytes of one token's KV over every layer.
    pub fn token_bytes(&self) -> usize {
        2 * self.layers * self.slice_bytes()
    }
    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.token_bytes() * self.block_tokens
    }
}

/// Tokenize text (see the module docs).
pub fn tokenize(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// Render chat messages with the fixed template.
pub fn render_chat(messages: &[(String, String)]) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str("<|");
        s.push_str(role);
        s.push_str("|>\n");
        s.push_str(content);
        s.push('\n');
    }
    s.push_str("<|assistant|>\n");
    s
}

/// The names of the full blocks of `tokens` under the reference model's seed [`NAME_SEED`].
#[cfg(test)]
pub fn block_names(tokens: &[u32], block_tokens: usize, lora_id: u64, salt: Option<&str>) -> Vec<u64> {
    crate::abi::names::block_names(NAME_SEED, tokens, block_tokens, lora_id, salt)
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What [`Engine::on_reusable`] calls: the blocks that just became reusable and their content
/// digests ([`Engine::block_digests`]), one per block.
pub type OnReusable = Box<dyn Fn(&[u32], &[[u8; 32]]) + Send + Sync>;

/// Engine settings.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// KV shape.
    pub shape: Shape,
    /// Modeled prefill rate, tokens per second (0: no modeled time, compute only).
    pub prefill_tokens_per_s: f64,
}

/// One generation's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// Output tokens (indices into the word list).
    pub tokens: Vec<u32>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused.
    pub cached_tokens: usize,
    /// Prompt tokens prefilled here.
    pub prefilled_tokens: usize,
    /// Generation ended at an end-of-generation token (`finish_reason: stop`), not at
    /// `max_tokens` (`length`).
    pub stopped: bool,
    /// A real model's digest of every step's logits (the `x-kvrelay-logits` header with
    /// `--debug-endpoints`); `None` for the reference model.
    pub logits_digest: Option<u64>,
    /// Time to first token: from the request's start (its fetch included, once the HTTP layer
    /// added it) to the first output token's logits (the `x-kvrelay-ttft-ms` header).
    pub ttft: Duration,
    /// Per output token: its log-probability and the alternatives (the reference model is
    /// certain of each token it emits: 0, the token alone).
    pub logprobs: Vec<TokenLogprob>,
}

impl Generation {
    /// The OpenAI `finish_reason`.
    pub fn finish_reason(&self) -> &'static str {
        if self.stopped {
            "stop"
        } else {
            "length"
        }
    }
}

/// Why a generation failed.
#[derive(Debug)]
pub enum EngineError {
    /// The prompt can never fit in the pool.
    NeverFits(NeverFits),
    /// An empty prompt.
    EmptyPrompt,
    /// The copy engine failed.
    Copy(AbiError),
    /// The prompt and `max_tokens` exceed the model's context.
    ContextLength {
        /// Prompt tokens plus `max_tokens`.
        needed: usize,
        /// Tokens per context.
        limit: usize,
    },
    /// The model's run failed.
    Model(String),
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineError::NeverFits(n) => write!(
                f,
                "the prompt needs {} KV blocks and the pool holds {}; it can never be served (shorten it or start the server with more --kv-blocks)",
                n.needed, n.capacity
            ),
            EngineError::EmptyPrompt => f.write_str("the prompt is empty"),
            EngineError::Copy(e) => write!(f, "KV copy failed: {e}"),
            EngineError::ContextLength { needed, limit } => write!(
                f,
                "the prompt and max_tokens need {needed} tokens of context and the model's contexts hold {limit} (shorten the prompt, lower max_tokens, or raise --llama-ctx)"
            ),
            EngineError::Model(e) => write!(f, "the model failed: {e}"),
        }
    }
}

/// Words that output token ids map onto.
pub const WORDS: [&str; 32] = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
    "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray",
    "yankee", "zulu", "red", "green", "blue", "amber", "violet", "white",
];

/// Render output tokens as text (each token a word, space-separated).
pub fn detokenize(tokens: &[u32]) -> Vec<String> {
    tokens.iter().enumerate().map(|(i, &t)| detokenize_one(t, i == 0)).collect()
}

/// The reference model's text of output token `t` (words are separated by a space).
fn detokenize_one(t: u32, first: bool) -> String {
    format!("{}{}", if first { "" } else { " " }, WORDS[t as usize % WORDS.len()])
}

/// Where a generation sends its output tokens one by one, each with its log-probability
/// ([`Engine::generate_streaming`]).
pub type TokenSink = tokio::sync::mpsc::UnboundedSender<(u32, TokenLogprob)>;

/// Alternatives kept per output token (OpenAI's `top_logprobs` allows at most 20).
pub const TOP_LOGPROBS: usize = 20;

/// An output token's log-probability (natural log) and the most likely tokens at its step, most
/// likely first (at most [`TOP_LOGPROBS`]; the chosen token is among them: decoding is greedy).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenLogprob {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// `(token, log-probability)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities of a step's `logits` (a log-softmax in f64): `chosen`'s and the `k`
/// most likely tokens' (ties: the lower id first). One pass for the maximum, one for the sum,
/// one for the top `k`; no allocation beyond the `k` entries.
#[cfg_attr(not(feature = "llama"), allow(dead_code))]
pub fn logprobs_of(logits: &[f32], chosen: u32, k: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &x) in logits.iter().enumerate() {
        if top.len() == k && top.last().is_none_or(|&(_, low)| x <= low) {
            continue;
        }
        let at = top.partition_point(|&(_, y)| y >= x);
        top.insert(at, (i as u32, x));
        top.truncate(k);
    }
    let lp = |x: f32| (f64::from(x) - lse) as f32;
    TokenLogprob {
        logprob: logits.get(chosen as usize).map_or(f32::NEG_INFINITY, |&x| lp(x)),
        top: top.into_iter().map(|(t, x)| (t, lp(x))).collect(),
    }
}

/// Turns output tokens into text one token at a time, as [`Engine::detokenize`] does for a
/// whole generation: the pieces it returns, then [`finish`](Self::finish), concatenate to the
/// same text (a character split across tokens comes out with its last token).
pub struct Detokenizer<'a> {
    engine: &'a Engine,
    pending: Vec<u8>,
    count: usize,
}

impl Detokenizer<'_> {
    /// The text token `t` completes (empty while a character is still incomplete).
    pub fn push(&mut self, t: u32) -> String {
        self.count += 1;
        match &self.engine.model {
            Model::Reference => detokenize_one(t, self.count == 1),
            #[cfg(feature = "llama")]
            Model::Llama(l) => {
                l.piece(t, &mut self.pending);
                let valid = match std::str::from_utf8(&self.pending) {
                    Ok(_) => self.pending.len(),
                    Err(e) if e.error_len().is_none() => e.valid_up_to(),
                    Err(_) => self.pending.len(),
                };
                let rest = self.pending.split_off(valid);
                let out = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending = rest;
                out
            }
        }
    }

    /// What is left once the generation ended (an incomplete character, replaced).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// The model behind the seam.
pub enum Model {
    /// The reference model (module docs).
    Reference,
    /// llama.cpp running a GGUF.
    #[cfg(feature = "llama")]
    Llama(llama::Llama),
}

/// Sets the flag when the request's future is dropped (a run on a blocking thread stops at its
/// next decode call and gives its context back).
#[cfg(feature = "llama")]
struct CancelOnDrop(Arc<std::sync::atomic::AtomicBool>);

#[cfg(feature = "llama")]
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The engine: pool bytes, block table, model.
pub struct Engine {
    /// Settings.
    pub config: EngineConfig,
    /// The model.
    pub model: Model,
    /// The block table and reuse cache.
    pub cache: Arc<BlockCache>,
    /// The bytes.
    pub store: KvStore,
    /// Called with a block's id when a prefill wrote it completely, before it is published in
    /// the reuse cache (the KV agent records its checksum here).
    pub on_reusable: std::sync::OnceLock<OnReusable>,
}

impl Engine {
    /// An engine over `store` with `store`'s block count in `cache`.
    pub fn new(config: EngineConfig, cache: Arc<BlockCache>, store: KvStore) -> Engine {
        Engine::with_model(Model::Reference, config, cache, store)
    }

    /// An engine running `model` (its shape is `config.shape`).
    pub fn with_model(model: Model, config: EngineConfig, cache: Arc<BlockCache>, store: KvStore) -> Engine {
        Engine { config, model, cache, store, on_reusable: std::sync::OnceLock::new() }
    }

    /// The seed of this model's block names.
    pub fn name_seed(&self) -> u64 {
        match &self.model {
            Model::Reference => NAME_SEED,
            #[cfg(feature = "llama")]
            Model::Llama(l) => crate::abi::names::name_seed(l.identity.as_bytes()),
        }
    }

    /// The KV fingerprint's naming scheme: the naming function, its seed and the model's
    /// identity (two instances agree on it only when their KV is interchangeable).
    pub fn naming(&self) -> String {
        match &self.model {
            Model::Reference => format!("xxh3-chain/v1/{NAME_SEED:016x}/{MODEL_SEED:016x}"),
            #[cfg(feature = "llama")]
            Model::Llama(l) => format!("xxh3-chain/v1/{:016x}/{}", self.name_seed(), l.identity),
        }
    }

    /// The names of the full blocks of `tokens` (SPEC section 8, this model's seed).
    pub fn block_names(&self, tokens: &[u32], salt: Option<&str>) -> Vec<u64> {
        crate::abi::names::block_names(self.name_seed(), tokens, self.config.shape.block_tokens, 0, salt)
    }

    /// The content digests of the full blocks of `tokens` under this engine's identity (its
    /// naming scheme, [`Engine::naming`]): what a checked fetch asks for, and what a block is
    /// served with.
    pub fn block_digests(&self, tokens: &[u32]) -> Vec<[u8; 32]> {
        crate::abi::names::block_digests(self.naming().as_bytes(), tokens, self.config.shape.block_tokens)
    }

    /// Tokenize a text prompt.
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        match &self.model {
            Model::Reference => tokenize(text),
            #[cfg(feature = "llama")]
            Model::Llama(l) => l.tokenize(text),
        }
    }

    /// Render chat messages (role, content) into the prompt text, the assistant's turn opened.
    pub fn render_chat(&self, messages: &[(String, String)]) -> Result<String, String> {
        match &self.model {
            Model::Reference => Ok(render_chat(messages)),
            #[cfg(feature = "llama")]
            Model::Llama(l) => l.render_chat(messages),
        }
    }

    /// A [`Detokenizer`] for one generation.
    pub fn detokenizer(&self) -> Detokenizer<'_> {
        Detokenizer { engine: self, pending: Vec::new(), count: 0 }
    }

    /// The bytes of output token `t` alone (what a logprobs entry names; a character split
    /// across tokens is not whole here). `first`: the generation's first token (the reference
    /// model writes no space before it).
    pub fn token_bytes(&self, t: u32, first: bool) -> Vec<u8> {
        match &self.model {
            Model::Reference => detokenize_one(t, first).into_bytes(),
            #[cfg(feature = "llama")]
            Model::Llama(l) => {
                let mut out = Vec::new();
                l.piece(t, &mut out);
                out
            }
        }
    }

    /// Output tokens as text pieces (one per token).
    pub fn detokenize(&self, tokens: &[u32]) -> Vec<String> {
        match &self.model {
            Model::Reference => detokenize(tokens),
            #[cfg(feature = "llama")]
            Model::Llama(l) => l.detokenize(tokens),
        }
    }

    /// Whether a token-id prompt is valid for this model (ids within the vocabulary).
    #[cfg_attr(not(feature = "llama"), allow(unused_variables))]
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), String> {
        match &self.model {
            Model::Reference => Ok(()),
            #[cfg(feature = "llama")]
            Model::Llama(l) => match tokens.iter().find(|&&t| t as usize >= l.n_vocab()) {
                Some(t) => Err(format!("token id {t} is outside the model's vocabulary of {}", l.n_vocab())),
                None => Ok(()),
            },
        }
    }

    /// Local prefill rate in tokens/s for the fetch-or-prefill estimate (the modeled rate of
    /// the reference engine, the rate measured at load for a real model; 0: unknown).
    pub fn prefill_rate(&self) -> f64 {
        match &self.model {
            Model::Reference => self.config.prefill_tokens_per_s,
            #[cfg(feature = "llama")]
            Model::Llama(l) => l.prefill_tokens_per_s,
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.shape.block_tokens)
    }

    /// Fill `out` (one block) with the KV of `tokens` whose first token has prefix state
    /// `h` (updated to the state after the last token); `first` is the token's slot in the block.
    fn write_kv(&self, h: &mut u64, tokens: &[u32], first: usize, out: &mut [u8]) {
        let sh = self.config.shape;
        let slice = sh.slice_bytes();
        for (k, &t) in tokens.iter().enumerate() {
            *h = xxh3_64_with_seed(&t.to_le_bytes(), *h);
            let slot = first + k;
            for s in 0..2 * sh.layers {
                let off = (s * sh.block_tokens + slot) * slice;
                let mut st = *h ^ (s as u64).wrapping_mul(0x100_0000_01b3);
                for chunk in out[off..off + slice].chunks_mut(8) {
                    let v = splitmix(&mut st).to_le_bytes();
                    chunk.copy_from_slice(&v[..chunk.len()]);
                }
            }
        }
    }

    /// Run one prompt: reuse the cached prefix (`names` are its full-block names), prefill the
    /// rest through the copy engine, then generate `max_tokens` tokens from the KV bytes read
    /// back. Cancel-safe: dropping the future releases every block it took.
    #[allow(clippy::needless_range_loop)] // `i` indexes the lease, the names and the tokens
    pub async fn generate(&self, tokens: &[u32], names: &[u64], max_tokens: usize) -> Result<Generation, EngineError> {
        self.generate_streaming(tokens, names, max_tokens, None).await
    }

    /// [`generate`](Self::generate), sending each output token to `on_token` as soon as it is
    /// chosen (the real model decodes token by token; a closed receiver is ignored).
    pub async fn generate_streaming(
        &self,
        tokens: &[u32],
        names: &[u64],
        max_tokens: usize,
        on_token: Option<TokenSink>,
    ) -> Result<Generation, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        #[cfg(feature = "llama")]
        if let Model::Llama(l) = &self.model {
            return self.generate_llama(l, tokens, names, max_tokens, on_token).await;
        }
        let sh = self.config.shape;
        let total = self.blocks_for(tokens.len());
        let lease = self.cache.acquire(names, total).await.map_err(EngineError::NeverFits)?;
        let started = Instant::now();
        let cached_tokens = lease.hits * sh.block_tokens;
        // Prefix state up to the first token to compute (hashes only, no KV).
        let mut h = MODEL_SEED;
        for &t in &tokens[..cached_tokens] {
            h = xxh3_64_with_seed(&t.to_le_bytes(), h);
        }
        let bb = self.store.block_bytes();
        let mut staging = vec![0u8; bb];
        let mut digests = None;
        for i in lease.hits..total {
            let lo = i * sh.block_tokens;
            let hi = (lo + sh.block_tokens).min(tokens.len());
            self.write_kv(&mut h, &tokens[lo..hi], 0, &mut staging);
            self.store.write(&lease.ids[i..i + 1], &staging).map_err(EngineError::Copy)?;
            if hi - lo == sh.block_tokens {
                if let Some(f) = self.on_reusable.get() {
                    let digests = digests.get_or_insert_with(|| self.block_digests(tokens));
                    f(&lease.ids[i..i + 1], &digests[i..i + 1]);
                }
                lease.commit(i, names[i], i.checked_sub(1).map(|p| names[p]), &tokens[lo..hi]);
            }
            tokio::task::yield_now().await;
        }
        let prefilled = tokens.len() - cached_tokens;
        if self.config.prefill_tokens_per_s > 0.0 && prefilled > 0 {
            let modeled = Duration::from_secs_f64(prefilled as f64 / self.config.prefill_tokens_per_s);
            let spent = started.elapsed();
            if modeled > spent {
                tokio::time::sleep(modeled - spent).await;
            }
        }
        let digest = self.read_digest(&lease, tokens.len())?;
        let ttft = started.elapsed();
        drop(lease);
        let mut out = Vec::with_capacity(max_tokens);
        let mut logprobs = Vec::with_capacity(max_tokens);
        let mut prev = 0u32;
        for j in 0..max_tokens {
            let mut b = [0u8; 12];
            b[..8].copy_from_slice(&(j as u64).to_le_bytes());
            b[8..].copy_from_slice(&prev.to_le_bytes());
            prev = (xxh3_64_with_seed(&b, digest) % WORDS.len() as u64) as u32;
            out.push(prev);
            let lp = TokenLogprob { logprob: 0.0, top: vec![(prev, 0.0)] };
            if let Some(s) = &on_token {
                let _ = s.send((prev, lp.clone()));
            }
            logprobs.push(lp);
        }
        Ok(Generation {
            tokens: out,
            prompt_tokens: tokens.len(),
            cached_tokens,
            prefilled_tokens: prefilled,
            stopped: false,
            logits_digest: None,
            ttft,
            logprobs,
        })
    }

    /// [`generate`](Self::generate) on llama.cpp: the leading held blocks (at most all but the
    /// block of the last prompt token, whose logits the first output needs) are read from the
    /// pool and imported in prefix order; the rest of the prompt is decoded; the full prompt
    /// blocks this instance did not hold are exported into the lease's fresh blocks, their
    /// checksums recorded, and committed; then greedy decoding. Cancel-safe: dropping the future
    /// stops the run at its next decode call and releases every block.
    #[cfg(feature = "llama")]
    async fn generate_llama(
        &self,
        l: &llama::Llama,
        tokens: &[u32],
        names: &[u64],
        max_tokens: usize,
        on_token: Option<TokenSink>,
    ) -> Result<Generation, EngineError> {
        let started = Instant::now();
        let bt = self.config.shape.block_tokens;
        let needed = tokens.len() + max_tokens;
        if needed > l.n_ctx() {
            return Err(EngineError::ContextLength { needed, limit: l.n_ctx() });
        }
        let full = names.len();
        debug_assert_eq!(full, tokens.len() / bt);
        let lease = self.cache.acquire(names, full).await.map_err(EngineError::NeverFits)?;
        let import = lease.hits.min((tokens.len() - 1) / bt);
        let bb = self.store.block_bytes();
        let mut prefix = vec![0u8; import * bb];
        if import > 0 {
            self.store.read(&lease.ids[..import], &mut prefix).map_err(EngineError::Copy)?;
        }
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let _cancel = CancelOnDrop(cancel.clone());
        let out = l
            .run(llama::RunRequest {
                tokens: tokens.to_vec(),
                prefix,
                import_blocks: import,
                export_from: lease.hits,
                export_to: full,
                max_tokens,
                cancel,
                on_token,
            })
            .await
            .map_err(EngineError::Model)?;
        if full > lease.hits {
            let fresh = &lease.ids[lease.hits..full];
            self.store.write(fresh, &out.exported).map_err(EngineError::Copy)?;
            if let Some(f) = self.on_reusable.get() {
                f(fresh, &self.block_digests(tokens)[lease.hits..full]);
            }
            for (i, &name) in names.iter().enumerate().skip(lease.hits) {
                lease.commit(i, name, i.checked_sub(1).map(|p| names[p]), &tokens[i * bt..(i + 1) * bt]);
            }
        }
        drop(lease);
        let cached_tokens = import * bt;
        Ok(Generation {
            tokens: out.tokens,
            prompt_tokens: tokens.len(),
            cached_tokens,
            prefilled_tokens: tokens.len() - cached_tokens,
            stopped: out.stopped,
            logprobs: out.logprobs,
            logits_digest: Some(out.logits_digest),
            ttft: out.first_token.saturating_duration_since(started),
        })
    }

    /// Read every valid KV byte of the prompt back through the copy engine and hash it.
    fn read_digest(&self, lease: &Lease, n_tokens: usize) -> Result<u64, EngineError> {
        let sh = self.config.shape;
        let bb = self.store.block_bytes();
        let mut hasher = Xxh3::with_seed(MODEL_SEED);
        let per = chunk_blocks(bb);
        let mut buf = vec![0u8; bb * per.min(lease.ids.len())];
        for (c, ids) in lease.ids.chunks(per).enumerate() {
            let part = &mut buf[..ids.len() * bb];
            self.store.read(ids, part).map_err(EngineError::Copy)?;
            for (k, block) in part.chunks(bb).enumerate() {
                let first_token = (c * per + k) * sh.block_tokens;
                let valid = (n_tokens - first_token).min(sh.block_tokens);
                if valid == sh.block_tokens {
                    hasher.update(block);
                } else {
                    // a partial block: only its valid token slots (the rest is stale memory)
                    let slice = sh.slice_bytes();
                    for s in 0..2 * sh.layers {
                        let off = s * sh.block_tokens * slice;
                        hasher.update(&block[off..off + valid * slice]);
                    }
                }
            }
        }
        Ok(hasher.digest())
    }

    /// Flip one byte of the block cached under `name` (test hook: proves that wrong KV changes
    /// the answer). Returns whether the block was found.
    pub fn corrupt_block(&self, name: u64) -> Result<bool, AbiError> {
        let lease = self.cache.pin_prefix(&[name]);
        let Some(&b) = lease.ids.first() else { return Ok(false) };
        self.corrupt_block_id(b)?;
        Ok(true)
    }

    /// Flip one byte of block `b` (test hook for `--kv-fault corrupt`: the KV agent's recorded
    /// checksum stays, so this is memory going bad under a committed block).
    pub fn corrupt_block_id(&self, b: u32) -> Result<(), AbiError> {
        let mut buf = vec![0u8; self.store.block_bytes()];
        self.store.read(&[b], &mut buf)?;
        let mid = buf.len() / 2;
        buf[mid] ^= 0x40;
        self.store.write(&[b], &buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(blocks: usize) -> Engine {
        let shape = Shape { block_tokens: 4, layers: 2, kv_heads: 1, head_dim: 8, dtype_bytes: 2 };
        let store = KvStore::host(blocks, shape.block_bytes()).unwrap();
        Engine::new(EngineConfig { shape, prefill_tokens_per_s: 0.0 }, BlockCache::new(blocks), store)
    }

    fn run(e: &Engine, text: &str, salt: Option<&str>) -> Generation {
        let t = tokenize(text);
        let names = block_names(&t, e.config.shape.block_tokens, 0, salt);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(e.generate(&t, &names, 8)).unwrap()
    }

    #[test]
    fn reuse_gives_the_cold_answer_and_corruption_changes_it() {
        let e = engine(16);
        let p = "the quick brown fox jumps over the lazy dog, twice over";
        let cold = run(&e, p, None);
        assert_eq!(cold.cached_tokens, 0);
        let warm = run(&e, p, None);
        assert!(warm.cached_tokens > 0);
        assert_eq!(warm.tokens, cold.tokens);
        let salted = run(&e, p, Some("tenant-b"));
        assert_eq!((salted.cached_tokens, &salted.tokens), (0, &cold.tokens));
        let t = tokenize(p);
        let names = block_names(&t, 4, 0, None);
        assert!(e.corrupt_block(names[1]).unwrap());
        let bad = run(&e, p, None);
        assert!(bad.cached_tokens > 0);
        assert_ne!(bad.tokens, cold.tokens, "corrupted KV must change the answer");
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -50.0];
        let lp = logprobs_of(&logits, 1, 3);
        let lse = (1f64.exp() + 2.0 * 3f64.exp() + 2f64.exp() + (-50f64).exp()).ln();
        assert!((f64::from(lp.logprob) - (3.0 - lse)).abs() < 1e-6, "{lp:?}");
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2], "most likely first, ties by the lower id");
        assert_eq!(lp.top[0].1, lp.logprob);
        // every token's probability adds up to one
        let all = logprobs_of(&logits, 0, logits.len());
        let total: f64 = all.top.iter().map(|t| f64::from(t.1).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(all.top.iter().all(|t| t.1 <= 0.0));
        assert!(logprobs_of(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn names_depend_on_the_whole_prefix_salt_and_lora() {
        let a = block_names(&[1, 2, 3, 4, 5, 6, 7, 8], 4, 0, None);
        let b = block_names(&[9, 2, 3, 4, 5, 6, 7, 8], 4, 0, None);
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1]);
        assert_ne!(a, block_names(&[1, 2, 3, 4, 5, 6, 7, 8], 4, 1, None));
        assert_ne!(a, block_names(&[1, 2, 3, 4, 5, 6, 7, 8], 4, 0, Some("s")));
        assert_eq!(block_names(&[1, 2, 3], 4, 0, None), Vec::<u64>::new());
        assert_eq!(tokenize("abcde"), vec![u32::from_le_bytes(*b"abcd"), u32::from(b'e')]);
    }
}
