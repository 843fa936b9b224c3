// kvrelay_llama.hpp: kvrelay inside llama-server (integrations/llama.cpp/README.md).
//
// Everything kvrelay-specific lives in kvrelay_llama_*.cpp (kvrelay_llama_state.hpp lists them);
// kvrelay.patch only calls the functions below from llama-server's own code. build.sh copies
// the files into tools/server/ of the tree.
//
// This header deliberately does not include kvrelay.hpp: server.cpp (target llama-server-impl)
// includes it too, and only server-context links kvrelay. A hint travels with a task as a
// std::shared_ptr to a kvrelay::Snapshot declared here and in server-task.h, so copying a task's
// params (child tasks for n_cmpl > 1, the final result) costs one atomic increment.
#pragma once

#include "server-common.h"  // json, server_chat_params, mtmd, llama_tokens

#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvrelay {
class Snapshot;
}

namespace kvrelay_llama {

/// An admitted hint (null: none, or ignored).
using hint_ptr = std::shared_ptr<const kvrelay::Snapshot>;

/// Blocks of kvrelay's store pinned for a task (fetch_prefix); unpinned when the last copy goes.
/// Type-erased so that server-task.h needs no declaration of it.
using held_ptr = std::shared_ptr<void>;

/// llama_server(argc, argv), before common_params_parse: takes this integration's options out of
/// argv (so llama.cpp's own parser never sees them) and reads their environment variables:
///   --kv-hints-trusted     (LLAMA_ARG_KV_HINTS_TRUSTED=1|true|on|enabled)  admit KV hints
///   --kv-block-tokens N    (LLAMA_ARG_KV_BLOCK_TOKENS=N, default 32)       tokens per named block
///   --kv-listen HOST:PORT  (LLAMA_ARG_KV_LISTEN)           serve this server's KV blocks there
///   --kv-trusted-endpoint E (LLAMA_ARG_KV_TRUSTED_ENDPOINTS, comma-separated; repeatable)
///                          the endpoints a hint may fetch from (the trusted registry)
///   --kv-allow-peer SPEC   (LLAMA_ARG_KV_ALLOW_PEERS, comma-separated; repeatable, default
///                          loopback)  who may fetch from this server
///   --kv-pool-mib N        (LLAMA_ARG_KV_POOL_MIB, default 1024)  host memory of the block store
///   --kv-fetch faster|always (LLAMA_ARG_KV_FETCH, default faster)  fetch only when the
///                          estimate beats this server's measured prefill, or always
///   --kv-load-failure-policy recompute|fail (LLAMA_ARG_KV_LOAD_FAILURE_POLICY, default
///                          recompute)  a failed fetch prefills as a cold request, or fails it (502)
/// The block store, the KV agent and the fetch path are on when --kv-listen or a trusted
/// endpoint is given. A flag wins over its variable. Prints this integration's usage before llama.cpp's on -h /
/// --help / --usage. Returns false after printing why when a value is invalid.
bool consume_args(int & argc, char ** argv);

/// llama_server, once the model is loaded (main thread, before any request): fixes the naming
/// identity from the model file, the llama.cpp build and the context's KV settings, and logs it.
/// With the KV path on, reads the context's state layout off a one-token probe (decoded into
/// sequence 0, then the memory is cleared), allocates the block store and starts the KV agent;
/// a failure there logs why and leaves the KV path off (hints are still admitted and counted).
void on_model_loaded(const common_params & params, llama_context * ctx);

/// handle_completions_impl (HTTP thread), once per request after tokenization: finds the
/// request's hint in the raw request body (`req.body`: kvrelay::find_hint, kv_hints, kv_hint or
/// router_hint at the top level, kv_hint or router_hint under kv_transfer_params), admits the
/// client's own bytes through the process-wide kvrelay::Admission and returns one entry per
/// prompt (a single envelope is shared, an aligned list of kv_hints is admitted entry by
/// entry). Throws std::invalid_argument (HTTP 400) for two hints at once or an aligned list of
/// the wrong length; an ignored hint never throws (kvrelay counts it).
std::vector<hint_ptr> admit_request_hints(const std::string & body, size_t n_prompts);

/// What fetch_prefix throws under --kv-load-failure-policy fail when a submitted fetch failed:
/// the request is answered with response() (HTTP 502, type kv_load_failed) instead of
/// prefilling as a cold one.
class kv_load_failed : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
    json response() const { return json{ { "code", 502 }, { "message", what() }, { "type", "kv_load_failed" } }; }
};

