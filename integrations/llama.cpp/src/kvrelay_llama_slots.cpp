// kvrelay_llama_slots.cpp: the slot hooks on llama-server's main loop: import a prompt's held blocks,
// time and mark a prompt done, export its new blocks.
// Uses kvrelay only through its public C++ header (kvrelay_llama_state.hpp lists the files).
#include "kvrelay_llama_state.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kvrelay_llama {
using namespace detail;

namespace {

// Calls f(i0, i1) for each maximal run of ids[i0 .. i1) that lie one after another in the pool
// (their blocks are one contiguous span: one range call moves them all). O(n).
template <typename F> void for_runs(const uint32_t * ids, size_t n, F && f) {
    size_t i0 = 0;
    while (i0 < n) {
        size_t i1 = i0 + 1;
        while (i1 < n && ids[i1] == ids[i1 - 1] + 1) {
            i1++;
        }
        f(i0, i1);
        i0 = i1;
    }
}

const char * range_status(int32_t st) {
    switch (st) {
        case LLAMA_KV_RANGE_UNSUPPORTED: return "the KV memory has no position-range access";
        case LLAMA_KV_RANGE_MISMATCH:    return "the KV layout is not the one read at start";
        case LLAMA_KV_RANGE_INVALID:     return "a bad range or size";
        case LLAMA_KV_RANGE_MISSING:     return "the slot lacks a position of the range";
        case LLAMA_KV_RANGE_NO_ROOM:     return "the KV cache has no free cells for it";
        case LLAMA_KV_RANGE_FAILED:      return "the backend failed";
        default:                         return "an unknown status";
    }
}

// The copy libllama asks for on a device store (llama_kv_range_copy_fn): one checked strided
// device-to-device copy on the runtime's copier, enqueued; kv_range_move completes them.
bool device_copy(void * user_data, void * dst, size_t dst_pitch, const void * src, size_t src_pitch, size_t width,
                 size_t height) {
    try {
        static_cast<kvrelay::CudaCopier *>(user_data)->copy_2d(uint64_t(uintptr_t(dst)), dst_pitch,
                                                               uint64_t(uintptr_t(src)), src_pitch, width, height);
        return true;
    } catch (const std::exception & e) {
        SRV_WRN("kvrelay: a device copy of the KV was refused: %s\n", e.what());
        return false;
    }
}

// Move positions [p0, p1) of seq_id between llama.cpp's KV cache and the store's blocks at
// `block` (get: cache -> store, set: store -> cache): llama_kv_range_get / _set for a host
// store, the _with forms and the copier for a device store, whose copies are complete when this
// returns (a set whose copies failed is removed again: the slot never keeps unwritten cells).
int32_t kv_range_move(kv_runtime & kv, llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1,
                      uint8_t * block, size_t size, bool set) {
    const uint32_t  bt = uint32_t(S().block_tokens);
    const uint8_t * d  = kv.schema.desc.data();
    const size_t    dn = kv.schema.desc.size();
    if (!kv.copier) {
        return set ? llama_kv_range_set(ctx, seq_id, p0, p1, bt, d, dn, block, size)
                   : llama_kv_range_get(ctx, seq_id, p0, p1, bt, d, dn, block, size);
    }
    std::lock_guard<std::mutex> g(kv.copier_mu);
    const auto                  t0 = std::chrono::steady_clock::now();
    int32_t st = set ? llama_kv_range_set_with(ctx, seq_id, p0, p1, bt, d, dn, block, size, device_copy, kv.copier.get())
                     : llama_kv_range_get_with(ctx, seq_id, p0, p1, bt, d, dn, block, size, device_copy, kv.copier.get());
    try {
        kv.copier->finish();  // also after a failure: nothing of it may still be in flight
    } catch (const std::exception & e) {
        SRV_WRN("kvrelay: the device copies of the KV failed: %s\n", e.what());
        if (set && st == LLAMA_KV_RANGE_OK) {
            llama_memory_seq_rm(llama_get_memory(ctx), seq_id, p0, -1);
        }
        st = LLAMA_KV_RANGE_FAILED;
    }
    kv.counts.device_copy_ns += uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    return st;
}

}  // namespace

