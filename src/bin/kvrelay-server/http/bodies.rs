//! Request bodies: the size-limited read, the JSON parse that keeps hints raw, the typed bodies
//! of each endpoint, prompts (text, token ids, batches), chat and responses input rendered with
//! the engine's template.

use super::*;

/// Read a body with the server's size limit (413 above it).
pub async fn read_body(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = st.config.max_body_bytes;
    let too_large = || ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        kind: "invalid_request_error",
        code: Some("body_too_large"),
        message: format!("request body over the server's limit of {limit} bytes"),
    };
    if let Some(n) =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
    {
        if n > limit as u64 {
            return Err(too_large());
        }
    }
    axum::body::to_bytes(body, limit).await.map_err(|_| too_large())
}

/// Parse a JSON body (400 with `invalid_json` when it is not JSON).
pub fn parse<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    // Values kept raw or skipped are walked iteratively by serde_json, so lifting the limit
    // lets deep hints reach admission; typed members are shallow.
    de.disable_recursion_limit();
    let v = T::deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    v.map_err(|e| {
        let msg = if e.is_syntax() || e.is_eof() || e.is_io() {
            format!("the body is not valid JSON ({} at line {} column {})", classify(&e), e.line(), e.column())
        } else {
            format!("invalid request body: {e}")
        };
        ApiError::bad_request(msg).with_code("invalid_json")
    })
}

pub(super) fn classify(e: &serde_json::Error) -> &'static str {
    if e.is_eof() {
        "unexpected end"
    } else {
        "syntax error"
    }
}

/// The KV hint of a generation body, found in its original bytes by the library's one rule
/// (`kvrelay::hints::find_hint`, as C++ runtimes find it): `kv_hints` (the spelling of OpenAI
/// clients' `extra_body`), Dynamo's `kv_hint` or `router_hint`, or either under
/// `kv_transfer_params`; `null` is absent; two at once is a 400 (`multiple_kv_hints`).
pub(super) fn hint(bytes: &[u8]) -> Result<Option<&[u8]>, ApiError> {
    match kvrelay::hints::find_hint(bytes) {
        Ok(f) if f.spelling == kvrelay::hints::HintSpelling::None => Ok(None),
        Ok(f) => Ok(Some(&bytes[f.value])),
        Err(e @ kvrelay::hints::FindError::Multiple(..)) => {
            Err(ApiError::bad_request(e.to_string()).with_code("multiple_kv_hints"))
        }
        // the body parsed as the endpoint's object already: not reached
        Err(e) => Err(ApiError::bad_request(e.to_string()).with_code("invalid_json")),
    }
}

#[derive(Deserialize)]
pub(super) struct CompletionBody<'a> {
    #[serde(borrow)]
    pub(super) prompt: Option<&'a RawValue>,
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) max_tokens: Option<u64>,
    /// Each choice (each streamed chunk) also carries its output `token_ids` (vLLM's field).
    #[serde(default)]
    pub(super) return_token_ids: Option<bool>,
    /// The legacy API's `logprobs`: log-probabilities of the output tokens and this many most
    /// likely alternatives each (0 to 20; `null`: none).
    #[serde(default)]
    pub(super) logprobs: Option<u64>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(super) cache_salt: Option<String>,
}

#[derive(Deserialize, Default)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

#[derive(Deserialize)]
pub(super) struct ChatBody<'a> {
    #[serde(borrow, default)]
    pub(super) messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) max_tokens: Option<u64>,
    #[serde(default)]
    pub(super) max_completion_tokens: Option<u64>,
    /// Log-probabilities of the output tokens.
    #[serde(default)]
    pub(super) logprobs: Option<bool>,
    /// With `logprobs`: this many most likely alternatives per token (0 to 20).
    #[serde(default)]
    pub(super) top_logprobs: Option<u64>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(super) cache_salt: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct Message<'a> {
    pub(super) role: String,
    #[serde(borrow, default)]
    pub(super) content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
pub(super) struct ResponsesBody<'a> {
    #[serde(borrow)]
    pub(super) input: Option<&'a RawValue>,
    #[serde(default)]
    pub(super) instructions: Option<String>,
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) max_output_tokens: Option<u64>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) cache_salt: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct LookupBody<'a> {
    #[serde(borrow, default)]
    pub(super) prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(super) messages: Option<&'a RawValue>,
    #[serde(default)]
    pub(super) model: Option<String>,
    #[serde(default)]
    pub(super) cache_salt: Option<String>,
}

/// A prompt as text or token ids.
pub(super) enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptIn {
    /// The prompt's tokens under `e`'s tokenizer (token ids are checked against its vocabulary).
    pub(super) fn tokens(&self, e: &Engine) -> Result<Vec<u32>, ApiError> {
        match self {
            PromptIn::Text(t) => Ok(e.tokenize(t)),
            PromptIn::Tokens(t) => {
                e.check_tokens(t).map_err(|m| ApiError::bad_request(m).with_code("invalid_prompt"))?;
                Ok(t.clone())
            }
        }
    }
}

