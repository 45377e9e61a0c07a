// Decode-step kernels for the fused decode path (kvbaton.backend.fast_decode), and the few prefill
// needs beyond oneDNN's matrix products (kvbaton.backend.prefill).
//
// A decode step of a small model reads every weight once and does little arithmetic per byte, so
// it is bound by memory bandwidth and by per-op overhead. These kernels exist for exactly that:
//   - linear: weights pre-packed in blocks of 16 outputs so one pass streams them sequentially (the
//     hardware prefetchers' best case), rows of a batch sharing each loaded weight vector; bf16
//     weights use AVX512-BF16 dot products where the CPU has them;
//   - attention: reads K/V straight from the paged pool through the block table (no gather),
//     grouped query heads share each K/V load, long contexts split into chunks merged by their
//     log-sum-exp (so both cores work on one sequence);
//   - rms_norm / add_rms_norm / rope_write / silu_mul / head_norm_inplace: the small per-layer ops, one call
//     each (q/k head norms for Qwen3 and Gemma 3);
//   - prefill: prefill_attention (prefill_attention.cpp: causal flash attention of a chunk, or of tokens
//     scattered among cached ones, over its paged K/V, GQA groups sharing K/V tiles) and rope_inplace;
//     silu_mul splits many rows across threads.
// Both attentions take a sliding window and a soft-cap (the model's, from kvbaton.backend.models) and are
// compiled for head sizes 64, 96, 128 and 256 (models.paths.KERNEL_HEAD_DIMS).
// Activations are fp32; weights and the KV pool are fp32 or bf16 (converted on load).
//
// Every row of a batch is computed with the same instruction sequence whatever the batch holds,
// so a sequence decodes to the same bits alone or batched. Built at first use with
// torch.utils.cpp_extension for the CPU it runs on (-march=native), as one translation unit with
// prefill_attention.cpp and bindings.cpp (this file first); see kvbaton.backend.compute.cpu.kernels.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <atomic>
#include <cmath>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <limits>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;        // output rows per packed weight block, floats per vector
constexpr int64_t kChunk = 256;       // attention tokens per task (rounded to whole blocks)
constexpr int64_t kParallelRows = 64; // row-wise ops split across threads from this many rows (prefill)

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline vf load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
#ifdef __AVX512F__
  // One widening instruction; GCC lowers the generic version below in two 256-bit halves.
  __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vf>(_mm512_castsi512_ps(w));
#else
  vh h; std::memcpy(&h, p, sizeof h);
  vu w = __builtin_convertvector(h, vu) << 16;
  vf v; std::memcpy(&v, &w, sizeof v); return v;
#endif
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(vf v) { float s = 0.f; for (int i = 0; i < kLanes; ++i) s += v[i]; return s; }
inline vf splat(float x) { return vf{} + x; }

// exp(x) for a vector: 2^n * e^r with |r| <= ln2/2, degree-7 Taylor polynomial (rel. error < 3e-9
// before fp32 rounding); exactly 0 below the fp32 range, as softmax of -inf must be.
inline vf vexp(vf x) {
  const vf lo = splat(-87.33654f), hi = splat(88.72283f);
  vi under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  vf t = x * 1.44269504088896341f;
  vf n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  vf r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  vf p = splat(1.f / 5040);
  p = p * r + 1.f / 720; p = p * r + 1.f / 120; p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;   p = p * r + 0.5f;      p = p * r + 1.f;     p = p * r + 1.f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale; std::memcpy(&scale, &bits, sizeof scale);
  vf y = p * scale;
  return under ? splat(0.f) : y;
}

inline float hsum_tree(vf v);

template <typename T> T* ptr(const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// The K and V pools: contiguous [layers, kv_heads, slots, d], one shape and dtype for both.
void check_pools(const torch::Tensor& k_pool, const torch::Tensor& v_pool) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4, "pool must be contiguous [L, G, S, d]");
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == k_pool.scalar_type(), "K and V pools differ");
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(),
              name, " must be a contiguous fp32 CPU tensor");
}

// ---- linear ---------------------------------------------------------------------------------