void on_task_launched(int id_slot, int id_task, const hint_ptr & hint) noexcept {
    try {
        if (KV != nullptr && id_slot >= 0) {
            slot_kv & slot = KV->slot(id_slot);
            slot.aligned   = false;  // set again only by import_prefix, for this task's prompt
            slot.kept      = false;
            slot.pending.clear();
        }
        if (hint) {
            LOG_DBG("kvrelay: slot %d, task %d carries an admitted KV hint with %zu action(s)\n", id_slot, id_task,
                    hint->action_count());
        }
    } catch (...) {
    }
}

void on_cells_changed(int seq_id, int keep) noexcept {
    if (KV == nullptr || seq_id < 0) {
        return;
    }
    try {
        const size_t bt    = S().block_tokens;
        slot_kv &    slot  = KV->slot(seq_id);
        const size_t upto  = keep <= 0 ? 0 : size_t(keep) / bt * bt;
        slot.exact_upto    = std::min(slot.exact_upto, upto);
        if (slot.pending.size() > upto) {
            slot.pending.resize(upto);
        }
        if (upto == 0) {
            slot.aligned = false;
        }
        KV->counts.cells_changed++;
    } catch (...) {
    }
}

void on_cells_copied(int src_seq, int dst_seq) noexcept {
    if (KV == nullptr || src_seq < 0 || dst_seq < 0) {
        return;
    }
    try {
        const size_t exact = KV->slot(src_seq).exact_upto;
        slot_kv &    dst   = KV->slot(dst_seq);
        dst.exact_upto     = exact;
        dst.aligned        = false;
        dst.pending.clear();
        KV->counts.cells_changed++;
    } catch (...) {
    }
}

int import_prefix(llama_context * ctx, int seq_id, const server_tokens & prompt, int n_past) noexcept {
    if (KV == nullptr || prompt.has_mtmd || n_past < 0 || seq_id < 0) {
        return n_past;
    }
    kv_runtime & kv = *KV;
    try {
        slot_kv &            slot   = kv.slot(seq_id);
        const llama_tokens & tokens = prompt.get_tokens();
        const size_t         bt     = S().block_tokens;
        slot.pending.clear();  // a new prompt: an export not made after the last one's first token is dropped
        slot.kept = false;
        // full blocks that may be reused: at least one prompt token is evaluated
        const size_t         n_max  = tokens.empty() ? 0 : (tokens.size() - 1) / bt;
        // what the slot keeps of its own cells: the leading ones known to equal a cold prefill
        // (imported, or prefilled from a block edge; never generated ones), whole blocks only
        const size_t n_exact = std::min({ size_t(n_past), slot.exact_upto, n_max * bt }) / bt * bt;
        size_t       n_new   = n_exact;
        // blocks whose name and content digest are those of this slot's own tokens, pinned until
        // they are in the slot
        std::unique_ptr<pin_guard> pins;
        if (n_max * bt > n_exact) {
            const block_keys keys = keys_of(kv, tokens.data(), n_max * bt);
            pins = std::make_unique<pin_guard>(*kv.store, keys.names.data(), keys.digests.data(), keys.names.size());
            n_new = std::max(n_new, pins->n * bt);
        }
        // llama-server's own reuse reaches past the exact prefix (a prompt asked again, a turn
        // that adds less than a block): cutting it back to a block edge only makes sense when a
        // block computed after the cut would be exported. When every full block of the prompt
        // lies within the exact prefix, none is: keep llama-server's reuse, and mark the
        // prompt's prefill (which starts mid-block) as not aligned, so nothing of it is exported
        const size_t n_full = tokens.size() / bt * bt;
        if (n_new == n_exact && size_t(n_past) > n_exact && n_full <= n_exact) {
            slot.exact_upto = n_exact;
            slot.aligned    = false;
            slot.kept       = true;
            return n_past;
        }
        if (n_new > n_exact) {
            // only the missing positions [n_exact, n_new) enter the slot, one range call per run
            // of blocks that lie one after another in the store; the slot's cells below n_exact
            // and every other slot stay as they are. A refused call leaves the slot as it was
            // (libllama checks everything first): the prompt is prefilled from where the
            // imported run ends
            const auto     t0   = std::chrono::steady_clock::now();
            const size_t   b0   = n_exact / bt;
            const size_t   bb   = kv.store->block_bytes();
            size_t         done = b0;
            int32_t        st   = LLAMA_KV_RANGE_OK;
            if (kv.import_check) {
                // the agent registers the store's memory with keyed peers (NIXL), who can write
                // into it: a slot takes only blocks that still hold what was recorded for
                // them (checksum and keyed tag, checked where they lie: one kernel on a device
                // store), and the prompt is prefilled from the first that does not
                const size_t want = n_new / bt - b0;
                const size_t ok   = kv.agent->verify_blocks(pins->ids.data() + b0, want);
                if (ok < want) {
                    kv.counts.import_tampered++;
                    SRV_WRN("kvrelay: store block %u (block %zu of slot %d's prompt) no longer holds what was recorded "
                            "for it; it prefills from token %zu\n",
                            unsigned(pins->ids[b0 + ok]), b0 + ok, seq_id, (b0 + ok) * bt);
                    n_new = (b0 + ok) * bt;
                }
            }
            for_runs(pins->ids.data() + b0, n_new / bt - b0, [&](size_t i0, size_t i1) {
                if (st != LLAMA_KV_RANGE_OK) {
                    return;
                }
                st = kv_range_move(kv, ctx, seq_id, llama_pos((b0 + i0) * bt), llama_pos((b0 + i1) * bt),
                                   kv.store->block(pins->ids[b0 + i0]), (i1 - i0) * bb, true);
                if (st == LLAMA_KV_RANGE_OK) {
                    done = b0 + i1;
                    kv.counts.import_bytes += (i1 - i0) * bb;
                }
            });
            if (st != LLAMA_KV_RANGE_OK) {
                kv.counts.import_refused++;
                SRV_WRN("kvrelay: llama.cpp refused the KV of blocks %zu..%zu for slot %d (%s); it prefills from token %zu\n",
                        done, n_new / bt, seq_id, range_status(st), done * bt);
            }
            n_new = done * bt;
            kv.counts.imported_tokens += n_new - std::min(n_new, size_t(n_past));
            // what a fetch costs past its transfer: the agent's estimate counts it from now on
            const double took = kv.work.add(t0);
            if (done > b0) {
                try {
                    kv.agent->record_import(done - b0, took);
                } catch (...) {
                    // the import stands whatever the estimate makes of it
                }
            }
            SRV_DBG("kvrelay: slot %d: imported %zu blocks after the %zu tokens it kept (had %d)\n", seq_id, done - b0,
                    n_exact, n_past);
        } else if (n_new < size_t(n_past)) {
            kv.counts.recomputed_tokens += size_t(n_past) - n_new;
        }
        // the prompt's prefill starts at a block edge: its blocks are exact, and exported
        slot.exact_upto = n_new;
        slot.aligned    = true;
        return int(n_new);
    } catch (...) {
        kv.counts.import_refused++;
        return n_past;
    }
}

