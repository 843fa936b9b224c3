//! A real model behind the engine seam (feature `llama`): llama.cpp, CPU only, running a GGUF
//! (SmolLM2-135M-Instruct in the tests and the demo).
//!
//! **Settings that make KV movable.** A fetched or reused prefix gives logits bit-identical to a
//! cold prefill only when both runs do the same arithmetic, so every context is created with:
//! flash attention off (not "auto"), `n_ubatch` equal to the block size (a prompt is decoded in
//! physical batches that start at block edges, imported prefix or not), a unified KV cache with
//! two sequences (the request's, 0, and a scratch one, 1, used for export), F16 K and V, and a
//! fixed thread count. Each request runs alone in a context whose memory it cleared first, so
//! position `i` lives in cell `i` whether it was computed or imported. The same GGUF (by
//! sha256), the same llama.cpp build (crate version and its CPU feature string) and those
//! settings form the engine's identity: it seeds the block names and is the KV fingerprint's
//! naming scheme, so two instances that differ in any of them refuse each other's KV.
//!
//! **A block's bytes** (what the pool holds, what the agent moves and checksums): for each layer
//! in order, the K rows of the block's cells (`block_tokens * k_row` bytes, cell-major, as
//! llama.cpp stores K); then for each layer, V transposed as llama.cpp stores it without flash
//! attention: `n_embd_v` runs of `block_tokens * el` bytes (element `j` of every cell of the
//! block). SmolLM2-135M: 30 layers, `k_row` = 384 bytes (3 KV heads x 64 x F16), 192 V runs of
//! 64 bytes per layer: 23,040 bytes per token, 737,280 per 32-token block.
//!
//! **Export and import** go through llama.cpp's sequence state (format 4 of this build; it
//! carries no version, so the layout is checked at load by exporting a probe and parsing it):
//! export copies the prompt's full blocks into the scratch sequence, serializes it and cuts the
//! rows per block; import writes one state blob of the leading blocks, in prefix order, into the
//! request's empty sequence, then only the rest of the prompt is decoded.
//!
//! **Cost.** Every llama.cpp call runs on a blocking thread (`spawn_blocking`), never on the async
//! executor. A request holds one of `contexts` contexts for its whole run (more wait: the
//! server's running slots are clamped to that number, so the HTTP queue and its 429 apply); a
//! context's KV memory is `n_ctx * token_bytes` (SmolLM2, 8,192 tokens: 189 MB). Import of a
//! 576-token prefix is about 2 ms, export about 8 ms (13.3 MB) on two cores.

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Instant;

use llama_cpp_sys_2 as sys;

mod state;
use state::parse;
pub use state::Schema;

/// The llama.cpp build the identity names (pinned in Cargo.toml).
pub const LLAMA_BUILD: &str = "llama-cpp-sys-2/0.1.161";
/// The request's sequence and the scratch sequence used for export.
const SEQ: i32 = 0;
const SCRATCH: i32 = 1;
/// Tokens per `llama_decode` call (a multiple of the block size): the cancellation check runs
/// between calls.
const CHUNK_BLOCKS: usize = 8;

/// What `--engine llama` loads.
#[derive(Clone, Debug)]
pub struct LlamaSettings {
    /// The GGUF file.
    pub model_file: PathBuf,
    /// Tokens per block (= `n_ubatch`).
    pub block_tokens: usize,
    /// Contexts (requests running at once).
    pub contexts: usize,
    /// Tokens per context (prompt plus output).
    pub n_ctx: usize,
    /// CPU threads per context (0: the cores divided among the contexts, at least one).
    pub threads: usize,
}

/// Threads per context: `threads`, or for 0 the cores divided among the `contexts`, at least
/// one each. Every context using every core oversubscribes the CPU as soon as two requests run
/// (on 2 cores one 503-token request took 13.5 s alone and 152 s beside another; with a thread
/// per context, 10.6 s).
pub fn threads_per_context(threads: usize, contexts: usize) -> usize {
    if threads > 0 {
        return threads;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / contexts.max(1)).max(1)
}

