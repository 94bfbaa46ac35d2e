// One attention pass over the prompt chunk of each bounded request of a batch, in one layer, inside vLLM's paged fp32
// KV cache (the CPU backend's 'vec' layout, as paged_decode.cpp): the output and the probability mass of every key,
// together. See h2o_kv/vllm/attention.py. vLLM has written the chunk's keys and values before attention; query i of
// row r sits at column `column + i` and sees the keys [0, column + i] (causal; earlier chunks' keys included).
//
// Work items are (row, KV head, block of queries), in parallel (OpenMP, dynamic schedule: later blocks see more
// keys). An item, in one pass over the keys its queries see: the logits of its queries x the group's query heads
// (keys read dimension-major through the block table, in place, paged block by paged block, each block used by all
// the item's rows while it is in the L1/L2 cache, four query rows per register tile), softmax, then again block by
// block output += probabilities @ values (values token-major, read in place) and the probabilities' column sums
// (the block's mass) into a scratch row of its own. Then, per (row, KV head), the blocks' masses are added in block
// order (deterministic) into `mass[r]` and, for the blocks of the row's observation window (its queries from
// `window_from` on; no block straddles it), into `window[r]`.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include "simd.h"

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;       // keys (logits) or head dimensions (output) per register tile
constexpr int kTile = 4;             // query rows per register tile
constexpr int64_t kCells = 1 << 16;  // logits of one item (256 KiB): sets the queries of a block

struct Item {
  int64_t row, head, q0, q1, scratch;  // queries [q0, q1) of the row's chunk; offset of its mass in the scratch
  bool window;                         // the block lies in the row's observation window
};

// l[r][t] = q[r] . k[t] for R query rows and the first n keys of one paged block (dimension-major, block_size
// columns; block_size is a multiple of kLanes, so a tile never reads past the block)
template <int R>
void tile_logits(const float* q, int64_t dim, const float* keys, int64_t block_size, int64_t n, float* l,
                 int64_t l_stride) {
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    float acc[R][kLanes] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float* kd = keys + d * block_size + t0;
      for (int r = 0; r < R; ++r) {
        const float qd = q[r * dim + d];
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) acc[r][j] += qd * kd[j];
      }
    }
    const int64_t m = std::min(kLanes, n - t0);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < m; ++j) l[r * l_stride + t0 + j] = acc[r][j];
  }
}

// out[r] += sum_t p[r][t] v[t] for R query rows over the first n keys of one paged block (values token-major)
template <int R>
void tile_output(const float* p, int64_t p_stride, const float* values, int64_t dim, int64_t n, float* out) {
  for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
    float acc[R][kLanes];
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kLanes; ++j) acc[r][j] = out[r * dim + d0 + j];
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = values + t * dim + d0;
      for (int r = 0; r < R; ++r) {
        const float w = p[r * p_stride + t];
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) acc[r][j] += w * vt[j];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kLanes; ++j) out[r * dim + d0 + j] = acc[r][j];
  }
}

template <typename F>
void dispatch_tile(int rows, F&& f) {
  switch (rows) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

}  // namespace

