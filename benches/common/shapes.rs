//! Generated envelopes of the shapes routers and clients send, shared by the admission benchmark
//! and the tests (`tests/properties.rs` and `tests/alloc.rs` include this file by path).
//!
//! A shape is built as a small tree ([`J`]) from a seed, then written in one of several
//! spellings ([`Style`]): compact (the canonical form when no string needs decoding), spaced
//! (`", "` and `": "`, Python's `json.dumps` default), indented (newline and indentation after
//! every opener and comma, `json.dumps(indent=2)`), or with arbitrary whitespace (spaces, tabs,
//! newlines, CR) wherever JSON allows it. Strings can be written with every non-ASCII character
//! as `\uXXXX` (surrogate pairs for astral ones), as `ensure_ascii` writers do.
//!
//! Shapes:
//! - `hashes`: one `kv.fetch` action with a list of random u64 block hashes;
//! - `mixed`: many actions whose payloads mix strings, floats, small integers, booleans, `null`,
//!   nested objects and short arrays, plus extra metadata at the root;
//! - `strings`: chat-like payloads, string-heavy, with `\"`, `\\`, `\n`, `\t`, `\u00XX`
//!   controls, `\uXXXX` escapes of non-ASCII characters, surrogate pairs, and raw non-ASCII
//!   text (Latin, Cyrillic, CJK, emoji).
//!
//! Floats are drawn so that their shortest round-trip form is what `ryu` prints, so the compact
//! spelling of `hashes` and `mixed` is already canonical (as from a router using the same
//! encoder); `strings` has escapes that the canonical form decodes.
#![allow(dead_code)]

/// xorshift64*: small, seeded, reproducible.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A JSON value with member order kept.
#[derive(Clone, Debug)]
pub enum J {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
    /// Number text written as given (tests use it for spellings ryu would not print).
    Raw(String),
}