// Packed weight layouts. Block b holds outputs 16b..16b+15 as one sequential run of memory:
//   FmaTile: [blocks, in, 16]        element (b, i, j)    = W[16b+j][i]
//   DotTile: [blocks, in/2, 16, 2]   element (b, k, j, t) = W[16b+j][2k+t]  (bf16 with AVX512-BF16:
//            the pairs vdpbf16ps multiplies, 32 multiply-adds per instruction)
#if defined(__AVX512BF16__)
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif

// MR rows x NB packed blocks: MR*NB accumulators, each a plain sequential sum over the input, so a
// row gets the same bits in every instantiation (alone, in a batch, at the edge of a block group).
// Per input element: NB weight vectors and MR broadcasts feed MR*NB multiply-adds.
struct FmaTile {
  using X = float;  // input rows as fp32
  template <int MR, int NB, typename W>
  static void run(const W* w, int64_t in, const float* x, int64_t x_stride, float* y, int64_t out) {
    vf acc[MR][NB] = {};
    for (int64_t i = 0; i < in; ++i) {
      vf wv[NB];
      for (int c = 0; c < NB; ++c) wv[c] = load(w + (c * in + i) * kLanes);
      for (int r = 0; r < MR; ++r) {
        const float xr = x[r * x_stride + i];
        for (int c = 0; c < NB; ++c) acc[r][c] += wv[c] * xr;
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NB; ++c) store(y + r * out + c * kLanes, acc[r][c]);
  }
};

#if defined(__AVX512BF16__)
struct DotTile {
  using X = uint32_t;  // input rows rounded to bf16, read as (x[2k], x[2k+1]) pairs
  template <int MR, int NB, typename W>
  static void run(const W* w, int64_t in, const uint32_t* x, int64_t x_stride, float* y, int64_t out) {
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in / 2; ++k) {
      __m512bh wv[NB];
      for (int c = 0; c < NB; ++c)
        wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(w + (c * in + 2 * k) * kLanes)));
      for (int r = 0; r < MR; ++r) {
        const __m512bh xr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * x_stride + k])));
        for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xr);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NB; ++c) _mm512_storeu_ps(y + r * out + c * kLanes, acc[r][c]);
  }
};
#endif

template <typename Tile, int NB, typename W, typename X>
inline void tile_rows(const W* w, int64_t in, const X* x, int64_t x_stride, int64_t n, float* y, int64_t out) {
  int64_t r = 0;
  if constexpr (NB % 2 == 0) {  // eight rows share each weight load: batches stay compute-efficient
    for (; r + 8 <= n; r += 8)
      for (int c = 0; c < NB; c += 2)
        Tile::template run<8, 2>(w + c * in * kLanes, in, x + r * x_stride, x_stride, y + r * out + c * kLanes, out);
  }
  for (; r + 4 <= n; r += 4) Tile::template run<4, NB>(w, in, x + r * x_stride, x_stride, y + r * out, out);
  for (; r < n; ++r) Tile::template run<1, NB>(w, in, x + r * x_stride, x_stride, y + r * out, out);
}

template <typename Tile, typename W, typename X>
void linear_impl(const X* x, int64_t x_stride, int64_t n, const W* wp, int64_t blocks, int64_t in, const float* bias,
                 float* y) {
  constexpr int64_t kGroup = 4;  // blocks per tile: four weight streams, four independent chains per row
  const int64_t out = blocks * kLanes, groups = (blocks + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * kGroup;
      if (b + kGroup <= blocks) {
        tile_rows<Tile, kGroup>(wp + b * in * kLanes, in, x, x_stride, n, y + b * kLanes, out);
      } else {
        for (int64_t c = b; c < blocks; ++c) tile_rows<Tile, 1>(wp + c * in * kLanes, in, x, x_stride, n, y + c * kLanes, out);
      }
      if (bias != nullptr)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = b; c < std::min(blocks, b + kGroup); ++c)
            store(y + r * out + c * kLanes, load(y + r * out + c * kLanes) + load(bias + c * kLanes));
    }
  });
}

bool dot_layout(const torch::Tensor& w) { return kDotBf16 && w.scalar_type() == torch::kBFloat16; }

