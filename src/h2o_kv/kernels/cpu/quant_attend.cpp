// Fused CPU kernels over quantized KV slots (H2OCache(kv_bits=4|8), see h2o_kv/hf/quant.py).
//
// quant_attend: one decode step's attention, reading the codes where they lie (no dequantized copy is made). Per
// (sequence, KV head) and slot s, with group j of `group` numbers:
//   logit[g, s] = sum_j scale[s, j] * (q[g] . codes[s, group j]) + zero[s, j] * sum(q[g, group j])
// (or q[g] . ring[pos[s] % R] for the newest columns, held in full precision), a softmax over the visible slots,
// the probability mass of each slot summed over the query heads of the group, and
//   out[g] = sum_s sum_j p[g, s] * (scale[s, j] * codes[s, group j] + zero[s, j])   (or p[g, s] * ring value).
// 4-bit codes hold number 2i in the low nibble of byte i and 2i+1 in the high one: an entry's codes are unpacked
// once per step part with each group's even numbers first, the query and the output use the same order, so every
// inner loop is contiguous (SIMD, no shuffles).
// quant_write: the new token of a decode step quantized into its slot and the ring (QuantizedSlots.write).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// the codes of one entry as floats, group by group; 4-bit: each group's even numbers (low nibbles), then its odd ones
template <int BITS>
inline void unpack_split(const uint8_t* __restrict codes, float* __restrict out, int64_t dim, int64_t group) {
  if constexpr (BITS == 8) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(codes[d]);
  } else {
    const int64_t half = group / 2;
    for (int64_t j = 0; j < dim / group; ++j) {
      const uint8_t* c = codes + j * half;
      float* o = out + j * group;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        o[i] = static_cast<float>(c[i] & 15);
        o[half + i] = static_cast<float>(c[i] >> 4);
      }
    }
  }
}

using h2o_simd::dot;

}  // namespace