/// The loaded model. llama.cpp allows many contexts of one model on different threads.
struct ModelPtr(*mut sys::llama_model);
// SAFETY: a loaded llama_model is read-only; llama.cpp documents using one model from several
// contexts on several threads. It is freed once, in Drop, after every context (Core's order).
unsafe impl Send for ModelPtr {}
// SAFETY: as above: shared read-only access only.
unsafe impl Sync for ModelPtr {}

impl Drop for ModelPtr {
    fn drop(&mut self) {
        // SAFETY: loaded by llama_model_load_from_file, freed once; every context was freed first.
        unsafe { sys::llama_model_free(self.0) };
    }
}

/// One context and its batch, used by one request at a time.
struct Context {
    ctx: *mut sys::llama_context,
    batch: sys::llama_batch,
    cap: usize,
    /// Reused blob and block buffers (no allocation per request after warm-up, beyond growth).
    blob: Vec<u8>,
}
// SAFETY: a llama_context may move between threads; it is used by one thread at a time (owned
// by the request that took it from the pool).
unsafe impl Send for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the batch came from llama_batch_init and the context from llama_init_from_model;
        // each is freed once, before the model (Core's field order).
        unsafe {
            sys::llama_batch_free(self.batch);
            sys::llama_free(self.ctx);
        }
    }
}

/// What one run produces.
pub struct RunOutput {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Whether generation stopped at an end-of-generation token (else at `max_tokens`).
    pub stopped: bool,
    /// The exported blocks' bytes (block-major).
    pub exported: Vec<u8>,
    /// XXH3-64 of the logits of every step, as bits: equal only when every step's arithmetic
    /// was (tests compare it between a reused or fetched prefix and a cold run).
    pub logits_digest: u64,
    /// Per output token: its log-probability and the most likely alternatives.
    pub logprobs: Vec<super::TokenLogprob>,
    /// When the first output token's logits were ready (the prefill done).
    pub first_token: Instant,
}

/// One request for a context.
pub struct RunRequest {
    /// The whole prompt.
    pub tokens: Vec<u32>,
    /// The leading blocks to import (`import_blocks * block_bytes`, prefix order).
    pub prefix: Vec<u8>,
    /// How many leading blocks `prefix` holds.
    pub import_blocks: usize,
    /// Full prompt blocks to export after the prefill: `export_from..export_to`.
    pub export_from: usize,
    /// End of the export range (blocks).
    pub export_to: usize,
    /// Output tokens at most.
    pub max_tokens: usize,
    /// Set when the request is gone: the run stops at the next decode call.
    pub cancel: Arc<AtomicBool>,
    /// Where each output token goes as soon as it is chosen (streaming).
    pub on_token: Option<super::TokenSink>,
}

struct Core {
    // Field order: contexts are freed before the model.
    contexts: Mutex<Vec<Context>>,
    _model: ModelPtr,
    vocab: *const sys::llama_vocab,
    schema: Schema,
    n_vocab: usize,
    n_ctx: usize,
}
// SAFETY: `vocab` points into the model (read-only, lives as long as `model`); contexts are
// behind a mutex and used by one request at a time.
unsafe impl Send for Core {}
// SAFETY: as above.
unsafe impl Sync for Core {}

/// llama.cpp behind the seam.
pub struct Llama {
    core: Arc<Core>,
    permits: Arc<tokio::sync::Semaphore>,
    template: Option<CString>,
    /// The served model's name (the GGUF's `general.name`, else the file name).
    pub name: String,
    /// Everything the KV depends on: model hash, build, settings (see the module docs).
    pub identity: String,
    /// Contexts (requests running at once).
    pub contexts: usize,
    /// Prompt tokens per second measured at load (the fetch-or-prefill estimate's local rate).
    pub prefill_tokens_per_s: f64,
    n_kv_heads: usize,
}

static BACKEND: Once = Once::new();