/// handle_completions_impl (HTTP thread), per prompt, before its task is posted: when the prompt
/// carries an admitted hint and the KV path is on, the orchestration policy decides (the trusted
/// endpoint registry, the binding) and the provider fetches the run of the prompt's blocks that
/// the block store lacks and the hint names (SPEC section 8), when the agent's estimate beats
/// this server's measured prefill (--kv-fetch). Waits for the fetch on this thread, in 20 ms
/// slices, cancelling it when `should_stop` turns true (the client went away); the verified
/// blocks are committed to the store, where import_prefix finds them. Costs one naming pass
/// over the prompt when a hint is admitted, nothing otherwise. Any failure leaves the request to
/// prefill as a cold one, counted by reason; the one exception: under
/// --kv-load-failure-policy fail, a fetch that was submitted and failed (the agent's failures:
/// connect, timeout, refused, corrupt, truncated, ...; not a client gone, nor a decision not to
/// fetch) throws kv_load_failed after counting it. Throws nothing else.
/// `lora`: the request names LoRA adapters (the policy then discards the hint as ineligible);
/// `cache_prompt` false: nothing is fetched (the slot would not import it), counted.
/// Returns, when blocks were fetched, a pin on the prompt's leading blocks in the store (those
/// held before and the fetched ones): the task carries it (`task_params::kv_held`; its children
/// for n_cmpl > 1 do not, they copy the parent's KV) so that no reservation evicts them while the
/// task waits for a slot, and the slot drops it once import_prefix ran or was skipped (a task
/// that never reaches a slot drops it when it ends). Null otherwise.
held_ptr fetch_prefix(const server_tokens & prompt, bool lora, bool cache_prompt, const hint_ptr & hint,
                      const std::function<bool()> & should_stop);

/// One prompt of a request, for fetch_prefixes.
struct fetch_input {
    const server_tokens * prompt       = nullptr;
    bool                  lora         = false;
    bool                  cache_prompt = true;
    hint_ptr              hint;
};

/// fetch_prefix for every prompt of one request: out[i] for in[i]. Where more than one prompt is
/// hinted, their fetches run at once, each on a thread of its own (a batched /completion waits
/// for the slowest fetch, not for their sum); `should_stop` is then asked under a lock. Throws
/// kv_load_failed, the first prompt's in order, once every fetch ended.
std::vector<held_ptr> fetch_prefixes(const std::vector<fetch_input> & in, const std::function<bool()> & should_stop);

/// The slot's cached-prefix logic (main loop, SLOT_STATE_STARTED) once `n_past` is final:
/// imports the prompt's leading blocks that the block store holds past `n_past` (fetched for
/// this request, or computed here by an earlier prompt) into sequence `seq_id`: only the
/// positions the slot lacks (from the exact prefix it keeps to the last held block), one
/// llama_kv_range_set per run of blocks that lie one after another in the store; the slot's
/// cells below and every other sequence stay as they are. Returns the new n_past: a block
/// multiple above `n_past` after an import, `n_past` when nothing is imported, the end of the
/// imported blocks when llama.cpp refused one (it changes nothing before refusing). At least one
/// prompt token is always left to evaluate. Cost: O(the bytes that enter the slot), straight
/// from the store, no other buffer.
int import_prefix(llama_context * ctx, int seq_id, const server_tokens & prompt, int n_past) noexcept;