// W [out, in] (fp32 or bf16) -> the packed layout linear() reads, outputs padded to a multiple of 16.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out, in]");
  const int64_t out = weight.size(0), in = weight.size(1), blocks = (out + kLanes - 1) / kLanes;
  auto w = weight.contiguous();
  if (blocks * kLanes != out) w = torch::cat({w, w.new_zeros({blocks * kLanes - out, in})});
  if (dot_layout(w)) {
    TORCH_CHECK(in % 2 == 0, "bf16 weights need an even input width");
    return w.view({blocks, kLanes, in / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({blocks, in, kLanes});
  }
  return w.view({blocks, kLanes, in}).transpose(1, 2).contiguous();
}

// y[n, blocks*16] = x[n, in] @ W^T (+ bias) for a weight from pack().
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  check_f32(x, "x");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes && packed.is_contiguous(), "weight must come from pack()");
  const int64_t n = x.size(0), in = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == in, "weight/input width mismatch");
  const float* b = nullptr;
  if (bias.has_value()) { check_f32(*bias, "bias"); TORCH_CHECK(bias->numel() == blocks * kLanes); b = ptr<float>(*bias); }
  auto y = torch::empty({n, blocks * kLanes}, x.options());
  if (packed.scalar_type() == torch::kBFloat16) {
#if defined(__AVX512BF16__)
    // Inputs rounded to bf16 (as the model's own bf16 forward has them), read in pairs.
    std::vector<c10::BFloat16> xb(n * in);
    for (int64_t i = 0; i < n * in; ++i) xb[i] = c10::BFloat16(ptr<float>(x)[i]);
    linear_impl<DotTile>(reinterpret_cast<const uint32_t*>(xb.data()), in / 2, n, ptr<c10::BFloat16>(packed), blocks,
                         in, b, ptr<float>(y));
#else
    linear_impl<FmaTile>(ptr<float>(x), in, n, ptr<c10::BFloat16>(packed), blocks, in, b, ptr<float>(y));
#endif
  } else {
    TORCH_CHECK(packed.scalar_type() == torch::kFloat32, "weights must be fp32 or bf16");
    linear_impl<FmaTile>(ptr<float>(x), in, n, ptr<float>(packed), blocks, in, b, ptr<float>(y));
  }
  return y;
}

// ---- norms, rotary, activation --------------------------------------------------------------

template <typename W>
void norm_row(const float* x, const W* w, int64_t h, double eps, float* y) {
  float ss = 0.f;
  for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
  for (int64_t i = 0; i < h; ++i) y[i] = static_cast<float>(w[i]) * (x[i] * inv);
}

void norm_rows(const torch::Tensor& x, const torch::Tensor& w, double eps, torch::Tensor& y) {
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(w.numel() == h && w.is_contiguous(), "norm weight size");
  for (int64_t r = 0; r < n; ++r) {
    if (w.scalar_type() == torch::kBFloat16)
      norm_row(ptr<float>(x) + r * h, ptr<c10::BFloat16>(w), h, eps, ptr<float>(y) + r * h);
    else
      norm_row(ptr<float>(x) + r * h, ptr<float>(w), h, eps, ptr<float>(y) + r * h);
  }
}

// RMSNorm of each row of x: w * x / sqrt(mean(x^2) + eps).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  auto y = torch::empty_like(x);
  norm_rows(x, w, eps, y);
  return y;
}

// residual += delta (in place), then RMSNorm of the new residual.
torch::Tensor add_rms_norm(torch::Tensor& residual, const torch::Tensor& delta, const torch::Tensor& w, double eps) {
  check_f32(residual, "residual");
  check_f32(delta, "delta");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "residual/delta shape mismatch");
  float* r = ptr<float>(residual);
  const float* d = ptr<float>(delta);
  for (int64_t i = 0, e = residual.numel(); i < e; ++i) r[i] += d[i];
  auto y = torch::empty_like(residual);
  norm_rows(residual, w, eps, y);
  return y;
}

template <typename KV>
void put(KV* dst, const float* src, int64_t d) { for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<KV>(src[i]); }

