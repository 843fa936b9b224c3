//! `kvrelay-server`: the test server. OpenAI-compatible endpoints carrying `kv_hints`, a
//! reference engine whose reuse can be checked, Prometheus metrics, and a demo of the whole
//! flow. It consumes kvrelay through its C ABI (module `abi`), as a C++ runtime does.

mod abi;
mod cache;
mod client;
mod demo;
mod engine;
mod http;
mod metrics;
mod transfer;

use std::net::SocketAddr;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};

use abi::{Admission, BindingConfig, Orchestrator};
use cache::BlockCache;
use engine::{Engine, EngineConfig, KvStore, Shape};
use http::{AppState, HttpConfig};

/// kvrelay's test server.
#[derive(Parser, Debug)]
#[command(name = "kvrelay-server", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve HTTP until interrupted (prints `listening on ADDR` once ready).
    Serve(ServeArgs),
    /// Start an instance on loopback, drive the whole flow, check every answer against a cold
    /// run, print a report and the metrics; exit 0 only when everything matched.
    Demo(ServeArgs),
}

/// Every setting; each flag also reads the environment variable it names.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, env = "KVRELAY_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// The model name served and reported by /v1/models (default: `kvrelay-reference`, or the
    /// GGUF's `general.name` with `--engine llama`).
    #[arg(long, env = "KVRELAY_MODEL")]
    pub model: Option<String>,
    /// The engine behind the endpoints: `reference` (the built-in model whose reuse can be
    /// checked byte for byte) or `llama` (llama.cpp on the CPU running `--model-file`; builds
    /// with the `llama` feature). With `llama` the KV shape comes from the model (the
    /// `--layers`, `--kv-heads`, `--head-dim` and `--dtype-bytes` settings are not used), the
    /// running requests are at most `--llama-contexts`, and decoding is greedy (sampling
    /// parameters such as `temperature` are ignored, as they are by the reference engine).
    #[arg(long, env = "KVRELAY_ENGINE", default_value = "reference")]
    pub engine: String,
    /// The GGUF model file of `--engine llama`.
    #[arg(long, env = "KVRELAY_MODEL_FILE")]
    pub model_file: Option<std::path::PathBuf>,
    /// llama.cpp contexts (requests running at once) of `--engine llama`; each holds
    /// `--llama-ctx` tokens of KV.
    #[arg(long, env = "KVRELAY_LLAMA_CONTEXTS", default_value_t = 2)]
    pub llama_contexts: usize,
    /// Tokens per llama.cpp context (prompt plus output).
    #[arg(long, env = "KVRELAY_LLAMA_CTX", default_value_t = 8192)]
    pub llama_ctx: usize,
    /// CPU threads per llama.cpp context (0: the cores divided among the contexts, at least
    /// one, so that concurrent requests do not oversubscribe the CPU). Part of the KV
    /// fingerprint: two instances exchange KV only when they run the same count.
    #[arg(long, env = "KVRELAY_LLAMA_THREADS", default_value_t = 0)]
    pub llama_threads: usize,
    /// Tokens per KV block (the unit of reuse and naming).
    #[arg(long, env = "KVRELAY_BLOCK_TOKENS", default_value_t = 32)]
    pub block_tokens: usize,
    /// Layers of the reference model's KV.
    #[arg(long, env = "KVRELAY_LAYERS", default_value_t = 4)]
    pub layers: usize,
    /// KV heads.
    #[arg(long, env = "KVRELAY_KV_HEADS", default_value_t = 2)]
    pub kv_heads: usize,
    /// Head size.
    #[arg(long, env = "KVRELAY_HEAD_DIM", default_value_t = 64)]
    pub head_dim: usize,
    /// Bytes per KV element.
    #[arg(long, env = "KVRELAY_DTYPE_BYTES", default_value_t = 2)]
    pub dtype_bytes: usize,
    /// KV pool size in blocks.
    #[arg(long, env = "KVRELAY_KV_BLOCKS", default_value_t = 1024)]
    pub kv_blocks: usize,
    /// Where the KV pool lives: `cpu` (host memory, the CPU copy engine) or `cuda:N` (memory of
    /// CUDA device N, the CUDA copy engine through pinned staging).
    #[arg(long, env = "KVRELAY_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Requests running at once.
    #[arg(long, env = "KVRELAY_MAX_CONCURRENCY", default_value_t = 64)]
    pub max_concurrency: usize,
    /// Requests waiting for a running slot; beyond, 429 with Retry-After.
    #[arg(long, env = "KVRELAY_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// Modeled prefill rate in tokens/s (about an 8B model in BF16 on one H200: 2 x 8e9 FLOP
    /// per token at ~40% of 989 TFLOP/s); 0 runs at the reference engine's own speed.
    #[arg(long, env = "KVRELAY_PREFILL_TOKENS_PER_S", default_value_t = 25_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Largest request body in bytes (413 above).
    #[arg(long, env = "KVRELAY_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Output tokens when a request names none.
    #[arg(long, env = "KVRELAY_DEFAULT_MAX_TOKENS", default_value_t = 16)]
    pub default_max_tokens: usize,
    /// Largest max_tokens accepted.
    #[arg(long, env = "KVRELAY_MAX_TOKENS_LIMIT", default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// Limit on a hint's canonical encoding, bytes (kvrelay's default: 65,536).
    #[arg(long, env = "KVRELAY_HINT_MAX_BYTES")]
    pub hint_max_bytes: Option<usize>,
    /// A trusted KV endpoint (`tcp://HOST:PORT`) for the orchestration registry; repeatable
    /// (comma-separated in the environment variable).
    #[arg(long = "trusted-endpoint", env = "KVRELAY_TRUSTED_ENDPOINTS", value_delimiter = ',')]
    pub trusted_endpoints: Vec<String>,
    /// Serve /debug/kv/corrupt (flips a byte of a cached block) and allow --kv-fault (tests).
    #[arg(long, env = "KVRELAY_DEBUG_ENDPOINTS")]
    pub debug_endpoints: bool,
    /// Address of this instance's KV service (its `source_control_endpoint`; port 0 picks one,
    /// reported by /v1/kv/info).
    #[arg(long, env = "KVRELAY_KV_LISTEN", default_value = "127.0.0.1:0")]
    pub kv_listen: SocketAddr,
    /// Peers the KV service accepts: `loopback`, an address or ADDR/PREFIX; repeatable
    /// (comma-separated in the environment variable).
    #[arg(long = "kv-peer-allow", env = "KVRELAY_KV_PEER_ALLOW", value_delimiter = ',', default_value = "loopback")]
    pub kv_peer_allow: Vec<String>,
    /// On a failed KV fetch: `recompute` (prefill locally, answer as a cold run) or `fail` (the
    /// request fails with 502 `kv_load_failed`).
    #[arg(long, env = "KVRELAY_KV_LOAD_FAILURE_POLICY", default_value = "recompute")]
    pub kv_load_failure_policy: String,
    /// Fault the KV service injects (tests; needs --debug-endpoints): none, corrupt (a pinned
    /// block goes bad in memory), stall, die, slow (answers 2 s late).
    #[arg(long, env = "KVRELAY_KV_FAULT", default_value = "none")]
    pub kv_fault: String,
    /// Source base URLs `/v1/kv_transfer` may pull from (`http://HOST:PORT`, comma-separated);
    /// unset refuses every transfer (403).
    #[arg(long, env = "KV_TRANSFER_SOURCE_ALLOW", value_delimiter = ',')]
    pub kv_transfer_source_allow: Vec<String>,
    /// Seconds a `/v1/kv_transfer` request hash is deduplicated.
    #[arg(long, env = "KV_TRANSFER_DEDUP_TTL", default_value_t = 60)]
    pub kv_transfer_dedup_ttl: u64,
    /// `/v1/kv_transfer` jobs running at once (`skipped_busy` beyond).
    #[arg(long, env = "KV_TRANSFER_MAX_INFLIGHT", default_value_t = 4)]
    pub kv_transfer_max_inflight: usize,
    /// How this instance fetches KV blocks, through the library's KV agent: `tcp` (the
    /// embedded transport) or `nixl` (NIXL over UCX; builds with the `nixl` feature; the pool,
    /// VRAM with --device cuda:N, is registered with NIXL at startup and this instance serves
    /// NIXL and TCP readers) or `cuda-ipc` (instances of one host with --device cuda:N: the
    /// destination maps the source's pool through CUDA IPC and copies device to device) or
    /// `cuda-ipc,nixl` (both, each source fetched from with the first that reaches it).
    /// Control always runs on the KV service.
    #[arg(long, env = "KVRELAY_KV_TRANSPORT", default_value = "tcp")]
    pub kv_transport: String,
    /// With --kv-transport nixl or cuda-ipc: fetch over TCP from a source that transport cannot
    /// reach (it does not serve it, another host for CUDA IPC, memory that cannot be mapped),
    /// once, and from that source over TCP for the next 60 s (true); false pins the transport
    /// (such a fetch fails as `refused` and the request prefills).
    #[arg(long, env = "KVRELAY_KV_TRANSPORT_FALLBACK", default_value_t = true, action = clap::ArgAction::Set)]
    pub kv_transport_fallback: bool,
    /// Microseconds the KV agent's threads poll (busy) for the next step of a fetch before they
    /// sleep (the library's `poll`, at most 10000; 0: they sleep at once). Takes the thread
    /// wake-ups off back-to-back fetches, for up to this much CPU time per step.
    #[arg(long, env = "KVRELAY_KV_POLL_US", default_value_t = 0)]
    pub kv_poll_us: u64,
    /// Folder holding `libnixl_capi.so` (else the loader's search path, e.g. LD_LIBRARY_PATH).
    #[arg(long, env = "KVRELAY_NIXL_LIB_DIR")]
    pub nixl_lib_dir: Option<std::path::PathBuf>,
    /// Publish KV events (what the reuse cache stores and evicts, vLLM's format, for routers
    /// such as Dynamo's) on a ZMQ PUB socket bound here (`tcp://HOST:PORT`, port 0 picks one;
    /// reported by /v1/kv/info). Off when unset. Only peers of --kv-peer-allow connect (the
    /// events carry cached prompts' token ids).
    #[arg(long, env = "KVRELAY_KV_EVENTS_ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// Where the KV events' replay socket (ZMQ ROUTER) binds (default: the events endpoint's
    /// host, a free port).
    #[arg(long, env = "KVRELAY_KV_EVENTS_REPLAY_ENDPOINT", requires = "kv_events_endpoint")]
    pub kv_events_replay_endpoint: Option<String>,
    /// A file holding a pre-shared key for the KV events' sockets: subscribers and replay
    /// peers then log in with ZMQ PLAIN as `kvrelay` with the key's subscriber token
    /// (HMAC-SHA-256 of `kvrelay-kv-events/v1 subscriber`, hex). The token crosses the network
    /// in clear and the events are not encrypted: it keeps out peers without the token, not
    /// readers of the traffic.
    #[arg(long, env = "KVRELAY_KV_EVENTS_KEY_FILE", requires = "kv_events_endpoint")]
    pub kv_events_key_file: Option<String>,
}