unsafe extern "C" fn log_errors(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if level == sys::GGML_LOG_LEVEL_ERROR && !text.is_null() {
        // SAFETY: llama.cpp passes a NUL-terminated message.
        let s = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        eprint!("llama.cpp: {s}");
    }
}

fn sha256_file(path: &Path) -> Result<String, String> {
    use sha2::Digest as _;
    use std::io::Read as _;
    let mut f = std::fs::File::open(path).map_err(|e| format!("--model-file {}: {e}", path.display()))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| format!("--model-file {}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn meta_str(model: *const sys::llama_model, key: &str) -> Option<String> {
    let key = CString::new(key).ok()?;
    let mut buf = vec![0u8; 256];
    // SAFETY: `model` is loaded; key is NUL-terminated; buf is writable for its length.
    let n = unsafe { sys::llama_model_meta_val_str(model, key.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return None;
    }
    let n = (n as usize).min(buf.len() - 1);
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

impl Llama {
    /// Load the model, create the contexts and probe the state layout. Blocking (reads and
    /// hashes the file: about 0.5 s for 98 MB); call it before serving.
    pub fn load(s: &LlamaSettings) -> Result<Llama, String> {
        if s.block_tokens == 0 || s.contexts == 0 || s.n_ctx < s.block_tokens * 2 {
            return Err("--engine llama needs a block size, at least one context and --llama-ctx of two blocks".into());
        }
        let threads = threads_per_context(s.threads, s.contexts);
        let hash = sha256_file(&s.model_file)?;
        BACKEND.call_once(|| {
            // SAFETY: called once per process, before any other llama.cpp call; the callback is
            // a plain function that only reads its arguments.
            unsafe {
                sys::llama_log_set(Some(log_errors), std::ptr::null_mut());
                sys::llama_backend_init();
            }
        });
        // SAFETY: returns a static NUL-terminated string describing the build's CPU features.
        let system = unsafe { CStr::from_ptr(sys::llama_print_system_info()) }.to_string_lossy().into_owned();
        let path = CString::new(s.model_file.as_os_str().to_string_lossy().as_bytes())
            .map_err(|_| "--model-file: the path contains a NUL byte")?;
        // SAFETY: default parameters by value.
        let mut mp = unsafe { sys::llama_model_default_params() };
        mp.n_gpu_layers = 0;
        // SAFETY: path is NUL-terminated; params by value. Null means failure (logged).
        let model = unsafe { sys::llama_model_load_from_file(path.as_ptr(), mp) };
        if model.is_null() {
            return Err(format!("--model-file {}: llama.cpp could not load it", s.model_file.display()));
        }
        let model = ModelPtr(model);
        // SAFETY: the model is loaded; the vocab lives as long as it.
        let vocab = unsafe { sys::llama_model_get_vocab(model.0) };
        // SAFETY: as above.
        let n_vocab = unsafe { sys::llama_vocab_n_tokens(vocab) }.max(0) as usize;
        // SAFETY: as above.
        let n_kv_heads = unsafe { sys::llama_model_n_head_kv(model.0) }.max(1) as usize;
        let name = meta_str(model.0, "general.name")
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| s.model_file.file_stem().map_or("llama".into(), |f| f.to_string_lossy().into_owned()));
        // SAFETY: the model is loaded; a null name asks for the default template; the returned
        // string (or null) lives as long as the model and is copied here.
        let template = unsafe {
            let t = sys::llama_model_chat_template(model.0, std::ptr::null());
            (!t.is_null()).then(|| CStr::from_ptr(t).to_owned())
        };
        let mut contexts = Vec::with_capacity(s.contexts);
        for _ in 0..s.contexts {
            contexts.push(new_context(model.0, s, threads)?);
        }
        // the probe: decode a few blocks, export them, read the layout off the blob
        let probe_blocks = 4.min(s.n_ctx / s.block_tokens - 1).max(1);
        let probe: Vec<u32> = (0..probe_blocks * s.block_tokens).map(|i| (i % n_vocab.max(1)) as u32).collect();
        let t0 = Instant::now();
        let ctx = &mut contexts[0];
        ctx.clear();
        ctx.decode_prompt(&probe, 0, &AtomicBool::new(false))?;
        let rate = probe.len() as f64 / t0.elapsed().as_secs_f64().max(1e-6);
        ctx.export_blob(probe.len())?;
        let parsed = parse(&ctx.blob, Some(probe.len()))?;
        let schema = Schema {
            n_rot_k: parsed.n_rot_k,
            n_rot_v: parsed.n_rot_v,
            layers: parsed.layers.clone(),
            block_tokens: s.block_tokens,
        };
        ctx.clear();
        let l0 = schema.layers[0];
        if schema.layers.iter().any(|l| *l != l0) || l0.k_type != sys::GGML_TYPE_F16 as i32 || l0.v_type != l0.k_type {
            return Err("--engine llama: the model's layers differ in KV shape or are not F16 (not supported)".into());
        }
        if l0.k_row != l0.n_embd_v * l0.v_el || l0.k_row % (2 * n_kv_heads) != 0 {
            return Err("--engine llama: K and V rows differ in size (not supported)".into());
        }
        let identity = format!(
            "{LLAMA_BUILD}/state4/gguf-sha256:{hash}/fa:off/ubatch:{}/kv:f16/unified/threads:{threads}/cpu:{:016x}",
            s.block_tokens,
            xxhash_rust::xxh3::xxh3_64(system.as_bytes())
        );
        let n_ctx = contexts[0].n_ctx();
        let n = contexts.len();
        Ok(Llama {
            core: Arc::new(Core { contexts: Mutex::new(contexts), _model: model, vocab, schema, n_vocab, n_ctx }),
            permits: Arc::new(tokio::sync::Semaphore::new(n)),
            template,
            name,
            identity,
            contexts: n,
            prefill_tokens_per_s: rate,
            n_kv_heads,
        })
    }

    /// The state layout (block bytes and their cut).
    pub fn schema(&self) -> &Schema {
        &self.core.schema
    }

    /// The KV shape the fingerprint reports: layers, KV heads, head size, bytes per element.
    pub fn shape_parts(&self) -> (usize, usize, usize, usize) {
        let l = self.core.schema.layers[0];
        (self.core.schema.layers.len(), self.n_kv_heads, l.k_row / (2 * self.n_kv_heads), 2)
    }

    /// Tokens per context.
    pub fn n_ctx(&self) -> usize {
        self.core.n_ctx
    }

    /// Vocabulary size (token ids of a prompt must be below it).
    pub fn n_vocab(&self) -> usize {
        self.core.n_vocab
    }

    /// Tokenize `text` (the model's BOS when it asks for one; special tokens such as the chat
    /// template's are parsed).
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        let Ok(len) = i32::try_from(text.len()) else { return Vec::new() };
        let mut out: Vec<i32> = vec![0; text.len() + 2];
        for _ in 0..2 {
            // SAFETY: vocab lives as long as the model; text is `len` bytes; out is writable for
            // its length.
            let n = unsafe {
                sys::llama_tokenize(
                    self.core.vocab,
                    text.as_ptr().cast(),
                    len,
                    out.as_mut_ptr(),
                    out.len() as i32,
                    true,
                    true,
                )
            };
            if n >= 0 {
                out.truncate(n as usize);
                return out.into_iter().map(|t| t as u32).collect();
            }
            if n == i32::MIN {
                return Vec::new();
            }
            out.resize((-n) as usize, 0);
        }
        Vec::new()
    }

    /// Render chat messages with the GGUF's own template (llama.cpp's built-in templates), the
    /// assistant's turn opened.
    pub fn render_chat(&self, messages: &[(String, String)]) -> Result<String, String> {
        let tmpl = self.template.as_ref().ok_or("the model file has no chat template")?;
        let owned: Vec<(CString, CString)> = messages
            .iter()
            .map(|(r, c)| Ok((CString::new(r.as_str())?, CString::new(c.as_str())?)))
            .collect::<Result<_, std::ffi::NulError>>()
            .map_err(|_| "a message contains a NUL character".to_string())?;
        let msgs: Vec<sys::llama_chat_message> =
            owned.iter().map(|(r, c)| sys::llama_chat_message { role: r.as_ptr(), content: c.as_ptr() }).collect();
        let total: usize = messages.iter().map(|(r, c)| r.len() + c.len()).sum();
        let mut buf = vec![0u8; 2 * total + 256];
        for _ in 0..2 {
            let cap = i32::try_from(buf.len()).map_err(|_| "the chat is too long")?;
            // SAFETY: tmpl and every message string are NUL-terminated and outlive the call;
            // buf is writable for `cap` bytes.
            let n = unsafe {
                sys::llama_chat_apply_template(
                    tmpl.as_ptr(),
                    msgs.as_ptr(),
                    msgs.len(),
                    true,
                    buf.as_mut_ptr().cast(),
                    cap,
                )
            };
            if n < 0 {
                return Err("the model's chat template is not one llama.cpp supports".into());
            }
            if (n as usize) <= buf.len() {
                buf.truncate(n as usize);
                return String::from_utf8(buf).map_err(|_| "the chat template gave invalid UTF-8".into());
            }
            buf.resize(n as usize, 0);
        }
        Err("the chat template's output kept growing".into())
    }

    /// Append the bytes of token `t` to `out` (special tokens are not rendered).
    pub fn piece(&self, t: u32, out: &mut Vec<u8>) {
        let mut buf = [0u8; 64];
        // SAFETY: vocab lives as long as the model; buf is writable for its length.
        let n = unsafe {
            sys::llama_token_to_piece(self.core.vocab, t as i32, buf.as_mut_ptr().cast(), buf.len() as i32, 0, false)
        };
        if n > 0 {
            out.extend_from_slice(&buf[..n as usize]);
        } else if n < 0 {
            let mut big = vec![0u8; (-n) as usize];
            // SAFETY: as above, with a buffer of the size llama.cpp asked for.
            let m = unsafe {
                sys::llama_token_to_piece(
                    self.core.vocab,
                    t as i32,
                    big.as_mut_ptr().cast(),
                    big.len() as i32,
                    0,
                    false,
                )
            };
            if m > 0 {
                out.extend_from_slice(&big[..m as usize]);
            }
        }
    }

    /// Output tokens as text pieces, one per token; bytes of a character split over tokens go
    /// with the token that completes it, so every piece is valid UTF-8 and the pieces
    /// concatenate to the whole text.
    pub fn detokenize(&self, tokens: &[u32]) -> Vec<String> {
        let mut out = Vec::with_capacity(tokens.len());
        let mut pending = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            self.piece(t, &mut pending);
            let last = i + 1 == tokens.len();
            let valid = match std::str::from_utf8(&pending) {
                Ok(_) => pending.len(),
                Err(e) if e.error_len().is_none() && !last => e.valid_up_to(),
                Err(_) => pending.len(),
            };
            let rest = pending.split_off(valid);
            out.push(String::from_utf8_lossy(&pending).into_owned());
            pending = rest;
        }
        out
    }

    /// Run one request in a free context (waiting for one), on a blocking thread.
    pub async fn run(&self, req: RunRequest) -> Result<RunOutput, String> {
        let permit = self.permits.clone().acquire_owned().await.map_err(|_| "the engine is shutting down")?;
        let core = self.core.clone();
        let task = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut ctx = core.contexts.lock().unwrap_or_else(|e| e.into_inner()).pop().expect("a permit is a context");
            let out = ctx.run(&core, &req);
            core.contexts.lock().unwrap_or_else(|e| e.into_inner()).push(ctx);
            out
        });
        task.await.map_err(|e| format!("the llama.cpp run failed: {e}"))?
    }
}