// Rotate q and k of every row (Hugging Face rotate_half convention), write k and v into the pool
// (k_pool/v_pool [layers, kv_heads, slots, d]) at slots[row] of `layer`; return rotated q [n, heads, d].
template <typename KV>
void rope_write_impl(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, KV* kp, KV* vp,
                     int64_t layer, const int64_t* slots, int64_t heads, int64_t kv_heads, int64_t d, int64_t pool_slots,
                     float* q_out) {
  const int64_t n = qkv.size(0), width = qkv.size(1), half = d / 2;
  std::vector<float> tmp(d);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = ptr<float>(qkv) + r * width;
    const float* c = ptr<float>(cos) + r * d;
    const float* s = ptr<float>(sin) + r * d;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const float* x = row + h * d;
      float* dst = h < heads ? q_out + (r * heads + h) * d : tmp.data();
      for (int64_t i = 0; i < half; ++i) dst[i] = x[i] * c[i] - x[i + half] * s[i];
      for (int64_t i = half; i < d; ++i) dst[i] = x[i] * c[i] + x[i - half] * s[i];
      if (h >= heads) {
        const int64_t g = h - heads;
        const int64_t at = ((layer * kv_heads + g) * pool_slots + slots[r]) * d;
        put(kp + at, tmp.data(), d);
        put(vp + at, row + (heads + kv_heads + g) * d, d);
      }
    }
  }
}

torch::Tensor rope_write(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor& k_pool, torch::Tensor& v_pool, int64_t layer, const torch::Tensor& slots,
                         int64_t heads, int64_t kv_heads) {
  check_f32(qkv, "qkv"); check_f32(cos, "cos"); check_f32(sin, "sin");
  check_pools(k_pool, v_pool);
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == qkv.size(0), "slots");
  const int64_t d = k_pool.size(3), pool_slots = k_pool.size(2), n = qkv.size(0);
  TORCH_CHECK(k_pool.size(1) == kv_heads && qkv.size(1) == (heads + 2 * kv_heads) * d && cos.size(1) == d, "shapes");
  TORCH_CHECK(layer >= 0 && layer < k_pool.size(0), "layer out of range");
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(ptr<int64_t>(slots)[r] >= 0 && ptr<int64_t>(slots)[r] < pool_slots, "slot out of range");
  auto q = torch::empty({n, heads, d}, qkv.options());
  if (k_pool.scalar_type() == torch::kBFloat16)
    rope_write_impl(qkv, cos, sin, ptr<c10::BFloat16>(k_pool), ptr<c10::BFloat16>(v_pool), layer, ptr<int64_t>(slots),
                    heads, kv_heads, d, pool_slots, ptr<float>(q));
  else {
    TORCH_CHECK(k_pool.scalar_type() == torch::kFloat32, "pool must be fp32 or bf16");
    rope_write_impl(qkv, cos, sin, ptr<float>(k_pool), ptr<float>(v_pool), layer, ptr<int64_t>(slots), heads, kv_heads,
                    d, pool_slots, ptr<float>(q));
  }
  return q;
}

// RMSNorm of many rows (prefill): the sum of squares in 16 lanes (a tree at the end), rows split across
// threads. It rounds a little differently from rms_norm (one sequential sum), which decode keeps.
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "norm weight");
  TORCH_CHECK(x.dim() == 2 && w.numel() == x.size(1) && x.size(1) % kLanes == 0, "norm shapes");
  const int64_t n = x.size(0), h = x.size(1);
  auto y = torch::empty_like(x);
  const float* wp = ptr<float>(w);
  at::parallel_for(0, n, kParallelRows, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* xr = ptr<float>(x) + r * h;
      float* yr = ptr<float>(y) + r * h;
      vf ss = {};
      for (int64_t i = 0; i < h; i += kLanes) { const vf v = load(xr + i); ss += v * v; }
      const float inv = 1.f / std::sqrt(hsum_tree(ss) / static_cast<float>(h) + static_cast<float>(eps));
      for (int64_t i = 0; i < h; i += kLanes) store(yr + i, load(wp + i) * (load(xr + i) * inv));
    }
  });
  return y;
}

