// Small loops shared by the fused CPU kernels, written so the compiler vectorizes them (-O3 -march=native).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace h2o_simd {

// e^x for x <= 0 (softmax after subtracting the maximum), within ~2 float ulp; 0 below -87 and for -inf (masked).
// Cody-Waite reduction x = k ln2 + r, |r| <= ln2 / 2, a degree-6 Taylor polynomial, 2^k from the exponent bits:
// branch-free, so `omp simd` loops over it vectorize (std::exp does not without -ffast-math).
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.f);
  const float k = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

// softmax of l[0, n) in place (-inf entries become 0); at least one entry must be finite
inline void softmax(float* __restrict l, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = std::max(top, l[i]);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) l[i] = exp_nonpositive(l[i] - top);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += l[i];
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) l[i] *= inv;
}

// a . b: 16 lanes of partial sums (FMAs in SIMD registers), then the lanes added pairwise
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
#pragma omp simd
    for (int k = 0; k < 16; ++k) lanes[k] += a[i + k] * b[i + k];
  for (int width = 8; width > 0; width /= 2)
#pragma omp simd
    for (int k = 0; k < width; ++k) lanes[k] += lanes[k + width];
  float total = lanes[0];
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

}  // namespace h2o_simd