fn new_context(model: *mut sys::llama_model, s: &LlamaSettings, threads: usize) -> Result<Context, String> {
    let chunk = CHUNK_BLOCKS * s.block_tokens;
    // SAFETY: default parameters by value.
    let mut cp = unsafe { sys::llama_context_default_params() };
    cp.n_ctx = u32::try_from(s.n_ctx).map_err(|_| "--llama-ctx is too large")?;
    cp.n_batch = chunk as u32;
    cp.n_ubatch = s.block_tokens as u32;
    cp.n_seq_max = 2;
    cp.n_threads = threads as i32;
    cp.n_threads_batch = threads as i32;
    cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = sys::GGML_TYPE_F16;
    cp.type_v = sys::GGML_TYPE_F16;
    cp.kv_unified = true;
    cp.offload_kqv = false;
    cp.no_perf = true;
    // SAFETY: the model is loaded; params by value. Null means failure.
    let ctx = unsafe { sys::llama_init_from_model(model, cp) };
    if ctx.is_null() {
        return Err("llama.cpp could not create a context (memory?)".into());
    }
    // SAFETY: allocates a batch of `chunk` tokens with one sequence id each.
    let batch = unsafe { sys::llama_batch_init(chunk as i32, 0, 1) };
    Ok(Context { ctx, batch, cap: chunk, blob: Vec::new() })
}

