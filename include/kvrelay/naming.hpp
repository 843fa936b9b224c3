// kvrelay/naming.hpp: Block names and content digests: Naming.
// Part of kvrelay.hpp (C++17 RAII wrappers over kvrelay.h); include <kvrelay.hpp> for all of them.
#ifndef KVRELAY_KVRELAY_NAMING_HPP
#define KVRELAY_KVRELAY_NAMING_HPP

#include "core.hpp"

namespace kvrelay {

/// Block names (SPEC section 8; kvrelay_block_names): how a runtime names the full blocks of a
/// request's tokens, the same way every runtime that links kvrelay does. Holds its own copy of
/// the salt; copyable.
class Naming {
 public:
  /// Names under `seed` (seed_of() the engine's identity), `block_tokens` per block, `lora_id`
  /// (0: none) and the request's cache salt ("" : none; copied).
  Naming(uint64_t seed, std::size_t block_tokens, uint64_t lora_id = 0, std::string_view salt = {})
      : seed_(seed), block_tokens_(block_tokens), lora_id_(lora_id), salt_(salt) {}
  /// The seed of an engine whose identity is `identity` (model digest, build, KV settings).
  static uint64_t seed_of(std::string_view identity) {
    uint64_t seed = 0;
    check(kvrelay_name_seed(reinterpret_cast<const uint8_t *>(identity.data()), identity.size(), &seed));
    return seed;
  }
  /// The names of the full blocks of `tokens`, which begin at block `first_block` of their
  /// request after the block named `parent` (both 0 for a whole prompt).
  std::vector<uint64_t> names(const uint32_t *tokens, std::size_t n, uint64_t parent = 0,
                              std::size_t first_block = 0) const {
    std::vector<uint64_t> out(block_tokens_ ? n / block_tokens_ : 0);
    std::size_t got = 0;
    const kvrelay_naming c = c_naming();
    check(kvrelay_block_names(&c, parent, first_block, tokens, n, out.data(), out.size(), &got));
    out.resize(got);
    return out;
  }
  /// The same for signed token ids (llama.cpp's `llama_token`), read as their unsigned values
  /// without a copy (ids are never negative; the two types share their representation).
  std::vector<uint64_t> names(const int32_t *tokens, std::size_t n, uint64_t parent = 0,
                              std::size_t first_block = 0) const {
    return names(reinterpret_cast<const uint32_t *>(tokens), n, parent, first_block);
  }
  std::vector<uint64_t> names(const std::vector<uint32_t> &tokens) const { return names(tokens.data(), tokens.size()); }
  std::vector<uint64_t> names(const std::vector<int32_t> &tokens) const { return names(tokens.data(), tokens.size()); }
  /// A block's content digest (kvrelay_block_digests): SHA-256, chained like the names.
  using Digest = BlockDigest;
  /// The content digests of the full blocks of `tokens` under the engine identity `identity`
  /// (the string seed_of() takes), cut as names() cuts them: `tokens` begin at block
  /// `first_block` of their request after the block whose digest is `*parent` (nullptr and 0
  /// for a whole prompt; nullptr with `first_block` above 0 throws KVRELAY_ERR_NULL). Names are
  /// what routers index, but they are not collision-resistant: import a block into a slot
  /// only when its recorded digest equals the digest of that slot's own tokens.
  std::vector<Digest> digests(std::string_view identity, const uint32_t *tokens, std::size_t n,
                              const Digest *parent = nullptr, std::size_t first_block = 0) const {
    std::vector<Digest> out(block_tokens_ ? n / block_tokens_ : 0);
    std::size_t got = 0;
    const kvrelay_naming c = c_naming();
    check(kvrelay_block_digests(&c, reinterpret_cast<const uint8_t *>(identity.data()), identity.size(),
                                parent ? parent->data() : nullptr, first_block, tokens, n,
                                reinterpret_cast<uint8_t *>(out.data()), out.size(), &got));
    out.resize(got);
    return out;
  }
  /// The same for signed token ids (llama.cpp's `llama_token`), read as their unsigned values.
  std::vector<Digest> digests(std::string_view identity, const int32_t *tokens, std::size_t n,
                              const Digest *parent = nullptr, std::size_t first_block = 0) const {
    return digests(identity, reinterpret_cast<const uint32_t *>(tokens), n, parent, first_block);
  }
  std::vector<Digest> digests(std::string_view identity, const std::vector<uint32_t> &tokens) const {
    return digests(identity, tokens.data(), tokens.size());
  }
  std::vector<Digest> digests(std::string_view identity, const std::vector<int32_t> &tokens) const {
    return digests(identity, tokens.data(), tokens.size());
  }
  /// The C struct for this naming (valid while this object lives and is not modified).
  kvrelay_naming c_naming() const noexcept {
    return kvrelay_naming{sizeof(kvrelay_naming), seed_,
                          block_tokens_,          lora_id_,
                          reinterpret_cast<const uint8_t *>(salt_.data()), salt_.size()};
  }

 private:
  uint64_t seed_;
  std::size_t block_tokens_;
  uint64_t lora_id_;
  std::string salt_;
};

}  // namespace kvrelay

#endif  // KVRELAY_KVRELAY_NAMING_HPP