/// The environment variable that turns hint trust on (off by default).
pub const TRUST_ENV: &str = "KVRELAY_TRUST_KV_HINTS";

/// A running server.
pub struct Server {
    /// The bound address.
    pub addr: SocketAddr,
    /// Its state (for in-process inspection).
    pub state: Arc<AppState>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// The KV service's endpoint (`tcp://host:port`).
    pub fn kv_endpoint(&self) -> &str {
        &self.state.transfer.endpoint
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The transport name `--kv-transport` selects (checked here, so that a typo or a build
/// without NIXL fails the start with a message).
fn transport(args: &ServeArgs) -> Result<&'static str, String> {
    match args.kv_transport.as_str() {
        "tcp" => Ok("tcp"),
        "nixl" if cfg!(feature = "nixl") => Ok("nixl"),
        "nixl" => Err("--kv-transport nixl: this build has no NIXL support (build with `--features nixl`)".into()),
        "cuda-ipc" => Ok("cuda-ipc"),
        "cuda-ipc,nixl" | "nixl,cuda-ipc" if !cfg!(feature = "nixl") => Err(format!(
            "--kv-transport {}: this build has no NIXL support (build with `--features nixl`)",
            args.kv_transport
        )),
        "cuda-ipc,nixl" => Ok("cuda-ipc,nixl"),
        "nixl,cuda-ipc" => Ok("nixl,cuda-ipc"),
        t => Err(format!("--kv-transport {t}: expected tcp, nixl, cuda-ipc, or cuda-ipc,nixl")),
    }
}

/// The engine's model and the KV shape (`--engine`).
fn load_model(args: &ServeArgs) -> Result<(engine::Model, Shape), String> {
    match args.engine.as_str() {
        "reference" => Ok((
            engine::Model::Reference,
            Shape {
                block_tokens: args.block_tokens,
                layers: args.layers,
                kv_heads: args.kv_heads,
                head_dim: args.head_dim,
                dtype_bytes: args.dtype_bytes,
            },
        )),
        #[cfg(feature = "llama")]
        "llama" => {
            let file = args.model_file.clone().ok_or("--engine llama needs --model-file (a GGUF file)")?;
            let settings = engine::llama::LlamaSettings {
                model_file: file,
                block_tokens: args.block_tokens,
                contexts: args.llama_contexts,
                n_ctx: args.llama_ctx,
                threads: args.llama_threads,
            };
            let l = engine::llama::Llama::load(&settings)?;
            let (layers, kv_heads, head_dim, dtype_bytes) = l.shape_parts();
            let shape = Shape { block_tokens: args.block_tokens, layers, kv_heads, head_dim, dtype_bytes };
            if shape.block_bytes() != l.schema().block_bytes() {
                return Err("--engine llama: the model's KV layout does not fit the pool's block shape".into());
            }
            Ok((engine::Model::Llama(l), shape))
        }
        #[cfg(not(feature = "llama"))]
        "llama" => Err("--engine llama: this build has no llama.cpp (build with `--features llama`)".into()),
        e => Err(format!("--engine {e}: expected reference or llama")),
    }
}

/// Build everything and start serving on `args.listen`. Hint trust comes from
/// `KVRELAY_TRUST_KV_HINTS` unless `trust` forces it on or off.
pub async fn start(args: &ServeArgs, trust: Option<bool>) -> Result<Server, String> {
    if args.block_tokens == 0
        || args.kv_blocks == 0
        || args.layers == 0
        || args.kv_heads == 0
        || args.head_dim == 0
        || args.dtype_bytes == 0
    {
        return Err("--block-tokens, --kv-blocks and the KV shape must all be at least 1".into());
    }
    // loading a model reads and hashes its file: off the async workers
    let (model, shape) = {
        let a = args.clone();
        tokio::task::spawn_blocking(move || load_model(&a)).await.map_err(|e| format!("loading the model: {e}"))??
    };
    if shape.slice_bytes() % 16 != 0 {
        return Err(
            "kv_heads * head_dim * dtype_bytes must be a multiple of 16 bytes (the copy engine's alignment)".into()
        );
    }
    let store = match args.device.as_str() {
        "cpu" => KvStore::host(args.kv_blocks, shape.block_bytes()).map_err(|e| e.to_string())?,
        d => match d.strip_prefix("cuda:").and_then(|n| n.parse::<i32>().ok()) {
            Some(n) => KvStore::cuda(n, args.kv_blocks, shape.block_bytes())?,
            None => return Err(format!("--device {d}: expected `cpu` or `cuda:N`")),
        },
    };
    let admission = Admission::new(TRUST_ENV, trust, args.hint_max_bytes).map_err(|e| e.to_string())?;
    let family = "kvrelay";
    let orchestrator = Orchestrator::new(
        &[(family, "kv.fetch", "1.0")],
        &[BindingConfig { id: "kv-tcp", family, named: true, authorized: true, supports: &[("kv.fetch", "1.0")] }],
        &args.trusted_endpoints,
        Arc::new(transfer::KvProvider),
    )
    .map_err(|e| format!("{e} (is every --trusted-endpoint of the form tcp://HOST:PORT?)"))?;
    let max_concurrency = match &model {
        engine::Model::Reference => args.max_concurrency,
        #[cfg(feature = "llama")]
        engine::Model::Llama(l) => args.max_concurrency.min(l.contexts),
    };
    let served = args.model.clone().unwrap_or_else(|| match &model {
        engine::Model::Reference => "kvrelay-reference".into(),
        #[cfg(feature = "llama")]
        engine::Model::Llama(l) => l.name.clone(),
    });
    let (events, sink) = match &args.kv_events_endpoint {
        Some(at) => {
            let cfg = abi::EventsSettings {
                endpoint: at,
                replay_endpoint: args.kv_events_replay_endpoint.as_deref(),
                block_size: shape.block_tokens,
                medium: if store.region().device.is_some() { "GPU" } else { "CPU" },
                allow: &args.kv_peer_allow,
                key_file: args.kv_events_key_file.as_deref(),
            };
            let e = Arc::new(abi::KvEvents::start(&cfg).map_err(|e| format!("--kv-events-endpoint: {e}"))?);
            (Some(e.clone()), Some(e as Arc<dyn cache::EventSink>))
        }
        None => (None, None),
    };
    let engine = Arc::new(Engine::with_model(
        model,
        EngineConfig { shape, prefill_tokens_per_s: args.prefill_tokens_per_s },
        BlockCache::with_events(args.kv_blocks, sink),
        store,
    ));
    let fail_on_load_error = match args.kv_load_failure_policy.as_str() {
        "recompute" => false,
        "fail" => true,
        p => return Err(format!("--kv-load-failure-policy {p}: expected recompute or fail")),
    };
    let fault = transfer::Fault::parse(&args.kv_fault)?;
    if fault != transfer::Fault::None && !args.debug_endpoints {
        return Err("--kv-fault needs --debug-endpoints".into());
    }
    let mut source_allow = Vec::new();
    for s in &args.kv_transfer_source_allow {
        source_allow.push(
            http::kv::normalize_source(s)
                .ok_or_else(|| format!("KV_TRANSFER_SOURCE_ALLOW: `{s}` is not a base URL like http://HOST:PORT"))?,
        );
    }
    let naming = engine.naming();
    let fingerprint = transfer::fingerprint(shape, &naming);
    let transport = transport(args)?;
    let kv_listen = args.kv_listen.to_string();
    let settings = abi::AgentSettings {
        fingerprint,
        listen: &kv_listen,
        allow: &args.kv_peer_allow,
        device: engine.store.region().device,
        transport,
        nixl_lib_dir: args.nixl_lib_dir.as_deref(),
        tcp_fallback: args.kv_transport_fallback,
        poll_us: args.kv_poll_us,
    };
    let holder = transfer::CacheHolder { cache: engine.cache.clone(), engine: Arc::downgrade(&engine), fault };
    // SAFETY: the pool's memory lives in `engine`, which `TransferState` keeps alive until after
    // the agent (its field order); the holder's pins keep blocks referenced, so the engine
    // neither evicts nor rewrites them while they are sent; a fetch's destination blocks are
    // fresh blocks of its own lease, touched by nothing else until it completes.
    let agent = unsafe { abi::KvAgent::new(&settings, engine.store.layout(), Arc::new(holder)) }.map_err(|e| {
        let e = e.replace("kvrelay_agent_new failed: ", "");
        if transport != "tcp" {
            format!("--kv-transport {transport}: {e}")
        } else {
            format!("--kv-listen {}: {e}", args.kv_listen)
        }
    })?;
    let agent = Arc::new(agent);
    {
        // a block a prefill completed gets its checksum and content digest before it is published
        let weak = Arc::downgrade(&agent);
        let _ = engine.on_reusable.set(Box::new(move |ids: &[u32], digests: &[[u8; 32]]| {
            if let Some(a) = weak.upgrade() {
                if let Err(e) = a.record_checksums(ids).and_then(|()| a.record_digests(ids, digests)) {
                    tracing::warn!("recording KV checksums and digests: {e}");
                }
            }
        }));
    }
    let transfer_state = transfer::TransferState {
        endpoint: agent.endpoint(),
        agent,
        transport,
        fingerprint,
        naming,
        fail_on_load_error,
        pool: engine.clone(),
        events,
    };
    let state = AppState::new(
        admission,
        orchestrator,
        engine,
        HttpConfig {
            model: served,
            max_body_bytes: args.max_body_bytes,
            max_concurrency,
            max_queue: args.max_queue,
            default_max_tokens: args.default_max_tokens,
            max_tokens_limit: args.max_tokens_limit,
            debug_endpoints: args.debug_endpoints,
        },
        transfer_state,
        http::kv::TransferConfig {
            source_allow,
            dedup_ttl: std::time::Duration::from_secs(args.kv_transfer_dedup_ttl),
            max_inflight: args.kv_transfer_max_inflight,
            trusted_endpoints: args.trusted_endpoints.clone(),
        },
    );
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.map_err(|e| format!("listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let app = http::router(state.clone());
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("server stopped: {e}");
        }
    });
    Ok(Server { addr, state, task })
}

/// A setting's environment variable set to the empty string means "not set" (clap would take
/// it as a value, or refuse it as a missing one): removed before the command line is parsed,
/// while the process has one thread. The trust switch keeps the library's own reading.
fn unset_empty_settings() {
    for (k, v) in std::env::vars_os() {
        let name = k.to_string_lossy();
        if v.is_empty() && (name.starts_with("KVRELAY_") || name.starts_with("KV_TRANSFER_")) && name != TRUST_ENV {
            std::env::remove_var(&k);
        }
    }
}

fn main() {
    unset_empty_settings();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVRELAY_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let code = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(args).await,
            Command::Demo(args) => demo::run(args).await,
        }
    });
    std::process::exit(code);
}

async fn serve(args: ServeArgs) -> i32 {
    let server = match start(&args, None).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvrelay-server: {e}");
            return 2;
        }
    };
    tracing::info!(
        addr = %server.addr,
        model = %server.state.config.model,
        engine = %args.engine,
        kvrelay = abi::version(),
        kv_blocks = args.kv_blocks,
        block_bytes = server.state.engine.store.block_bytes(),
        "serving"
    );
    tracing::info!(kv_endpoint = %server.kv_endpoint(), transport = server.state.transfer.transport, "kv service");
    println!("listening on {}", server.addr);
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let _ = tokio::signal::ctrl_c().await;
    0
}