// Rotate the q and k heads of every row of qkv = [q heads | k heads | v heads] in place (Hugging Face
// rotate_half convention, the arithmetic of rope_write): prefill's rotary, no copy of q, k or v.
void rope_inplace(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                  int64_t kv_heads) {
  check_f32(qkv, "qkv"); check_f32(cos, "cos"); check_f32(sin, "sin");
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0), "shapes");
  const int64_t n = qkv.size(0), width = qkv.size(1), d = cos.size(1), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && width == (heads + 2 * kv_heads) * d, "qkv must be [n, (heads + 2 * kv_heads) * head_dim]");
  at::parallel_for(0, n, kParallelRows, [&](int64_t a, int64_t b) {
    std::vector<float> tmp(d);
    for (int64_t r = a; r < b; ++r) {
      const float* c = ptr<float>(cos) + r * d;
      const float* s = ptr<float>(sin) + r * d;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* x = ptr<float>(qkv) + r * width + h * d;
        std::memcpy(tmp.data(), x, d * sizeof(float));
        for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * c[i] - tmp[i + half] * s[i];
        for (int64_t i = half; i < d; ++i) x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
      }
    }
  });
}

// RMSNorm of every q head (q_weight) and k head (k_weight) of the rows of qkv = [q heads | k heads | v heads],
// in place, before RoPE (Qwen3's and Gemma 3's q_norm / k_norm): rms_norm's arithmetic, per head.
void head_norm_inplace(torch::Tensor& qkv, const torch::Tensor& q_weight, const torch::Tensor& k_weight, double eps,
                       int64_t heads, int64_t kv_heads) {
  check_f32(qkv, "qkv");
  const int64_t n = qkv.size(0), width = qkv.size(1), d = q_weight.numel();
  TORCH_CHECK(qkv.dim() == 2 && k_weight.numel() == d && width == (heads + 2 * kv_heads) * d, "qkv must be [n, (heads + 2 * kv_heads) * head_dim]");
  TORCH_CHECK(q_weight.is_contiguous() && k_weight.is_contiguous() && q_weight.scalar_type() == k_weight.scalar_type(), "norm weights");
  const bool bf16 = q_weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || q_weight.scalar_type() == torch::kFloat32, "norm weights must be fp32 or bf16");
  at::parallel_for(0, n, kParallelRows, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* x = ptr<float>(qkv) + r * width + h * d;
        const torch::Tensor& w = h < heads ? q_weight : k_weight;
        if (bf16) norm_row(x, ptr<c10::BFloat16>(w), d, eps, x);
        else norm_row(x, ptr<float>(w), d, eps, x);
      }
  });
}

// silu(gate) * up for x = [gate | up] of each row. Many rows (prefill) are split across threads;
// every row is computed the same way either way.
torch::Tensor silu_mul(const torch::Tensor& x) {
  check_f32(x, "x");
  const int64_t n = x.size(0), inter = x.size(1) / 2;
  TORCH_CHECK(inter % kLanes == 0, "intermediate size must be a multiple of 16");
  auto y = torch::empty({n, inter}, x.options());
  at::parallel_for(0, n, kParallelRows, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* g = ptr<float>(x) + r * 2 * inter;
      float* o = ptr<float>(y) + r * inter;
      for (int64_t i = 0; i < inter; i += kLanes) {
        vf gv = load(g + i);
        store(o + i, gv / (1.f + vexp(-gv)) * load(g + inter + i));
      }
    }
  });
  return y;
}

// ---- attention ------------------------------------------------------------------------------