void paged_prefill(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor output, torch::Tensor block_table,
                   torch::Tensor meta, std::vector<torch::Tensor> mass, std::vector<torch::Tensor> window,
                   double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kFloat &&
                  output.scalar_type() == torch::kFloat,
              "paged_prefill: fp32 queries, cache and output only");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_prefill: query must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(output.is_contiguous() && output.sizes() == query.sizes(),
              "paged_prefill: contiguous output [tokens, heads, head_dim]");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 4, "paged_prefill: a contiguous 4-D layer cache");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && block_table.is_contiguous() &&
                  meta.scalar_type() == torch::kLong && meta.is_contiguous() && meta.dim() == 2 && meta.size(1) == 4 &&
                  block_table.size(0) == meta.size(0),
              "paged_prefill: block_table int32 [rows, blocks], meta int64 [rows, 4]");
  const int64_t rows = meta.size(0), tokens = query.size(0), q_heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = kv_cache.size(1), block_size = kv_cache.size(2), width = block_table.size(1);
  const int64_t group = q_heads / kv_heads, blocks_in_cache = kv_cache.size(0);
  TORCH_CHECK(q_heads % kv_heads == 0 && kv_cache.size(3) == 2 * dim,
              "paged_prefill: cache [blocks, kv_heads, block_size, 2 * head_dim], query heads a multiple of kv_heads");
  TORCH_CHECK(block_size % kLanes == 0 && dim % kLanes == 0,
              "paged_prefill: block_size and head_dim must be multiples of 16");
  const bool with_mass = !mass.empty();
  TORCH_CHECK(!with_mass || (static_cast<int64_t>(mass.size()) == rows && window.size() == mass.size()),
              "paged_prefill: one mass and one window tensor per row, or none");
  const auto* m = meta.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  std::vector<Item> items;
  int64_t scratch_size = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t start = m[r * 4], queries = m[r * 4 + 1], column = m[r * 4 + 2];
    const int64_t window_from = std::clamp<int64_t>(m[r * 4 + 3], 0, queries);
    const int64_t seen = column + queries;
    TORCH_CHECK(queries >= 1 && column >= 0 && start >= 0 && start + queries <= tokens,
                "paged_prefill: a row's queries out of range of the batch");
    TORCH_CHECK(seen <= width * block_size, "paged_prefill: a row's keys out of range of its blocks");
    for (int64_t b = 0; b < (seen + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[r * width + b] >= 0 && table[r * width + b] < blocks_in_cache,
                  "paged_prefill: block id out of range");
    if (with_mass) {
      for (const auto* t : {&mass[r], &window[r]}) {
        const bool used = t == &mass[r] || window_from < queries;
        TORCH_CHECK(!used || (t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 2 &&
                              t->size(0) == kv_heads && t->size(1) >= seen),
                    "paged_prefill: mass/window float32 [kv_heads, >= keys seen by the chunk]");
      }
    }
    // blocks of queries: as many as keep an item's logits within kCells, split at the observation window
    const int64_t per_block = std::max<int64_t>(1, kCells / (group * seen));
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (const auto& [lo, hi, in_window] : {std::tuple{int64_t{0}, window_from, false},
                                              std::tuple{window_from, queries, true}}) {
        const int64_t count = (hi - lo + per_block - 1) / per_block;
        for (int64_t k = 0; k < count; ++k) {
          const int64_t q0 = lo + (hi - lo) * k / count, q1 = lo + (hi - lo) * (k + 1) / count;
          items.push_back({r, h, q0, q1, scratch_size, in_window});
          scratch_size += column + q1;
        }
      }
    }
  }
  const float* q_data = query.data_ptr<float>();
  const float* cache = kv_cache.data_ptr<float>();
  float* out = output.data_ptr<float>();
  const int64_t q_stride = query.stride(0), head_floats = 2 * block_size * dim;
  const float fscale = static_cast<float>(scale);
  thread_local std::vector<float> scratch;  // reused across calls (no fresh pages per layer)
  if (with_mass && static_cast<int64_t>(scratch.size()) < scratch_size) scratch.resize(scratch_size);
  float* sums = scratch.data();
  const int64_t n_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qbuf, logits, obuf;
    std::vector<const float*> keys, values;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = n_items - 1; k >= 0; --k) {  // the costliest (latest) blocks first
      const Item& it = items[k];
      const int64_t r = it.row, h = it.head, start = m[r * 4], column = m[r * 4 + 2];
      const int64_t n_rows = (it.q1 - it.q0) * group, seen = column + it.q1;
      // the block's queries, scaled, row i * group + g: query i of the block, head g of the group
      qbuf.resize(n_rows * dim);
      for (int64_t i = it.q0; i < it.q1; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const float* src = q_data + (start + i) * q_stride + (h * group + g) * dim;
          float* dst = qbuf.data() + ((i - it.q0) * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * fscale;
        }
      const int64_t blocks = (seen + block_size - 1) / block_size;
      keys.resize(blocks);
      values.resize(blocks);
      for (int64_t b = 0; b < blocks; ++b) {
        keys[b] = cache + (table[r * width + b] * kv_heads + h) * head_floats;
        values[b] = keys[b] + block_size * dim;
      }
      logits.resize(n_rows * seen);
      float* l = logits.data();
      // the keys a tile of rows sees: up to its last row's column
      auto visible = [&](int64_t t0, int tile) { return column + it.q0 + (t0 + tile - 1) / group + 1; };
      // logits, paged block by block, a tile of rows at a time
      for (int64_t b = 0, first = 0; b < blocks; ++b, first += block_size) {
        for (int64_t t0 = 0; t0 < n_rows; t0 += kTile) {
          const int tile = static_cast<int>(std::min<int64_t>(kTile, n_rows - t0));
          const int64_t n = std::min(block_size, visible(t0, tile) - first);
          if (n <= 0) continue;
          dispatch_tile(tile, [&](auto R) {
            tile_logits<decltype(R)::value>(qbuf.data() + t0 * dim, dim, keys[b], block_size, n, l + t0 * seen + first,
                                            seen);
          });
        }
      }
      // softmax over each row's visible keys; the rest of the row is zero
      for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t visible = column + it.q0 + i / group + 1;
        float* row = l + i * seen;
        h2o_simd::softmax(row, visible);
        std::fill(row + visible, row + seen, 0.f);
      }
      // output and mass, paged block by block
      obuf.assign(n_rows * dim, 0.f);
      float* s = sums + it.scratch;
      for (int64_t b = 0, first = 0; b < blocks; ++b, first += block_size) {
        for (int64_t t0 = 0; t0 < n_rows; t0 += kTile) {
          const int tile = static_cast<int>(std::min<int64_t>(kTile, n_rows - t0));
          const int64_t n = std::min(block_size, visible(t0, tile) - first);
          if (n <= 0) continue;
          dispatch_tile(tile, [&](auto R) {
            tile_output<decltype(R)::value>(l + t0 * seen + first, seen, values[b], dim, n, obuf.data() + t0 * dim);
          });
        }
        if (with_mass) {  // the block's column sums over these keys
          const int64_t n = std::min(block_size, seen - first);
          float* sb = s + first;
          std::fill(sb, sb + n, 0.f);
          for (int64_t i = 0; i < n_rows; ++i) {
            const float* row = l + i * seen + first;
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) sb[t] += row[t];
          }
        }
      }
      for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t q = it.q0 + i / group, g = i % group;
        std::copy(obuf.data() + i * dim, obuf.data() + (i + 1) * dim, out + ((start + q) * q_heads + h * group + g) * dim);
      }
    }
  }
  if (!with_mass) return;
  // per (row, KV head): the blocks' masses in block order
  std::vector<int64_t> first_item(rows * kv_heads + 1, n_items);
  for (int64_t k = n_items - 1; k >= 0; --k) first_item[items[k].row * kv_heads + items[k].head] = k;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / kv_heads, h = rh % kv_heads;
      float* total = mass[r].data_ptr<float>() + h * mass[r].size(1);
      float* in_window = window[r].numel() > 0 ? window[r].data_ptr<float>() + h * window[r].size(1) : nullptr;
      for (int64_t k = first_item[rh]; k < n_items && items[k].row == r && items[k].head == h; ++k) {
        const float* s = sums + items[k].scratch;
        const int64_t seen = m[r * 4 + 2] + items[k].q1;
#pragma omp simd
        for (int64_t t = 0; t < seen; ++t) total[t] += s[t];
        if (items[k].window) {
#pragma omp simd
          for (int64_t t = 0; t < seen; ++t) in_window[t] += s[t];
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", &paged_prefill,
        "attention over bounded rows' prompt chunks in vLLM's paged fp32 cache, with the mass of every key");
}