pub(super) fn token_list(v: &[Value]) -> Option<Vec<u32>> {
    v.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

/// A completion prompt: a string, a list of strings, a token list or a list of token lists.
/// Returns the prompts and whether the request is batched (a list of prompts).
pub(super) fn completion_prompts(raw: Option<&RawValue>) -> Result<(Vec<PromptIn>, bool), ApiError> {
    let missing = || ApiError::bad_request("the request has no prompt").with_code("missing_prompt");
    let raw = raw.ok_or_else(missing)?;
    let bad = || {
        ApiError::bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        )
        .with_code("invalid_prompt")
    };
    let v: Value = serde_json::from_str(raw.get()).map_err(|_| bad())?;
    match v {
        Value::String(s) => Ok((vec![PromptIn::Text(s)], false)),
        Value::Array(items) if items.is_empty() => Err(missing()),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Ok((vec![PromptIn::Tokens(token_list(&items).ok_or_else(bad)?)], false))
        }
        Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for it in items {
                out.push(match it {
                    Value::String(s) => PromptIn::Text(s),
                    Value::Array(t) => PromptIn::Tokens(token_list(&t).ok_or_else(bad)?),
                    _ => return Err(bad()),
                });
            }
            Ok((out, true))
        }
        Value::Null => Err(missing()),
        _ => Err(bad()),
    }
}

/// Message content: a string, or a list of parts whose `text` members are concatenated.
pub(super) fn content_text(raw: Option<&RawValue>) -> Result<String, ApiError> {
    let Some(raw) = raw else { return Ok(String::new()) };
    let v: Value = serde_json::from_str(raw.get())
        .map_err(|_| ApiError::bad_request("message content must be a string or a list of parts"))?;
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match p.get("text").and_then(Value::as_str) {
                    Some(t) => s.push_str(t),
                    None => return Err(ApiError::bad_request("only text content parts are supported")),
                }
            }
            Ok(s)
        }
        _ => Err(ApiError::bad_request("message content must be a string or a list of parts")),
    }
}

pub(super) fn chat_text(
    e: &Engine,
    messages: Option<&[Message<'_>]>,
    instructions: Option<&str>,
) -> Result<String, ApiError> {
    let messages = messages
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::bad_request("the request has no messages").with_code("missing_prompt"))?;
    let mut rendered = Vec::with_capacity(messages.len() + 1);
    if let Some(i) = instructions {
        rendered.push(("system".to_string(), i.to_string()));
    }
    for m in messages {
        rendered.push((m.role.clone(), content_text(m.content)?));
    }
    e.render_chat(&rendered).map_err(|m| ApiError::bad_request(m).with_code("invalid_messages"))
}

pub(super) fn responses_text(e: &Engine, b: &ResponsesBody<'_>) -> Result<String, ApiError> {
    let missing = || ApiError::bad_request("the request has no input").with_code("missing_prompt");
    let raw = b.input.ok_or_else(missing)?;
    if let Ok(s) = serde_json::from_str::<String>(raw.get()) {
        let m = vec![Message { role: "user".into(), content: Some(raw) }];
        let _ = s;
        return chat_text(e, Some(&m), b.instructions.as_deref());
    }
    let msgs: Vec<Message<'_>> = serde_json::from_str(raw.get())
        .map_err(|_| ApiError::bad_request("input must be a string or a list of messages"))?;
    chat_text(e, Some(&msgs), b.instructions.as_deref())
}

pub(super) fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.config.model => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: Some("model_not_found"),
            message: format!("the model `{m}` does not exist; this server serves `{}`", st.config.model),
        }),
        _ => Ok(()),
    }
}

/// The tokens of a `{prompt | messages}` body with one prompt (lookup, prefill, transfer).
pub fn prompt_tokens(
    st: &AppState,
    prompt: Option<&RawValue>,
    messages: Option<&RawValue>,
    model: Option<&str>,
) -> Result<Vec<u32>, ApiError> {
    check_model(st, model)?;
    if let Some(m) = messages {
        let msgs: Vec<Message<'_>> = serde_json::from_str(m.get())
            .map_err(|_| ApiError::bad_request("messages must be a list of {role, content}"))?;
        return Ok(st.engine.tokenize(&chat_text(&st.engine, Some(&msgs), None)?));
    }
    let (p, batched) = completion_prompts(prompt)?;
    if batched {
        return Err(ApiError::bad_request("this endpoint takes one prompt"));
    }
    p[0].tokens(&st.engine)
}

/// The alternatives per token a request asks for (`None`: no logprobs): at most
/// [`TOP_LOGPROBS`](crate::engine::TOP_LOGPROBS), as OpenAI's API allows.
pub(super) fn logprobs_wanted(enabled: bool, top: Option<u64>) -> Result<Option<usize>, ApiError> {
    let max = crate::engine::TOP_LOGPROBS as u64;
    match (enabled, top) {
        (_, Some(k)) if k > max => Err(ApiError::bad_request(format!("top_logprobs must be 0..={max}"))),
        (false, Some(_)) => Err(ApiError::bad_request("top_logprobs needs logprobs: true")),
        (false, None) => Ok(None),
        (true, k) => Ok(Some(k.unwrap_or(0) as usize)),
    }
}

pub(super) fn max_tokens(st: &AppState, n: Option<u64>) -> Result<usize, ApiError> {
    let n = n.map_or(st.config.default_max_tokens as u64, |n| n);
    if n == 0 || n > st.config.max_tokens_limit as u64 {
        return Err(ApiError::bad_request(format!("max_tokens must be 1..={}", st.config.max_tokens_limit)));
    }
    Ok(n as usize)
}
