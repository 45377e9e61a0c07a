// Prefill attention (kvbaton.backend.compute.cpu.prefill): the second part of the kernels' one translation unit.
// kvbaton.backend.compute.cpu.kernels builds decode_kernels.cpp, this file and bindings.cpp as one source, in that
// order, so everything in decode_kernels.cpp's anonymous namespace (vectors, exp, checks) is visible here.

namespace {

// ---- prefill attention ----------------------------------------------------------------------

// Causal attention of a run of new tokens over their sequence's paged K/V (a prefill chunk, first or
// later): query i sees keys 0..kv_len - n + i. Flash-style: for each K/V head and block of kBQ query
// positions, the group's query heads form one tile of rows that streams over key tiles of kBK keys with
// an online softmax, so the scores never leave the cache and the GQA group shares every K/V load. The
// two products are register-tiled GEMM micro-kernels (kMR rows x 64 keys, then kMR rows x head_dim);
// key tiles wholly past a block's causal limit are skipped, tiles on the diagonal masked.
constexpr int64_t kBK = 64;  // keys per tile: 4 vectors of scores per row
constexpr int64_t kBQ = 32;  // query positions per task
constexpr int kMR = 6;       // rows per micro-tile (6 x 4 accumulators + 4 operand vectors: 28 registers)

inline float hmax(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a0 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  v8 a1 = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v8 a = a0 > a1 ? a0 : a1;
  v4 b0 = __builtin_shufflevector(a, a, 0, 1, 2, 3), b1 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  v4 b = b0 > b1 ? b0 : b1;
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Scores of MR rows against one key tile (Kt: [d][64], keys transposed), scaled (soft-capped when cap > 0)
// and masked (row r sees keys lower[r]..limit[r]), then the online-softmax step while they are still in
// registers: P = exp(s - m_new) into P, and per row the running max m, sum l and the factor
// alpha = exp(m_old - m_new) the row's output must be rescaled by.
// noinline: compiled alone, the tile keeps its operands in registers.
template <int MR>
__attribute__((noinline)) void score_tile(const float* q, int64_t d, const float* kt, float scale, float cap,
                                          int64_t k0, bool masked, const int64_t* limit, const int64_t* lower,
                                          float* p, float* m, float* l, float* alpha) {
  vf acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vf{};
  for (int64_t j = 0; j < d; ++j) {
    const float* k = kt + j * kBK;
    const vf k0v = load(k), k1 = load(k + 16), k2 = load(k + 32), k3 = load(k + 48);
    for (int r = 0; r < MR; ++r) {
      const float x = q[r * d + j];
      acc[r][0] += k0v * x; acc[r][1] += k1 * x; acc[r][2] += k2 * x; acc[r][3] += k3 * x;
    }
  }
  const vf ninf = splat(-std::numeric_limits<float>::infinity());
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int r = 0; r < MR; ++r) {
    vf mx = ninf;
    for (int c = 0; c < 4; ++c) {
      acc[r][c] *= scale;
      if (cap > 0.f)
        for (int i = 0; i < kLanes; ++i) acc[r][c][i] = std::tanh(acc[r][c][i] / cap) * cap;
      if (masked) {
        const vi key = lane + static_cast<int32_t>(k0 + c * kLanes);
        const vi seen = (key <= static_cast<int32_t>(limit[r])) & (key >= static_cast<int32_t>(lower[r]));
        acc[r][c] = seen ? acc[r][c] : ninf;
      }
      mx = acc[r][c] > mx ? acc[r][c] : mx;
    }
    // Causal rows see key 0 in their first tile; a row of a sliding window may see none of a tile's keys
    // (they are all before its window): nothing to add, and exp(-inf - -inf) must not run.
    const float m_new = std::max(m[r], hmax(mx));
    if (m_new == -std::numeric_limits<float>::infinity()) {
      std::memset(p + r * kBK, 0, kBK * sizeof(float));
      alpha[r] = 1.f;
      continue;
    }
    const float a = m_new == m[r] ? 1.f : std::exp(m[r] - m_new);
    vf sum = {};
    for (int c = 0; c < 4; ++c) {
      const vf e = vexp(acc[r][c] - m_new);
      store(p + r * kBK + c * kLanes, e);
      sum += e;
    }
    l[r] = l[r] * a + hsum_tree(sum);
    m[r] = m_new;
    alpha[r] = a;
  }
}

// out[MR][d] = out * alpha + P[MR][keys] . V[keys][d]
template <int MR, int DV>
__attribute__((noinline)) void value_tile(const float* p, int64_t keys, const float* v, const float* alpha,
                                          float* out) {
  constexpr int64_t d = DV * kLanes;
  vf acc[MR][DV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = load(out + r * d + c * kLanes) * alpha[r];
  for (int64_t t = 0; t < keys; ++t) {
    vf vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = load(v + t * d + c * kLanes);
    for (int r = 0; r < MR; ++r) {
      const float x = p[r * kBK + t];
      for (int c = 0; c < DV; ++c) acc[r][c] += vv[c] * x;
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DV; ++c) store(out + r * d + c * kLanes, acc[r][c]);
}

template <typename KV, int DV>
void prefill_attention_impl(const float* q, int64_t q_tok, int64_t q_head, const KV* kp, const KV* vp, int64_t layer,
                            const int64_t* slots, int64_t first_slot, int64_t kv_len, int64_t n, int64_t heads,
                            int64_t kv_heads, int64_t pool_slots, float scale, const int64_t* positions, int64_t window,
                            float cap, float* out) {
  constexpr int64_t d = DV * kLanes;
  // rows per value micro-tile: its accumulators (VMR x DV vectors) and a key's DV vectors fit the registers
  constexpr int VMR = DV <= 4 ? kMR : (DV <= 8 ? 2 : 1);
  const int64_t group = heads / kv_heads, start = kv_len - n;
  // The position of query i among the keys (it sees keys 0..at(i)): the last n positions, or the
  // given ascending ones (selective recomputation: queries scattered among cached tokens). With a
  // sliding window it sees only keys lower(i)..at(i), its `window` latest.
  auto at = [&](int64_t i) { return positions != nullptr ? positions[i] : start + i; };
  auto lower = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, at(i) - window + 1) : int64_t{0}; };
  // Key tiles from the first one any query sees: tile t holds keys t * 64.. (as without a window).
  const int64_t first_tile = lower(0) / kBK, tiles = (kv_len + kBK - 1) / kBK - first_tile, padded = tiles * kBK;
  // The sequence's K (transposed per key tile, [g][tile][d][64]) and V ([g][key][d]) in fp32, zero
  // padded to whole tiles: gathered once through the slots, shared by every query block.
  std::unique_ptr<float[]> kt(new float[kv_heads * padded * d]), vg(new float[kv_heads * padded * d]);
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) {
      const int64_t g = task / tiles, tile = task % tiles;
      const int64_t base = (layer * kv_heads + g) * pool_slots;
      float* kdst = kt.get() + (g * tiles + tile) * d * kBK;
      float* vdst = vg.get() + (g * padded + tile * kBK) * d;
      for (int64_t i = 0; i < kBK; ++i) {
        const int64_t t = (first_tile + tile) * kBK + i;
        if (t < kv_len) {
          const int64_t slot = slots != nullptr ? slots[t] : first_slot + t;
          const KV* ks = kp + (base + slot) * d;
          const KV* vs = vp + (base + slot) * d;
          for (int64_t j = 0; j < d; ++j) { kdst[j * kBK + i] = to_float(ks[j]); vdst[i * d + j] = to_float(vs[j]); }
        } else {
          for (int64_t j = 0; j < d; ++j) { kdst[j * kBK + i] = 0.f; vdst[i * d + j] = 0.f; }
        }
      }
    }
  });
  const int64_t blocks = (n + kBQ - 1) / kBQ, tasks = kv_heads * blocks;
  const int64_t max_rows = (group * kBQ + kMR - 1) / kMR * kMR;
  std::atomic<int64_t> next{0};
  // One worker per thread taking tasks off a shared counter, latest query blocks (most keys) first.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> qt(max_rows * d), p(max_rows * kBK), acc(max_rows * d), m(max_rows), l(max_rows), alpha(max_rows);
    std::vector<int64_t> limit(max_rows), low(max_rows);
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t block = blocks - 1 - task / kv_heads, g = task % kv_heads;
      const int64_t i0 = block * kBQ, np = std::min(kBQ, n - i0);
      const int64_t rows = group * np, prows = (rows + kMR - 1) / kMR * kMR;
      for (int64_t h = 0; h < group; ++h)  // row h * np + i: query head g * group + h at position i0 + i
        for (int64_t i = 0; i < np; ++i) {
          std::memcpy(qt.data() + (h * np + i) * d, q + (i0 + i) * q_tok + (g * group + h) * q_head, d * sizeof(float));
          limit[h * np + i] = at(i0 + i);
          low[h * np + i] = lower(i0 + i);
        }
      for (int64_t r = rows; r < prows; ++r) {  // padding rows: zero queries, never written out
        std::memset(qt.data() + r * d, 0, d * sizeof(float));
        limit[r] = at(i0);
        low[r] = lower(i0);
      }
      std::fill(acc.begin(), acc.begin() + prows * d, 0.f);
      std::fill(m.begin(), m.begin() + prows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + prows, 0.f);
      const int64_t last = at(i0 + np - 1);  // the block's last query sees keys ..last
      const int64_t highest_low = lower(i0 + np - 1);  // and its first query keys lower(i0)..
      const float* kt_g = kt.get() + g * tiles * d * kBK;
      const float* v_g = vg.get() + g * padded * d;
      for (int64_t tile = lower(i0) / kBK - first_tile, k0 = (first_tile + tile) * kBK; k0 <= last; ++tile, k0 += kBK) {
        // some key of the tile is past some row's limit, or before some row's window
        const bool masked = k0 + kBK - 1 > at(i0) || k0 < highest_low;
        const int64_t keys = std::min(kBK, last + 1 - k0);
        for (int64_t r = 0; r < prows; r += kMR)
          score_tile<kMR>(qt.data() + r * d, d, kt_g + tile * d * kBK, scale, cap, k0, masked, limit.data() + r,
                          low.data() + r, p.data() + r * kBK, m.data() + r, l.data() + r, alpha.data() + r);
        for (int64_t r = 0; r < prows; r += VMR)
          value_tile<VMR, DV>(p.data() + r * kBK, keys, v_g + (k0 - first_tile * kBK) * d, alpha.data() + r,
                              acc.data() + r * d);
      }
      for (int64_t h = 0; h < group; ++h)
        for (int64_t i = 0; i < np; ++i) {
          const int64_t r = h * np + i;
          const float inv = 1.f / l[r];
          float* dst = out + ((i0 + i) * heads + g * group + h) * d;
          for (int64_t j = 0; j < d; ++j) dst[j] = acc[r * d + j] * inv;
        }
    }
  });
}

