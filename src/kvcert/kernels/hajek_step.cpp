// One call of Hájek attention with its linearized variance, fused (CPU, float32).
//
// For every (batch, KV head) and each of its R query rows (the group's query heads × query positions),
// over n slots with the additive logit bias b (−log π on retained slots, −inf on slots that are not
// retained or are masked for that row):
//   a_i   = softmax_i(scale · q·k_i + b_i)
//   out   = Σ_i a_i v_i
//   var_j = Σ_{i < t} (1 − π_i) a_i² (v_ij − out_j)²
// where only the first t slots may be sampled (the cache sorts sampled slots first). Optionally also
//   terms = (Σ_{i < t} c_i, Σ_{i < t} c_i²),   c_i = (1 − π_i) a_i²,
// the weights of the variance's terms and their squares, from which the effective number of terms behind
// var follows (docs/METHOD.md §7); they cost two additions per sampled slot and row.
// Keys and values are read once for all R rows. The slots are split into chunks (several per KV head, so
// that a few heads keep every thread busy): pass 1 computes each chunk's logits, softmax statistics and
// unnormalized output; the chunks are merged; pass 2 adds each chunk's share of the variance, on the same
// thread that read the chunk, while its values are still in cache, reusing pass 1's exponentials.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Slots per chunk: fixed, so that the summation order, and hence every rounding, does not depend on the
// number of threads; 256 slots give a 4k-token cache about five chunks per KV head to spread.
constexpr int64_t kChunk = 256;

inline float dot(const float* a, const float* b, int64_t d) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= d; j += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j + 16), _mm512_loadu_ps(b + j + 16), acc1);
    }
    if (j < d) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc0);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // independent partial sums
  int64_t j = 0;
  for (; j + 8 <= d; j += 8)
    for (int u = 0; u < 8; ++u) acc[u] += a[j + u] * b[j + u];
  float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; j < d; ++j) total += a[j] * b[j];
  return total;
}

// exp(x) within a few ulp for x ≤ 88, 0 for x < −87 (−inf included); branch-free so that loops vectorize.
#pragma omp declare simd notinbranch
inline float exp_approx(float x) {
  const float keep = x < -87.0f ? 0.0f : 1.0f;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n * keep;
}

// acc[r] += Σ_i w[r][i] v_i for the RT rows of a tile, with the RT × DV sums held in registers.
template <int DV, int RT>
void weighted_sum(const float* w, int64_t w_stride, const float* v, int64_t v_stride, int64_t len, float* acc,
                  int64_t acc_stride) {
  float a[RT][DV] = {};
  for (int64_t i = 0; i < len; ++i) {
    const float* vi = v + i * v_stride;
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r) {
      const float wr = w[r * w_stride + i];
#pragma omp simd
      for (int j = 0; j < DV; ++j) a[r][j] += wr * vi[j];
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < DV; ++j) acc[r * acc_stride + j] += a[r][j];
}

