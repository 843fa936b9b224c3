// kvrelay_llama.hpp: kvrelay inside llama-server, phase 1 (integrations/llama.cpp/README.md).
//
// Everything kvrelay-specific lives in kvrelay_llama.cpp; kvrelay.patch only calls the functions
// below from llama-server's own code. build.sh copies both files into tools/server/ of the tree.
//
// This header deliberately does not include kvrelay.hpp: server.cpp (target llama-server-impl)
// includes it too, and only server-context links kvrelay. A hint travels with a task as a
// std::shared_ptr to a kvrelay::Snapshot declared here and in server-task.h, so copying a task's
// params (child tasks for n_cmpl > 1, the final result) costs one atomic increment.
#pragma once

#include "server-common.h"  // json, server_chat_params, mtmd, llama_tokens

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace kvrelay {
class Snapshot;
}

namespace kvrelay_llama {

/// An admitted hint (null: none, or ignored).
using hint_ptr = std::shared_ptr<const kvrelay::Snapshot>;

/// llama_server(argc, argv), before common_params_parse: takes this integration's options out of
/// argv (so llama.cpp's own parser never sees them) and reads their environment variables:
///   --kv-hints-trusted     (LLAMA_ARG_KV_HINTS_TRUSTED=1|true|on|enabled)  admit KV hints
///   --kv-block-tokens N    (LLAMA_ARG_KV_BLOCK_TOKENS=N, default 32)       tokens per named block
/// A flag wins over its variable. Prints this integration's usage before llama.cpp's on -h /
/// --help / --usage. Returns false after printing why when a value is invalid.
bool consume_args(int & argc, char ** argv);

/// llama_server, once the model is loaded (main thread, before any request): fixes the naming
/// identity from the model file, the llama.cpp build and the context's KV settings, and logs it.
void on_model_loaded(const common_params & params, const llama_context * ctx);

/// handle_completions_impl (HTTP thread), once per request after tokenization: finds the
/// request's hint in the raw request body (`req.body`: kvrelay::find_hint, kv_hints, kv_hint or
/// router_hint at the top level, kv_hint or router_hint under kv_transfer_params), admits the
/// client's own bytes through the process-wide kvrelay::Admission and returns one entry per
/// prompt (a single envelope is shared, an aligned list of kv_hints is admitted entry by
/// entry). Throws std::invalid_argument (HTTP 400) for two hints at once or an aligned list of
/// the wrong length; an ignored hint never throws (kvrelay counts it).
std::vector<hint_ptr> admit_request_hints(const std::string & body, size_t n_prompts);

/// launch_slot_with_task (main loop): phase 1 only logs (debug level) that the task carries an
/// admitted hint and its action count, never the hint's contents. Never throws.
void on_task_launched(int id_slot, int id_task, const hint_ptr & hint) noexcept;

/// GET /metrics: kvrelay's admission counters as Prometheus text (metric prefix
/// llamacpp_kv_hints), each line newline-terminated; "" if they cannot be rendered.
std::string prometheus() noexcept;

/// GET /v1/kv/info: {block_tokens, naming_seed, naming_identity, model, kv_hints_trusted, ...}.
json kv_info(const std::string & model_name);

/// POST /v1/kv/lookup {prompt | messages, cache_salt?}: the prompt tokenized as the completion
/// routes do (messages through the chat template as /v1/chat/completions does) and the names of
/// its full blocks. Throws std::invalid_argument (HTTP 400) for a bad body.
json kv_lookup(const json & body, const server_chat_params & chat_params, const llama_vocab * vocab,
               mtmd_context * mctx, const mtmd_helper_init_opt & init_opt);

}  // namespace kvrelay_llama