// Sum of the 16 lanes as a tree (a sequential sum would be a 16-step dependency chain per score).
inline float hsum_tree(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// A block of K or V as fp32: itself, or converted once into `buf` (not once per query head).
inline const float* as_float(const float* p, int64_t, float*) { return p; }
inline const float* as_float(const c10::BFloat16* p, int64_t count, float* buf) {
  for (int64_t i = 0; i < count; i += kLanes) store(buf + i, load(p + i));
  return buf;
}

// The pool offset of token t of a sequence (its block from the table, its row in the block), in elements.
inline int64_t token_at(const int32_t* table, int64_t block_size, int64_t t, int64_t d) {
  return (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * d;
}

// One task: the `group` query heads of kv head g of sequence s over tokens [t0, t1) (t0 anywhere: a sliding
// window starts mid-block). Writes the un-normalised output acc[group, d], its max m[group], sum l[group].
// DV = d / 16 vectors per head, a compile-time constant so a head's accumulators stay in registers. cap > 0:
// each score becomes cap * tanh(score / cap) (soft-capping, Gemma 2), in transformers' order.
template <typename KV, int DV>
void attend_chunk(const float* q, const KV* kbase, const KV* vbase, const int32_t* table, int64_t block_size,
                  int64_t t0, int64_t t1, int64_t group, float scale, float cap, float* acc, float* m, float* l) {
  constexpr int64_t d = DV * kLanes;
  const int64_t len = t1 - t0;
  std::vector<float> scores(group * len), buf(block_size * d);
  for (int64_t t = t0; t < t1;) {  // block by block: a block's keys of this head are contiguous
    const int64_t in_block = std::min(block_size - t % block_size, t1 - t);
    const float* k = as_float(kbase + token_at(table, block_size, t, d), in_block * d, buf.data());
    for (int64_t i = 0; i < in_block; ++i, k += d) {
      vf kv[DV];
      for (int j = 0; j < DV; ++j) kv[j] = load(k + j * kLanes);
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = q + h * d;
        vf a = load(qh) * kv[0];
        for (int j = 1; j < DV; ++j) a += load(qh + j * kLanes) * kv[j];
        float score = hsum_tree(a) * scale;
        if (cap > 0.f) score = std::tanh(score / cap) * cap;
        scores[h * len + (t - t0) + i] = score;
      }
    }
    t += in_block;
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sc = scores.data() + h * len;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sc[t]);
    vf sums = {};
    int64_t t = 0;
    for (; t + kLanes <= len; t += kLanes) { vf e = vexp(load(sc + t) - mx); store(sc + t, e); sums += e; }
    float sum = hsum_tree(sums);
    for (; t < len; ++t) { vf e = vexp(splat(sc[t] - mx)); sc[t] = e[0]; sum += e[0]; }
    m[h] = mx;
    l[h] = sum;
  }
  for (int64_t i = 0; i < group * d; ++i) acc[i] = 0.f;
  for (int64_t t = t0; t < t1;) {
    const int64_t in_block = std::min(block_size - t % block_size, t1 - t);
    const float* v = as_float(vbase + token_at(table, block_size, t, d), in_block * d, buf.data());
    for (int64_t h = 0; h < group; ++h) {  // the block's values stay in L1 across the heads
      const float* p = scores.data() + h * len + (t - t0);
      vf a[DV];
      for (int j = 0; j < DV; ++j) a[j] = load(acc + h * d + j * kLanes);
      for (int64_t i = 0; i < in_block; ++i)
        for (int j = 0; j < DV; ++j) a[j] += load(v + i * d + j * kLanes) * p[i];
      for (int j = 0; j < DV; ++j) store(acc + h * d + j * kLanes, a[j]);
    }
    t += in_block;
  }
}

template <typename KV>
void attention_impl(const float* q, const KV* kp, const KV* vp, int64_t layer, const int32_t* tables, int64_t max_blocks,
                    const int64_t* lengths, int64_t n, int64_t heads, int64_t kv_heads, int64_t d, int64_t pool_slots,
                    int64_t block_size, float scale, int64_t window, float cap, float* out) {
  const int64_t group = heads / kv_heads;
  const int64_t chunk = std::max<int64_t>(1, kChunk / block_size) * block_size;
  // A sliding window: the query (the last token) sees its `window` latest keys, itself included.
  auto first_key = [&](int64_t s) { return window > 0 && lengths[s] > window ? lengths[s] - window : int64_t{0}; };
  auto chunks_of = [&](int64_t s) { return (lengths[s] - first_key(s) + chunk - 1) / chunk; };
  std::vector<int64_t> first(n + 1, 0);  // task index of each sequence's first chunk
  for (int64_t s = 0; s < n; ++s) first[s + 1] = first[s] + kv_heads * chunks_of(s);
  const int64_t tasks = first[n];
  std::vector<float> acc(tasks * group * d), m(tasks * group), l(tasks * group);
  std::vector<int64_t> task_seq(tasks);
  for (int64_t s = 0; s < n; ++s) for (int64_t t = first[s]; t < first[s + 1]; ++t) task_seq[t] = s;
  at::parallel_for(0, tasks, 1, [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) {
      const int64_t s = task_seq[task], local = task - first[s];
      const int64_t chunks = chunks_of(s);
      const int64_t g = local / chunks, c = local % chunks;
      const int64_t t0 = first_key(s) + c * chunk, t1 = std::min(lengths[s], t0 + chunk);
      const int64_t base = (layer * kv_heads + g) * pool_slots * d;
      const float* qs = q + (s * heads + g * group) * d;
      const int32_t* table = tables + s * max_blocks;
      float *a_out = acc.data() + task * group * d, *m_out = m.data() + task * group, *l_out = l.data() + task * group;
      switch (d) {
        case 64: attend_chunk<KV, 4>(qs, kp + base, vp + base, table, block_size, t0, t1, group, scale, cap, a_out, m_out, l_out); break;
        case 96: attend_chunk<KV, 6>(qs, kp + base, vp + base, table, block_size, t0, t1, group, scale, cap, a_out, m_out, l_out); break;
        case 128: attend_chunk<KV, 8>(qs, kp + base, vp + base, table, block_size, t0, t1, group, scale, cap, a_out, m_out, l_out); break;
        default: attend_chunk<KV, 16>(qs, kp + base, vp + base, table, block_size, t0, t1, group, scale, cap, a_out, m_out, l_out);
      }
    }
  });
  for (int64_t s = 0; s < n; ++s) {
    const int64_t chunks = chunks_of(s);
    for (int64_t g = 0; g < kv_heads; ++g) {
      const int64_t t_first = first[s] + g * chunks;
      for (int64_t h = 0; h < group; ++h) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, m[(t_first + c) * group + h]);
        float* o = out + (s * heads + g * group + h) * d;
        float total = 0.f;
        for (int64_t j = 0; j < d; ++j) o[j] = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t at = (t_first + c) * group + h;
          const float w = std::exp(m[at] - mx);
          total += l[at] * w;
          for (int64_t j = 0; j < d; ++j) o[j] += acc[at * d + j] * w;
        }
        for (int64_t j = 0; j < d; ++j) o[j] /= total;
      }
    }
  }
}

