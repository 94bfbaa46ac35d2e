// Fused CPU kernels for the bookkeeping of one H2O decode step in one layer (see h2o_kv/kernels/__init__.py).
// Each replaces a handful of small torch ops whose dispatch and cache-cold reads dominate on a CPU.
#include <torch/extension.h>

#include <cstring>
#include <limits>

// Write one token per (sequence, KV head) into slot free[b, h]: keys, values, its column, a zero score, valid.
void write_slot(torch::Tensor keys, torch::Tensor values, torch::Tensor pos, torch::Tensor scores,
                torch::Tensor valid, torch::Tensor free, torch::Tensor key, torch::Tensor value, int64_t column) {
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && key.is_contiguous() && value.is_contiguous(),
              "write_slot: key/value buffers must be contiguous");
  TORCH_CHECK(key.scalar_type() == keys.scalar_type() && value.scalar_type() == values.scalar_type(),
              "write_slot: new entries must have the buffers' dtype");
  TORCH_CHECK(pos.scalar_type() == torch::kLong && scores.scalar_type() == torch::kFloat &&
                  free.scalar_type() == torch::kLong && pos.is_contiguous() && scores.is_contiguous() &&
                  free.is_contiguous(),
              "write_slot: pos/free must be contiguous int64, scores contiguous float32");
  TORCH_CHECK(valid.scalar_type() == torch::kBool && valid.is_contiguous() && valid.numel() == pos.numel(),
              "write_slot: valid must be a contiguous bool tensor shaped like pos");
  const int64_t rows = pos.size(0) * pos.size(1), slots = pos.size(2);
  TORCH_CHECK(free.numel() == rows && key.numel() / key.size(-1) == rows, "write_slot: one token per row");
  const int64_t key_bytes = keys.size(3) * keys.element_size(), value_bytes = values.size(3) * values.element_size();
  auto* k = static_cast<char*>(keys.data_ptr());
  auto* v = static_cast<char*>(values.data_ptr());
  const auto* new_k = static_cast<const char*>(key.data_ptr());
  const auto* new_v = static_cast<const char*>(value.data_ptr());
  auto* p = pos.data_ptr<int64_t>();
  auto* s = scores.data_ptr<float>();
  auto* ok = valid.data_ptr<bool>();
  const auto* f = free.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(f[r] >= 0 && f[r] < slots, "write_slot: slot index out of range");
    const int64_t i = r * slots + f[r];
    std::memcpy(k + i * key_bytes, new_k + r * key_bytes, key_bytes);
    std::memcpy(v + i * value_bytes, new_v + r * value_bytes, value_bytes);
    p[i] = column;
    s[i] = 0.f;
    ok[i] = true;
  }
}

// H2O's steady-state step: scores += mass (in place), then per row the first slot of lowest score among those
// whose column is below `recent_from` (the recent window is never evicted); [batch, heads, 1] int64.
// Same result as `scores.add_(mass); scores.masked_fill(pos >= recent_from, inf).min(-1, keepdim=True).indices`
// for NaN-free scores (torch.min would return a NaN's index; a NaN here is never the victim).
torch::Tensor h2o_victim(torch::Tensor scores, torch::Tensor mass, torch::Tensor pos, int64_t recent_from) {
  TORCH_CHECK(scores.scalar_type() == torch::kFloat && mass.scalar_type() == torch::kFloat &&
                  pos.scalar_type() == torch::kLong && scores.is_contiguous() && mass.is_contiguous() &&
                  pos.is_contiguous() && mass.sizes() == scores.sizes() && pos.sizes() == scores.sizes(),
              "h2o_victim: scores/mass must be contiguous float32 and pos int64 of the same shape");
  const int64_t rows = scores.size(0) * scores.size(1), slots = scores.size(2);
  auto victim = torch::empty({scores.size(0), scores.size(1), 1}, pos.options());
  auto* s = scores.data_ptr<float>();
  const auto* m = mass.data_ptr<float>();
  const auto* p = pos.data_ptr<int64_t>();
  auto* out = victim.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    float best = std::numeric_limits<float>::infinity();
    int64_t at = 0;
    for (int64_t i = r * slots, end = i + slots; i < end; ++i) {
      s[i] += m[i];
      if (p[i] < recent_from && s[i] < best) {
        best = s[i];
        at = i - r * slots;
      }
    }
    out[r] = at;
  }
  return victim;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_slot", &write_slot, "write one token per (sequence, head) into its free slot, in place");
  m.def("h2o_victim", &h2o_victim, "fold the mass into the scores and pick the H2O victim of every row");
}
