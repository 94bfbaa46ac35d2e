// Fused CPU attention of one decode step over quantized KV slots (H2OCache(kv_bits=4|8), see h2o_kv/hf/quant.py).
// Reads the codes where they lie: no dequantized copy of the keys or values is ever made. Per (sequence, KV head):
//   logit[g, s] = sum_groups scale[s, j] * (q[g] . codes[s, group j]) + zero[s, j] * sum(q[g, group j])
// (or q[g] . ring[pos[s] % R] for the newest columns, held in full precision), a softmax over the visible slots,
// the probability mass of each slot summed over the query heads of the group, and
//   out[g] = sum_s p[g, s] * value[s]   (value dequantized on the fly, or from the ring).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline int code_at(const uint8_t* data, int64_t d, int64_t bits) {
  if (bits == 8) return data[d];
  const uint8_t byte = data[d >> 1];
  return (d & 1) ? (byte >> 4) : (byte & 15);
}

}  // namespace

// query [B, Hkv, G, D] float32, already scaled; k/v data [B, Hkv, S, D*bits/8] uint8; scale/zero [B, Hkv, S, D/group]
// float32; rings [B, Hkv, R, D] float32; pos [B, Hkv, S] int64; valid [B, Hkv, S] bool. A slot is attended when valid
// or at `column` (a pad token sees its own key); it is read from the ring when pos >= column + 1 - R.
// Returns (out [B, Hkv, G, D] float32, mass [B, Hkv, S] float32).
std::vector<torch::Tensor> quant_attend(torch::Tensor query, torch::Tensor kdata, torch::Tensor kscale,
                                        torch::Tensor kzero, torch::Tensor kring, torch::Tensor vdata,
                                        torch::Tensor vscale, torch::Tensor vzero, torch::Tensor vring,
                                        torch::Tensor pos, torch::Tensor valid, int64_t column, int64_t bits) {
  for (const auto& t : {query, kscale, kzero, kring, vscale, vzero, vring})
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous(), "quant_attend: float32 contiguous tensors");
  TORCH_CHECK(kdata.scalar_type() == torch::kByte && vdata.scalar_type() == torch::kByte && kdata.is_contiguous() &&
                  vdata.is_contiguous(),
              "quant_attend: codes must be contiguous uint8");
  TORCH_CHECK(pos.scalar_type() == torch::kLong && valid.scalar_type() == torch::kBool && pos.is_contiguous() &&
                  valid.is_contiguous(),
              "quant_attend: pos int64, valid bool, contiguous");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_attend: bits must be 4 or 8");
  const int64_t B = query.size(0), H = query.size(1), G = query.size(2), D = query.size(3);
  const int64_t S = pos.size(2), R = kring.size(2), groups = kscale.size(3), group = D / groups;
  const int64_t row_bytes = kdata.size(3);
  TORCH_CHECK(groups * group == D && row_bytes == D * bits / 8 && vdata.size(3) == row_bytes,
              "quant_attend: shapes do not match head_dim / group / bits");
  auto out = torch::zeros({B, H, G, D}, query.options());
  auto mass = torch::zeros({B, H, S}, query.options());
  const float* q_all = query.data_ptr<float>();
  const uint8_t* kd = kdata.data_ptr<uint8_t>();
  const uint8_t* vd = vdata.data_ptr<uint8_t>();
  const float *ks = kscale.data_ptr<float>(), *kz = kzero.data_ptr<float>(), *kr = kring.data_ptr<float>();
  const float *vs = vscale.data_ptr<float>(), *vz = vzero.data_ptr<float>(), *vr = vring.data_ptr<float>();
  const int64_t* p_all = pos.data_ptr<int64_t>();
  const bool* ok_all = valid.data_ptr<bool>();
  float* out_all = out.data_ptr<float>();
  float* mass_all = mass.data_ptr<float>();
  const int64_t ring_from = column + 1 - R;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits(G * S), qsum(G * groups), deq(D);
    for (int64_t row = begin; row < end; ++row) {
      const float* q = q_all + row * G * D;
      const int64_t* p = p_all + row * S;
      const bool* ok = ok_all + row * S;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < groups; ++j) {
          float acc = 0.f;
          for (int64_t d = j * group; d < (j + 1) * group; ++d) acc += q[g * D + d];
          qsum[g * groups + j] = acc;
        }
      // logits
      for (int64_t s = 0; s < S; ++s) {
        const bool visible = ok[s] || p[s] == column;
        if (!visible) {
          for (int64_t g = 0; g < G; ++g) logits[g * S + s] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const int64_t i = row * S + s;
        if (p[s] >= ring_from) {
          const float* k = kr + (row * R + p[s] % R) * D;
          for (int64_t g = 0; g < G; ++g) {
            float acc = 0.f;
            for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * k[d];
            logits[g * S + s] = acc;
          }
          continue;
        }
        const uint8_t* codes = kd + i * row_bytes;
        for (int64_t d = 0; d < D; ++d) deq[d] = static_cast<float>(code_at(codes, d, bits));
        for (int64_t g = 0; g < G; ++g) {
          float acc = 0.f;
          for (int64_t j = 0; j < groups; ++j) {
            float dot = 0.f;
            for (int64_t d = j * group; d < (j + 1) * group; ++d) dot += q[g * D + d] * deq[d];
            acc += ks[i * groups + j] * dot + kz[i * groups + j] * qsum[g * groups + j];
          }
          logits[g * S + s] = acc;
        }
      }
      // softmax per query head, mass over the group
      float* m = mass_all + row * S;
      for (int64_t g = 0; g < G; ++g) {
        float* l = logits.data() + g * S;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) top = l[s] > top ? l[s] : top;
        float total = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          l[s] = std::exp(l[s] - top);
          total += l[s];
        }
        const float inv = 1.f / total;
        for (int64_t s = 0; s < S; ++s) {
          l[s] *= inv;
          m[s] += l[s];
        }
      }
      // output: probabilities times values
      float* o = out_all + row * G * D;
      for (int64_t s = 0; s < S; ++s) {
        if (m[s] == 0.f) continue;  // masked (or underflowed) everywhere: adds nothing
        const int64_t i = row * S + s;
        const float* v;
        if (p[s] >= ring_from) {
          v = vr + (row * R + p[s] % R) * D;
        } else {
          const uint8_t* codes = vd + i * row_bytes;
          for (int64_t j = 0; j < groups; ++j) {
            const float sc = vs[i * groups + j], zp = vz[i * groups + j];
            for (int64_t d = j * group; d < (j + 1) * group; ++d)
              deq[d] = static_cast<float>(code_at(codes, d, bits)) * sc + zp;
          }
          v = deq.data();
        }
        for (int64_t g = 0; g < G; ++g) {
          const float w = logits[g * S + s];
          float* og = o + g * D;
          for (int64_t d = 0; d < D; ++d) og[d] += w * v[d];
        }
      }
    }
  });
  return {out, mass};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_attend", &quant_attend, "one decode step's attention over quantized KV slots, with per-slot mass");
}