void on_prompt_done(llama_context * ctx, int seq_id, const server_tokens & prompt, bool exportable,
                    double t_prompt_ms, uint64_t n_processed) noexcept {
    (void) ctx;
    if (KV == nullptr || prompt.has_mtmd || seq_id < 0) {
        return;
    }
    kv_runtime & kv = *KV;
    try {
        const size_t bt   = S().block_tokens;
        slot_kv &    slot = kv.slot(seq_id);
        // llama-server's prompt time includes kvrelay's main-loop work meanwhile (this prompt's
        // import, other slots' imports and exports): the prefill alone is the rest
        const auto   now       = loop_work::clock::now();
        const auto   window    = std::chrono::duration_cast<loop_work::clock::duration>(
            std::chrono::duration<double, std::milli>(std::max(0.0, t_prompt_ms)));
        const double prefill_s = t_prompt_ms / 1e3 - kv.work.since(now - window);
        // a prompt of a few blocks or more (a short one's time is mostly per-decode overhead, which
        // the tokens a fetch would save do not pay twice)
        // and not the first one after start, which pays one-time costs (with --no-warmup, or on a
        // GPU: kernels loaded, graphs and buffers made) that would hold the average up for long
        if (n_processed >= 4 * bt && prefill_s > 0 && std::exchange(kv.warmed, true)) {
            const double now  = prefill_s / double(n_processed);
            const double prev = kv.sec_per_token.load(std::memory_order_relaxed);
            kv.sec_per_token.store(prev > 0 ? 0.8 * prev + 0.2 * now : now, std::memory_order_relaxed);
        }
        // a prompt prefilled from a block edge (import_prefix ran for it) without a LoRA adapter:
        // its full blocks equal a cold prefill's; anything else is not served, and not kept
        // a prompt whose prefill started mid-block (llama-server's own reuse kept, nothing to
        // export) leaves the cells before its start as they were: the exact prefix stays
        const bool   exact = exportable && slot.aligned;
        const size_t full  = prompt.size() / bt * bt;
        slot.exact_upto    = exact ? full : exportable && slot.kept ? std::min(slot.exact_upto, full) : 0;
        slot.aligned       = false;
        slot.kept          = false;
        slot.pending.clear();
        if (exact && slot.exact_upto > 0) {
            // exported by export_pending, once the first token is on its way (the copy of the
            // tokens keeps the buffer's capacity from prompt to prompt)
            const llama_tokens & tokens = prompt.get_tokens();
            slot.pending.assign(tokens.begin(), tokens.begin() + slot.exact_upto);
        }
    } catch (...) {
        kv.counts.export_failed++;
    }
}