template <typename KV>
void prefill_dispatch(const float* q, int64_t q_tok, int64_t q_head, const KV* kp, const KV* vp, int64_t layer,
                      const int64_t* slots, int64_t first_slot, int64_t kv_len, int64_t n, int64_t heads,
                      int64_t kv_heads, int64_t pool_slots, float scale, const int64_t* positions, int64_t window,
                      float cap, int64_t d, float* out) {
  switch (d) {
    case 64: prefill_attention_impl<KV, 4>(q, q_tok, q_head, kp, vp, layer, slots, first_slot, kv_len, n, heads,
                                           kv_heads, pool_slots, scale, positions, window, cap, out); break;
    case 96: prefill_attention_impl<KV, 6>(q, q_tok, q_head, kp, vp, layer, slots, first_slot, kv_len, n, heads,
                                           kv_heads, pool_slots, scale, positions, window, cap, out); break;
    case 128: prefill_attention_impl<KV, 8>(q, q_tok, q_head, kp, vp, layer, slots, first_slot, kv_len, n, heads,
                                            kv_heads, pool_slots, scale, positions, window, cap, out); break;
    default: prefill_attention_impl<KV, 16>(q, q_tok, q_head, kp, vp, layer, slots, first_slot, kv_len, n, heads,
                                            kv_heads, pool_slots, scale, positions, window, cap, out);
  }
}