// query [B, Hkv, G, D] float32, already scaled; k/v data [B, Hkv, S, D*bits/8] uint8; scale/zero [B, Hkv, S, D/group]
// float32; rings [B, Hkv, R, D] float32; pos [B, Hkv, S] int64; valid [B, Hkv, S] bool. A slot is attended when valid
// or at `column` (a pad token sees its own key); it is read from the ring when pos >= column + 1 - R.
// Returns (out [B, Hkv, G, D] float32, mass [B, Hkv, S] float32).
template <int BITS>
std::vector<torch::Tensor> quant_attend_bits(torch::Tensor query, torch::Tensor kdata, torch::Tensor kscale,
                                             torch::Tensor kzero, torch::Tensor kring, torch::Tensor vdata,
                                             torch::Tensor vscale, torch::Tensor vzero, torch::Tensor vring,
                                             torch::Tensor pos, torch::Tensor valid, int64_t column) {
  for (const auto& t : {query, kscale, kzero, kring, vscale, vzero, vring})
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous(), "quant_attend: float32 contiguous tensors");
  TORCH_CHECK(kdata.scalar_type() == torch::kByte && vdata.scalar_type() == torch::kByte && kdata.is_contiguous() &&
                  vdata.is_contiguous(),
              "quant_attend: codes must be contiguous uint8");
  TORCH_CHECK(pos.scalar_type() == torch::kLong && valid.scalar_type() == torch::kBool && pos.is_contiguous() &&
                  valid.is_contiguous(),
              "quant_attend: pos int64, valid bool, contiguous");
  const int64_t B = query.size(0), H = query.size(1), G = query.size(2), D = query.size(3);
  const int64_t S = pos.size(2), R = kring.size(2), groups = kscale.size(3), group = D / groups;
  const int64_t row_bytes = kdata.size(3);
  TORCH_CHECK(groups * group == D && group % 2 == 0 && row_bytes == D * BITS / 8 && vdata.size(3) == row_bytes,
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
  const float inf = std::numeric_limits<float>::infinity();
  // per group j, the query's numbers in unpack_split's order: 8-bit as they are; 4-bit the even ones, then the odd
  const int64_t half = BITS == 8 ? group : group / 2;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits(G * S), qsum(G * groups), split(G * D), acc(G * D), zsum(G * groups), deq(D);
    for (int64_t row = begin; row < end; ++row) {
      const float* q = q_all + row * G * D;
      const int64_t* p = p_all + row * S;
      const bool* ok = ok_all + row * S;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < groups; ++j) {
          const float* qg = q + g * D + j * group;
          float* lo = split.data() + g * D + j * group;
          float total = 0.f;
          for (int64_t i = 0; i < group; ++i) total += qg[i];
          qsum[g * groups + j] = total;
          for (int64_t i = 0; i < group; ++i) {  // 4-bit: even numbers first, then odd ones
            if (BITS == 8) lo[i] = qg[i];
            else (i % 2 ? lo[half + i / 2] : lo[i / 2]) = qg[i];
          }
        }
      // logits
      for (int64_t s = 0; s < S; ++s) {
        if (!(ok[s] || p[s] == column)) {
          for (int64_t g = 0; g < G; ++g) logits[g * S + s] = -inf;
          continue;
        }
        if (p[s] >= ring_from) {
          const float* k = kr + (row * R + p[s] % R) * D;
          for (int64_t g = 0; g < G; ++g) logits[g * S + s] = dot(q + g * D, k, D);
          continue;
        }
        const int64_t i = row * S + s;
        unpack_split<BITS>(kd + i * row_bytes, deq.data(), D, group);
        for (int64_t g = 0; g < G; ++g) {
          float total = 0.f;
          for (int64_t j = 0; j < groups; ++j)
            total += ks[i * groups + j] * dot(split.data() + g * D + j * group, deq.data() + j * group, group) +
                     kz[i * groups + j] * qsum[g * groups + j];
          logits[g * S + s] = total;
        }
      }
      // softmax per query head, mass over the group
      float* m = mass_all + row * S;
      for (int64_t g = 0; g < G; ++g) {
        float* l = logits.data() + g * S;
        h2o_simd::softmax(l, S);
#pragma omp simd
        for (int64_t s = 0; s < S; ++s) m[s] += l[s];
      }
      // output: sum_s p * (scale * codes + zero), the codes term in the split order, the zero term per group
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(zsum.begin(), zsum.end(), 0.f);
      float* o = out_all + row * G * D;
      for (int64_t s = 0; s < S; ++s) {
        if (m[s] == 0.f) continue;  // masked (or underflowed) everywhere: adds nothing
        if (p[s] >= ring_from) {
          const float* v = vr + (row * R + p[s] % R) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = logits[g * S + s];
            float* og = o + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) og[d] += w * v[d];
          }
          continue;
        }
        const int64_t i = row * S + s;
        unpack_split<BITS>(vd + i * row_bytes, deq.data(), D, group);
        for (int64_t g = 0; g < G; ++g) {
          const float w = logits[g * S + s];
          for (int64_t j = 0; j < groups; ++j) {
            const float ws = w * vs[i * groups + j];
            const float* c = deq.data() + j * group;
            float* a = acc.data() + g * D + j * group;
#pragma omp simd
            for (int64_t d = 0; d < group; ++d) a[d] += ws * c[d];
            zsum[g * groups + j] += w * vz[i * groups + j];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < groups; ++j) {
          const float* lo = acc.data() + g * D + j * group;
          float* og = o + g * D + j * group;
          for (int64_t d = 0; d < group; ++d)
            og[d] += (BITS == 8 ? lo[d] : (d % 2 ? lo[half + d / 2] : lo[d / 2])) + zsum[g * groups + j];
        }
    }
  });
  return {out, mass};
}