void export_pending(llama_context * ctx, int seq_id) noexcept {
    if (KV == nullptr || seq_id < 0 || size_t(seq_id) >= KV->slots.size() || KV->slots[size_t(seq_id)].pending.empty()) {
        return;
    }
    kv_runtime & kv   = *KV;
    slot_kv &    slot = kv.slots[size_t(seq_id)];
    try {
        // exported once, whatever happens below (the buffer keeps its capacity); its time is
        // kvrelay's main-loop work, which other slots' prompt times then include
        struct on_exit {
            llama_tokens &                t;
            loop_work &                   work;
            loop_work::clock::time_point start;
            ~on_exit() {
                t.clear();
                work.add(start);
            }
        } const done{ slot.pending, kv.work, loop_work::clock::now() };
        const size_t                bt     = S().block_tokens;
        const llama_tokens &        tokens = slot.pending;
        const block_keys            keys   = keys_of(kv, tokens.data(), tokens.size());
        const std::vector<uint64_t> & names = keys.names;
        // the blocks held stay pinned while the new ones are reserved and committed after them
        // (a name held for other tokens ends the run: this prompt's own blocks are not stored
        // under it, and the ones after it chain from it)
        pin_guard    held(*kv.store, names.data(), keys.digests.data(), names.size());
        const size_t from = held.n;
        if (from == names.size()) {
            return;
        }
        // only the new blocks leave the KV cache, straight into their store blocks: one range
        // call per run of blocks that lie one after another in the store
        reservation                   res(*kv.store, names.size() - from, publish_removed(kv));
        const std::vector<uint32_t> & ids = res.ids;
        const size_t                  bb  = kv.store->block_bytes();
        int32_t                       st  = LLAMA_KV_RANGE_OK;
        for_runs(ids.data(), ids.size(), [&](size_t i0, size_t i1) {
            if (st == LLAMA_KV_RANGE_OK) {
                st = kv_range_move(kv, ctx, seq_id, llama_pos((from + i0) * bt), llama_pos((from + i1) * bt),
                                   kv.store->block(ids[i0]), (i1 - i0) * bb, false);
                if (st == LLAMA_KV_RANGE_OK) {
                    kv.counts.export_bytes += (i1 - i0) * bb;
                }
            }
        });
        if (st != LLAMA_KV_RANGE_OK) {
            // the reservation frees every block: none of this prompt's new blocks is served
            kv.counts.export_failed++;
            SRV_WRN("kvrelay: slot %d: its blocks are not served: llama.cpp: %s\n", seq_id, range_status(st));
            return;
        }
        // recorded before the blocks can be pinned by name: each is served with its checksum and
        // its content digest, which a fetching server compares with its own tokens' digest
        kv.agent->record_checksums(ids);
        kv.agent->record_digests(ids, std::vector<block_store::digest>(keys.digests.begin() + from,
                                                                      keys.digests.begin() + from + ids.size()));
        res.handed                      = ids.size();
        const std::vector<size_t> fresh = kv.store->commit(ids.data(), names.data() + from, keys.digests.data() + from,
                                                           ids.size(), publish_stored(kv, names, tokens, from));
        kv.counts.exported_blocks += fresh.size();
    } catch (const std::exception & e) {
        kv.counts.export_failed++;
        SRV_WRN("kvrelay: slot %d: its blocks are not served: %s\n", seq_id, e.what());
    } catch (...) {
        kv.counts.export_failed++;
    }
}

}  // namespace kvrelay_llama