// Head sizes the attention kernels are compiled for (kvbaton.backend.models.paths.KERNEL_HEAD_DIMS).
inline bool kernel_head_dim(int64_t d) { return d == 64 || d == 96 || d == 128 || d == 256; }

// Decode attention of one new query per sequence over its paged context: q [n, heads, d];
// tables [n, max_blocks] int32 block ids; lengths [n] tokens to attend (including the new one).
// window > 0: each query sees only its `window` latest keys (a sliding window); softcap > 0: soft-capped scores.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool, int64_t layer,
                        const torch::Tensor& tables, const torch::Tensor& lengths, int64_t block_size, double scale,
                        int64_t window, double softcap) {
  check_f32(q, "q");
  check_pools(k_pool, v_pool);
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && tables.is_contiguous() && tables.dim() == 2, "tables must be int32 [n, blocks]");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.is_contiguous(), "lengths must be int64");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_pool.size(1), pool_slots = k_pool.size(2), max_blocks = tables.size(1);
  TORCH_CHECK(k_pool.size(3) == d && kernel_head_dim(d) && heads % kv_heads == 0, "head_dim must be 64, 96, 128 or 256");
  TORCH_CHECK(tables.size(0) == n && lengths.numel() == n, "one table and length per query");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  TORCH_CHECK(layer >= 0 && layer < k_pool.size(0), "layer out of range");
  const int64_t* len = ptr<int64_t>(lengths);
  const int32_t* tab = ptr<int32_t>(tables);
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(len[s] >= 1 && len[s] <= max_blocks * block_size, "length outside the block table");
    for (int64_t b = 0; b < (len[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tab[s * max_blocks + b] >= 0 && (tab[s * max_blocks + b] + 1) * block_size <= pool_slots, "block out of range");
  }
  auto out = torch::empty({n, heads * d}, q.options());
  if (k_pool.scalar_type() == torch::kBFloat16)
    attention_impl(ptr<float>(q), ptr<c10::BFloat16>(k_pool), ptr<c10::BFloat16>(v_pool), layer, tab, max_blocks, len, n,
                   heads, kv_heads, d, pool_slots, block_size, static_cast<float>(scale), window,
                   static_cast<float>(softcap), ptr<float>(out));
  else
    attention_impl(ptr<float>(q), ptr<float>(k_pool), ptr<float>(v_pool), layer, tab, max_blocks, len, n, heads,
                   kv_heads, d, pool_slots, block_size, static_cast<float>(scale), window, static_cast<float>(softcap),
                   ptr<float>(out));
  return out;
}

}  // namespace