// q: [n, heads, d] fp32 (any strides, d contiguous), the queries of the last n of kv_len tokens, already
// rotated, or of the ascending `positions` ([n] int64, the last one kv_len - 1) when given; their K/V
// (and every other token's up to kv_len) are in the pool at `slots` ([kv_len] int64), or at first_slot..
// when slots is empty. Query i sees keys 0..its position (window > 0: only its `window` latest); softcap > 0:
// soft-capped scores. Returns [n, heads, d].
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                int64_t layer, const torch::Tensor& slots, int64_t first_slot, int64_t kv_len,
                                double scale, const torch::Tensor& positions, int64_t window, double softcap) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 3 && q.stride(2) == 1 && q.device().is_cpu(),
              "q must be fp32 [n, heads, head_dim] with contiguous head_dim");
  check_pools(k_pool, v_pool);
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_pool.size(1), pool_slots = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == d && kernel_head_dim(d) && heads % kv_heads == 0, "head_dim must be 64, 96, 128 or 256");
  TORCH_CHECK(layer >= 0 && layer < k_pool.size(0), "layer out of range");
  TORCH_CHECK(n >= 1 && kv_len >= n, "kv_len must cover the queries");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  const int64_t* sl = nullptr;
  if (slots.numel() > 0) {
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == kv_len, "slots");
    sl = ptr<int64_t>(slots);
    for (int64_t t = 0; t < kv_len; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < pool_slots, "slot out of range");
  } else {
    TORCH_CHECK(first_slot >= 0 && first_slot + kv_len <= pool_slots, "slots out of range");
  }
  const int64_t* pos = nullptr;
  if (positions.numel() > 0) {
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == n,
                "positions must be [n] int64");
    pos = ptr<int64_t>(positions);
    TORCH_CHECK(pos[0] >= 0 && pos[n - 1] == kv_len - 1, "positions must end at kv_len - 1");
    for (int64_t i = 1; i < n; ++i) TORCH_CHECK(pos[i] > pos[i - 1], "positions must ascend");
  }
  auto out = torch::empty({n, heads, d}, q.options());
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (k_pool.scalar_type() == torch::kBFloat16)
    prefill_dispatch(ptr<float>(q), q.stride(0), q.stride(1), ptr<c10::BFloat16>(k_pool), ptr<c10::BFloat16>(v_pool),
                     layer, sl, first_slot, kv_len, n, heads, kv_heads, pool_slots, s, pos, window, cap, d,
                     ptr<float>(out));
  else {
    TORCH_CHECK(k_pool.scalar_type() == torch::kFloat32, "pool must be fp32 or bf16");
    prefill_dispatch(ptr<float>(q), q.stride(0), q.stride(1), ptr<float>(k_pool), ptr<float>(v_pool), layer, sl,
                     first_slot, kv_len, n, heads, kv_heads, pool_slots, s, pos, window, cap, d, ptr<float>(out));
  }
  return out;
}

}  // namespace