impl Context {
    fn n_ctx(&self) -> usize {
        // SAFETY: a live context.
        unsafe { sys::llama_n_ctx(self.ctx) as usize }
    }

    fn mem(&self) -> sys::llama_memory_t {
        // SAFETY: a live context.
        unsafe { sys::llama_get_memory(self.ctx) }
    }

    /// Empty the KV memory (metadata only: the cells are rewritten before they are read).
    fn clear(&mut self) {
        // SAFETY: a live context's memory.
        unsafe { sys::llama_memory_clear(self.mem(), false) };
    }

    /// Decode `tokens` at positions `first..` into sequence 0, in calls of `cap` tokens (block
    /// aligned when `first` is); logits only for the last token.
    fn decode_prompt(&mut self, tokens: &[u32], first: usize, cancel: &AtomicBool) -> Result<(), String> {
        let n = tokens.len();
        let mut done = 0;
        while done < n {
            if cancel.load(Ordering::Relaxed) {
                return Err("cancelled".into());
            }
            let m = (n - done).min(self.cap);
            self.fill(&tokens[done..done + m], first + done, done + m == n);
            // SAFETY: a live context and a batch of `m <= cap` filled entries.
            let r = unsafe { sys::llama_decode(self.ctx, self.batch) };
            if r != 0 {
                return Err(format!("llama_decode failed ({r})"));
            }
            done += m;
        }
        Ok(())
    }