fn s(x: &str) -> J {
    J::Str(x.to_string())
}
fn obj(m: Vec<(&str, J)>) -> J {
    J::Obj(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// Whitespace between tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ws {
    /// None at all.
    Compact,
    /// `", "` and `": "` (Python's `json.dumps` default).
    Spaced,
    /// A newline and `n` spaces per level after every opener and comma and before every
    /// closer of a non-empty container, and `": "` (Python's `json.dumps(indent=n)`).
    Indent(usize),
    /// Random runs of spaces, tabs, newlines and CRs (0 to 3 bytes, seeded) everywhere JSON
    /// allows whitespace, including before and after the root value.
    Random(u64),
}

#[derive(Clone, Copy, Debug)]
pub struct Style {
    pub ws: Ws,
    /// Every non-ASCII character as `\uXXXX` (`ensure_ascii`).
    pub ensure_ascii: bool,
}

impl Style {
    pub const COMPACT: Style = Style { ws: Ws::Compact, ensure_ascii: false };
    pub const SPACED: Style = Style { ws: Ws::Spaced, ensure_ascii: false };
    pub const INDENTED: Style = Style { ws: Ws::Indent(2), ensure_ascii: false };
}

/// Characters the string shape always writes as `\uXXXX` escapes (whatever the style), so that
/// every spelling has escapes the canonical form decodes: `€` and an astral emoji (a surrogate
/// pair).
const ALWAYS_ESCAPED: [char; 2] = ['\u{20AC}', '\u{1F600}'];

struct Writer {
    out: String,
    ws: Ws,
    rng: Rng,
    ensure_ascii: bool,
}

impl Writer {
    fn gap(&mut self) {
        if let Ws::Random(_) = self.ws {
            for _ in 0..self.rng.below(4) {
                let c = *self.rng.pick(&[' ', '\t', '\n', '\r']);
                self.out.push(c);
            }
        }
    }
    fn newline(&mut self, depth: usize) {
        if let Ws::Indent(n) = self.ws {
            self.out.push('\n');
            for _ in 0..n * depth {
                self.out.push(' ');
            }
        }
    }
    fn after_colon(&mut self) {
        match self.ws {
            Ws::Spaced | Ws::Indent(_) => self.out.push(' '),
            Ws::Random(_) => self.gap(),
            Ws::Compact => {}
        }
    }
    fn after_comma(&mut self, depth: usize) {
        match self.ws {
            Ws::Spaced => self.out.push(' '),
            Ws::Indent(_) => self.newline(depth),
            Ws::Random(_) => self.gap(),
            Ws::Compact => {}
        }
    }
    fn string(&mut self, v: &str) {
        self.out.push('"');
        for c in v.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => self.out.push_str(&format!("\\u{:04x}", c as u32)),
                c if !c.is_ascii() && (self.ensure_ascii || ALWAYS_ESCAPED.contains(&c)) => {
                    let mut u = [0u16; 2];
                    for unit in c.encode_utf16(&mut u) {
                        self.out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
    fn value(&mut self, v: &J, depth: usize) {
        match v {
            J::Null => self.out.push_str("null"),
            J::Bool(b) => self.out.push_str(if *b { "true" } else { "false" }),
            J::Int(i) => self.out.push_str(&i.to_string()),
            J::UInt(u) => self.out.push_str(&u.to_string()),
            J::Float(f) => self.out.push_str(ryu::Buffer::new().format_finite(*f)),
            J::Str(x) => self.string(x),
            J::Raw(t) => self.out.push_str(t),
            J::Arr(a) => {
                self.out.push('[');
                if !a.is_empty() {
                    self.newline(depth + 1);
                    self.gap();
                    for (i, e) in a.iter().enumerate() {
                        if i > 0 {
                            self.out.push(',');
                            self.after_comma(depth + 1);
                        }
                        self.value(e, depth + 1);
                        self.gap();
                    }
                    self.newline(depth);
                } else {
                    self.gap();
                }
                self.out.push(']');
            }
            J::Obj(m) => {
                self.out.push('{');
                if !m.is_empty() {
                    self.newline(depth + 1);
                    self.gap();
                    for (i, (k, e)) in m.iter().enumerate() {
                        if i > 0 {
                            self.out.push(',');
                            self.after_comma(depth + 1);
                        }
                        self.string(k);
                        self.gap();
                        self.out.push(':');
                        self.after_colon();
                        self.value(e, depth + 1);
                        self.gap();
                    }
                    self.newline(depth);
                } else {
                    self.gap();
                }
                self.out.push('}');
            }
        }
    }
}

/// Write `v` in `style`.
pub fn write(v: &J, style: Style) -> String {
    let seed = if let Ws::Random(seed) = style.ws { seed | 1 } else { 1 };
    let mut w = Writer { out: String::new(), ws: style.ws, rng: Rng(seed), ensure_ascii: style.ensure_ascii };
    w.gap();
    w.value(v, 0);
    w.gap();
    w.out
}

/// The shapes of the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Hashes,
    Mixed,
    Strings,
}

impl Shape {
    pub const ALL: [Shape; 3] = [Shape::Hashes, Shape::Mixed, Shape::Strings];
    pub fn name(self) -> &'static str {
        match self {
            Shape::Hashes => "hashes",
            Shape::Mixed => "mixed",
            Shape::Strings => "strings",
        }
    }
}

/// An envelope of `shape` with `n` units (hashes, actions, or messages), from `seed`.
/// `n == 0` gives the small form (about 250 bytes compact).
pub fn envelope(shape: Shape, n: usize, seed: u64) -> J {
    let mut r = Rng(seed | 1);
    let root = |actions: Vec<J>, extra: Option<J>| {
        let mut m = vec![("protocol_version", s("0.1")), ("message_id", s("req-7f3a9c")), ("actions", J::Arr(actions))];
        if let Some(e) = extra {
            m.push(("trace", e));
        }
        obj(m)
    };
    match shape {
        Shape::Hashes => {
            let k = if n == 0 { 2 } else { n };
            let hashes = (0..k).map(|_| J::UInt(r.next())).collect();
            root(
                vec![obj(vec![
                    ("action_id", s("a1")),
                    ("action_type", s("kv.fetch")),
                    ("action_version", s("1.0")),
                    (
                        "payload",
                        obj(vec![
                            ("source_control_endpoint", s("tcp://10.0.0.7:23280")),
                            ("block_hashes", J::Arr(hashes)),
                        ]),
                    ),
                ])],
                None,
            )
        }
        Shape::Mixed => {
            if n == 0 {
                return root(vec![mixed_action(&mut r, 0, true)], None);
            }
            let actions = (0..n).map(|i| mixed_action(&mut r, i, false)).collect();
            let trace = obj(vec![
                ("router", s("r-3")),
                ("ts_ms", J::UInt(1_732_960_000_123)),
                ("sampled", J::Bool(true)),
                ("load", J::Float(0.625)),
            ]);
            root(actions, Some(trace))
        }
        Shape::Strings => {
            if n == 0 {
                let payload = obj(vec![
                    ("source_control_endpoint", s("tcp://10.0.0.7:23280")),
                    ("prompt", J::Str(text(&mut r, 9))),
                ]);
                return root(vec![action("s0", "router.note", payload)], None);
            }
            let actions = (0..n)
                .map(|i| {
                    let msgs = (0..2 + r.below(3))
                        .map(|j| {
                            let len = 8 + r.below(60) as usize;
                            obj(vec![
                                ("role", s(if j % 2 == 0 { "user" } else { "assistant" })),
                                ("content", J::Str(text(&mut r, len))),
                            ])
                        })
                        .collect();
                    let payload = obj(vec![
                        ("source_control_endpoint", s("tcp://10.0.0.7:23280")),
                        ("title", J::Str(text(&mut r, 4))),
                        ("messages", J::Arr(msgs)),
                    ]);
                    action(&format!("s{i}"), "router.note", payload)
                })
                .collect();
            root(actions, None)
        }
    }
}

fn action(id: &str, ty: &str, payload: J) -> J {
    obj(vec![("action_id", s(id)), ("action_type", s(ty)), ("action_version", s("1.0")), ("payload", payload)])
}

/// A float with at most four significant digits in a moderate range (its ryu form is what a
/// shortest-round-trip encoder prints).
fn float(r: &mut Rng) -> f64 {
    let m = r.below(10_000) as f64;
    let e = r.below(6) as i32;
    m / 10f64.powi(e)
}

fn mixed_action(r: &mut Rng, i: usize, small: bool) -> J {
    let ty = *r.pick(&["kv.fetch", "kv.prefetch", "router.note"]);
    let endpoint = format!("tcp://10.0.{}.{}:23280", r.below(256), r.below(256));
    let payload = if small {
        obj(vec![
            ("source_control_endpoint", J::Str(endpoint)),
            ("priority", J::Int(r.below(10) as i64)),
            ("score", J::Float(float(r))),
            ("stream", J::Bool(true)),
        ])
    } else {
        let ids = (0..2 + r.below(6)).map(|_| J::Int(r.below(5000) as i64)).collect();
        let weights = (0..1 + r.below(3)).map(|_| J::Float(float(r))).collect();
        obj(vec![
            ("source_control_endpoint", J::Str(endpoint)),
            ("model", s(r.pick::<&str>(&["llama-3.1-8b-instruct", "qwen2.5-72b", "mistral-7b-v0.3"]))),
            ("priority", J::Int(r.below(10) as i64 - 2)),
            ("score", J::Float(float(r))),
            ("stream", J::Bool(r.chance(50))),
            ("ttl_ms", J::Int(r.below(100_000) as i64)),
            (
                "layers",
                obj(vec![
                    ("first", J::Int(0)),
                    ("last", J::Int(31 + r.below(50) as i64)),
                    ("dtype", s(r.pick::<&str>(&["bf16", "fp8", "fp16"]))),
                    ("quant", J::Null),
                ]),
            ),
            ("block_ids", J::Arr(ids)),
            ("weights", J::Arr(weights)),
            ("tags", J::Arr(vec![s("hot"), J::Str(format!("tenant-{}", r.below(100)))])),
        ])
    };
    action(&format!("a{i}"), ty, payload)
}

const ASCII_WORDS: &[&str] = &[
    "the",
    "cache",
    "of",
    "prefill",
    "tokens",
    "model",
    "request",
    "is",
    "a",
    "block",
    "router",
    "and",
    "to",
    "decode",
    "latency",
    "with",
    "batch",
    "for",
    "in",
    "attention",
    "layer",
    "quickly",
    "summarize",
    "document",
    "please",
    "answer",
    "question",
    "context",
    "window",
];
const NON_ASCII_WORDS: &[&str] =
    &["naïve", "Größe", "café", "данные", "ключ", "模型", "缓存", "トークン", "🚀", "señal", "Zürich", "€", "😀"];

/// `words` words of text: mostly ASCII, some raw non-ASCII, and now and then a quotation, a
/// backslash, a newline, a tab or a control character.
fn text(r: &mut Rng, words: usize) -> String {
    let mut t = String::new();
    for i in 0..words {
        if i > 0 {
            let sep = match r.below(40) {
                0 => "\n",
                1 => "\t",
                2 => ", ",
                3 => ". ",
                _ => " ",
            };
            t.push_str(sep);
        }
        match r.below(100) {
            0..=77 => t.push_str(r.pick::<&str>(ASCII_WORDS)),
            78..=91 => t.push_str(r.pick::<&str>(NON_ASCII_WORDS)),
            92..=95 => {
                t.push('"');
                t.push_str(r.pick::<&str>(ASCII_WORDS));
                t.push('"');
            }
            96..=97 => t.push_str("C:\\models\\kv"),
            98 => t.push('\u{1}'),
            _ => t.push_str("a/b"),
        }
    }
    t
}

/// The largest `n` whose envelope's compact spelling is at most `limit` bytes when written
/// canonically (a binary search; the size grows with `n` for every shape).
pub fn max_units(shape: Shape, seed: u64, limit: usize, canonical_len: impl Fn(&J) -> usize) -> usize {
    let (mut lo, mut hi) = (1usize, 1usize);
    while canonical_len(&envelope(shape, hi, seed)) <= limit {
        lo = hi;
        hi *= 2;
    }
    // canonical_len(lo) <= limit < canonical_len(hi)
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if canonical_len(&envelope(shape, mid, seed)) <= limit {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}