/// post_decode (main loop) when a slot's prompt is evaluated, before its first token is sampled:
/// updates the prefill speed the fetch decision compares with (`t_prompt_ms` for `n_processed`
/// tokens, less kvrelay's own main-loop work meanwhile, imports and exports, which
/// llama-server's prompt time includes; prompts of 4 blocks or more, not the first), decides which
/// of the slot's cells equal a cold prefill, and leaves the prompt's full blocks for
/// export_pending, unless `exportable` is false (the slot computed them with a LoRA adapter
/// enabled, which the names do not cover). Cost: one copy of the prompt's token ids.
void on_prompt_done(llama_context * ctx, int seq_id, const server_tokens & prompt, bool exportable,
                    double t_prompt_ms, uint64_t n_processed) noexcept;

/// post_decode (main loop), after the slot's sampled token went to process_token (a streamed
/// first token is on its way to the client, and not in the KV yet), or before the final
/// response when that token ends the request (so that a client holding the answer finds the
/// blocks served): commits the full blocks of the prompt on_prompt_done left,
/// that the store lacks (copied by llama_kv_range_get straight into reserved store blocks,
/// checksums recorded), so that peers can fetch them. Once per prompt; O(1) for every later
/// token, and when nothing is left. Cost: O(the new blocks' bytes), one naming pass otherwise;
/// no buffer of the sequence's size. Kept out of a streamed request's time to first token.
void export_pending(llama_context * ctx, int seq_id) noexcept;

/// launch_slot_with_task (main loop): a new task starts on the slot: what the integration
/// tracks per task (the prompt's start at a block edge, an export left over) is reset; the
/// slot's exact cells stay what the hooks below left. Logs (debug level) that the task carries
/// an admitted hint and its action count, never the hint's contents. Never throws.
void on_task_launched(int id_slot, int id_task, const hint_ptr & hint) noexcept;

/// Every path of llama-server that replaces or moves a slot's cells other than a prefill or
/// decode of its own (main loop): the prompt cache's load, a prompt cleared (slot erase, a
/// failed restore, a new prompt with nothing to keep), a slot restored from a file, a context
/// shift, --cache-reuse chunk shifting. The cells of `seq_id` at positions `keep` and above are
/// no longer known to equal a cold prefill (0: none of them): they are neither exported nor
/// kept as an exact prefix by import_prefix, which then takes what the block store holds and
/// prefills the rest from a block edge. An export pending past `keep` is cut to it. O(1).
void on_cells_changed(int seq_id, int keep) noexcept;

/// copy_state_to (main loop, children of n_cmpl > 1): `dst_seq`'s cells became a copy of
/// `src_seq`'s: it is exact where the source is, and exports nothing (the parent does). O(1).
void on_cells_copied(int src_seq, int dst_seq) noexcept;

/// GET /metrics: kvrelay's counters as Prometheus text, each line newline-terminated: admission
/// (llamacpp_kv_hints_*), and with the KV path on the policy (llamacpp_kv_policy_*), the agent
/// (kvrelay_kv_agent_*) and this integration's fetch, import and export counters
/// (llamacpp_kv_*); "" if they cannot be rendered.
std::string prometheus() noexcept;

/// GET /v1/kv/info: {block_tokens, naming_seed, naming_identity, model, kv_hints_trusted,
/// source_control_endpoint (this server's KV endpoint, "" when it serves none), ...}.
json kv_info(const std::string & model_name);

/// POST /v1/kv/lookup {prompt | messages, cache_salt?}: the prompt tokenized as the completion
/// routes do (messages through the chat template as /v1/chat/completions does), the names of
/// its full blocks and how many leading ones the block store holds (blocks_held). Throws std::invalid_argument (HTTP 400) for a bad body.
json kv_lookup(const json & body, const server_chat_params & chat_params, const llama_vocab * vocab,
               mtmd_context * mctx, const mtmd_helper_init_opt & init_opt);

}  // namespace kvrelay_llama
