// One H2O decode step of the bounded requests of a batch, in one layer, inside vLLM's paged fp32 KV cache (the CPU
// backend's 'vec' layout): per (block, KV head) keys dimension-major [head_dim][block_size], then values token-major
// [block_size][head_dim]. See h2o_kv/vllm/attention.py. For each (row, KV head), in one pass over its slots:
//   1. the new token's key and value go into the head's first free slot (its column, a zero score, valid);
//   2. attention of the group's query heads over the slots (invalid ones masked), softmax, output;
//   3. the mass (probability summed over the group's query heads) is either written to `mass` (any policy, ranked in
//      Python) or, for H2O, added to the scores in place, and where the row evicts (`meta[r][3]`), the first slot of
//      lowest score among those whose column is below `meta[r][4]` (the recent window) is freed: the same victim as
//      h2o_kv.policies.H2O.decode_victim.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Row {
  int64_t token, slots, column, evict, recent_from;
};

}  // namespace

void paged_decode(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                  torch::Tensor output, torch::Tensor block_table, torch::Tensor meta, std::vector<torch::Tensor> pos,
                  std::vector<torch::Tensor> scores, std::vector<torch::Tensor> valid, c10::optional<torch::Tensor> mass,
                  double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat && key.scalar_type() == torch::kFloat &&
                  value.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kFloat &&
                  output.scalar_type() == torch::kFloat,
              "paged_decode: fp32 queries, keys, values, cache and output only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1 &&
                  value.stride(2) == 1 && query.stride(1) == query.size(2) && key.stride(1) == key.size(2) &&
                  value.stride(1) == value.size(2),
              "paged_decode: query/key/value must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 4, "paged_decode: a contiguous 4-D layer cache");
  TORCH_CHECK(output.is_contiguous(), "paged_decode: contiguous output");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && block_table.is_contiguous() &&
                  meta.scalar_type() == torch::kLong && meta.is_contiguous() && meta.size(1) == 5,
              "paged_decode: block_table int32 [rows, blocks], meta int64 [rows, 5]");
  const int64_t rows = meta.size(0), q_heads = query.size(1), dim = query.size(2), kv_heads = key.size(1);
  const int64_t group = q_heads / kv_heads, block_size = kv_cache.size(2), width = block_table.size(1);
  TORCH_CHECK(kv_cache.size(1) == kv_heads && kv_cache.size(3) == 2 * dim,
              "paged_decode: cache [blocks, kv_heads, block_size, 2 * head_dim]");
  TORCH_CHECK(static_cast<int64_t>(pos.size()) == rows && scores.size() == pos.size() && valid.size() == pos.size(),
              "paged_decode: one pos/scores/valid tensor per row");
  float* out_mass = nullptr;
  int64_t mass_width = 0;
  if (mass.has_value()) {
    TORCH_CHECK(mass->scalar_type() == torch::kFloat && mass->is_contiguous() && mass->size(0) == rows &&
                    mass->size(1) == kv_heads,
                "paged_decode: mass float32 [rows, kv_heads, slots]");
    out_mass = mass->data_ptr<float>();
    mass_width = mass->size(2);
  }
  const auto* m = meta.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slots = m[r * 5 + 1];
    TORCH_CHECK(pos[r].scalar_type() == torch::kLong && scores[r].scalar_type() == torch::kFloat &&
                    valid[r].scalar_type() == torch::kBool && pos[r].is_contiguous() && scores[r].is_contiguous() &&
                    valid[r].is_contiguous() && pos[r].size(0) == kv_heads && pos[r].size(1) >= slots &&
                    scores[r].sizes() == pos[r].sizes() && valid[r].sizes() == pos[r].sizes(),
                "paged_decode: row state pos int64 / scores float32 / valid bool [kv_heads, >= slots]");
    TORCH_CHECK(slots >= 1 && slots <= width * block_size && (out_mass == nullptr || slots <= mass_width),
                "paged_decode: slots out of range of the row's blocks");
    TORCH_CHECK(m[r * 5] >= 0 && m[r * 5] < query.size(0), "paged_decode: token index out of range");
  }
  float* cache = kv_cache.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float* q_data = query.data_ptr<float>();
  const float* k_data = key.data_ptr<float>();
  const float* v_data = value.data_ptr<float>();
  float* out = output.data_ptr<float>();
  const int64_t q_stride = query.stride(0), k_stride = key.stride(0), v_stride = value.stride(0);
  const int64_t head_floats = 2 * block_size * dim, blocks_in_cache = kv_cache.size(0);
  const float inf = std::numeric_limits<float>::infinity();

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits, probs_sum;
    std::vector<const float*> bases;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const Row row{m[r * 5], m[r * 5 + 1], m[r * 5 + 2], m[r * 5 + 3], m[r * 5 + 4]};
      const int64_t slots = row.slots, stride = pos[r].size(1);
      int64_t* p = pos[r].data_ptr<int64_t>() + h * stride;
      float* s = scores[r].data_ptr<float>() + h * stride;
      bool* ok = valid[r].data_ptr<bool>() + h * stride;
      const int64_t blocks = (slots + block_size - 1) / block_size;
      bases.assign(blocks, nullptr);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t block = table[r * width + b];
        TORCH_CHECK(block >= 0 && block < blocks_in_cache, "paged_decode: block id out of range");
        bases[b] = cache + (block * kv_heads + h) * head_floats;
      }
      // 1. the new token into the first free slot
      int64_t free = 0;
      while (free < slots && ok[free]) ++free;
      TORCH_CHECK(free < slots, "paged_decode: no free slot in a decode step");
      {
        float* base = const_cast<float*>(bases[free / block_size]);
        const int64_t offset = free % block_size;
        const float* k = k_data + row.token * k_stride + h * dim;
        const float* v = v_data + row.token * v_stride + h * dim;
        for (int64_t d = 0; d < dim; ++d) base[d * block_size + offset] = k[d];
        for (int64_t d = 0; d < dim; ++d) base[block_size * dim + offset * dim + d] = v[d];
        p[free] = row.column;
        s[free] = 0.f;
        ok[free] = true;
      }
      // 2. logits of the group's query heads, block by block (keys dimension-major: the inner loop is contiguous)
      logits.assign(group * slots, 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        const float* keys = bases[b];
        const int64_t first = b * block_size, n = std::min(block_size, slots - first);
        for (int64_t g = 0; g < group; ++g) {
          const float* q = q_data + row.token * q_stride + (h * group + g) * dim;
          float* l = logits.data() + g * slots + first;
          for (int64_t d = 0; d < dim; ++d) {
            const float qd = q[d] * static_cast<float>(scale);
            const float* kd = keys + d * block_size;
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) l[t] += qd * kd[t];
          }
        }
      }
      // softmax per query head; a slot is visible when valid and not in the row's future
      for (int64_t g = 0; g < group; ++g) {
        float* l = logits.data() + g * slots;
        for (int64_t t = 0; t < slots; ++t)
          if (!ok[t] || p[t] > row.column) l[t] = -inf;
        h2o_simd::softmax(l, slots);
      }
      // output = probs @ values (values token-major: the inner loop over head_dim is contiguous)
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (row.token * q_heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = 0.f;
        const float* l = logits.data() + g * slots;
        for (int64_t b = 0; b < blocks; ++b) {
          const float* values = bases[b] + block_size * dim;
          const int64_t first = b * block_size, n = std::min(block_size, slots - first);
          for (int64_t t = 0; t < n; ++t) {
            const float w = l[first + t];
            const float* v = values + t * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) o[d] += w * v[d];
          }
        }
      }
      // 3. the mass: to `mass`, or folded into H2O's scores (and the victim freed)
      probs_sum.assign(slots, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const float* l = logits.data() + g * slots;
#pragma omp simd
        for (int64_t t = 0; t < slots; ++t) probs_sum[t] += l[t];
      }
      if (out_mass != nullptr) {
        float* dst = out_mass + (r * kv_heads + h) * mass_width;
        for (int64_t t = 0; t < slots; ++t) dst[t] = probs_sum[t];
        for (int64_t t = slots; t < mass_width; ++t) dst[t] = 0.f;
        continue;
      }
      for (int64_t t = 0; t < slots; ++t) s[t] += probs_sum[t];
      if (row.evict) {
        float best = inf;
        int64_t at = 0;
        for (int64_t t = 0; t < slots; ++t) {
          if (p[t] < row.recent_from && s[t] < best) {
            best = s[t];
            at = t;
          }
        }
        ok[at] = false;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "one H2O decode step of bounded rows in vLLM's paged fp32 cache, in place");
}