    /// Fill the batch with `tokens` at positions `pos0..`, sequence 0.
    fn fill(&mut self, tokens: &[u32], pos0: usize, logits_last: bool) {
        let b = &mut self.batch;
        for (i, &t) in tokens.iter().enumerate() {
            // SAFETY: the batch holds `cap >= tokens.len()` entries of each array, and one
            // sequence id per entry (llama_batch_init(cap, 0, 1)).
            unsafe {
                *b.token.add(i) = t as i32;
                *b.pos.add(i) = (pos0 + i) as i32;
                *b.n_seq_id.add(i) = 1;
                *(*b.seq_id.add(i)) = SEQ;
                *b.logits.add(i) = i8::from(logits_last && i + 1 == tokens.len());
            }
        }
        b.n_tokens = tokens.len() as i32;
    }

    /// Export cells `0..cells` of sequence 0 into `self.blob` (through the scratch sequence).
    fn export_blob(&mut self, cells: usize) -> Result<(), String> {
        let mem = self.mem();
        // SAFETY: a live context; positions [0, cells) of sequence 0 exist.
        unsafe { sys::llama_memory_seq_cp(mem, SEQ, SCRATCH, 0, cells as i32) };
        // SAFETY: a live context.
        let size = unsafe { sys::llama_state_seq_get_size_ext(self.ctx, SCRATCH, 0) };
        self.blob.resize(size, 0);
        // SAFETY: blob is writable for `size` bytes.
        let n = unsafe { sys::llama_state_seq_get_data_ext(self.ctx, self.blob.as_mut_ptr(), size, SCRATCH, 0) };
        // SAFETY: a live context; removing a whole sequence never fails.
        unsafe { sys::llama_memory_seq_rm(mem, SCRATCH, -1, -1) };
        if n != size || size == 0 {
            return Err("llama.cpp could not export the KV state".into());
        }
        Ok(())
    }