std::vector<torch::Tensor> quant_attend(torch::Tensor query, torch::Tensor kdata, torch::Tensor kscale,
                                        torch::Tensor kzero, torch::Tensor kring, torch::Tensor vdata,
                                        torch::Tensor vscale, torch::Tensor vzero, torch::Tensor vring,
                                        torch::Tensor pos, torch::Tensor valid, int64_t column, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_attend: bits must be 4 or 8");
  return bits == 8 ? quant_attend_bits<8>(query, kdata, kscale, kzero, kring, vdata, vscale, vzero, vring, pos, valid,
                                          column)
                   : quant_attend_bits<4>(query, kdata, kscale, kzero, kring, vdata, vscale, vzero, vring, pos, valid,
                                          column);
}

// One new token per (sequence, KV head), x [B, H, 1, D] float32, quantized as h2o_kv.hf.quant.quantize does (min/max
// per group, scale = (max - min) / (2^bits - 1), code = round-half-even((x - min) / max(scale, FLT_MIN)) clamped),
// into slot free[b, h] of data/scale/zero [B, H, S, .], and into the ring at column % R: QuantizedSlots.write.
void quant_write(torch::Tensor data, torch::Tensor scale, torch::Tensor zero, torch::Tensor ring, torch::Tensor free,
                 torch::Tensor x, int64_t column, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_write: bits must be 4 or 8");
  for (const auto& t : {scale, zero, ring, x})
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous(), "quant_write: float32 contiguous tensors");
  TORCH_CHECK(data.scalar_type() == torch::kByte && data.is_contiguous() && free.scalar_type() == torch::kLong &&
                  free.is_contiguous(),
              "quant_write: data uint8, free int64, contiguous");
  const int64_t rows = x.size(0) * x.size(1), D = x.size(3), S = data.size(2), R = ring.size(2);
  const int64_t groups = scale.size(3), group = D / groups, row_bytes = data.size(3);
  TORCH_CHECK(x.size(2) == 1 && free.numel() == rows && row_bytes == D * bits / 8 && groups * group == D,
              "quant_write: one token per (sequence, head); shapes must match head_dim / group / bits");
  const float levels = static_cast<float>((1 << bits) - 1);
  const float* in = x.data_ptr<float>();
  const int64_t* f = free.data_ptr<int64_t>();
  uint8_t* codes_all = data.data_ptr<uint8_t>();
  float *sc_all = scale.data_ptr<float>(), *zp_all = zero.data_ptr<float>(), *ring_all = ring.data_ptr<float>();
  std::vector<uint8_t> codes(D);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(f[r] >= 0 && f[r] < S, "quant_write: slot index out of range");
    const float* v = in + r * D;
    const int64_t i = r * S + f[r];
    for (int64_t j = 0; j < groups; ++j) {
      const float* part = v + j * group;
      float lo = part[0], hi = part[0];
      for (int64_t d = 1; d < group; ++d) {
        lo = std::min(lo, part[d]);
        hi = std::max(hi, part[d]);
      }
      const float sc = (hi - lo) / levels, div = std::max(sc, std::numeric_limits<float>::min());
      sc_all[i * groups + j] = sc;
      zp_all[i * groups + j] = lo;
      for (int64_t d = 0; d < group; ++d)
        codes[j * group + d] = static_cast<uint8_t>(std::min(levels, std::max(0.f, std::nearbyint((part[d] - lo) / div))));
    }
    uint8_t* out = codes_all + i * row_bytes;
    if (bits == 8) {
      for (int64_t d = 0; d < D; ++d) out[d] = codes[d];
    } else {
      for (int64_t b = 0; b < D / 2; ++b) out[b] = codes[2 * b] | (codes[2 * b + 1] << 4);
    }
    std::memcpy(ring_all + (r * R + column % R) * D, v, D * sizeof(float));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_write", &quant_write, "quantize one token per (sequence, head) into its free slot and the ring");
  m.def("quant_attend", &quant_attend, "one decode step's attention over quantized KV slots, with per-slot mass");
}