// acc[r] += Σ_i c_ri (v_i − o_r)², c_ri = (1 − π_i) (e_ri f_r)², for the RT rows of a tile; terms with
// c below the smallest normal float are dropped (lost to rounding anyway; subnormal arithmetic is slow).
// With TERMS, sums[2r] += Σ_i c_ri and sums[2r + 1] += Σ_i c_ri² over the same terms.
template <int DV, int RT, bool TERMS>
void weighted_squares(const float* e, int64_t e_stride, const float* f, const float* one_minus_pi, const float* v,
                      int64_t v_stride, int64_t len, const float* o, int64_t o_stride, float* acc, int64_t acc_stride,
                      float* sums) {
  float oo[RT][DV], p[RT][DV] = {};
  float s1[RT] = {}, s2[RT] = {};
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < DV; ++j) oo[r][j] = o[r * o_stride + j];
  for (int64_t i = 0; i < len; ++i) {
    const float w1 = one_minus_pi[i];
    if (w1 == 0.f) continue;  // certain slot
    const float* vi = v + i * v_stride;
#pragma GCC unroll 4
    for (int r = 0; r < RT; ++r) {
      const float a = e[r * e_stride + i] * f[r];
      float c = w1 * a * a;
      c = c >= std::numeric_limits<float>::min() ? c : 0.f;
      if (TERMS) {
        s1[r] += c;
        s2[r] += c * c;
      }
#pragma omp simd
      for (int j = 0; j < DV; ++j) {
        const float diff = vi[j] - oo[r][j];
        p[r][j] += c * diff * diff;
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < DV; ++j) acc[r * acc_stride + j] += p[r][j];
  if (TERMS)
    for (int r = 0; r < RT; ++r) {
      sums[2 * r] += s1[r];
      sums[2 * r + 1] += s2[r];
    }
}

// Rows per register tile for head size DV (0: no specialization, use the generic loops).
inline int tile_rows(int64_t dv) { return dv == 64 ? 4 : dv == 128 ? 2 : 0; }

template <int DV>
void weighted_sum_tile(int rt, const float* w, int64_t w_stride, const float* v, int64_t v_stride, int64_t len,
                       float* acc, int64_t acc_stride) {
  switch (rt) {
    case 1: return weighted_sum<DV, 1>(w, w_stride, v, v_stride, len, acc, acc_stride);
    case 2: return weighted_sum<DV, 2>(w, w_stride, v, v_stride, len, acc, acc_stride);
    case 3: return weighted_sum<DV, 3>(w, w_stride, v, v_stride, len, acc, acc_stride);
    default: return weighted_sum<DV, 4>(w, w_stride, v, v_stride, len, acc, acc_stride);
  }
}

template <int DV, bool TERMS>
void weighted_squares_rows(int rt, const float* e, int64_t e_stride, const float* f, const float* w1, const float* v,
                           int64_t v_stride, int64_t len, const float* o, int64_t o_stride, float* acc,
                           int64_t acc_stride, float* sums) {
  switch (rt) {
    case 1: return weighted_squares<DV, 1, TERMS>(e, e_stride, f, w1, v, v_stride, len, o, o_stride, acc, acc_stride, sums);
    case 2: return weighted_squares<DV, 2, TERMS>(e, e_stride, f, w1, v, v_stride, len, o, o_stride, acc, acc_stride, sums);
    case 3: return weighted_squares<DV, 3, TERMS>(e, e_stride, f, w1, v, v_stride, len, o, o_stride, acc, acc_stride, sums);
    default: return weighted_squares<DV, 4, TERMS>(e, e_stride, f, w1, v, v_stride, len, o, o_stride, acc, acc_stride, sums);
  }
}

// sums: nullptr (no terms wanted) or 2 floats per row of the tile.
template <int DV>
void weighted_squares_tile(int rt, const float* e, int64_t e_stride, const float* f, const float* w1, const float* v,
                           int64_t v_stride, int64_t len, const float* o, int64_t o_stride, float* acc,
                           int64_t acc_stride, float* sums) {
  if (sums != nullptr)
    weighted_squares_rows<DV, true>(rt, e, e_stride, f, w1, v, v_stride, len, o, o_stride, acc, acc_stride, sums);
  else
    weighted_squares_rows<DV, false>(rt, e, e_stride, f, w1, v, v_stride, len, o, o_stride, acc, acc_stride, sums);
}

void check(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "hajek_step: ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "hajek_step: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "hajek_step: ", name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.stride(-1) == 1, "hajek_step: ", name, "'s last dimension must be contiguous");
}