    fn run(&mut self, core: &Core, req: &RunRequest) -> Result<RunOutput, String> {
        let bt = core.schema.block_tokens;
        let n = req.tokens.len();
        self.clear();
        if req.import_blocks > 0 {
            let mut blob = std::mem::take(&mut self.blob);
            core.schema.build_import(&req.prefix, req.import_blocks, &mut blob);
            // SAFETY: blob is `len` readable bytes; sequence 0 is empty (cleared above).
            let r = unsafe { sys::llama_state_seq_set_data_ext(self.ctx, blob.as_ptr(), blob.len(), SEQ, 0) };
            let len = blob.len();
            self.blob = blob;
            if r != len {
                self.clear();
                return Err("llama.cpp refused the imported KV state".into());
            }
        }
        let first = req.import_blocks * bt;
        self.decode_prompt(&req.tokens[first..], first, &req.cancel)?;
        let first_token = Instant::now();
        let mut exported = Vec::new();
        if req.export_to > req.export_from {
            self.export_blob(req.export_to * bt)?;
            core.schema.cut_blocks(&self.blob, req.export_from, req.export_to, &mut exported)?;
        }
        let mut tokens = Vec::with_capacity(req.max_tokens);
        let mut logprobs = Vec::with_capacity(req.max_tokens);
        let mut stopped = false;
        let mut digest = xxhash_rust::xxh3::Xxh3::new();
        for j in 0..req.max_tokens {
            // SAFETY: the last decode asked for the logits of its last token: n_vocab floats.
            let logits = unsafe {
                let p = sys::llama_get_logits_ith(self.ctx, -1);
                if p.is_null() {
                    return Err("llama.cpp returned no logits".into());
                }
                std::slice::from_raw_parts(p, core.n_vocab)
            };
            // SAFETY: the same floats viewed as their bytes (f32 has no padding; u8 alignment 1).
            digest.update(unsafe { std::slice::from_raw_parts(logits.as_ptr().cast::<u8>(), logits.len() * 4) });
            let t = argmax(logits);
            // SAFETY: vocab lives as long as the model.
            if unsafe { sys::llama_vocab_is_eog(core.vocab, t as i32) } {
                stopped = true;
                break;
            }
            tokens.push(t);
            let lp = super::logprobs_of(logits, t, super::TOP_LOGPROBS);
            if let Some(s) = &req.on_token {
                let _ = s.send((t, lp.clone()));
            }
            logprobs.push(lp);
            if j + 1 == req.max_tokens {
                break;
            }
            if req.cancel.load(Ordering::Relaxed) {
                return Err("cancelled".into());
            }
            self.fill(&[t], n + j, true);
            // SAFETY: a live context and a batch of one entry.
            let r = unsafe { sys::llama_decode(self.ctx, self.batch) };
            if r != 0 {
                return Err(format!("llama_decode failed ({r})"));
            }
        }
        Ok(RunOutput { tokens, stopped, exported, logits_digest: digest.digest(), first_token, logprobs })
    }
}

/// The greedy choice: the highest logit, the lowest id among equals.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_equals() {
        assert_eq!(argmax(&[0.5, 2.0, 2.0, -1.0]), 1);
    }

    #[test]
    fn contexts_share_the_cores_by_default() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(threads_per_context(3, 2), 3, "an explicit count stands");
        assert_eq!(threads_per_context(0, 1), cores);
        assert_eq!(threads_per_context(0, 2), (cores / 2).max(1));
        assert!(threads_per_context(0, 2) * 2 <= cores.max(2), "two contexts never oversubscribe");
        assert_eq!(threads_per_context(0, 1000), 1, "at least one each");
    }
}