// q (B, H, R, d); k (B, H, n, d); v (B, H, n, dv); bias (B, H, 1 or R, n); one_minus_pi (B, H, t), t ≤ n,
// 1 − π of the first t slots (0 where π = 1). Returns out and var, both (B, H, R, dv). terms: None, or a
// float32 (B, H, R, 2) tensor that receives (Σ c_i, Σ c_i²) per row (overwritten).
std::tuple<at::Tensor, at::Tensor> hajek_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& bias, const at::Tensor& one_minus_pi, double scale,
                                              const c10::optional<at::Tensor>& terms) {
  check(q, "q", 4);
  check(k, "k", 4);
  check(v, "v", 4);
  check(bias, "bias", 4);
  check(one_minus_pi, "one_minus_pi", 3);
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3);
  const int64_t n = k.size(2), dv = v.size(3), t = one_minus_pi.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == d, "hajek_step: k ", k.sizes(), " does not match q ",
              q.sizes());
  TORCH_CHECK(v.size(0) == B && v.size(1) == H && v.size(2) == n, "hajek_step: v ", v.sizes(), " does not match k ",
              k.sizes());
  TORCH_CHECK(bias.size(0) == B && bias.size(1) == H && (bias.size(2) == 1 || bias.size(2) == R) && bias.size(3) == n,
              "hajek_step: bias ", bias.sizes(), " is not (B, H, 1 or R, n) for q ", q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(one_minus_pi.size(0) == B && one_minus_pi.size(1) == H && t <= n, "hajek_step: one_minus_pi ",
              one_minus_pi.sizes(), " does not match k ", k.sizes());

  const bool want_terms = terms.has_value() && terms->defined();
  if (want_terms) {
    check(*terms, "terms", 4);
    TORCH_CHECK(terms->is_contiguous() && terms->size(0) == B && terms->size(1) == H && terms->size(2) == R &&
                    terms->size(3) == 2,
                "hajek_step: terms must be a contiguous (B, H, R, 2) tensor, got ", terms->sizes());
    terms->zero_();
  }
  auto out = at::empty({B, H, R, dv}, q.options());
  auto var = at::zeros({B, H, R, dv}, q.options());
  if (B * H * R == 0 || dv == 0) return {out, var};
  if (n == 0) {  // no slot at all: undefined, as softmax over nothing
    out.fill_(std::numeric_limits<float>::quiet_NaN());
    return {out, var};
  }
  const int64_t BH = B * H;
  const int64_t chunk = kChunk;
  const int64_t C = (n + chunk - 1) / chunk;

  std::vector<float> expo(BH * R * n);          // logits, then exp(logit − chunk max)
  std::vector<float> chunk_max(BH * C * R);     // then exp(chunk max − M) / Z: the chunk's weight factor
  std::vector<float> chunk_sum(BH * C * R);
  std::vector<float> chunk_out(BH * C * R * dv);
  std::vector<float> chunk_var(BH * C * R * dv, 0.f);
  std::vector<float> chunk_terms(want_terms ? BH * C * R * 2 : 0, 0.f);

  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const float* wp = one_minus_pi.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides(), bs = bias.strides(), ws = one_minus_pi.strides();
  const int64_t bias_row = bias.size(2) == 1 ? 0 : bs[2];
  const float fscale = static_cast<float>(scale);

  // Pass 1: per chunk and row, logits, their max, exp(logit − max), Σ exp and Σ exp · v.
  at::parallel_for(0, BH * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / C, c = task % C, b = bh / H, h = bh % H;
      const int64_t lo = c * chunk, len = std::min(n, lo + chunk) - lo;
      const float* qb = qp + b * qs[0] + h * qs[1];
      const float* kb = kp + b * ks[0] + h * ks[1] + lo * ks[2];
      const float* vb = vp + b * vs[0] + h * vs[1] + lo * vs[2];
      float* e = expo.data() + bh * R * n + lo;
      for (int64_t i = 0; i < len; ++i) {
        const float* ki = kb + i * ks[2];
        for (int64_t r = 0; r < R; ++r) e[r * n + i] = fscale * dot(qb + r * qs[2], ki, d);
      }
      float* acc = chunk_out.data() + task * R * dv;
      std::fill(acc, acc + R * dv, 0.f);
      for (int64_t r = 0; r < R; ++r) {
        float* er = e + r * n;
        const float* br = bp + b * bs[0] + h * bs[1] + r * bias_row + lo;
        float m = kNegInf;
        for (int64_t i = 0; i < len; ++i) {
          er[i] += br[i];
          m = std::max(m, er[i]);
        }
        float sum = 0.f;
        if (m != kNegInf) {
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < len; ++i) {
            er[i] = exp_approx(er[i] - m);
            sum += er[i];
          }
        } else {
          std::fill(er, er + len, 0.f);
        }
        chunk_max[task * R + r] = m;
        chunk_sum[task * R + r] = sum;
      }
      const int tile = tile_rows(dv);
      for (int64_t r0 = 0; tile > 0 && r0 < R; r0 += tile) {
        const int rt = static_cast<int>(std::min<int64_t>(tile, R - r0));
        if (dv == 64) weighted_sum_tile<64>(rt, e + r0 * n, n, vb, vs[2], len, acc + r0 * dv, dv);
        else weighted_sum_tile<128>(rt, e + r0 * n, n, vb, vs[2], len, acc + r0 * dv, dv);
      }
      for (int64_t i = 0; tile == 0 && i < len; ++i) {
        const float* vi = vb + i * vs[2];
        for (int64_t r = 0; r < R; ++r) {
          const float w = e[r * n + i];
          if (w == 0.f) continue;
          float* a = acc + r * dv;
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) a[j] += w * vi[j];
        }
      }
    }
  });

  // Merge: M = max of the chunk maxima, Z = Σ exp(m_c − M) Σ_c, out = Σ exp(m_c − M) acc_c / Z.
  for (int64_t bh = 0; bh < BH; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t r = 0; r < R; ++r) {
      float M = kNegInf;
      for (int64_t c = 0; c < C; ++c) M = std::max(M, chunk_max[(bh * C + c) * R + r]);
      float* o = op + ((b * H + h) * R + r) * dv;
      if (M == kNegInf) {  // the row has no retained slot: undefined, as softmax over −inf
        std::fill(o, o + dv, std::numeric_limits<float>::quiet_NaN());
        for (int64_t c = 0; c < C; ++c) chunk_max[(bh * C + c) * R + r] = 0.f;
        continue;
      }
      float Z = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        float& m_c = chunk_max[(bh * C + c) * R + r];
        m_c = m_c == kNegInf ? 0.f : std::exp(m_c - M);
        Z += m_c * chunk_sum[(bh * C + c) * R + r];
      }
      std::fill(o, o + dv, 0.f);
      for (int64_t c = 0; c < C; ++c) {
        const float f = (chunk_max[(bh * C + c) * R + r] /= Z);
        if (f == 0.f) continue;
        const float* a = chunk_out.data() + ((bh * C + c) * R + r) * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) o[j] += f * a[j];
      }
    }
  }
  if (t == 0) return {out, var};

  // Pass 2: each chunk's sampled slots add (1 − π_i) a_i² (v_i − out)²; same chunks, same threads as pass 1.
  const int64_t C_tail = (t + chunk - 1) / chunk;
  at::parallel_for(0, BH * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / C, c = task % C, b = bh / H, h = bh % H;
      if (c >= C_tail) continue;
      const int64_t lo = c * chunk, len = std::min(t, lo + chunk) - lo;
      const float* vb = vp + b * vs[0] + h * vs[1] + lo * vs[2];
      const float* wb = wp + b * ws[0] + h * ws[1] + lo;
      const float* e = expo.data() + bh * R * n + lo;
      float* acc = chunk_var.data() + task * R * dv;
      float* sums = want_terms ? chunk_terms.data() + task * R * 2 : nullptr;
      const int tile = tile_rows(dv);
      for (int64_t r0 = 0; tile > 0 && r0 < R; r0 += tile) {
        const int rt = static_cast<int>(std::min<int64_t>(tile, R - r0));
        const float* f = chunk_max.data() + task * R + r0;
        const float* o = op + (bh * R + r0) * dv;
        float* s = sums != nullptr ? sums + r0 * 2 : nullptr;
        if (dv == 64) weighted_squares_tile<64>(rt, e + r0 * n, n, f, wb, vb, vs[2], len, o, dv, acc + r0 * dv, dv, s);
        else weighted_squares_tile<128>(rt, e + r0 * n, n, f, wb, vb, vs[2], len, o, dv, acc + r0 * dv, dv, s);
      }
      for (int64_t i = 0; tile == 0 && i < len; ++i) {
        const float* vi = vb + i * vs[2];
        for (int64_t r = 0; r < R; ++r) {
          const float a = e[r * n + i] * chunk_max[task * R + r];
          const float w = wb[i] * a * a;
          // below the smallest normal float the term is lost to rounding, and subnormal arithmetic is slow
          if (!(w >= std::numeric_limits<float>::min())) continue;
          if (sums != nullptr) {
            sums[2 * r] += w;
            sums[2 * r + 1] += w * w;
          }
          const float* o = op + (bh * R + r) * dv;
          float* p = acc + r * dv;
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) {
            const float diff = vi[j] - o[j];
            p[j] += w * diff * diff;
          }
        }
      }
    }
  });
  float* varp = var.data_ptr<float>();
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t c = 0; c < C_tail; ++c)
      for (int64_t x = 0; x < R * dv; ++x) varp[bh * R * dv + x] += chunk_var[(bh * C + c) * R * dv + x];
  if (want_terms) {  // merged in chunk order, like the variance: independent of the thread count
    float* tp = terms->data_ptr<float>();
    for (int64_t bh = 0; bh < BH; ++bh)
      for (int64_t c = 0; c < C_tail; ++c)
        for (int64_t x = 0; x < R * 2; ++x) tp[bh * R * 2 + x] += chunk_terms[(bh * C + c) * R * 2 + x];
  }
  return {out, var};
}

}  // namespace

TORCH_LIBRARY(kvcert, m) {
  m.def(
      "hajek_step(Tensor q, Tensor k, Tensor v, Tensor bias, Tensor one_minus_pi, float scale, "
      "Tensor(a!)? terms=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcert, CPU, m) { m.impl("hajek_step", &hajek_step); }
